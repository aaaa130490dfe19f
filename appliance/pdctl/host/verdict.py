"""One host check's verdict: pass, fail, warn or skip, with the fix for a failure or a
warning (a warning does not fail `pdctl doctor`). Shared by doctor's checks and its PCIe
checks (pcichecks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["pass", "fail", "skip", "warn"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def passed(name: str, detail: str) -> Check:
    return Check(name, "pass", detail)


def failed(name: str, detail: str, fix: str) -> Check:
    return Check(name, "fail", detail, fix)


def skipped(name: str, detail: str) -> Check:
    return Check(name, "skip", detail)


def warned(name: str, detail: str, fix: str) -> Check:
    return Check(name, "warn", detail, fix)
