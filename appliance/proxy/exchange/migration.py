"""An answer whose engine broke off goes on from another engine (docs/protocol.md step 44).

When the engine serving a request fails (killed, its connection reset, its stream cut
short) the proxy asks another that can serve it: another D in rotation, else a P (P serves
whole requests), at most `migration_limit` times per request, each counted
(`pd_proxy_migrations_total{how}`, `migrated=` on the access line):
- before the client's first byte, the request again, whole (Paths.elsewhere; a whole
  answer's first byte is its last, so a non-stream request is always this case; a stream
  whose headers went out but none of its events goes on in the same stream);
- a followed stream (exchange.clientstream: led by P's token, or served by D or P alone):
  the rest of the answer after the tokens the client has, by their ids (the engine returns
  them with each chunk; the proxy takes them out), with what is left of max_tokens and
  min_tokens. The client's stream goes on where it stopped, with no gap and nothing
  repeated: under greedy decoding, one server's tokens.
Not continued (the stream ends with an error event, as with no engine to go to): the
classic split's streams (D's chunks carry no token ids), and so everything the first-token
path does not take (logprobs, n > 1, stop strings, penalties, structured output, the
Responses API; first_token.ineligible), a chat stream whose text a server-side parser
shaped (reasoning, tool calls); seeded sampling is served whole by one engine and goes on
only before its first byte (its random stream restarts).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from appliance.proxy.exchange import first_token
from appliance.proxy.exchange.clientstream import ClientStream
from appliance.proxy.exchange.relay import Resume
from appliance.proxy.flight import Flight
from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.nodes.backends import Backend, Backends
from appliance.proxy.openai_api import COMPLETIONS
from appliance.proxy.upstream.response import Response

log = logging.getLogger("appliance.proxy")
_encode = msgspec.json.encode

# How a call is sent to a node (Paths._send_decode).
Send = Callable[[Flight, Backend, str, bytes], Awaitable[Response]]


def _least_busy(nodes: list[Backend]) -> Backend:
    return min(nodes, key=lambda b: (b.in_flight, b.decodes))


def target(failed: str, decodes: list[Backend], prefills: list[Backend],
           pick: Callable[[list[Backend]], Backend] = _least_busy) -> Backend | None:
    """Where a broken answer goes on: another D in rotation (by `pick`), else the least
    busy P."""
    others = [b for b in decodes if b.url != failed]
    if others:
        return pick(others)
    ps = [b for b in prefills if b.url != failed]
    return _least_busy(ps) if ps else None


class Migration:
    def __init__(self, limit: int, metrics: ProxyMetrics, backends: Backends,
                 send: Send, stopping: Callable[[], bool] = lambda: False) -> None:
        self.limit = limit
        self.stopping = stopping  # the proxy is shutting down: its calls end, nothing moves
        self.metrics = metrics
        self.backends = backends
        self.send = send

    def to(self, flight: Flight, failed: str, decodes: list[Backend] | None = None,
           pick: Callable[[list[Backend]], Backend] = _least_busy) -> Backend | None:
        """The engine the request goes on from, or None (its limit reached, the proxy
        stopping, none in rotation). `decodes`: the D's it may go to (default: those in
        rotation), chosen by `pick` (the proxy's routing policy, where the caller has it)."""
        if flight.rec.migrated >= self.limit or self.stopping():
            return None
        return target(failed, self.backends.ready_decode() if decodes is None else decodes,
                      list(self.backends.ready_prefill()), pick)

    def moved(self, flight: Flight, node: Backend, how: str, why: str) -> None:
        """The bookkeeping of one move: the serving counts go to `node`, whatever P held
        for the request is given up, and the move is counted and logged."""
        rec = flight.rec
        flight.stop_serving()
        flight.serve_on(node, holds_node=True)  # its slot is not the request's admission
        if flight.kv is not None:
            flight.kv.given_up(f"its answer goes on from {node.url}")
        rec.migrated += 1
        rec.decode = node.url
        self.metrics.migrations.labels(how).inc()
        log.warning("%s %s: %s; %s %s goes on with it (%s)", rec.route, rec.request_id, why,
                    node.role, node.url, how)

    def whole(self, flight: Flight, failed: Backend, data: bytes) -> Resume:
        """A stream in the client's own format: asked again whole (`data`, the client's
        body as sent), before any of its events reached the client."""
        async def resume(relayed: bool, why: str) -> Response | None:
            node = None if relayed else self.to(flight, failed.url)
            if node is None:
                return None
            return await self._again(flight, node, data, why)
        return resume

    async def _again(self, flight: Flight, node: Backend, data: bytes, why: str) -> Response:
        self.moved(flight, node, "whole", why)
        return await self.send(flight, node, flight.rec.route, data)

    def continued(self, flight: Flight, failed: Backend, body: dict[str, Any],
                  stream: ClientStream, again: bytes | None = None) -> Resume:
        """A followed stream: the rest of it after the tokens the client has. `again`: a
        stream served alone, asked again whole (these bytes) while none of the engine's
        events reached the client."""
        route = flight.rec.route
        serving = failed.url  # the engine that broke off last

        async def resume(relayed: bool, why: str) -> Response | None:
            nonlocal serving
            node = self.to(flight, serving)
            if node is None:
                return None
            if again is not None and not relayed and stream.native:
                serving = node.url
                return await self._again(flight, node, again, why)
            if not stream.continuable:
                return None
            assert stream.prompt_ids is not None
            done = stream.done()
            data = first_token.resumed_request(body, route, stream.prompt_ids, done)
            if data.get("max_tokens", 1) <= 0:
                return None  # it had every token; only its end was lost
            self.moved(flight, node, "continued", f"{why} after {len(done)} tokens")
            stream.resumed()
            serving = node.url
            return await self.send(flight, node, COMPLETIONS, _encode(data))
        return resume
