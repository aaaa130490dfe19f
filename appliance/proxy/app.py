"""The proxy's shared state: settings, nodes, routing, placement, metrics, the upstream
pool, and when the proxy answers at all. Each generation request enters through
appliance.proxy.entry. A node found down fails what it holds at once; for a P, so do the
D calls waiting on its KV (they are asked again on D alone).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from appliance import bearer
from appliance.proxy.admission import Admission
from appliance.proxy.exchange.paths import Paths
from appliance.proxy.exchange.relay import Relay
from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.nodes.backends import Backend, Backends
from appliance.proxy.nodes.discovery import KubernetesDiscovery
from appliance.proxy.nodes.engineload import LoadPoller, kv_loads
from appliance.proxy.nodes.handover import Handover
from appliance.proxy.nodes.health import HealthPoller
from appliance.proxy.openai_api import CHAT, COMPLETIONS, RESPONSES
from appliance.proxy.ownership.kv import PrefillKV
from appliance.proxy.ownership.pulls import Pulls
from appliance.proxy.ownership.release import KVReleaser
from appliance.proxy.placement import Placement
from appliance.proxy.placement.routing import Router
from appliance.proxy.placement.seeding import Nodes, seed
from appliance.proxy.prefix.cache import PrefixCache
from appliance.proxy.responses import Homes
from appliance.proxy.settings import ProxySettings
from appliance.proxy.tracing import Tracing
from appliance.proxy.upstream.pool import Upstreams
from appliance.sidechannel import curve

log = logging.getLogger("appliance.proxy")
# After P went down, D's gauges of unfinished KV loads are read this much later: a pull
# that had landed reaches them with D's next steps.
LANDED_RECHECK_S = 1.0

# Keyed with auth_ops_endpoints; /health and /ready stay open: they say only ready or not,
# and load balancers, probes and the container's health check ask them without a key.
_OPS_PATHS = frozenset({"/metrics", "/status"})


COMPLETIONS_ROUTES = (COMPLETIONS, CHAT, RESPONSES)  # what the proxy splits into P and D
SEED_TIMEOUT_S = 30.0  # each call of auto's first measurements (placement.seeding)


class Proxy:
    """State shared by all requests: settings, nodes, routing, metrics, the upstream pool."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.in_flight = 0
        self.shutting_down = False  # SIGTERM: no new requests (appliance.proxy.admin)
        self.metrics = ProxyMetrics(in_flight=lambda: self.in_flight)
        self.backends = Backends(settings, self.metrics)
        self.router = Router(settings.policy)
        self.session: aiohttp.ClientSession | None = None
        self.poller: HealthPoller | None = None
        self.load: LoadPoller | None = None  # the engines' own counts, for auto
        self.discovery: KubernetesDiscovery | None = None
        self._seeding: asyncio.Task[str] | None = None  # auto's first measurements
        self.prefix: PrefixCache | None = None  # the prefix index: auto or cache-aware routing
        self.homes = Homes()  # the node that answered each response (the Responses API)
        self.tracing = (None if not settings.otlp_traces_endpoint else
                        Tracing(settings.otlp_traces_endpoint, settings.otlp_traces_protocol,
                                settings.otlp_traces_sample_ratio))
        self.base_headers: dict[str, str] = {}
        if settings.backend_api_key:
            self.base_headers["Authorization"] = f"Bearer {settings.backend_api_key}"
        self.models_timeout = aiohttp.ClientTimeout(
            total=settings.health_timeout_s + settings.connect_timeout_s)
        self.api_keys = bearer.Keys(settings.api_keys)  # clients'
        self.node_key = bearer.Keys([settings.backend_api_key])  # the admin API's
        # Keep-alive below uvicorn's 5 s default, so a pooled connection is never reused
        # just as vLLM closes it (a classic source of "failed after the router idled").
        # Read timeouts are checked every tick, so a tick is a fraction of the shortest one.
        tick = min(0.25, settings.prefill_timeout_s / 10, settings.decode_read_timeout_s / 10)
        self.tls = settings.upstream_ssl()
        self.upstreams = Upstreams(keepalive_s=4.0, connect_timeout_s=settings.connect_timeout_s,
                                   tick_s=tick, tls=self.tls,
                                   max_connections=settings.max_connections_per_node,
                                   deadline_s=settings.upstream_deadline_s)
        self.backends.on_down = self._node_down
        # A node that left is forgotten once idle: so are its pooled connections.
        self.backends.on_drop = self._dropped
        # Drained or leaving nodes hand what they still answer over (nodes/handover.py).
        self.handover = Handover(self.backends, settings.drain_handover_s,
                                 self.upstreams.fail_node)
        self.admission = Admission(settings.max_in_flight_per_decode, settings.max_queued,
                                   settings.queue_timeout_s,
                                   lambda why: self.metrics.overloaded.labels(why).inc())
        # The cluster's key: P's side channels and every engine's KV events are under it.
        self.curve_key = curve.load(settings.side_channel_key_file)
        self.releaser = KVReleaser(self.metrics, curve_key=self.curve_key)
        self.relay = Relay(settings, self.metrics, self.backends)
        # D calls waiting on a P's KV, failed over if that P goes down (unless D's own KV
        # events say the KV is there already).
        self.pulls = Pulls(self._landed)
        self._rechecks: set[asyncio.Task[None]] = set()
        self.placement = Placement(settings.split, settings.itl_slo_ms,
                                   settings.prefill_timeout_s,
                                   decode_chunk=settings.decode_prefill_chunk)
        self.metrics.split_counts = self.placement.counts
        if self.tracing is not None:
            self.metrics.trace_spans = self.tracing.export.counts
        self.paths = Paths(settings, self.metrics, self.backends, self.upstreams,
                           self.relay, self.pulls, self.base_headers,
                           lambda: self.shutting_down)

    async def start(self, _app: web.Application | None = None) -> None:
        # aiohttp's client for the light traffic: health checks, /query, /v1/models.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0, ttl_dns_cache=300,
                                         ssl=self.tls)
        # Bodies are relayed as they come, so ask for them uncompressed; no cookies either.
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))
        self.poller = HealthPoller(self.backends, self.session, self.settings, self.base_headers)
        self.poller.start()
        self.upstreams.start()
        self.handover.start()
        if self.tracing is not None:
            await self.tracing.start()
        # The index serves auto's placement and the cache-aware routing policies.
        if self.settings.prefix_index and (self.settings.split == "auto"
                                           or self.settings.policy.startswith("cache_aware")):
            s = self.settings
            self.prefix = PrefixCache(self.session, self.base_headers,
                                      lambda: [b.url for b in self.backends.all()],
                                      s.prefix_hash_seed, s.kv_events_resync_s,
                                      s.tokenize_timeout_s, s.tokenizer,
                                      s.kv_block_size, self.curve_key)
            self.prefix.start()
        if self.settings.split == "auto":
            nodes = Nodes(self.backends.ready_prefill, self.backends.ready_decode,
                          self.backends.rotation_changed, self.session, self.base_headers,
                          min(self.settings.prefill_timeout_s, SEED_TIMEOUT_S),
                          self.settings.deadlines.recv_ms(after_prefill=True))
            self._seeding = asyncio.create_task(seed(
                self.placement.prefill, self.placement.handoff, nodes, self.settings.calibrate))
            if self.settings.engine_load_interval_s > 0:
                self.load = LoadPoller(self.backends, self.session, self.base_headers,
                                       self.settings.engine_load_interval_s,
                                       self.settings.health_timeout_s)
                self.load.start()
        if self.settings.discovery == "kubernetes":
            # Nodes come and go with the pods; the poller checks each new one at once.
            self.discovery = KubernetesDiscovery(self.settings.kubernetes,
                                                 self.poller.reconcile)
            self.discovery.start()

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._seeding is not None:
            self._seeding.cancel()
            await asyncio.gather(self._seeding, return_exceptions=True)
        for task in list(self._rechecks):
            task.cancel()
        await asyncio.gather(*self._rechecks, return_exceptions=True)
        if self.discovery is not None:
            await self.discovery.stop()
        if self.poller is not None:
            await self.poller.stop()
        await self.handover.stop()
        if self.load is not None:
            await self.load.stop()
        if self.prefix is not None:
            await self.prefix.stop()
        if self.session is not None:
            await self.session.close()
        await self.upstreams.close()
        await self.releaser.close()
        if self.tracing is not None:
            await self.tracing.close()

    def _landed(self, kv: PrefillKV) -> bool:
        return self.prefix is not None and self.prefix.holds(kv.d_url, kv.lands)

    def _dropped(self, b: Backend) -> None:
        self.upstreams.forget(b.url)
        self.placement.forget(b.url)

    def _node_down(self, b: Backend, why: str) -> None:
        """A node failed down_after health checks in a row: fail what it holds at once.
        A P's calls then go to D alone; so do D's calls still waiting on that P's KV
        (else each would wait for D's recv_timeout_s)."""
        message = (f"{b.role} node {b.url} is down ({self.backends.down_after} failed health "
                   f"checks: {why})")
        if self.prefix is not None:  # what a down engine holds is unknown until it is back
            self.prefix.forget(b.url, "down")
        failed = self.upstreams.fail_node(b.url, message)
        if failed:
            log.warning("%s %s is down (%s): failed its %d calls in flight", b.role, b.url,
                        why, failed)
            self.metrics.upstream_errors.labels(b.role, b.url, "down").inc(failed)
        if b.role == "prefill":
            moved, kept = self.pulls.fail_over(b.url, message)
            if moved:
                log.warning("prefill %s is down: the decode calls waiting on its KV go to D "
                            "alone: transfer=%s", b.url, ",".join(moved))
            if kept:
                log.info("prefill %s is down: D holds the KV of its calls already, they go "
                         "on: transfer=%s", b.url, ",".join(kept))
                task = asyncio.create_task(self._recheck_kept(b.url, message))
                self._rechecks.add(task)
                task.add_done_callback(self._rechecks.discard)

    async def _recheck_kept(self, p_url: str, why: str) -> None:
        """The calls kept when P went down, checked against D's own count of unfinished KV
        loads once D's gauges have caught up (ownership/pulls.py)."""
        await asyncio.sleep(LANDED_RECHECK_S)
        assert self.session is not None
        for d_url in self.pulls.kept(p_url):
            try:
                async with self.session.get(f"{d_url}/metrics", headers=self.base_headers,
                                            timeout=self.models_timeout) as r:
                    loading = kv_loads(await r.text()) if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
                loading = None
            moved = self.pulls.recheck(p_url, d_url, loading, why)
            if moved:
                log.warning("prefill %s is down and decode %s still loads KV for %s of the "
                            "calls its KV events showed landed: they go to D alone: "
                            "transfer=%s", p_url, d_url, "some" if loading else "maybe some",
                            ",".join(moved))

    # ---- auth -------------------------------------------------------------------------

    def authorized(self, request: web.Request) -> bool:
        return self.api_keys.admit(request.headers.get("Authorization", ""))

    def needs_auth(self, path: str) -> bool:
        if not self.api_keys:
            return False
        return path.startswith("/v1/") or (self.settings.auth_ops_endpoints
                                           and path in _OPS_PATHS)

    # ---- the generation endpoints ---------------------------------------------------------

    def cannot_answer(self) -> str | None:
        """Why a generation request would get a 503 now; None: it would be answered. One
        rule for requests and /ready: a D in rotation (or a P, which then serves requests
        whole), and a P too unless requests fall back to D alone (once any P has had an
        engine id: before, the cluster is still starting)."""
        if self.shutting_down:
            return "the proxy is shutting down"
        if not self.backends.ever_ready:
            return "not ready: no prefill node has reported an engine id yet"
        if not self.backends.ready_decode() and not (self.settings.fallback_to_prefill
                                                     and self.backends.ready_prefill()):
            return "no decode node is healthy"
        if not self.backends.ready_prefill() and not self.settings.fallback_to_decode:
            return "no prefill node is healthy with a known engine id"
        return None

    async def wait_answerable(self) -> str | None:
        """cannot_answer(), after waiting up to node_wait_s for a node to come into rotation:
        a gap of moments (a rollout's handover, a node back from a failed check) is not
        worth a 503. Shutting down or never ready: at once."""
        deadline = time.monotonic() + self.settings.node_wait_s
        while (why := self.cannot_answer()) is not None and self.backends.ever_ready \
                and not self.shutting_down:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await self.backends.rotation_changed(left)
        return why
