"""Prefill and decode nodes and their health (docs/protocol.md steps 6-7; the checks:
appliance.proxy.nodes.health).

Membership changes at run time (`Backends.reconcile`, fed by the static settings at start
and by appliance.proxy.nodes.discovery after): a node is a *member* (in rotation once its health
checks pass, as at start-up), *leaving* (gone from the configuration: out of rotation at
once, still health checked, what it holds finishes, like a drain) or *dropped* (forgotten,
once it holds nothing). A leaving node that reappears is a member again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.settings import DecodeNode, PrefillNode, ProxySettings

log = logging.getLogger("appliance.proxy.nodes.health")


@dataclass(eq=False)
class Backend:
    role: str  # "prefill" | "decode"
    url: str
    healthy: bool = False
    in_flight: int = 0
    last_error: str | None = None
    last_check: float | None = None  # monotonic
    # Prompt tokens sent here to prefill and not done yet (appliance.proxy.placement).
    prefill_tokens: int = 0
    # Requests this node decodes now (placed on it, P's KV sent to it, or served whole).
    decodes: int = 0
    # Of those, the ones whose prompt is not computed yet (in P's queue or this node's):
    # a prefill run now stalls no step of theirs (appliance.proxy.placement.Ticket).
    prefilling: int = 0
    # What the engine waits on and runs beyond this proxy's requests (other proxies',
    # direct callers), from its own gauges (appliance.proxy.nodes.engineload).
    others_waiting: int = 0
    others_running: int = 0
    # Round-robin tie breaker for least-outstanding: how many requests this node was given.
    picked: int = 0
    # A decode node's context length (from /v1/models; None until known): a continuation
    # that would not fit is sent the classic way, so the client gets D's 400 as JSON.
    max_model_len: int | None = None
    # Health checks failed in a row (0 while healthy).
    failures: int = 0
    # Drained (the admin API, `pdctl drain`): nothing new, what it has finishes.
    draining: bool = False
    # Gone from the configuration (discovery): nothing new; dropped once it holds nothing.
    leaving: bool = False
    # Forgotten: a health check still running for it changes nothing.
    dropped: bool = False
    # It left holding requests in flight (its drop is then a line of its own).
    left_busy: bool = False

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.draining and not self.leaving

    @property
    def decoding(self) -> int:
        """Requests whose decode steps a prefill run here now would stall."""
        return max(0, self.decodes - self.prefilling)

    @property
    def held(self) -> int:
        """Requests in flight that need this node (a leaving one is dropped at 0)."""
        return self.in_flight

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_rotation": self.in_rotation,
            "draining": self.draining,
            "leaving": self.leaving,
            "in_flight": self.in_flight,
            "prefill_tokens": self.prefill_tokens,
            "decodes": self.decodes,
            "prefilling": self.prefilling,
            "others": {"waiting": self.others_waiting, "running": self.others_running},
            "last_error": self.last_error,
            "last_check_age_s": None if self.last_check is None
            else round(now - self.last_check, 3),
        }


@dataclass(eq=False)
class PrefillBackend(Backend):
    bootstrap_url: str = ""
    # dp rank -> engine id, from the bootstrap's /query.
    engine_ids: dict[int, str] = field(default_factory=dict)
    # dp rank -> its workers' side-channel addresses (every tp and pp rank), same source:
    # where the proxy sends a release for KV no decode node will pull.
    side_channels: dict[int, list[str]] = field(default_factory=dict)
    # Requests whose transfer names this P, from its pick to the request's end: a D may
    # still pull its KV after P answered, and a P found down then fails that D over.
    transfers: int = 0
    _next_rank: int = 0

    @property
    def in_rotation(self) -> bool:
        # Without an engine id D could not find P's workers: not ready (protocol step 6).
        return super().in_rotation and bool(self.engine_ids)

    @property
    def held(self) -> int:
        return max(self.in_flight, self.transfers)

    def next_rank(self) -> tuple[int, str]:
        """Several dp ranks behind one P are used in turn."""
        ranks = sorted(self.engine_ids)
        rank = ranks[self._next_rank % len(ranks)]
        self._next_rank += 1
        return rank, self.engine_ids[rank]

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["bootstrap_url"] = self.bootstrap_url
        out["engine_ids"] = {str(k): v for k, v in sorted(self.engine_ids.items())}
        return out


B = TypeVar("B", bound=Backend)
N = TypeVar("N", PrefillNode, DecodeNode)


class Backends:
    """All nodes known now; health is written by the poller and by failed requests,
    membership by reconcile() alone."""

    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics) -> None:
        self.prefill: list[PrefillBackend] = []
        self.decode: list[Backend] = []
        self.metrics = metrics
        # After this many failed health checks in a row, on_down(node, why) fails the calls
        # the node holds (the proxy's Upstreams.fail_node).
        self.down_after = settings.down_after_failures
        self.on_down: Callable[[Backend, str], None] | None = None
        # Latched once any P has had an engine id: before that, requests get 503 (the
        # deployment is still starting); after, a P outage means fallback, not an outage.
        self.ever_ready = False
        self._changes = asyncio.Event()  # set, and replaced, at each rotation change
        # The rotation, rebuilt when a node's health changes rather than on every request.
        self._ready_prefill: list[PrefillBackend] = []
        self._ready_decode: list[Backend] = []
        # A node dropped (it left and holds nothing): the proxy closes its connections.
        self.on_drop: Callable[[Backend], None] | None = None
        self.reconcile(settings.prefill, settings.decode)

    def all(self) -> list[Backend]:
        return [*self.prefill, *self.decode]

    def ready_prefill(self) -> list[PrefillBackend]:
        return self._ready_prefill

    def ready_decode(self) -> list[Backend]:
        return self._ready_decode

    # ---- membership ------------------------------------------------------------------

    def reconcile(self, prefill: Sequence[PrefillNode],
                  decode: Sequence[DecodeNode]) -> list[Backend]:
        """The one place membership changes: these are the nodes now. New ones join out of
        rotation (returned: HealthPoller.reconcile checks them at once), missing ones start
        leaving, leaving ones named again come back; leaving ones that hold nothing are
        dropped."""
        before = {id(b) for b in self.all()}
        self.prefill = self._merge("prefill", self.prefill, {n.url: n for n in prefill},
                                   self._new_prefill)
        self.decode = self._merge("decode", self.decode, {n.url: n for n in decode},
                                  lambda n: Backend("decode", n.url))
        self.sweep()
        self._refresh()
        return [b for b in self.all() if id(b) not in before]

    @staticmethod
    def _new_prefill(n: PrefillNode) -> PrefillBackend:
        return PrefillBackend("prefill", n.url, bootstrap_url=n.bootstrap_url)

    def _merge(self, role: str, members: list[B], wanted: Mapping[str, N],
               make: Callable[[N], B]) -> list[B]:
        known = {b.url for b in members}
        for b in members:
            node = wanted.get(b.url)
            if node is None:
                if not b.leaving:
                    b.leaving, b.left_busy = True, b.held > 0
                    self._changed(b, "removed")
                    if b.left_busy:  # else sweep() drops it now, in one line
                        log.warning("%s %s removed: out of rotation, dropped once its %d "
                                    "requests in flight finish", role, b.url, b.held)
                continue
            if b.leaving:
                b.leaving = False
                self._changed(b, "returned")
                log.info("%s %s added again before it was dropped: back in rotation when "
                         "healthy", role, b.url)
            if (isinstance(b, PrefillBackend) and isinstance(node, PrefillNode)
                    and node.bootstrap_url != b.bootstrap_url):
                log.warning("prefill %s: bootstrap %s -> %s; its engine ids are read again",
                            b.url, b.bootstrap_url, node.bootstrap_url)
                b.bootstrap_url, b.engine_ids, b.side_channels = node.bootstrap_url, {}, {}
                self._rotation_changed(b)
        added = [make(n) for url, n in wanted.items() if url not in known]
        for b in added:
            self._changed(b, "added")
            log.info("%s %s added: in rotation once its health checks pass", role, b.url)
        return [*members, *added]

    def sweep(self) -> None:
        """Drop the leaving nodes that hold nothing any more."""
        gone = [b for b in self.all() if b.leaving and not b.held]
        if not gone:
            return
        self.prefill = [b for b in self.prefill if b not in gone]
        self.decode = [b for b in self.decode if b not in gone]
        for b in gone:
            b.dropped = True
            self.metrics.forget_backend(b.role, b.url)
            self.metrics.membership.labels(b.role, "dropped").inc()
            log.info("%s %s %s", b.role, b.url,
                     "dropped: its requests in flight finished" if b.left_busy
                     else "removed and dropped: nothing in flight")
            if self.on_drop is not None:
                self.on_drop(b)
        self._refresh()

    def _changed(self, b: Backend, change: str) -> None:
        self.metrics.membership.labels(b.role, change).inc()
        self._rotation_changed(b)

    def _refresh(self) -> None:
        self._ready_prefill = [n for n in self.prefill if n.in_rotation]
        self._ready_decode = [n for n in self.decode if n.in_rotation]
        self.metrics.backends_known.labels("prefill").set(len(self.prefill))
        self.metrics.backends_known.labels("decode").set(len(self.decode))

    # ---- health and rotation -------------------------------------------------------------

    def set_health(self, b: Backend, healthy: bool, error: str | None = None,
                   engine_ids: dict[int, str] | None = None,
                   side_channels: dict[int, list[str]] | None = None) -> None:
        if b.dropped:  # a check that was running when the node was dropped
            return
        was = b.in_rotation
        if engine_ids is not None and isinstance(b, PrefillBackend):
            b.engine_ids = engine_ids
            b.side_channels = side_channels or {}
        b.healthy = healthy
        b.last_error = error
        b.last_check = time.monotonic()
        b.failures = 0 if healthy else b.failures + 1
        if b.failures == self.down_after and self.on_down is not None:
            # Hung or gone for that many checks in a row (a SIGSTOPped process accepts
            # connections and answers nothing): what it holds fails now, not at its timeout.
            self.on_down(b, error or "failed its health checks")
        if isinstance(b, PrefillBackend) and b.in_rotation:
            self.ever_ready = True
        now = self._rotation_changed(b)
        if was != now:
            if now:
                log.info("%s %s in rotation", b.role, b.url)
            else:
                log.warning("%s %s out of rotation: %s", b.role, b.url, error)

    def _rotation_changed(self, b: Backend) -> bool:
        now = b.in_rotation
        self.metrics.backend_up.labels(b.role, b.url).set(1 if now else 0)
        self._ready_prefill = [n for n in self.prefill if n.in_rotation]
        self._ready_decode = [n for n in self.decode if n.in_rotation]
        # Wake whoever waits for the rotation to change (Proxy.wait_answerable).
        changed, self._changes = self._changes, asyncio.Event()
        changed.set()
        return now

    async def rotation_changed(self, timeout: float) -> None:
        """Until the set of nodes in rotation may have changed, or `timeout` passed."""
        try:
            await asyncio.wait_for(self._changes.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def find(self, node: str) -> list[Backend]:
        """The nodes `node` names: a URL, or "prefill" / "decode" for all of that role."""
        if node in ("prefill", "decode"):
            return list(self.prefill if node == "prefill" else self.decode)
        return [b for b in self.all() if b.url == node.rstrip("/")]

    def set_draining(self, b: Backend, draining: bool) -> None:
        if b.draining != draining:
            b.draining = draining
            self._rotation_changed(b)
            log.warning("%s %s %s", b.role, b.url,
                        "draining: out of rotation, its requests in flight finish"
                        if draining else "undrained: back in rotation when healthy")

    def mark_failed(self, b: Backend, error: str) -> None:
        """A request could not connect: out of rotation now, the poller brings it back."""
        self.set_health(b, False, error)

    def not_ready_reason(self) -> str | None:
        if not self.ready_prefill():
            return "no prefill node is healthy with a known engine id"
        if not self.ready_decode():
            return "no decode node is healthy"
        return None

    def status(self) -> dict[str, Any]:
        return {
            "ready": self.not_ready_reason() is None,
            "reason": self.not_ready_reason(),
            "prefill": [b.describe() for b in self.prefill],
            "decode": [b.describe() for b in self.decode],
        }
