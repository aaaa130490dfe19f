"""The P/D exchange: one request split into P's leg and D's (seeds steps 8-10, 25, 42-43).

Pick P (and a dp rank) and D, send both at once, wait for P's status before any byte of D's
answer reaches the client (with vLLM, D cannot speak before P has sent the KV, so this costs
nothing), then relay D (appliance.proxy.relay). A streaming request that
first_token.ineligible() accepts goes P first instead: P's token reaches the client as soon
as P answers, and D, asked then, continues after it. P failing cancels D; D failing cancels
P; the client leaving cancels both (the server runs with handler_cancellation, so the
handler is cancelled and its upstream connections closed). Who must free P's KV is one
state per request (appliance.proxy.ownership), released here when the request ends owing
it. A P found down while D waits for its KV: D is asked again alone.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from appliance.connector import curve
from appliance.httperrors import json_error
from appliance.proxy import first_token
from appliance.proxy.admission import Admission
from appliance.proxy.backends import Backend, Backends, HealthPoller, PrefillBackend
from appliance.proxy.errors import ProxyError, upstream_error_body
from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.ownership import Holder, PrefillKV, Pulls
from appliance.proxy.record import Record
from appliance.proxy.relay import Relay, json_response
from appliance.proxy.release import KVReleaser
from appliance.proxy.routing import Router
from appliance.proxy.settings import ProxySettings
from appliance.proxy.split import (
    CHAT,
    COMPLETIONS,
    decode_body,
    new_transfer_id,
    parse_request,
    prefill_body,
    prefill_finish_reason,
    uuid4_str,
)
from appliance.proxy.upstream import Pool, Response, UpstreamError, Upstreams, wait_any

log = logging.getLogger("appliance.proxy")

_encode = msgspec.json.encode
# Keyed with auth_ops_endpoints; /health stays open: it says only ready or not, and load
# balancers and the container's health check probe it without a key.
_OPS_PATHS = frozenset({"/metrics", "/status"})
# One upstream call of the cold path: pool, response sent already (or None), body, read
# timeout, headers.
_Call = tuple[Pool, "Response | None", bytes, float, dict[str, str]]


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
        self.base_headers: dict[str, str] = {}
        if settings.backend_api_key:
            self.base_headers["Authorization"] = f"Bearer {settings.backend_api_key}"
        self.models_timeout = aiohttp.ClientTimeout(
            total=settings.health_timeout_s + settings.connect_timeout_s)
        self.api_keys = [k.encode() for k in settings.api_keys]
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
        self.admission = Admission(settings.max_in_flight_per_decode, settings.max_queued,
                                   settings.queue_timeout_s,
                                   lambda why: self.metrics.overloaded.labels(why).inc())
        self.releaser = KVReleaser(self.metrics,
                                   curve_key=curve.load(settings.side_channel_key_file))
        self.relay = Relay(settings, self.metrics, self.backends)
        self.pulls = Pulls()  # D calls waiting on a P's KV, failed over if that P goes down

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

    async def stop(self, _app: web.Application | None = None) -> None:
        if self.poller is not None:
            await self.poller.stop()
        if self.session is not None:
            await self.session.close()
        await self.upstreams.close()
        await self.releaser.close()

    def _node_down(self, b: Backend, why: str) -> None:
        """A node failed down_after health checks in a row: fail what it holds at once.
        A P's calls then go to D alone; so do D's calls still waiting on that P's KV
        (else each would wait for D's recv_timeout_s)."""
        message = (f"{b.role} node {b.url} is down ({self.backends.down_after} failed health "
                   f"checks: {why})")
        failed = self.upstreams.fail_node(b.url, message)
        if failed:
            log.warning("%s %s is down (%s): failed its %d calls in flight", b.role, b.url,
                        why, failed)
            self.metrics.upstream_errors.labels(b.role, b.url, "down").inc(failed)
        if b.role == "prefill":
            moved = self.pulls.fail_over(b.url, message, lambda kv: log.warning(
                "transfer=%s: %s; D asked alone", kv.transfer_id, message))
            if moved:
                log.warning("prefill %s is down: %d decode calls waiting on its KV go to D "
                            "alone", b.url, moved)

    # ---- auth -------------------------------------------------------------------------

    def authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        token = given.strip().encode()
        # Compare against every key, so timing says nothing about which one was close.
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(token, key)
        return ok

    def needs_auth(self, path: str) -> bool:
        if not self.api_keys:
            return False
        return path.startswith("/v1/") or (self.settings.auth_ops_endpoints
                                           and path in _OPS_PATHS)

    # ---- the generation endpoints ---------------------------------------------------------

    async def generate(self, request: web.Request, route: str) -> web.StreamResponse:
        given = request.headers.get("X-Request-Id")
        if given and len(given) <= 256 and given.isascii() and given.isprintable():
            rec = Record(route, given, time.monotonic())
        else:  # absent, or not safe to send upstream verbatim
            rec = Record(route, uuid4_str(), time.monotonic(), own_request_id=True)
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
            if rec.kv is not None:
                self.pulls.done(rec.kv)
                if rec.kv.owed:
                    # However the request ended, no D took P's KV over: free it now rather
                    # than after P's send_timeout_s.
                    self.releaser.release(rec.kv)
                    rec.kv.move(Holder.NONE, "released by the proxy")
            self.metrics.count_request(route, rec.status)
            if self.settings.log_requests:
                rec.log()

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

        if not self.backends.ever_ready:
            raise ProxyError(503, "not ready: no prefill node has reported an engine id yet")
        decodes = self.backends.ready_decode()
        if not decodes:
            raise ProxyError(503, "no decode node is healthy")
        prefills = self.backends.ready_prefill()
        if not prefills and not self.settings.fallback_to_decode:
            raise ProxyError(503, "no prefill node is healthy with a known engine id")
        d = await self.admission.admit(self.backends.ready_decode, self.router.pick_decode)
        try:
            if not prefills:
                return await self._serve_plain(request, rec, body, d, "no_prefill")
            p = self.router.pick_prefill(prefills)
            if self.settings.first_token_from_prefill and body.get("stream") is True:
                if first_token.ineligible(body, rec.route) is None:
                    return await self._serve_first_token(request, rec, body, p, d)
                self.metrics.first_token.labels("decode").inc()
            return await self._serve_split(request, rec, body, p, d)
        finally:
            self.admission.release(d)

    def _headers(self, rec: Record) -> dict[str, str]:
        h = {"Content-Type": "application/json", "X-Request-Id": rec.request_id}
        h.update(self.base_headers)
        return h

    def _prefill_headers(self, rec: Record, kv: PrefillKV) -> dict[str, str]:
        """P's headers: with several dp ranks behind P's API server, the rank chosen (as
        vLLM's own example proxy does), so the prefill runs in the engine whose id D is told
        to pull from; without it P's server balances by itself and D waits on the wrong
        engine. One rank alone (no DP, or an external load balancer in front of each rank)
        gets none: such a server accepts only its local rank index."""
        h = self._headers(rec)
        if len(kv.p.engine_ids) > 1:
            h["X-data-parallel-rank"] = str(kv.rank)
        return h

    def _pair(self, rec: Record, p: PrefillBackend, d: Backend) -> tuple[PrefillKV, str]:
        """Picks P's dp rank and names the transfer: (the KV P will hold, P's engine id)."""
        rank, engine_id = p.next_rank()
        # A request id of ours is a fresh uuid4: the transfer id reuses it (as the reference
        # does), which also ties the two together in logs; a client's id is not trusted to be
        # unique, so then the transfer id gets its own.
        rec.transfer_id = f"xfer-{rec.request_id}" if rec.own_request_id else new_transfer_id()
        rec.prefill, rec.decode = f"{p.url}#dp{rank}", d.url
        rec.kv = PrefillKV(p, rank, rec.transfer_id)
        return rec.kv, engine_id

    async def _serve_split(self, request: web.Request, rec: Record, body: dict[str, Any],
                           p: PrefillBackend, d: Backend) -> web.StreamResponse:
        kv, engine_id = self._pair(rec, p, d)
        transfer_id = kv.transfer_id
        headers = self._headers(rec)
        p_headers = self._prefill_headers(rec, kv)
        p_data = _encode(prefill_body(body, rec.route, transfer_id))
        d_data = _encode(decode_body(body, transfer_id, p.bootstrap_url, engine_id))
        p_pool, d_pool = self.upstreams.pool(p.url), self.upstreams.pool(d.url)
        p_timeout = self.settings.prefill_timeout_s
        d_timeout = self.settings.decode_read_timeout_s

        kv.move(Holder.ASKED, "D's request, sent with P's, asks for it")
        p.in_flight += 1
        p_counted = True
        p_resp: Response | None = None
        d_resp: Response | None = None
        handed_over = False
        started = time.monotonic()
        try:
            # Both at once: on pooled connections, two writes back to back.
            p_resp = p_pool.send_nowait(rec.route, p_data, p_headers, read_timeout=p_timeout)
            d_resp = d_pool.send_nowait(rec.route, d_data, headers, read_timeout=d_timeout)
            p_error: UpstreamError | None = None
            if p_resp is None or d_resp is None:
                p_res, d_res = await self._send_both(
                    (p_pool, p_resp, p_data, p_timeout, p_headers),
                    (d_pool, d_resp, d_data, d_timeout, headers), rec.route)
                if isinstance(p_res, Response):
                    p_resp = p_res
                else:
                    p_error = p_res
                if isinstance(d_res, UpstreamError):
                    raise self.relay.decode_error(d, d_res)
                d_resp = d_res
            assert d_resp is not None
            if p_resp is not None:
                pr, dr = p_resp, d_resp
                # P's outcome first: no byte of D reaches the client before P has succeeded.
                await wait_any(pr, dr, until=lambda: pr.done or _failed_early(dr))
                if not pr.done:
                    # D is lost or refused: P's KV would wait for a pull that never comes.
                    pr.close()
                    handed_over = True
                    return await self.relay.relay(request, rec, d, dr)
                p_error = pr.error
            d_resp.touch()  # D's silence counts from P's answer: it was waiting for the KV
            p.in_flight -= 1
            p_counted = False

            if p_error is not None or p_resp is None:
                assert p_error is not None
                d_resp.close()
                return await self._prefill_failed(request, rec, body, p, d, p_error)
            p_raw = await p_resp.read()  # complete already: returns at once
            rec.prefill_s = time.monotonic() - started
            self.metrics.prefill_latency.observe(rec.prefill_s)
            if p_resp.status >= 300:
                # For example 400, prompt too long: D must not wait for KV that never comes.
                d_resp.close()
                return self._prefill_refused(rec, p, p_resp.status, p_raw)
            if (self.settings.fallback_on_prefill_stop
                    and prefill_finish_reason(p_raw) == "stop"):
                d_resp.close()
                return await self._serve_plain(request, rec, body, d, "prefill_stopped")
            handed_over = True
            self.pulls.waiting(kv, d_resp)
            return await self.relay.relay(request, rec, d, d_resp,
                                          self._alone(rec, d, rec.route, _encode(body)))
        finally:
            if p_counted:
                p.in_flight -= 1
            if p_resp is not None:
                p_resp.close()
            if d_resp is not None and not handed_over:
                d_resp.close()

    async def _prefill_failed(self, request: web.Request, rec: Record, body: dict[str, Any],
                              p: PrefillBackend, d: Backend,
                              error: UpstreamError) -> web.StreamResponse:
        """P unreachable or timed out: D alone if allowed, else 503."""
        self.metrics.upstream_errors.labels("prefill", p.url, error.kind).inc()
        if error.kind == "connect":
            self.backends.mark_failed(p, str(error))
            if rec.kv is not None:  # P never got it (a timed-out one may hold KV)
                rec.kv.move(Holder.NONE, "P unreachable")
        if not self.settings.fallback_to_decode:
            raise ProxyError(503, f"prefill node {p.url}: {error}")
        rec.error = f"prefill: {error}"
        reason = "prefill_timeout" if error.kind == "timeout" else "prefill_unreachable"
        return await self._serve_plain(request, rec, body, d, reason)

    def _prefill_refused(self, rec: Record, p: PrefillBackend, status: int,
                         raw: bytes) -> web.Response:
        """P answered an error (for example 400, prompt too long): the client gets it."""
        if rec.kv is not None:  # a P request that failed frees its own blocks
            rec.kv.move(Holder.NONE, f"P answered {status}")
        self.metrics.upstream_errors.labels("prefill", p.url, _kind(status)).inc()
        rec.error = "prefill failed"
        return json_response(status, upstream_error_body(status, raw, f"prefill node {p.url}"),
                             rec)

    async def _serve_first_token(self, request: web.Request, rec: Record, body: dict[str, Any],
                                 p: PrefillBackend, d: Backend) -> web.StreamResponse:
        """P first; its token goes to the client at once, then D continues after it
        (first_token module). D is asked only once P's answer says what to continue."""
        kv, engine_id = self._pair(rec, p, d)
        transfer_id = kv.transfer_id
        p_data = _encode(first_token.prefill_request(body, rec.route, transfer_id))
        started = time.monotonic()
        p_resp: Response | None = None
        p_error: UpstreamError | None = None
        p.in_flight += 1
        try:
            p_resp = await self.upstreams.pool(p.url).send(
                rec.route, p_data, self._prefill_headers(rec, kv),
                read_timeout=self.settings.prefill_timeout_s)
            p_raw = await p_resp.read()
        except UpstreamError as exc:
            p_error = exc
        finally:
            p.in_flight -= 1
            if p_resp is not None:
                p_resp.close()
        if p_error is not None or p_resp is None:
            assert p_error is not None
            return await self._prefill_failed(request, rec, body, p, d, p_error)
        rec.prefill_s = time.monotonic() - started
        self.metrics.prefill_latency.observe(rec.prefill_s)
        if p_resp.status >= 300:
            return self._prefill_refused(rec, p, p_resp.status, p_raw)

        answer = first_token.parse_prefill_answer(p_raw, rec.route)
        if answer is None or not first_token.fits(body, rec.route, answer, d.max_model_len):
            # P's token cannot lead (a parser's output, half a character), or D would refuse
            # the length after the stream began: D answers classically, still from P's KV,
            # which P holds for this transfer.
            self.metrics.first_token.labels("decode").inc()
            d_data = _encode(decode_body(body, transfer_id, p.bootstrap_url, engine_id))
            kv.move(Holder.ASKED, "D asked to answer from it")
            d_resp = await self._send_decode(rec, d, rec.route, d_data)
            self.pulls.waiting(kv, d_resp)
            return await self.relay.relay(request, rec, d, d_resp,
                                          self._alone(rec, d, rec.route, _encode(body)))
        stream = first_token.ClientStream(body, rec.route, answer)
        if answer.stopped:  # P's token is the whole answer; P freed its KV by itself
            kv.move(Holder.NONE, "P's token ended the answer")
            self.metrics.first_token.labels("prefill_only").inc()
            out = await self.relay.open_stream(request, rec)
            await out.write(stream.head())
            await out.write_eof()
            return out
        d_body = first_token.continuation_request(
            body, rec.route, answer, transfer_id, p.bootstrap_url, engine_id)
        kv.move(Holder.ASKED, "D asked to continue from it")
        # D is asked before the client hears anything: a client gone by then cancels
        # this handler, which cuts D's call and so frees the KV on both sides.
        d_resp = await self._send_decode(rec, d, COMPLETIONS, _encode(d_body))
        self.pulls.waiting(kv, d_resp)
        del d_body["kv_transfer_params"]  # what D is asked if P goes down first
        alone = self._alone(rec, d, COMPLETIONS, _encode(d_body))
        self.metrics.first_token.labels("prefill_led").inc()
        try:
            out = await self.relay.open_stream(request, rec)
            await out.write(stream.head())
            return await self.relay.continue_stream(rec, d, d_resp, out, stream, alone)
        finally:
            d_resp.close()

    async def _send_both(self, p_call: _Call, d_call: _Call, route: str
                         ) -> tuple[Response | UpstreamError, Response | UpstreamError]:
        """The cold path: one or both nodes need a new connection; connect concurrently."""
        async def send(pool: Pool, data: bytes, timeout: float,
                       headers: dict[str, str]) -> Response | UpstreamError:
            try:
                return await pool.send(route, data, headers, read_timeout=timeout)
            except UpstreamError as exc:
                return exc

        tasks = [None if sent is not None
                 else asyncio.create_task(send(pool, data, timeout, headers))
                 for pool, sent, data, timeout, headers in (p_call, d_call)]
        try:
            await asyncio.wait([t for t in tasks if t is not None])
        except BaseException:
            for t in tasks:
                if t is None:
                    continue
                if not t.done():
                    t.cancel()
                elif not t.cancelled() and isinstance(t.result(), Response):
                    t.result().close()  # type: ignore[union-attr]
            raise
        p_res = p_call[1] if tasks[0] is None else tasks[0].result()
        d_res = d_call[1] if tasks[1] is None else tasks[1].result()
        assert p_res is not None and d_res is not None
        return p_res, d_res

    async def _serve_plain(self, request: web.Request, rec: Record, body: dict[str, Any],
                           d: Backend, reason: str) -> web.StreamResponse:
        """D alone, local prefill, no kv_transfer_params: the fallback when P cannot help."""
        if rec.kv is not None:  # this D request does not ask for whatever P holds
            rec.kv.given_up(f"D asked alone ({reason})")
        self.metrics.fallbacks.labels(reason).inc()
        rec.fallback, rec.decode = reason, d.url
        upstream = await self._send_decode(rec, d, rec.route, _encode(body))
        return await self.relay.relay(request, rec, d, upstream)

    async def _send_decode(self, rec: Record, d: Backend, route: str, data: bytes) -> Response:
        try:
            return await self.upstreams.pool(d.url).send(
                route, data, self._headers(rec),
                read_timeout=self.settings.decode_read_timeout_s)
        except UpstreamError as exc:
            raise self.relay.decode_error(d, exc) from None

    def _alone(self, rec: Record, d: Backend, route: str,
               data: bytes) -> Callable[[], Awaitable[Response]]:
        """D's call asked again without P's KV: when the P it waited on went down."""
        async def again() -> Response:
            assert rec.kv is not None
            rec.kv.given_up("its P went down while D waited for the KV")
            self.metrics.fallbacks.labels("prefill_down").inc()
            rec.fallback = "prefill_down"
            return await self.upstreams.pool(d.url).send(
                route, data, self._headers(rec),
                read_timeout=self.settings.decode_read_timeout_s)
        return again

    def route_handler(self, route: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.generate(request, route)
        return handler

def _failed_early(d: Response) -> bool:
    """D's call ended before P's: unreachable, timed out, or answered an error status."""
    return d.error is not None or (d.head_done and d.status >= 400)


def _kind(status: int) -> str:
    return "http_4xx" if status < 500 else "http_5xx"


def _kind(status: int) -> str:
    return "http_4xx" if status < 500 else "http_5xx"
