"""The proxy's `--discovery kubernetes` settings (a part of ProxySettings)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from appliance.modelflags import Flag
from appliance.netaddr import host_port

# Where Kubernetes mounts a pod's service account: its namespace, token and cluster CA.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# The bootstrap sidecar beside each P (the MooncakeConnector's standard port).
DEFAULT_BOOTSTRAP_PORT = 8998
GROUP = "kubernetes discovery"  # the flags' --help section


def http_url(value: str, schemes: tuple[str, ...] = ("http", "https")) -> str:
    parts = urlsplit(value.strip())
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"expected a {'/'.join(schemes)}://host[:port] URL, got {value!r}")
    return value.strip().rstrip("/")


class KubernetesSettings(BaseModel):
    """`--discovery kubernetes`: P and D are the Ready pods these label selectors match
    (appliance.proxy.nodes.discovery). Unset namespace and API server are filled in from the
    pod's service account and environment when discovery is kubernetes."""

    model_config = ConfigDict(extra="forbid")

    namespace: Annotated[str | None, Flag(GROUP, metavar="NS")] = Field(
        None, description="default: the pod's own (its service account's namespace file)")
    prefill_selector: Annotated[str | None, Flag(GROUP, metavar="SELECTOR")] = Field(
        None, description="label selector of P pods, e.g. app.kubernetes.io/component=prefill")
    decode_selector: Annotated[str | None, Flag(GROUP, metavar="SELECTOR")] = Field(
        None, description="label selector of D pods")
    prefill_port: Annotated[int, Flag(GROUP, metavar="PORT")] = Field(
        8010, ge=1, le=65535, description="P's API")
    decode_port: Annotated[int, Flag(GROUP, metavar="PORT")] = Field(
        8020, ge=1, le=65535, description="D's API")
    bootstrap_port: Annotated[int, Flag(GROUP, metavar="PORT")] = Field(
        DEFAULT_BOOTSTRAP_PORT, ge=1, le=65535,
        description="the bootstrap sidecar beside each P")
    api_server: Annotated[str | None, Flag(GROUP, metavar="URL")] = Field(
        None, description="default https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT")
    # Re-read: bound service account tokens rotate.
    token_file: Annotated[str, Flag(GROUP, metavar="FILE")] = Field(
        f"{SERVICE_ACCOUNT_DIR}/token",
        description="the service account's bearer token, re-read when it changes")
    ca_file: Annotated[str, Flag(GROUP, metavar="FILE")] = Field(
        f"{SERVICE_ACCOUNT_DIR}/ca.crt",
        description="CA of the API server")
    retry_max_s: Annotated[float, Flag(GROUP)] = Field(
        30.0, gt=0, description="a failed list or watch is retried after a back-off doubling "
                                "up to this")
    watch_timeout_s: Annotated[int, Flag(GROUP)] = Field(
        240, ge=1, description="watches are ended by the server after this long and resumed")

    @field_validator("prefill_selector", "decode_selector", "namespace")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        return None if v is None else v.strip()

    @field_validator("api_server")
    @classmethod
    def _api_url(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v)

    def resolve(self, environ: Mapping[str, str]) -> None:
        """Fill in what was left to the pod: raises ValueError with one line when it
        cannot, and when a selector is missing."""
        missing = [f"--k8s-{r}-selector" for r in ("prefill", "decode")
                   if getattr(self, f"{r}_selector") is None]
        if missing:
            raise ValueError(f"--discovery kubernetes needs {' and '.join(missing)}")
        if self.namespace is None:
            path = Path(SERVICE_ACCOUNT_DIR) / "namespace"
            try:
                self.namespace = path.read_text().strip()
            except OSError as exc:
                raise ValueError(f"no --k8s-namespace and {path} unreadable "
                                 f"({exc.strerror})") from None
        if self.api_server is None:
            host = environ.get("KUBERNETES_SERVICE_HOST")
            if not host:
                raise ValueError("no --k8s-api-server and KUBERNETES_SERVICE_HOST is not set "
                                 "(not in a pod?)")
            port = int(environ.get("KUBERNETES_SERVICE_PORT") or 443)
            self.api_server = f"https://{host_port(host, port)}"
