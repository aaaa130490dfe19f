"""D's answer to the client (docs/protocol.md step 43): whole, streamed, or continued
after P's token.

Once the client's headers are out, a failure of D can only be said by an SSE error event.
A D call that fails because the P it waited on went down (ownership.PREFILL_DOWN) before D
said anything is asked again on D alone (`retry`), into the same client stream. A stream
that D breaks off (killed, its connection reset, cut short of its end) goes on from another
engine where `resume` can ask one (appliance.proxy.exchange.migration).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from appliance.proxy.access import AccessRecord
from appliance.proxy.errors import (
    NodeDown,
    ProxyError,
    sse_error_event,
    status_kind,
    upstream_error_body,
)
from appliance.proxy.exchange.clientstream import ClientStream
from appliance.proxy.exchange.sse import event_stream, token_events
from appliance.proxy.flight import Flight
from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.nodes.backends import Backend, Backends
from appliance.proxy.openai_api import answer_usage
from appliance.proxy.ownership.kv import PREFILL_DOWN
from appliance.proxy.settings import ProxySettings
from appliance.proxy.upstream.response import Response, UpstreamError

_encode = msgspec.json.encode

# D's call asked again on D alone (after its P went down); None where it cannot be.
Retry = Callable[[], Awaitable[Response]] | None
# Another engine asked to go on with a stream D broke off, given whether any of D's bytes
# reached the client and why it broke: its answer, or None where none can (a ProxyError
# when the one asked cannot answer).
Resume = Callable[[bool, str], Awaitable[Response | None]] | None


class Relay:
    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics,
                 backends: Backends) -> None:
        self.settings = settings
        self.metrics = metrics
        self.backends = backends

    def decode_error(self, d: Backend, exc: UpstreamError) -> ProxyError:
        if exc.kind == "down":  # counted once for all its calls; why names the node
            return NodeDown(d.url, str(exc))
        self.metrics.upstream_errors.labels(d.role, d.url, exc.kind).inc()
        if exc.kind == "timeout":
            return ProxyError(504, f"{d.role} node {d.url} did not answer in "
                                   f"{self.settings.decode_read_timeout_s:g} s")
        if exc.kind == "connect":
            self.backends.mark_failed(d, str(exc))
            return NodeDown(d.url, f"{d.role} node {d.url} unreachable: {exc}")
        if exc.broken:  # before its answer: another node may answer it (Paths.elsewhere)
            return NodeDown(d.url, f"{d.role} node {d.url} failed: {exc}")
        return ProxyError(502, f"{d.role} node {d.url} failed: {exc}")

    async def _head(self, d: Backend, upstream: Response, retry: Retry) -> Response:
        """D's status and headers; D asked again alone if its P went down first."""
        try:
            return await upstream.head()
        except UpstreamError as exc:
            if exc.kind != PREFILL_DOWN or retry is None:
                raise self.decode_error(d, exc) from None
        upstream.close()
        return await self._again(d, retry)

    async def _again(self, d: Backend, retry: Callable[[], Awaitable[Response]]) -> Response:
        again = await retry()  # a ProxyError if D cannot be asked
        try:
            return await again.head()
        except UpstreamError as exc:
            again.close()
            raise self.decode_error(d, exc) from None

    async def error_body(self, d: Backend, upstream: Response) -> dict[str, Any]:
        """D answered an error status: its body, made OpenAI-style, and counted."""
        try:
            raw = await upstream.read()
        except UpstreamError:
            raw = b""
        self.metrics.upstream_errors.labels(d.role, d.url, status_kind(upstream.status)).inc()
        return upstream_error_body(upstream.status, raw, f"{d.role} node {d.url}")

    async def relay(self, request: web.Request, flight: Flight, d: Backend, upstream: Response,
                    retry: Retry = None, resume: Resume = None,
                    follow: ClientStream | None = None) -> web.StreamResponse:
        """D's answer, streamed chunk by chunk or whole; the upstream closed after.
        `follow`: a stream whose token ids the proxy follows (and takes out)."""
        rec = flight.rec
        try:
            upstream = await self._head(d, upstream, retry)
            if upstream.status >= 400:
                inner = await self.error_body(d, upstream)
                if upstream.status < 500:  # the client's mistake, as D words it
                    return json_response(upstream.status, inner, rec)
                raise ProxyError(502, f"{d.role} node {d.url} answered {upstream.status}: "
                                      f"{inner['error']['message']}")
            content_type = upstream.header("content-type") or "application/json"
            if content_type.startswith("text/event-stream"):
                out = await prepare_stream(request, rec, upstream.status, content_type)
                return await self.stream(flight, d, upstream, out, rewrite=follow,
                                         retry=retry, resume=resume)
            try:
                raw = await upstream.read()
            except UpstreamError as exc:
                if exc.kind == PREFILL_DOWN and retry is not None:
                    upstream.close()
                    return await self.relay(request, flight, d, await self._again(d, retry))
                if exc.kind == "down":  # nothing of the answer reached the client
                    raise NodeDown(d.url, str(exc)) from None
                self.metrics.upstream_errors.labels(d.role, d.url, exc.kind).inc()
                message = f"{d.role} node {d.url} failed mid-answer: {exc}"
                if exc.broken:  # it broke off: another engine may answer it whole
                    raise NodeDown(d.url, message) from None
                raise ProxyError(502, message) from None
            self._first_byte(flight, stream=False)
            rec.usage_prompt, rec.usage_output = answer_usage(raw)
            if flight.kv is not None:
                flight.kv.decode_answered()
            return web.Response(status=upstream.status, body=raw, headers={
                "Content-Type": content_type, "X-Request-Id": rec.request_id})
        finally:
            # Closing an unfinished answer cuts the connection: vLLM aborts the request.
            upstream.close()

    async def continue_stream(self, flight: Flight, d: Backend, upstream: Response,
                              out: web.StreamResponse, stream: ClientStream,
                              retry: Retry = None, resume: Resume = None
                              ) -> web.StreamResponse:
        """D's continuation after P's token; the client's headers are sent already, so a
        failure of D becomes an error event."""
        rec = flight.rec
        try:
            upstream = await self._head(d, upstream, retry)
        except ProxyError as exc:
            moved = await self._resumed(resume, False, exc.message)
            if moved is None:
                return await self.end_stream(out, rec, exc.message)
            upstream.close()
            upstream = moved
        try:
            if upstream.status >= 400:
                inner = await self.error_body(d, upstream)
                return await self.end_stream(
                    out, rec, f"{d.role} node {d.url} answered {upstream.status}: "
                              f"{inner['error']['message']}")
            return await self.stream(flight, d, upstream, out, rewrite=stream, retry=retry,
                                     resume=resume)
        finally:
            upstream.close()

    async def _resumed(self, resume: Resume, relayed: bool, why: str) -> Response | None:
        """Another engine's answer, headed, where `resume` finds one (None: none)."""
        if resume is None:
            return None
        try:
            moved = await resume(relayed, why)
            if moved is not None:
                await moved.head()
        except (ProxyError, UpstreamError):
            return None
        return moved

    async def end_stream(self, out: web.StreamResponse, rec: AccessRecord,
                         error: str) -> web.StreamResponse:
        """D failed before its first byte, after P's token went out (counted already)."""
        rec.error = error
        try:
            await out.write(sse_error_event(502, error))
            await out.write_eof()
        except ConnectionResetError:
            pass
        return out

    async def open_stream(self, request: web.Request, flight: Flight,
                          head: bytes) -> web.StreamResponse:
        """The client's stream, opened with P's token (`head`) as its first bytes."""
        rec = flight.rec
        out = await prepare_stream(request, rec, 200, "text/event-stream; charset=utf-8")
        rec.led_by_prefill = True
        self._first_byte(flight)
        await out.write(head)
        rec.tokens_sent(token_events(head), time.monotonic(), self.metrics)
        return out

    def _first_byte(self, flight: Flight, stream: bool = True) -> None:
        rec = flight.rec
        if rec.ttfb_s is None:
            now = time.monotonic()
            rec.ttfb_s = now - rec.started
            self.metrics.decode_ttfb.observe(rec.ttfb_s)
            if rec.local:
                # D's local prefill is done: a stream's first token times it; a whole
                # answer's first byte comes after the decode too, so it teaches nothing.
                flight.close_ticket(now, learn=stream)

    async def stream(self, flight: Flight, d: Backend, upstream: Response,
                     out: web.StreamResponse, *,
                     rewrite: ClientStream | None = None,
                     retry: Retry = None, resume: Resume = None) -> web.StreamResponse:
        """D's stream to the client (the caller closes `upstream`; a retried or resumed one
        is closed here)."""
        rec = flight.rec
        fmt = event_stream(rec.route)
        error: str | None = None
        # A 200 stream's head may come before vLLM's engine has the request; its first
        # chunk comes after (a Responses stream's opening events are held till then):
        # from then on D's connector pulls or frees P's KV.
        kv = flight.kv if upstream.status < 300 else None
        relayed = False  # a byte of D's reached the client: D cannot be asked again
        again: Response | None = None
        events, last = 0, 0.0  # D's step events and when the latest came: its step time
        try:
            while True:
                try:
                    async for chunk in (again or upstream).chunks():
                        chunk = fmt.hold(chunk)
                        if not chunk:
                            continue
                        if not relayed:
                            rec.decode_first_at = time.monotonic()
                        relayed = True
                        if n := fmt.steps(chunk):
                            events += n
                            last = time.monotonic()
                        if kv is not None:
                            kv.decode_answered()
                            kv = None
                        if rewrite is not None:
                            chunk = rewrite.feed(chunk)
                            if not chunk:
                                continue
                        self._first_byte(flight)
                        try:
                            await out.write(chunk)
                        except ConnectionResetError:
                            rec.error = "client disconnected"
                            return out
                        rec.tokens_sent(fmt.tokens(chunk), time.monotonic(), self.metrics)
                        fmt.seen(chunk)
                    rest = fmt.flush() + (rewrite.flush() if rewrite is not None else b"")
                    if rest:
                        self._first_byte(flight)
                        await out.write(rest)
                        fmt.seen(rest)
                    if not fmt.complete:
                        error = f"decode stream ended before {fmt.end}"
                except UpstreamError as exc:
                    if exc.kind == PREFILL_DOWN and retry is not None and not relayed:
                        # P went down while D waited for its KV: D alone, same client stream.
                        upstream.close()
                        fmt.restart()
                        try:
                            again = await self._again(d, retry)
                        except ProxyError as failed:
                            error = failed.message
                        else:
                            retry = None
                            if again.status < 300:
                                continue
                            error = f"{d.role} node {d.url} answered {again.status}"
                    else:
                        error = f"{d.role} node {d.url} failed mid-stream: {exc}"
                if error is not None and (moved := await self._resumed(resume, relayed,
                                                                       error)) is not None:
                    # Another engine goes on with it, into the same client stream.
                    if again is not None:
                        again.close()
                    again, error, kv = moved, None, None  # P's KV was given up
                    if not relayed:
                        fmt.restart()
                    if moved.status < 300:
                        continue
                    error = f"the engine continuing it answered {moved.status}"
                break
        finally:
            if again is not None:
                again.close()
        if rec.decode_first_at is not None and (
                step := fmt.step_s(rec.decode_first_at, last, events)) is not None:
            rec.step_s = step
        if error is not None:
            # Headers are gone already; the error event is how a stream says it failed.
            self.metrics.upstream_errors.labels(d.role, d.url, "stream").inc()
            rec.error = error
            try:
                await out.write(fmt.error(502, error))
            except ConnectionResetError:
                return out
        try:
            await out.write_eof()
        except ConnectionResetError:
            # Clients (the openai SDK among them) hang up once they read [DONE]: the answer
            # was complete, so this is no client disconnect.
            if error is not None:
                rec.error = rec.error or "client disconnected"
        return out


async def prepare_stream(request: web.Request, rec: AccessRecord, status: int,
                         content_type: str) -> web.StreamResponse:
    out = web.StreamResponse(status=status, headers={
        "Content-Type": content_type, "Cache-Control": "no-cache",
        "X-Request-Id": rec.request_id})
    await out.prepare(request)
    return out


def json_response(status: int, body: dict[str, Any], rec: AccessRecord) -> web.Response:
    return web.Response(status=status, body=_encode(body), content_type="application/json",
                        headers={"X-Request-Id": rec.request_id})
