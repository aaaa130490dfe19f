"""One upstream call's answer, parsed by llhttp (httptools) as it arrives on a pooled
connection: status and the few headers the proxy acts on, then the body, read whole or
streamed. Malformed framing (a bad status line, a chunk size like `-1` or `0x10`, a missing
CRLF after a chunk) is an error, never a guess.

A call is never sent twice: once a request went out, the node may have read it (a second
prefill, or a second pull of one transfer), so a connection that dies before the answer
fails the call (`kind` "failed") and the caller decides.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

import httptools


class Home(Protocol):
    """What a call and its connection need of the pool they belong to
    (appliance.proxy.upstream.pool.Pool)."""

    loop: asyncio.AbstractEventLoop
    active: set[Response]  # calls waiting for bytes, watched for read timeouts

    def put(self, conn: Connection) -> None: ...  # a reusable connection, back

    def closed(self, conn: Connection) -> None: ...  # a connection gone


# Above this much unread body the connection stops reading (a slow client slows D down
# instead of growing the proxy's memory).
_HIGH_WATER = 1 << 20
_HEAD_LIMIT = 64 * 1024


class UpstreamError(Exception):
    """The call failed; `kind` is "connect", "timeout", "down" (its node failed its health
    checks) or "failed"; `broken`: the node closed the connection before its answer ended
    (it died, or was cut off): another node may serve what reached no client."""

    def __init__(self, kind: str, message: str, broken: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.broken = broken


class Connection(asyncio.Protocol):
    """One keep-alive connection, carrying one request at a time."""

    def __init__(self, pool: Home) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.lost = False  # closed, or not reusable after the current answer
        self.idle_since = 0.0
        self.response: Response | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: this connection is unusable
            self.abort()
            return
        self.response._feed(data)

    def eof_received(self) -> bool:
        self.lost = True
        if self.response is not None:
            self.response._eof()
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.closed(self)
        if self.response is not None:
            self.response._eof(exc)

    def abort(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()


class Response:
    """One call: status and headers once `head_done`, then the body via read() or chunks().

    `waiter` is resolved on every event (head, body bytes, end, error); callers may point
    several responses at one future to wait for whichever moves first.
    """

    def __init__(self, pool: Home, conn: Connection, read_timeout: float,
                 deadline: float | None = None) -> None:
        self.pool = pool
        self._conn = conn
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.head_done = False
        self._headers: dict[bytes, bytes] = {}  # lower-cased names; the first of each
        self._head_bytes = 0
        self._interim = False  # a 1xx answer: the real one follows
        self._framed = False  # Content-Length or chunked: the end is in the bytes
        self.complete = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._released = False
        # No timer per call: Upstreams' watchdog looks at `_last` a few times a second.
        self._loop = pool.loop
        self._read_timeout = read_timeout
        self._deadline = deadline  # loop time by which the whole answer must be in
        self._last = self._loop.time()
        pool.active.add(self)

    @property
    def done(self) -> bool:
        """Nothing more will arrive: the body is complete or the call failed."""
        return self.complete or self.error is not None

    def header(self, name: str) -> str | None:
        """The value of a response header (the first, if repeated); `name` in lower case."""
        value = self._headers.get(name.encode())
        return None if value is None else value.strip().decode("latin-1")

    @property
    def content_type(self) -> str:
        return self.header("content-type") or "application/octet-stream"

    # ---- llhttp's callbacks ----

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            return  # a chunked body's trailers
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > _HEAD_LIMIT:
            raise ValueError("response head over 64 KiB")
        self._headers.setdefault(name.lower(), value)

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # 100 Continue and friends: the real answer follows
            self._interim, self._headers, self._head_bytes = True, {}, 0
            return
        self.status = status
        self.head_done = True
        if not self._parser.should_keep_alive():
            self._conn.lost = True
        h = self._headers
        self._framed = b"content-length" in h or b"chunked" in h.get(b"transfer-encoding", b"")
        if not self._framed and status not in (204, 304):
            self._conn.lost = True  # the body ends with the connection

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True

    def on_message_begin(self) -> None:
        if self.complete:  # bytes past the answer: never reuse this connection
            self._conn.lost = True

    # ---- driven by the connection ----

    def _feed(self, data: bytes) -> None:
        self._last = self._loop.time()
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, ValueError) as exc:
            self._fail(UpstreamError("failed", f"malformed response: {exc}"))
            self.pool.active.discard(self)
            self._conn.abort()
            self._wake()
            return
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()
        if self.complete:
            self.pool.active.discard(self)
        self._wake()

    def _eof(self, exc: Exception | None = None) -> None:
        if not self.done:
            if self.head_done and not self._framed:
                self.complete = True  # a read-until-close body
            else:
                # Not sent again: the node may have read the request (see the module doc).
                where = "mid-body" if self.head_done else "before answering"
                self._fail(UpstreamError(
                    "failed", f"connection closed {where}" + (f": {exc}" if exc else ""),
                    broken=True))
        self.pool.active.discard(self)
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _check_timeout(self, now: float) -> None:
        if self.done:
            return
        if self._deadline is not None and now > self._deadline:
            why = "timed out: over the upstream deadline"
        elif now - self._last >= self._read_timeout:
            why = f"timed out: no data for {self._read_timeout:g} s"
        else:
            return
        self.abort(UpstreamError("timeout", why))

    def abort(self, error: UpstreamError) -> None:
        """End the call with `error` now (a timeout, or its node found down)."""
        self._fail(error)
        self.pool.active.discard(self)
        self._conn.abort()  # a late answer must not land on a reused connection
        self._wake()

    # ---- for the caller ----

    async def wait(self) -> None:
        """Until the next event."""
        self.waiter = self._loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def head(self) -> Response:
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self.wait()
        return self

    def _take(self) -> bytes:
        data = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._body.clear()
        self._buffered = 0
        self._last = self._loop.time()  # our reading pace is not the node's silence
        if self._paused and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body; the connection then goes back to the pool."""
        while not self.complete:
            if self.error is not None:
                raise self.error
            await self.wait()
        body = self._take()
        self.close()
        return body

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises UpstreamError if the body is cut short."""
        while True:
            if self._body:
                yield self._take()
                continue
            if self.complete:
                self.close()
                return
            if self.error is not None:
                raise self.error
            await self.wait()

    def touch(self) -> None:
        """Restart the read-timeout clock (D's silence is expected while P prefills)."""
        self._last = self._loop.time()

    def close(self) -> None:
        """Done with this call: a finished answer frees its connection for reuse, an
        unfinished one is cut, which is how the node learns the request is abandoned."""
        if self._released:
            return
        self._released = True
        self.pool.active.discard(self)
        self._conn.response = None
        if self.complete and not self._conn.lost:
            self.pool.put(self._conn)
        else:
            self._conn.abort()
