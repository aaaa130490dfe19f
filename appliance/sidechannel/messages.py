"""Side-channel messages between D and P workers: msgpack over ZMQ DEALER (D) -> ROUTER (P).

docs/protocol.md step 21: D tells P where to write (its Mooncake session, its block ids
and, on first contact, its KV layout). Step 30: P answers per request. The layout is sent
once per P and then named by ``layout_id``; a P that lost it (restart) answers LAYOUT_MISS
and D resends it.
D may also send a ``CancelRequest`` (its deadline passed, the request was aborted, or P's
blocks can be released); P's ROUTER decodes both with ``decode_side_channel``. Every decode
validates values, so a bad message becomes one ``MessageError`` and is never half-applied.
The proxy sends the same ``CancelRequest`` (its releases), so this module sits below both the
connector and the proxy and imports neither. A layout's regions obey ``region_problem``, the
rule the connector's ``plan.Region`` checks too; the connector converts between the two
(``appliance.connector.sidechannel.layout``).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

from appliance.netaddr import host_port

_MAX_ID = 4096  # request, transfer and engine ids are uuids plus prefixes in practice
_MAX_ITEMS = 1 << 20
_MAX_GROUPS = 64  # KV-cache groups per model (gpt-oss: 2; Gemma 3: 2; hybrid SSMs: a few)
RELEASE_PREFIX = "release-"  # a CancelEntry's d_req_id when no decode request is behind it
_ADDR_LIMIT = 1 << 63  # addresses are computed in int64

U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_ID)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class MessageError(ValueError):
    """Undecodable, mistyped or invalid side-channel message."""


class Status(str, enum.Enum):
    FINISH = "finish"  # every request in ``ok``/``failed`` was handled; KV for ``ok`` written
    ERROR = "error"  # the whole message was rejected; nothing was written
    LAYOUT_MISS = "layout_miss"  # P has no layout for ``layout_id``: resend with ``layout``


def region_problem(base_addr: int, block_stride: int, block_bytes: int, num_blocks: int,
                   group: int, heads: int) -> str | None:
    """Why these numbers are no region (block ``i`` is ``block_bytes`` long at ``base_addr +
    i * block_stride``), or None: empty, overlapping blocks, beyond the address range. The
    one rule for a layout D sends and for the connector's ``plan.Region``."""
    if not 0 <= base_addr < _ADDR_LIMIT:
        return f"base_addr {base_addr:#x} out of range"
    if block_bytes <= 0 or num_blocks <= 0:
        return f"empty region: {num_blocks} blocks of {block_bytes} bytes"
    if group < 0 or heads < 0:
        return f"negative KV-cache group or head count: group {group}, {heads} heads"
    if num_blocks > 1 and block_stride < block_bytes:
        return f"blocks overlap: stride {block_stride} < {block_bytes}"
    end = base_addr + (num_blocks - 1) * block_stride + block_bytes
    if end > _ADDR_LIMIT:
        return f"region ends beyond the address range: at {end:#x}"
    return None


class RegionMsg(msgspec.Struct, array_like=True, frozen=True):
    """One of D's regions, as a compact array (see ``plan.Region``)."""

    base_addr: U63
    block_stride: U63
    block_bytes: U63
    num_blocks: U63
    group: Annotated[int, msgspec.Meta(ge=0, lt=_MAX_GROUPS)] = 0
    heads: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] = 0


class ReqEntry(msgspec.Struct, array_like=True, frozen=True):
    """One D request: write P's KV for ``transfer_id`` into D's ``block_ids``, one list per
    KV-cache group (a sliding-window group names only the blocks its window still needs)."""

    d_req_id: Id
    transfer_id: Id
    block_ids: Annotated[list[Annotated[list[BlockId], msgspec.Meta(max_length=_MAX_ITEMS)]],
                         msgspec.Meta(max_length=_MAX_GROUPS)]
    # Milliseconds D will still wait when it sends this (0: no deadline). P starts no write
    # after it, so a D that gave up and reused the blocks is never written into.
    deadline_ms: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)] = 0
    # D checks what lands (`verify_kv`): P answers with a digest of the bytes it wrote.
    digest: bool = False


class TransferRequest(msgspec.Struct, tag="xreq", omit_defaults=True, frozen=True):
    """D -> P (protocol step 21). ``layout`` rides along on first contact only."""

    engine_id: Id
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    rpc_port: Port
    layout_id: U63
    reqs: Annotated[list[ReqEntry], msgspec.Meta(max_length=_MAX_ITEMS)] = []
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] = 1
    layout: Annotated[list[RegionMsg], msgspec.Meta(max_length=_MAX_ITEMS)] | None = None

    @property
    def session_id(self) -> str:
        """D's Mooncake session name, ``host:rpc_port`` (bracketed for IPv6)."""
        return host_port(self.host, self.rpc_port)

    def validate(self) -> None:
        """Cross-field rules msgspec cannot express; raises ``MessageError``."""
        if not 0 <= self.tp_rank < self.tp_size:
            raise MessageError(f"tp_rank {self.tp_rank} not below tp_size {self.tp_size}")
        if self.layout is not None:
            if not self.layout:
                raise MessageError("layout, when sent, must name at least one region")
            for r in self.layout:
                if problem := region_problem(r.base_addr, r.block_stride, r.block_bytes,
                                             r.num_blocks, r.group, r.heads):
                    raise MessageError(f"bad layout: {problem}")
            limit = min(r.num_blocks for r in self.layout)
            groups = max(r.group for r in self.layout) + 1
        else:
            limit = groups = None
        d_ids: set[str] = set()
        transfer_ids: set[str] = set()
        for entry in self.reqs:
            if not entry.d_req_id or not entry.transfer_id:
                raise MessageError("d_req_id and transfer_id must be non-empty")
            if entry.d_req_id in d_ids:
                raise MessageError(f"d_req_id {entry.d_req_id!r} appears twice")
            if entry.transfer_id in transfer_ids:
                raise MessageError(f"transfer_id {entry.transfer_id!r} appears twice")
            d_ids.add(entry.d_req_id)
            transfer_ids.add(entry.transfer_id)
            if sum(len(g) for g in entry.block_ids) > _MAX_ITEMS:
                raise MessageError(f"too many block ids for {entry.d_req_id!r}")
            for ids in entry.block_ids:
                if any(b < 0 for b in ids):
                    raise MessageError(f"negative block id for {entry.d_req_id!r}")
                if limit is not None and any(b >= limit for b in ids):
                    raise MessageError(f"block id of {entry.d_req_id!r} beyond D's {limit} "
                                       "blocks")
            if groups is not None and entry.block_ids and len(entry.block_ids) != groups:
                raise MessageError(f"{entry.d_req_id!r} names {len(entry.block_ids)} KV-cache "
                                   f"groups, the layout {groups}")


class CancelEntry(msgspec.Struct, array_like=True, frozen=True):
    d_req_id: Id
    transfer_id: Id

    @classmethod
    def release(cls, transfer_id: str) -> CancelEntry:
        """No decode request will pull this transfer's KV (sent by D's connector when its
        request never ran, and by the proxy when D never got it): P frees it now."""
        return cls(RELEASE_PREFIX + transfer_id, transfer_id)

    @property
    def is_release(self) -> bool:
        return self.d_req_id == RELEASE_PREFIX + self.transfer_id


class CancelRequest(msgspec.Struct, tag="xcancel", omit_defaults=True, frozen=True):
    """D -> P: D gave up on these transfers (deadline, abort) or releases P's blocks."""

    engine_id: Id
    reqs: Annotated[list[CancelEntry], msgspec.Meta(max_length=_MAX_ITEMS)] = []

    def validate(self) -> None:
        transfer_ids = [e.transfer_id for e in self.reqs]
        if len(set(transfer_ids)) != len(transfer_ids):
            raise MessageError("a transfer_id appears twice in the cancel request")
        if any(not e.d_req_id or not e.transfer_id for e in self.reqs):
            raise MessageError("d_req_id and transfer_id must be non-empty")


class TransferResponse(msgspec.Struct, tag="xresp", omit_defaults=True, frozen=True):
    """P -> D (protocol step 30): the outcome for some or all requests of a TransferRequest."""

    status: Status
    ok: list[Id] = []
    failed: dict[Id, Annotated[str, msgspec.Meta(max_length=_MAX_ID)]] = {}
    message: Annotated[str, msgspec.Meta(max_length=_MAX_ID)] = ""
    layout_id: U63 = 0
    # For requests in ``ok`` that asked for one: the digest of the bytes this worker wrote
    # (appliance.connector.transfers.digest); absent when it could not make one.
    digests: dict[Id, Annotated[int, msgspec.Meta(ge=0)]] = {}  # msgpack: at most 2^64-1

    def validate(self) -> None:
        if set(self.digests) - set(self.ok):
            raise MessageError("a digest for a request not reported ok")
        both = set(self.ok) & set(self.failed)
        if both:
            raise MessageError(f"requests both ok and failed: {sorted(both)}")
        if len(set(self.ok)) != len(self.ok):
            raise MessageError("a d_req_id appears twice in ok")
        if self.status is not Status.FINISH and self.ok:
            raise MessageError(f"status {self.status.value} cannot report requests as ok")


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(TransferRequest)
_response_decoder = msgspec.msgpack.Decoder(TransferResponse)
_cancel_decoder = msgspec.msgpack.Decoder(CancelRequest)
# What P's ROUTER receives: the tag tells a transfer request from a cancellation.
_side_channel_decoder = msgspec.msgpack.Decoder(TransferRequest | CancelRequest)


def _encode(msg: TransferRequest | TransferResponse | CancelRequest) -> bytes:
    msg.validate()
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str) -> Any:
    try:
        msg = decoder.decode(data)
    except (msgspec.DecodeError, TypeError) as exc:  # ValidationError is a DecodeError
        raise MessageError(f"invalid {what}: {exc}") from None
    msg.validate()
    return msg


def encode_request(msg: TransferRequest) -> bytes:
    return _encode(msg)


def encode_response(msg: TransferResponse) -> bytes:
    return _encode(msg)


def encode_cancel(msg: CancelRequest) -> bytes:
    return _encode(msg)


def decode_request(data: bytes) -> TransferRequest:
    return _decode(_request_decoder, data, "transfer request")


def decode_response(data: bytes) -> TransferResponse:
    return _decode(_response_decoder, data, "transfer response")


def decode_cancel(data: bytes) -> CancelRequest:
    return _decode(_cancel_decoder, data, "cancel request")


def decode_side_channel(data: bytes) -> TransferRequest | CancelRequest:
    """Decode what D sends P: either message, told apart by its tag (required here)."""
    return _decode(_side_channel_decoder, data, "side-channel message")
