"""The proxy's shared state and the entry of every generation request.

Per request: read and check the body, pick D (admission: a slot, or a 429) and P, and hand
the request to an exchange path (appliance.proxy.exchange); however it ends, release P's
KV if the request still owes it (appliance.proxy.ownership), count it and log it. A node
found down fails what it holds at once; for a P, so do the D calls waiting on its KV
(they are asked again on D alone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from appliance import bearer
from appliance.httperrors import json_error
from appliance.proxy.admission import Admission
from appliance.proxy.errors import NodeDown, ProxyError
from appliance.proxy.exchange import first_token
from appliance.proxy.exchange.paths import Exchange
from appliance.proxy.exchange.relay import Relay
from appliance.proxy.exchange.bodies import uuid4_str
from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.nodes.backends import Backend, Backends, PrefillBackend
from appliance.proxy.nodes.discovery import KubernetesDiscovery
from appliance.proxy.nodes.health import HealthPoller
from appliance.proxy.openai_api import CHAT, COMPLETIONS, parse_request
from appliance.proxy.ownership.kv import Holder, PrefillKV
from appliance.proxy.ownership.pulls import Pulls
from appliance.proxy.ownership.release import KVReleaser
from appliance.proxy.placement import Decision, Placement, Ticket
from appliance.proxy.placement.routing import Router
from appliance.proxy.prefix.cache import Lookup, PrefixCache
from appliance.proxy.record import Record
from appliance.proxy.settings import ProxySettings
from appliance.proxy.tracing import Tracing
from appliance.proxy.upstream.pool import Upstreams
from appliance.sidechannel import curve

log = logging.getLogger("appliance.proxy")

_encode = msgspec.json.encode
# Keyed with auth_ops_endpoints; /health and /ready stay open: they say only ready or not,
# and load balancers, probes and the container's health check ask them without a key.
_OPS_PATHS = frozenset({"/metrics", "/status"})


COMPLETIONS_ROUTES = (COMPLETIONS, CHAT)  # what the proxy splits into P and D


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
        self.discovery: KubernetesDiscovery | None = None
        self.prefix: PrefixCache | None = None  # the prefix index: auto or cache-aware routing
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
        self.admission = Admission(settings.max_in_flight_per_decode, settings.max_queued,
                                   settings.queue_timeout_s,
                                   lambda why: self.metrics.overloaded.labels(why).inc())
        self.releaser = KVReleaser(self.metrics,
                                   curve_key=curve.load(settings.side_channel_key_file))
        self.relay = Relay(settings, self.metrics, self.backends)
        # D calls waiting on a P's KV, failed over if that P goes down (unless D's own KV
        # events say the KV is there already).
        self.pulls = Pulls(self._landed)
        self.placement = Placement(settings.split, settings.itl_slo_ms,
                                   settings.prefill_timeout_s)
        self.metrics.split_counts = self.placement.counts
        if self.tracing is not None:
            self.metrics.trace_spans = self.tracing.export.counts
        self.exchange = Exchange(settings, self.metrics, self.backends, self.upstreams,
                                 self.relay, self.pulls, self.base_headers)

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
                                      s.kv_block_size)
            self.prefix.start()
        if self.settings.discovery == "kubernetes":
            # Nodes come and go with the pods; the poller checks each new one at once.
            self.discovery = KubernetesDiscovery(self.settings.kubernetes,
                                                 self.poller.reconcile)
            self.discovery.start()

    async def stop(self, _app: web.Application | None = None) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        if self.poller is not None:
            await self.poller.stop()
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
        rule for requests and /ready: a D in rotation, and a P too unless requests fall
        back to D alone (once any P has had an engine id: before, the cluster is still
        starting)."""
        if self.shutting_down:
            return "the proxy is shutting down"
        if not self.backends.ever_ready:
            return "not ready: no prefill node has reported an engine id yet"
        if not self.backends.ready_decode():
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

    async def generate(self, request: web.Request, route: str) -> web.StreamResponse:
        given = request.headers.get("X-Request-Id")
        if given and len(given) <= 256 and given.isascii() and given.isprintable():
            rec = Record(route, given, time.monotonic())
        else:  # absent, or not safe to send upstream verbatim
            rec = Record(route, uuid4_str(), time.monotonic(), own_request_id=True)
        if self.tracing is not None:
            rec.trace = self.tracing.begin()
        self.in_flight += 1
        try:
            resp = await self._generate(request, rec)
            rec.status = resp.status
            return resp
        except ProxyError as exc:
            rec.status, rec.error = exc.status, exc.message
            return json_error(exc.status, exc.message, exc.err_type,
                              headers={"X-Request-Id": rec.request_id, **exc.headers})
        except asyncio.CancelledError:
            rec.status, rec.error = 499, "client disconnected"  # nginx's code for it
            raise
        except ConnectionResetError:  # the client left as its answer started
            rec.status, rec.error = 499, "client disconnected"
            raise
        except Exception as exc:
            log.exception("request %s failed", rec.request_id)
            rec.status, rec.error = 500, repr(exc)
            return json_error(500, f"proxy error: {exc!r}",
                              headers={"X-Request-Id": rec.request_id})
        finally:
            self.in_flight -= 1
            if rec.computed_on is not None and rec.prefix is not None and self.prefix is not None:
                self.prefix.unexpect(rec.computed_on, rec.prefix)
            if rec.kv is not None:
                rec.kv.p.transfers -= 1
                self.pulls.done(rec.kv)
                if rec.kv.owed:
                    # However the request ended, no D took P's KV over: free it now rather
                    # than after P's send_timeout_s.
                    self.releaser.release(rec.kv)
                    rec.kv.move(Holder.NONE, "released by the proxy")
            self._learn(rec)
            self.metrics.count_request(route, rec.status)
            rec.observe_client(self.metrics, time.monotonic())
            if rec.trace is not None:
                rec.trace.finish(rec)
            if self.settings.log_requests:
                rec.log()

    def _learn(self, rec: Record) -> None:
        """What the finished request measured goes to the placement's estimates."""
        if rec.ticket is not None:
            rec.ticket.close(time.monotonic(), learn=False)
        if rec.placed is None:
            return
        handoff = None
        if (not rec.local and rec.fallback is None and rec.prefilled_at is not None
                and rec.decode_first_at is not None and rec.status == 200):
            # Only the blocks D lacks move.
            handoff = ((rec.prompt_tokens or rec.placed.tokens) - rec.placed.cached_d,
                       rec.decode_first_at - rec.prefilled_at)
        output = rec.usage_output if rec.usage_output is not None else rec.tokens_out
        self.placement.learned(rec.route, rec.prompt_chars, rec.prompt_tokens, handoff,
                               rec.step_s, rec.batch, output if rec.status == 200 else None)

    async def _generate(self, request: web.Request, rec: Record) -> web.StreamResponse:
        if self.shutting_down:
            raise ProxyError(503, "the proxy is shutting down")
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ProxyError(413, f"request body too large (limit {limit} bytes)")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body too large (limit {limit} bytes)") from None
        body = parse_request(raw, rec.route)

        why = await self.wait_answerable()
        if why is not None:
            raise ProxyError(503, why)
        prefills = self.backends.ready_prefill()
        size = self.placement.tokens(body, rec.route)  # (estimated tokens, characters)
        if prefills and self.prefix is not None:
            rec.prefix = await self._lookup(body, rec, prefills, size[0])
        rec.stream = body.get("stream") is True
        asked = time.monotonic()
        d = await self.admission.admit(
            self.backends.ready_decode, lambda ds: self.router.pick_decode(ds, rec.prefix))
        self.metrics.admission_wait.observe(time.monotonic() - asked)
        try:
            return await self._serve(request, rec, body, prefills, d, size)
        except NodeDown as down:
            if rec.ttfb_s is not None:
                raise
            return await self.exchange.elsewhere(
                request, rec, body, down, self.backends.ready_decode(),
                lambda ds: self.router.pick_decode(ds, rec.prefix))
        finally:
            self.admission.release(d)

    async def _serve(self, request: web.Request, rec: Record, body: dict[str, Any],
                     prefills: list[PrefillBackend], d: Backend,
                     size: tuple[int, int]) -> web.StreamResponse:
        """The request placed and sent on its path, D admitted."""
        serving: Backend | None = None  # the node that decodes: counted in its `decodes`
        try:
            if not prefills:
                serving = d
                d.decodes += 1
                return await self.exchange.plain(request, rec, body, d, "no_prefill")
            if self.prefix is not None and rec.prefix is not None:
                # As the index is now, and no await from here to `expect`: a burst on one
                # prefix sees where the first of it is computed.
                rec.prefix = self.prefix.recount(rec.prefix, list(rec.prefix.cached))
            p = self.router.pick_prefill(prefills, rec.prefix)
            rec.placed, rec.ticket, rec.prompt_chars = self._place(body, rec, p, d, size)
            if self.prefix is not None and rec.prefix is not None:
                # Its blocks are cached where it is computed from the step it is scheduled
                # in: a burst on the same prefix goes there before the events say so.
                rec.computed_on = (d if rec.placed.where == "local" else p).url
                self.prefix.expect(rec.computed_on, rec.prefix)
            serving = p if rec.placed.on_prefill else d
            serving.decodes += 1
            rec.batch = serving.decodes
            if serving is p:  # P holds the request: drains, leaves and routing see it
                p.in_flight += 1
                rec.prefill = p.url
            if rec.placed.local:
                return await self.exchange.local(request, rec, body, serving)
            if self.settings.first_token_from_prefill and body.get("stream") is True:
                if first_token.ineligible(body, rec.route) is None:
                    return await self.exchange.first_token(request, rec, body, p, d)
                self.metrics.first_token.labels("decode").inc()
            return await self.exchange.split(request, rec, body, p, d)
        finally:
            if serving is not None:
                if rec.batch is not None:  # the requests its node held, at start and end
                    rec.batch = (rec.batch + serving.decodes) / 2
                serving.decodes -= 1
                if serving is not d:
                    serving.in_flight -= 1

    async def _lookup(self, body: dict[str, Any], rec: Record,
                      prefills: list[PrefillBackend], estimate: int) -> Lookup | None:
        """The prompt's cached share on every node in rotation, from the prefix index, before
        P and D are picked by it. Its ids come from the proxy's own tokenizer when it has
        one, else from the least busy D's /tokenize: a D must answer the request anyway,
        where a frozen P would hold every request for tokenize_timeout_s (a loaded D's API
        server takes longer: 8-30 ms measured here with 8 streams on one core, against
        2-3 ms idle; the access line's tokenize_ms)."""
        assert self.prefix is not None
        decodes = self.backends.ready_decode()
        if not decodes:
            return None
        ask = min(decodes, key=lambda b: (b.in_flight, b.decodes))
        return await self.prefix.lookup(body, rec.route, estimate, ask.url,
                                        [b.url for b in (*prefills, *decodes)])

    def _place(self, body: dict[str, Any], rec: Record, p: Backend, d: Backend,
               size: tuple[int, int]) -> tuple[Decision, Ticket, int]:
        """The placement's decision, with each node's cached share of the prompt when the
        prefix index told it; the prediction counted for each node that computes the
        prompt (P alone, D alone, or both: D looks its cache up for a remote one too)."""
        placed = self.placement.choose(body, rec.route, p, d, rec.prefix, size)
        decision = placed[0]
        computing: list[tuple[Backend, int]] = []
        if decision.where != "local":
            computing.append((p, decision.cached_p))
        if decision.where != "p_alone":
            computing.append((d, decision.cached_d))
        for node, cached in computing:
            self.metrics.prefix_hits.labels(node.role, node.url).inc(cached)
            self.metrics.prefix_queries.labels(node.role, node.url).inc(decision.tokens)
        return placed

    def route_handler(self, route: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.generate(request, route)
        return handler
