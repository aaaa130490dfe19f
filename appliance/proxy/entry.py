"""The entry of every generation request (docs/protocol.md steps 1-10): read and check the
body, look its prompt up in the prefix index, pick D (admission: a slot, or a 429) and P,
place it (appliance.proxy.placement) and hand it to an exchange path
(appliance.proxy.exchange). Everything the request takes is held by its Flight
(appliance.proxy.flight) and given back in `generate`'s one `finally`, however it ended;
then what it measured goes to the placement's estimates, the metrics and the access line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from appliance.httperrors import CLIENT_GONE, json_error
from appliance.proxy.access import NO_DECODE, AccessRecord, client_request_id
from appliance.proxy.app import Proxy
from appliance.proxy.errors import NodeDown, ProxyError
from appliance.proxy.exchange import first_token
from appliance.proxy.exchange.bodies import uuid4_str
from appliance.proxy.flight import Flight
from appliance.proxy.nodes.backends import Backend, PrefillBackend
from appliance.proxy.openai_api import (
    RESPONSES,
    batched_prompts,
    parse_request,
    seeded_sampling,
)
from appliance.proxy.placement import Decision
from appliance.proxy.placement.rule import serve_whole
from appliance.proxy.prefix.cache import Lookup
from appliance.proxy.responses import Turn

log = logging.getLogger("appliance.proxy")


class Entry:
    """The generation routes' handler, over the proxy's shared state."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    def handler(self, route: str) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.generate(request, route)
        return handle

    async def generate(self, request: web.Request, route: str) -> web.StreamResponse:
        px = self.proxy
        given = client_request_id(request.headers)
        if given is not None:
            rec = AccessRecord(route, given, time.monotonic())
        else:  # absent, or not safe to send upstream verbatim
            rec = AccessRecord(route, uuid4_str(), time.monotonic(), own_request_id=True)
        flight = Flight(rec, None if px.tracing is None else px.tracing.begin(), px.pulls,
                        px.releaser, px.prefix)
        flight.hold(px, "in_flight")
        try:
            resp = await self._generate(request, flight)
            rec.status = resp.status
            return resp
        except ProxyError as exc:
            rec.status, rec.error = exc.status, exc.message
            return json_error(exc.status, exc.message, exc.err_type,
                              headers={"X-Request-Id": rec.request_id, **exc.headers})
        except asyncio.CancelledError:
            rec.status, rec.error = CLIENT_GONE, "client disconnected"
            raise
        except ConnectionResetError:  # the client left as its answer started
            rec.status, rec.error = CLIENT_GONE, "client disconnected"
            raise
        except Exception as exc:
            log.exception("request %s failed", rec.request_id)
            rec.status, rec.error = 500, repr(exc)
            return json_error(500, f"proxy error: {exc!r}",
                              headers={"X-Request-Id": rec.request_id})
        finally:
            flight.end()
            self._learn(rec)
            px.metrics.count_request(route, rec.status)
            rec.observe_client(px.metrics, time.monotonic())
            if flight.trace is not None:
                flight.trace.finish(rec)
            if px.settings.log_requests:
                rec.log()

    def _learn(self, rec: AccessRecord) -> None:
        """What the finished request measured goes to the placement's estimates."""
        if rec.placed is None:
            return
        handoff = None
        if (not rec.local and rec.fallback is None and rec.prefilled_at is not None
                and rec.decode_first_at is not None and rec.status == 200):
            # Only the blocks D lacks move.
            handoff = ((rec.prompt_tokens or rec.placed.tokens) - rec.placed.cached_d,
                       rec.decode_first_at - rec.prefilled_at)
        output = rec.usage_output if rec.usage_output is not None else rec.tokens_out
        self.proxy.placement.learned(rec.route, rec.prompt_chars, rec.prompt_tokens, handoff,
                                     rec.step_s, rec.batch,
                                     output if rec.status == 200 else None)

    async def _generate(self, request: web.Request, flight: Flight) -> web.StreamResponse:
        px, rec = self.proxy, flight.rec
        if px.shutting_down:
            raise ProxyError(503, "the proxy is shutting down")
        # Received already, within body_timeout_s and max_body_bytes (appliance.proxy.intake).
        body = parse_request(await request.read(), rec.route)
        turn = Turn.begin(body, px.homes) if rec.route == RESPONSES else None
        rec.stream = body.get("stream") is True

        why = await px.wait_answerable()
        if why is not None:
            raise ProxyError(503, why)
        if not px.backends.ready_decode() and turn is None:
            return await self._on_prefill_alone(request, flight, body)
        prefills = px.backends.ready_prefill()
        size = px.placement.tokens(body, rec.route)  # (estimated tokens, characters)
        if prefills and px.prefix is not None:
            flight.looked_up(await self._lookup(body, rec.route, prefills, size[0]))
        asked = time.monotonic()
        d = await px.admission.admit(
            flight, px.backends.ready_decode if turn is None
            else turn.decodes(px.backends.ready_decode),
            lambda ds: px.router.pick_decode(ds, flight.prefix))
        px.metrics.admission_wait.observe(time.monotonic() - asked)
        try:
            resp = await self._serve(request, flight, body, d, size, turn)
        except NodeDown as down:
            if rec.ttfb_s is not None:
                raise
            flight.stop_serving()  # the node that went down serves it no longer
            resp = await px.paths.elsewhere(
                request, flight, body, down, px.backends.ready_decode(),
                lambda ds: px.router.pick_decode(ds, flight.prefix))
        if turn is not None:
            turn.answered(resp.status, rec)
        return resp

    async def _on_prefill_alone(self, request: web.Request, flight: Flight,
                                body: dict[str, Any]) -> web.StreamResponse:
        """No decode node in rotation (down, restarting, drained), a P is: it serves the
        request whole, as when placed `p_alone`, rather than the client getting a 503."""
        px = self.proxy
        p = px.router.pick_prefill(px.backends.ready_prefill(), flight.prefix)
        flight.serve_on(p, holds_node=True)
        flight.rec.prefill = p.url
        return await px.paths.plain(request, flight, body, p, NO_DECODE)

    async def _serve(self, request: web.Request, flight: Flight, body: dict[str, Any],
                     d: Backend, size: tuple[int, int],
                     turn: Turn | None) -> web.StreamResponse:
        """The request placed and sent on its path, D admitted (`turn`: a Responses
        request's, which may have to be served whole, or by the node it continues)."""
        px, rec = self.proxy, flight.rec
        # The rotation as it is now: a P drained or found down while the request was
        # tokenized or waited for its slot is not called.
        prefills = px.backends.ready_prefill()
        if not prefills:
            flight.serve_on(d, holds_node=False)
            return await px.paths.plain(request, flight, body, d, "no_prefill")
        if px.prefix is not None and flight.prefix is not None:
            # As the index is now, and no await from here to `expect`: a burst on one
            # prefix sees where the first of it is computed.
            asked = dict.fromkeys([*flight.prefix.cached, *(b.url for b in prefills)])
            flight.prefix = px.prefix.recount(flight.prefix, list(asked))
        p = (None if turn is None else turn.home(prefills)) \
            or px.router.pick_prefill(prefills, flight.prefix)
        decision, ticket, chars = self._place(body, flight, p, d, size,
                                              self._overrule(body, turn, p, d))
        flight.placed(decision, ticket, chars)
        flight.expect((d if decision.where == "local" else p).url)
        serving = p if decision.on_prefill else d
        # P holds the request: drains, leaves and routing see it (D's slot is its own).
        flight.serve_on(serving, holds_node=serving is p)
        if serving is p:
            rec.prefill = p.url
        if decision.local:
            return await px.paths.local(request, flight, body, serving)
        if px.settings.first_token_from_prefill and rec.stream:
            if first_token.ineligible(body, rec.route) is None:
                return await px.paths.first_token(request, flight, body, p, d)
            px.metrics.first_token.labels("decode").inc()
        return await px.paths.split(request, flight, body, p, d)

    async def _lookup(self, body: dict[str, Any], route: str,
                      prefills: list[PrefillBackend], estimate: int) -> Lookup | None:
        """The prompt's cached share on every node in rotation, from the prefix index, before
        P and D are picked by it. Its ids come from the proxy's own tokenizer when it has
        one, else from the least busy D's /tokenize: a D must answer the request anyway,
        where a frozen P would hold every request for tokenize_timeout_s (a loaded D's API
        server takes longer: 8-30 ms measured here with 8 streams on one core, against
        2-3 ms idle; the access line's tokenize_ms)."""
        px = self.proxy
        assert px.prefix is not None
        decodes = px.backends.ready_decode()
        if not decodes:
            return None
        ask = min(decodes, key=lambda b: (b.in_flight, b.decodes))
        return await px.prefix.lookup(body, route, estimate, ask.url,
                                      [b.url for b in (*prefills, *decodes)])

    @staticmethod
    def _overrule(body: dict[str, Any], turn: Turn | None, p: PrefillBackend,
                  d: Backend) -> Callable[[Decision], Decision] | None:
        """What placement must respect: a Responses request's own limits; a seeded sampled
        request served whole, so its random stream is one engine's, as on a plain server; a
        batch of prompts served whole (one transfer id cannot carry several prefills)."""
        if turn is not None:
            return turn.overrule(p, d)
        if seeded_sampling(body):
            return serve_whole("seeded")
        return serve_whole("batch") if batched_prompts(body) else None

    def _place(self, body: dict[str, Any], flight: Flight, p: Backend, d: Backend,
               size: tuple[int, int],
               overrule: Callable[[Decision], Decision] | None = None) -> Any:
        """The placement's decision, with each node's cached share of the prompt when the
        prefix index told it; the prediction counted for each node that computes the
        prompt (P alone, D alone, or both: D looks its cache up for a remote one too)."""
        px = self.proxy
        placed = px.placement.choose(body, flight.rec.route, p, d, flight.prefix, size,
                                     overrule)
        decision = placed[0]
        computing: list[tuple[Backend, int]] = []
        if decision.where != "local":
            computing.append((p, decision.cached_p))
        if decision.where != "p_alone":
            computing.append((d, decision.cached_d))
        for node, cached in computing:
            px.metrics.prefix_hits.labels(node.role, node.url).inc(cached)
            px.metrics.prefix_queries.labels(node.role, node.url).inc(decision.tokens)
        return placed
