"""Wire shapes of the bootstrap sidecar, compatible with vLLM's MooncakeConnector bootstrap.

docs/protocol.md step 4 (`POST /register`) and steps 7/20 (`GET /query`). JSON object keys
in `/query` are strings (`{"0": {"engine_id": ..., "worker_addr": {"0": {"0": "tcp://ip:port"}}}}`).
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# A worker's ZMQ side-channel address; IPv6 hosts come in brackets.
ADDR_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class Registration(msgspec.Struct, frozen=True):
    """Body of `POST /register` (protocol step 4)."""

    engine_id: EngineId
    addr: str
    dp_rank: NonNegative = 0
    tp_rank: NonNegative = 0
    pp_rank: NonNegative = 0
    # The engine's TP size, so a decode node of another TP size knows which ranks hold its
    # heads before all of them have registered. vLLM's MooncakeConnector does not send it
    # (0): /query then leaves it out, as the reference's sidecar answers.
    tp_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
    # A starting worker's registration: it replaces the same worker's entry at another
    # address (the process it restarts, whose entry has not expired yet). Refreshes leave it
    # false, so two live workers claiming one place still conflict.
    replace: bool = False

    def validate(self) -> None:
        m = ADDR_RE.match(self.addr)
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"addr must look like tcp://host:port, got {self.addr!r}")
        if self.tp_size and self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} not below tp_size {self.tp_size}")


class EngineView(msgspec.Struct):
    """One dp rank in the `/query` answer: tp_rank -> pp_rank -> addr, as strings."""

    engine_id: str
    worker_addr: dict[str, dict[str, str]]
    tp_size: int = 0  # 0: not registered (count the workers instead)


QueryAnswer = dict[str, EngineView]

_registration_decoder = msgspec.json.Decoder(Registration)
_query_decoder = msgspec.json.Decoder(QueryAnswer)


def decode_registration(body: bytes) -> Registration:
    """Decode and validate a registration; raises ValueError with a readable reason."""
    try:
        reg = _registration_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"invalid registration: {exc}") from None
    reg.validate()
    return reg


def decode_query(body: bytes) -> QueryAnswer:
    """Decode a `/query` answer (used by the proxy and by D workers)."""
    try:
        return _query_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"invalid /query answer: {exc}") from None
