"""Typed settings of the bootstrap sidecar."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

DEFAULT_PORT = 8998


class BootstrapSettings(BaseModel):
    host: str = "0.0.0.0"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    # Workers refresh well within this (the connector re-registers every ttl/3 seconds);
    # 0 keeps registrations until they are deleted, as the reference does.
    ttl: float = Field(30.0, ge=0)
    # When set, POST /register, DELETE and GET /query require `Authorization: Bearer <token>`.
    token: str | None = None
    max_body_bytes: int = Field(64 * 1024, ge=1024)

    @staticmethod
    def read_token(path: Path) -> str:
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
