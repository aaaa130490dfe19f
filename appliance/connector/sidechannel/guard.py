"""What P's side channel refuses before it decodes, plans, or writes a byte.

Pure checks, each returning the problem (a sentence for the log and D's ERROR reply) or
None; `admit` runs those that need no layout on a received frame, `check_blocks` runs once
the layout is known. A `Rejection` is counted under its reason (`stats.REJECT_REASONS`) and
logged once naming the engine and transfer ids (`record`), and its sender answered ERROR:
nothing of a refused message is acted on.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from appliance.sidechannel import messages as m

if TYPE_CHECKING:
    from appliance.connector.planning.plan import Region
    from appliance.connector.stats import TransferStats

log = logging.getLogger("vllm.appliance.connector.transfers.sender")  # the Sender's log: one stream

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
SideMessage = m.TransferRequest | m.CancelRequest


@dataclass(frozen=True)
class Rejection:
    reason: str  # one of stats.REJECT_REASONS
    problem: str
    msg: SideMessage | None = None  # None: not decoded

    def describe(self, most: int = 4) -> str:
        """`engine=... transfers=a,b,...` for the log line, at most `most` ids."""
        if self.msg is None:
            return "engine=?"
        reqs = self.msg.reqs
        more = f",+{len(reqs) - most}" if len(reqs) > most else ""
        ids = ",".join(e.transfer_id for e in reqs[:most]) or "-"
        return f"engine={self.msg.engine_id} transfers={ids}{more}"

    def record(self, stats: TransferStats) -> m.TransferResponse:
        """Count and log this rejection once; returns the ERROR answer for its sender."""
        if self.reason == "invalid":
            stats.record_failure()  # counted so before there were other reasons
        stats.record_rejected(self.reason)
        log.warning("rejected side-channel message (%s) %s: %s", self.reason,
                    self.describe(), self.problem)
        return self.response()

    def response(self) -> m.TransferResponse:
        """ERROR, naming each request (D fails them at once) unless there are too many."""
        problem = self.problem[:1024]  # D's decoder bounds a reply's strings
        named = isinstance(self.msg, m.TransferRequest) and self.reason != "entries"
        failed = {e.d_req_id: problem for e in self.msg.reqs} if named else {}
        return m.TransferResponse(status=m.Status.ERROR, failed=failed, message=problem)


def admit(frame: zmq.Frame, max_bytes: int, max_entries: int,
          internal: Iterable[Network]) -> SideMessage | Rejection:
    """The message in `frame`, decoded and validated, or why it is refused."""
    if problem := check_size(len(frame), max_bytes):
        return Rejection("size", problem)
    try:
        msg = m.decode_side_channel(frame.buffer)
    except m.MessageError as exc:
        return Rejection("invalid", str(exc))
    if problem := check_entries(msg, max_entries):
        return Rejection("entries", problem, msg)
    if isinstance(msg, m.TransferRequest) and (
            problem := check_session(msg.host, peer_of(frame), internal)):
        return Rejection("session", problem, msg)
    return msg


def check_size(nbytes: int, limit: int) -> str | None:
    """Checked before decoding: msgspec would otherwise build the whole message first."""
    if nbytes > limit:
        return f"message of {nbytes} bytes is over max_message_bytes={limit}"
    return None


def check_entries(msg: SideMessage, limit: int) -> str | None:
    """Checked before any task or transfer record exists for one of them."""
    if len(msg.reqs) > limit:
        return f"{len(msg.reqs)} entries are over max_message_entries={limit}"
    return None


def check_blocks(msg: m.TransferRequest, layout: Sequence[Region]) -> str | None:
    """Every block id within D's cache, also when the layout was sent earlier (the decoder
    checks only a layout riding in the same message): an id past it would make P write
    into whatever of D's memory follows that cache."""
    limit = min(r.num_blocks for r in layout)
    groups = max(r.group for r in layout) + 1
    for entry in msg.reqs:
        if entry.block_ids and len(entry.block_ids) != groups:
            return (f"d_req {entry.d_req_id} names {len(entry.block_ids)} KV-cache groups, "
                    f"D's layout {groups}")
        top = max((max(ids) for ids in entry.block_ids if ids), default=-1)
        if top >= limit:
            return f"block id {top} of d_req {entry.d_req_id} is beyond D's {limit} blocks"
    return None


def check_session(host: str, peer: str | None, internal: Iterable[Network]) -> str | None:
    """P writes into whatever Mooncake session a request names: only D's own address (the
    one the message came from) or one inside the cluster's internal networks."""
    try:
        addr = _address(host)
    except ValueError:
        return f"session host {host!r} is not an IP address"
    try:
        if peer is not None and addr == _address(peer):
            return None
    except ValueError:
        pass
    if any(addr in net for net in internal):
        return None
    return (f"session host {host} is neither the sender's address ({peer or 'unknown'}) "
            "nor in internal_networks")


def networks(cidrs: Iterable[str] | None) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs or ())


def peer_of(frame: zmq.Frame) -> str | None:
    """The IP address a received message came from (libzmq's Peer-Address, TCP only)."""
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return None


def _address(text: str) -> Address:
    addr = ipaddress.ip_address(text.strip("[]"))
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped  # a dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d
    return addr
