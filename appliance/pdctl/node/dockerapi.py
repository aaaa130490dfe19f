"""Container state, health, restarts and logs through the Docker Engine API (docker SDK).

`docker compose` (up, down) goes through the command runner: the SDK has no compose. Every
SDK failure becomes one line (`DockerUnavailable`), never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from appliance.pdctl.errors import PdctlError

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"


class DockerUnavailable(PdctlError):
    pass


@dataclass(frozen=True)
class ContainerState:
    service: str
    name: str
    state: str  # created, running, restarting, exited, ...
    health: str | None  # starting, healthy, unhealthy; None without a healthcheck
    restarts: int
    exit_code: int | None
    image: str

    @property
    def ok(self) -> bool:
        return self.state == "running" and self.health in (None, "healthy")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _daemon_address() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _why(exc: BaseException) -> str:
    text = str(exc)
    for needle, reason in (("FileNotFoundError", "no such socket: is dockerd running?"),
                           ("PermissionError", "permission denied: run as root or join the "
                                               "docker group"),
                           ("Connection refused", "connection refused: is dockerd running?"),
                           ("ConnectionRefused", "connection refused: is dockerd running?"),
                           ("timed out", "timed out")):
        if needle in text:
            return reason
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:200]


def _unavailable(exc: BaseException) -> DockerUnavailable:
    return DockerUnavailable(f"cannot reach the Docker daemon at {_daemon_address()} "
                             f"({_why(exc)})")


def _sdk_errors() -> tuple[type[BaseException], ...]:
    # docker and requests load here, not at the top: ~40 ms each at every pdctl start, and
    # only the commands that talk to the daemon need them.
    import docker.errors
    import requests

    return (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


class DockerApi:
    """A connected client; `connect()` raises DockerUnavailable when there is no daemon."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @classmethod
    def connect(cls, timeout: float = 10.0) -> DockerApi:
        try:
            import docker  # here, not at the top: see _sdk_errors
        except ImportError:
            raise PdctlError("the docker Python SDK is not installed (pip install docker)") \
                from None
        try:
            # version negotiation contacts the daemon here: no daemon, no client
            return cls(docker.from_env(timeout=int(timeout)))
        except _sdk_errors() as exc:
            raise _unavailable(exc) from None

    def project(self, project: str) -> dict[str, ContainerState]:
        """The project's containers by compose service name."""
        try:
            found = self.client.containers.list(
                all=True, filters={"label": f"{PROJECT_LABEL}={project}"})
            out = {}
            for c in found:
                attrs = c.attrs
                state = attrs.get("State", {})
                service = c.labels.get(SERVICE_LABEL, c.name)
                out[service] = ContainerState(
                    service=service, name=c.name, state=state.get("Status", "unknown"),
                    health=(state.get("Health") or {}).get("Status"),
                    restarts=int(attrs.get("RestartCount", 0)),
                    exit_code=state.get("ExitCode"),  # 0 while running (reset at each start)
                    image=attrs.get("Config", {}).get("Image", ""))
            return out
        except _sdk_errors() as exc:
            raise _unavailable(exc) from None

    def logs(self, project: str, service: str, tail: int | str = "all",
             follow: bool = False) -> Iterator[bytes]:
        try:
            found = self.client.containers.list(all=True, filters={"label": [
                f"{PROJECT_LABEL}={project}", f"{SERVICE_LABEL}={service}"]})
            if not found:
                raise PdctlError(f"no container for service {service!r} in project "
                                 f"{project!r} (is the node up?)")
            stream = found[0].logs(stdout=True, stderr=True, stream=True, follow=follow,
                                   tail=tail)
            yield from stream
        except _sdk_errors() as exc:
            raise _unavailable(exc) from None


def write_logs(chunks: Iterator[bytes], write: Callable[[str], None]) -> None:
    for chunk in chunks:
        write(chunk.decode(errors="replace"))
