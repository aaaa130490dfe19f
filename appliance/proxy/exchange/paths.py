"""The exchange paths of one request (docs/protocol.md steps 8-10, 25, 42-43): the classic split (P
and D at once, P's status before any byte of D's), P's token first (first_token module),
and D alone (the fallback when P cannot help). Each names the transfer, moves the KV's
holder (appliance.proxy.ownership) as the legs go, and hands D's answer to the relay. A
D call still waiting on P's KV is registered in `pulls`: if that P goes down, D is asked
again alone (`_alone`); a request whose serving node goes down before the client's first
byte is asked of another D alone, or of P (`elsewhere`), and a stream D breaks off goes on
from another engine where it can (exchange.migration).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from appliance.proxy.errors import NodeDown, ProxyError, status_kind, upstream_error_body
from appliance.proxy.exchange import clientstream, first_token
from appliance.proxy.exchange.bodies import decode_body, new_transfer_id, prefill_body
from appliance.proxy.exchange.migration import Migration
from appliance.proxy.exchange.relay import Relay, json_response
from appliance.proxy.flight import Flight
from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.nodes.backends import Backend, Backends, PrefillBackend
from appliance.proxy.openai_api import COMPLETIONS, prefill_finish_reason, prefill_prompt_tokens
from appliance.proxy.ownership.kv import PREFILL_DOWN, Holder, PrefillKV
from appliance.proxy.ownership.pulls import Pulls
from appliance.proxy.settings import ProxySettings
from appliance.proxy.upstream.pool import Pool, Upstreams, wait_any
from appliance.proxy.upstream.response import Response, UpstreamError

log = logging.getLogger(__name__)
_encode = msgspec.json.encode
# The fallback's reason when the node serving a request went down before its first byte.
DECODE_DOWN = "decode_down"
# One upstream call of the cold path: pool, response sent already (or None), body, read
# timeout, headers.
_Call = tuple[Pool, "Response | None", bytes, float, dict[str, str]]


class Paths:
    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics, backends: Backends,
                 upstreams: Upstreams, relay: Relay, pulls: Pulls,
                 base_headers: dict[str, str],
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.settings = settings
        self.metrics = metrics
        self.backends = backends
        self.upstreams = upstreams
        self.relay = relay
        self.pulls = pulls
        self.base_headers = base_headers
        self.migration = Migration(settings.migration_limit, metrics, backends,
                                   self._send_decode, stopping)

    def _headers(self, flight: Flight, node: Backend) -> dict[str, str]:
        """A call's headers; with tracing on, its span begins and its context goes along."""
        h = {"Content-Type": "application/json", "X-Request-Id": flight.rec.request_id}
        h.update(self.base_headers)
        if flight.trace is not None:
            flight.trace.call(node.role, node.url, flight.rec, h)
        return h

    def _prefill_headers(self, flight: Flight, kv: PrefillKV) -> dict[str, str]:
        """P's headers: with several dp ranks behind P's API server, the rank chosen (as
        vLLM's own example proxy does), so the prefill runs in the engine whose id D is told
        to pull from; without it P's server balances by itself and D waits on the wrong
        engine. One rank alone (no DP, or an external load balancer in front of each rank)
        gets none: such a server accepts only its local rank index."""
        h = self._headers(flight, kv.p)
        if len(kv.p.engine_ids) > 1:
            h["X-data-parallel-rank"] = str(kv.rank)
        return h

    def _pair(self, flight: Flight, p: PrefillBackend, d: Backend) -> tuple[PrefillKV, str]:
        """Picks P's dp rank and names the transfer: (the KV P will hold, P's engine id)."""
        rec = flight.rec
        rank, engine_id = p.next_rank()
        # A request id of ours is a fresh uuid4: the transfer id reuses it (as the reference
        # does), which also ties the two together in logs; a client's id is not trusted to be
        # unique, so then the transfer id gets its own.
        rec.transfer_id = f"xfer-{rec.request_id}" if rec.own_request_id else new_transfer_id()
        rec.prefill, rec.decode = f"{p.url}#dp{rank}", d.url
        kv = flight.take_kv(PrefillKV(
            p, rank, rec.transfer_id, d_url=d.url,
            lands=() if flight.prefix is None else flight.prefix.lacking(d.url)))
        return kv, engine_id

    async def split(self, request: web.Request, flight: Flight, body: dict[str, Any],
                    p: PrefillBackend, d: Backend) -> web.StreamResponse:
        """P and D at once; P's outcome before any byte of D's reaches the client."""
        rec = flight.rec
        kv, engine_id = self._pair(flight, p, d)
        transfer_id = kv.transfer_id
        headers = self._headers(flight, d)
        p_headers = self._prefill_headers(flight, kv)
        p_data = _encode(prefill_body(body, rec.route, transfer_id))
        d_data = _encode(decode_body(body, transfer_id, p.bootstrap_url, engine_id,
                                     self.settings.deadlines.recv_ms()))
        p_pool, d_pool = self.upstreams.pool(p.url), self.upstreams.pool(d.url)
        p_timeout = self.settings.prefill_timeout_s
        d_timeout = self.settings.decode_read_timeout_s

        kv.move(Holder.ASKED, "D's request, sent with P's, asks for it")
        p_leg = flight.hold(p, "in_flight")  # until P answered
        p_resp: Response | None = None
        d_resp: Response | None = None
        handed_over = False
        started = rec.serve_sent_at = time.monotonic()
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
                    return await self.relay.relay(request, flight, d, dr)
                p_error = pr.error
            d_resp.touch()  # D's silence counts from P's answer: it was waiting for the KV
            p_leg.release()

            if p_error is not None or p_resp is None:
                assert p_error is not None
                d_resp.close()
                return await self._prefill_failed(request, flight, body, p, d, p_error)
            p_raw = await p_resp.read()  # complete already: returns at once
            now = time.monotonic()
            flight.prefill_answered(now, p_resp.status < 300, prefill_prompt_tokens(p_raw))
            rec.prefill_s = now - started
            self.metrics.prefill_latency.observe(rec.prefill_s)
            if p_resp.status >= 300:
                # For example 400, prompt too long: D must not wait for KV that never comes.
                d_resp.close()
                return self._prefill_refused(flight, p, p_resp.status, p_raw)
            if (self.settings.fallback_on_prefill_stop
                    and prefill_finish_reason(p_raw) == "stop"):
                d_resp.close()
                return await self.plain(request, flight, body, d, "prefill_stopped")
            handed_over = True
            self.pulls.waiting(kv, d_resp)
            whole = _encode(body)  # what D alone, or another engine, is asked
            return await self.relay.relay(request, flight, d, d_resp,
                                          self._alone(flight, d, rec.route, whole),
                                          self.migration.whole(flight, d, whole))
        finally:  # the calls' connections; the counts are the flight's
            if p_resp is not None:
                p_resp.close()
            if d_resp is not None and not handed_over:
                d_resp.close()

    async def _prefill_failed(self, request: web.Request, flight: Flight, body: dict[str, Any],
                              p: PrefillBackend, d: Backend,
                              error: UpstreamError) -> web.StreamResponse:
        """P unreachable or timed out: D alone if allowed, else 503."""
        rec = flight.rec
        flight.close_ticket(time.monotonic(), learn=False)  # P's leg is over
        if error.kind != "down":  # a down node's calls are counted once, together
            self.metrics.upstream_errors.labels("prefill", p.url, error.kind).inc()
        if error.kind == "connect":
            self.backends.mark_failed(p, str(error))
            if flight.kv is not None:  # P never got it (a timed-out one may hold KV)
                flight.kv.move(Holder.NONE, "P unreachable")
        if not self.settings.fallback_to_decode:
            raise ProxyError(503, f"prefill node {p.url}: {error}")
        rec.error = f"prefill: {error}"
        reason = {"timeout": "prefill_timeout", "down": PREFILL_DOWN}.get(error.kind,
                                                                         "prefill_unreachable")
        return await self.plain(request, flight, body, d, reason)

    def _prefill_refused(self, flight: Flight, p: PrefillBackend, status: int,
                         raw: bytes) -> web.Response:
        """P answered an error (for example 400, prompt too long): the client gets it."""
        rec = flight.rec
        if flight.kv is not None:  # a P request that failed frees its own blocks
            flight.kv.move(Holder.NONE, f"P answered {status}")
        self.metrics.upstream_errors.labels("prefill", p.url, status_kind(status)).inc()
        rec.error = "prefill failed"
        return json_response(status, upstream_error_body(status, raw, f"prefill node {p.url}"),
                             rec)

    async def first_token(self, request: web.Request, flight: Flight, body: dict[str, Any],
                          p: PrefillBackend, d: Backend) -> web.StreamResponse:
        """P first; its token goes to the client at once, then D continues after it
        (first_token module). D is asked only once P's answer says what to continue."""
        rec = flight.rec
        kv, engine_id = self._pair(flight, p, d)
        transfer_id = kv.transfer_id
        p_data = _encode(first_token.prefill_request(body, rec.route, transfer_id))
        started = time.monotonic()
        p_resp: Response | None = None
        p_error: UpstreamError | None = None
        p_leg = flight.hold(p, "in_flight")  # until P answered
        try:
            p_resp = await self.upstreams.pool(p.url).send(
                rec.route, p_data, self._prefill_headers(flight, kv),
                read_timeout=self.settings.prefill_timeout_s)
            p_raw = await p_resp.read()
        except UpstreamError as exc:
            p_error = exc
        finally:  # the call's connection; the count is the flight's
            if p_resp is not None:
                p_resp.close()
        p_leg.release()
        if p_error is not None or p_resp is None:
            assert p_error is not None
            return await self._prefill_failed(request, flight, body, p, d, p_error)
        now = time.monotonic()
        rec.prefill_s = now - started
        self.metrics.prefill_latency.observe(rec.prefill_s)
        if p_resp.status >= 300:
            flight.prefill_answered(now, False, None)
            return self._prefill_refused(flight, p, p_resp.status, p_raw)

        answer = first_token.parse_prefill_answer(p_raw, rec.route)
        flight.prefill_answered(now, True, prefill_prompt_tokens(p_raw) if answer is None
                             else len(answer.prompt_token_ids))
        if answer is None or not first_token.fits(body, rec.route, answer, d.max_model_len):
            # P's token cannot lead (a parser's output, half a character), or D would refuse
            # the length after the stream began: D answers classically, still from P's KV,
            # which P holds for this transfer.
            self.metrics.first_token.labels("decode").inc()
            d_data = _encode(decode_body(body, transfer_id, p.bootstrap_url, engine_id,
                                         self.settings.deadlines.recv_ms(after_prefill=True)))
            kv.move(Holder.ASKED, "D asked to answer from it")
            d_resp = await self._send_decode(flight, d, rec.route, d_data)
            self.pulls.waiting(kv, d_resp)
            whole = _encode(body)  # what D alone, or another engine, is asked
            return await self.relay.relay(request, flight, d, d_resp,
                                          self._alone(flight, d, rec.route, whole),
                                          self.migration.whole(flight, d, whole))
        stream = clientstream.ClientStream(body, rec.route, answer)
        if answer.stopped:  # P's token is the whole answer; P freed its KV by itself
            kv.move(Holder.NONE, "P's token ended the answer")
            self.metrics.first_token.labels("prefill_only").inc()
            out = await self.relay.open_stream(request, flight, stream.head())
            await out.write_eof()
            return out
        d_body = first_token.continuation_request(
            body, rec.route, answer, transfer_id, p.bootstrap_url, engine_id,
            self.settings.deadlines.recv_ms(after_prefill=True))
        kv.move(Holder.ASKED, "D asked to continue from it")
        # D is asked before the client hears anything: a client gone by then cancels
        # this handler, which cuts D's call and so frees the KV on both sides.
        d_resp = await self._send_decode(flight, d, COMPLETIONS, _encode(d_body))
        self.pulls.waiting(kv, d_resp)
        del d_body["kv_transfer_params"]  # what D is asked if P goes down first
        alone = self._alone(flight, d, COMPLETIONS, _encode(d_body))
        self.metrics.first_token.labels("prefill_led").inc()
        try:
            out = await self.relay.open_stream(request, flight, stream.head())
            return await self.relay.continue_stream(
                flight, d, d_resp, out, stream, alone,
                self.migration.continued(flight, d, body, stream))
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

    async def plain(self, request: web.Request, flight: Flight, body: dict[str, Any],
                    d: Backend, reason: str) -> web.StreamResponse:
        """One node alone, no kv_transfer_params: D when P cannot help, P when no D can."""
        rec = flight.rec
        if flight.kv is not None:  # this D request does not ask for whatever P holds
            flight.kv.given_up(f"D asked alone ({reason})")
        self.metrics.fallbacks.labels(reason).inc()
        rec.fallback = reason
        return await self.local(request, flight, body, d)

    async def local(self, request: web.Request, flight: Flight, body: dict[str, Any],
                    node: Backend) -> web.StreamResponse:
        """One node alone (D, or P placed `p_alone`): the client's request as it is,
        prefilled and decoded there. Placed so (appliance.proxy.placement), or the
        fallback's last leg."""
        rec = flight.rec
        rec.decode = node.url  # the access line names the engine that decodes
        # A stream is followed by its token ids where it can go on elsewhere exactly (a
        # typed read of each event, about 4 us in the proxy: migration_limit 0 saves it).
        follow = clientstream.follow(body, rec.route) if self.migration.limit else None
        data = _encode(body if follow is None else {**body, "return_token_ids": True})
        upstream = await self._send_decode(flight, node, rec.route, data)
        resume = (self.migration.whole(flight, node, data) if follow is None
                  else self.migration.continued(flight, node, body, follow, again=data))
        return await self.relay.relay(request, flight, node, upstream, resume=resume,
                                      follow=follow)

    async def elsewhere(self, request: web.Request, flight: Flight, body: dict[str, Any],
                        down: NodeDown, decodes: list[Backend],
                        pick: Callable[[list[Backend]], Backend]) -> web.StreamResponse:
        """The node serving the request was found down, unreachable, or broke off its answer
        before the client's first byte: another D serves it alone, or else a P, within
        `migration_limit` (a rollout's old D, sent a request as it stopped, loses nothing).
        Whatever P held for it is given up. None: the 502 stands."""
        node = self.migration.to(flight, down.url, decodes, pick)
        if node is None:
            raise down
        # Its prefill will not happen where it was queued.
        flight.close_ticket(time.monotonic(), learn=False)
        self.migration.moved(flight, node, "whole", down.message)
        return await self.plain(request, flight, body, node, DECODE_DOWN)

    async def _send_decode(self, flight: Flight, d: Backend, route: str, data: bytes) -> Response:
        rec = flight.rec
        rec.serve_sent_at = time.monotonic()
        try:
            return await self.upstreams.pool(d.url).send(
                route, data, self._headers(flight, d),
                read_timeout=self.settings.decode_read_timeout_s)
        except UpstreamError as exc:
            raise self.relay.decode_error(d, exc) from None

    def _alone(self, flight: Flight, d: Backend, route: str,
               data: bytes) -> Callable[[], Awaitable[Response]]:
        """D's call asked again without P's KV: when the P it waited on went down."""
        rec = flight.rec
        async def again() -> Response:
            assert flight.kv is not None
            flight.kv.given_up("its P went down while D waited for the KV")
            self.metrics.fallbacks.labels("prefill_down").inc()
            rec.fallback = "prefill_down"
            return await self._send_decode(flight, d, route, data)
        return again


def _failed_early(d: Response) -> bool:
    """D's call ended before P's: unreachable, timed out, or answered an error status."""
    return d.error is not None or (d.head_done and d.status >= 400)
