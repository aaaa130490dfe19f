"""The proxy's static P and D (a part of ProxySettings) and their flags' spelling."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from appliance.netaddr import host_port
from appliance.proxy.k8s_settings import DEFAULT_BOOTSTRAP_PORT, http_url


def _node_url(value: str) -> str:
    # http:// on one host or a private network; https:// (vLLM's --ssl-certfile) when the
    # proxy reaches P or D across a network others share (see upstream_ca_file).
    return http_url(value)


class PrefillNode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    # Where the proxy reads engine ids, and the address D is told to pull KV through.
    bootstrap_url: str = Field("", validate_default=True)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _node_url(v)

    @field_validator("bootstrap_url")
    @classmethod
    def _bootstrap(cls, v: str, info: ValidationInfo) -> str:
        if v:
            return http_url(v)
        # Default: the sidecar on P's host at the MooncakeConnector's standard port.
        base = urlsplit(info.data.get("url", ""))
        return f"http://{host_port(base.hostname or '', DEFAULT_BOOTSTRAP_PORT)}"


class DecodeNode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _node_url(v)


def parse_prefill_flag(value: str) -> dict[str, str]:
    """`URL[,BOOTSTRAP_URL]` -> PrefillNode fields."""
    url, _, bootstrap = value.partition(",")
    return {"url": url, "bootstrap_url": bootstrap}


def parse_decode_flag(value: str) -> dict[str, str]:
    """`URL` -> DecodeNode fields."""
    return {"url": value}
