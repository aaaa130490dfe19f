"""The node's secrets, one 0600 file each in a 0700 directory (`pdctl init` writes them into
the config directory's `keys/`; `pdctl up --local` into its run directory):

- `api-key`: vLLM's `--api-key` on P and D (read by the launcher into VLLM_API_KEY, so it
  is never on a command line); the proxy sends it upstream, never a client's key.
- `bootstrap-token`: the sidecars' token, for /register, DELETE and /query.
- `side-channel.key`: the ZMQ CURVE secret the side channels (P's ROUTER, D's and the
  proxy's DEALERs) authenticate and encrypt with.

Every host of a cluster carries the same three files (copy the directory).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

API_KEY = "api-key"
BOOTSTRAP_TOKEN = "bootstrap-token"
SIDE_CHANNEL_KEY = "side-channel.key"
NAMES = (API_KEY, BOOTSTRAP_TOKEN, SIDE_CHANNEL_KEY)
# Where the launcher finds the api-key file (see appliance.launcher).
API_KEY_FILE_ENV = "PD_API_KEY_FILE"


@dataclass(frozen=True)
class NodeKeys:
    dir: Path

    @property
    def api_key(self) -> Path:
        return self.dir / API_KEY

    @property
    def bootstrap_token(self) -> Path:
        return self.dir / BOOTSTRAP_TOKEN

    @property
    def side_channel_key(self) -> Path:
        return self.dir / SIDE_CHANNEL_KEY

    def missing(self) -> list[Path]:
        return [self.dir / n for n in NAMES if not (self.dir / n).is_file()]


def _new_value(name: str) -> str:
    if name == SIDE_CHANNEL_KEY:
        from appliance.sidechannel.curve import generate_secret

        return generate_secret()
    return secrets.token_urlsafe(32)


def _write_secret(path: Path, value: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)  # atomic: a service reading it sees the old key or the new one


def ensure(dir: Path, rotate: bool = False) -> NodeKeys:
    """Write the keys that are missing (all of them with `rotate`); returns their paths."""
    keys = NodeKeys(dir)
    dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(dir, 0o700)
    for name in NAMES:
        path = dir / name
        if rotate or not path.is_file():
            _write_secret(path, _new_value(name))
    return keys


def read(path: str | Path, what: str = "key file") -> str:
    """A secret's value; ValueError with one line naming `what` and the file."""
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    if not value:
        raise ValueError(f"{what} {path} is empty")
    return value
