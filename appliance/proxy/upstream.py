"""A lean HTTP/1.1 client for the two hot upstream calls (P's request, D's request).

Why not aiohttp's client here: per call it costs more than the whole aiohttp server request
in front of it (measured ~110-150 us per call against ~75 us for a fake vLLM request), and
every proxied request makes two calls. This client does only what vLLM's servers (uvicorn,
HTTP/1.1) need: keep-alive connections pooled per node, Content-Length, chunked and
read-until-close bodies, streamed reads, connect and read timeouts, and closing the
connection to cancel a request. It needs no task per call: sending is a write on a pooled
connection, and the protocol's callbacks resolve whatever future the caller waits on.
Health checks, /query and /v1/models still use aiohttp's client.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

# Above this much unread body the connection stops reading (a slow client slows D down
# instead of growing the proxy's memory).
_HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """The call failed; `kind` is "connect", "timeout" or "failed"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Connection(asyncio.Protocol):
    """One keep-alive connection, carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False  # closed, or not reusable after the current answer
        self.idle_since = 0.0
        self.response: Response | None = None
        self.buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: this connection is unusable
            self.abort()
            return
        self.buf += data
        self.response._feed()

    def eof_received(self) -> bool:
        self.lost = True
        if self.response is not None:
            self.response._eof()
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
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

    def __init__(self, pool: Pool, conn: _Connection, request: bytes, reused: bool,
                 read_timeout: float) -> None:
        self._pool = pool
        self._conn = conn
        # Kept for one retry: a pooled connection the node closed while idle fails before
        # any answer byte, and the node never saw the request (see _eof).
        self._request = request
        self._reused = reused
        self._got_bytes = False
        self._retry_task: asyncio.Task[None] | None = None
        self.status = 0
        self.head_done = False
        self._head = self._head_lower = b""
        self.complete = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self._length: int | None = None  # Content-Length left
        self._chunked = False
        self._chunk_left = -1  # of the current chunk; -1: size line next; -2: final CRLF
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._released = False
        # No timer per call: Upstreams' watchdog looks at `_last` a few times a second.
        self._loop = pool.loop
        self._read_timeout = read_timeout
        self._last = self._loop.time()
        pool.active.add(self)

    @property
    def done(self) -> bool:
        """Nothing more will arrive: the body is complete or the call failed."""
        return self.complete or self.error is not None

    def header(self, name: str) -> str | None:
        """The value of a response header (the first, if repeated); `name` in lower case."""
        key = b"\r\n" + name.encode() + b":"
        i = self._head_lower.find(key)
        if i < 0:
            return None
        start = i + len(key)
        return self._head[start:self._head.find(b"\r\n", start)].strip().decode("latin-1")

    def _value(self, name: bytes) -> bytes:
        """A header's value, lower-cased, known to be present."""
        low = self._head_lower
        start = low.find(b"\r\n" + name + b":") + len(name) + 3
        return low[start:low.find(b"\r\n", start)].strip()

    @property
    def content_type(self) -> str:
        return self.header("content-type") or "application/octet-stream"

    # ---- driven by the connection ----

    def _feed(self) -> None:
        self._last = self._loop.time()
        if not self._got_bytes:
            self._got_bytes = True
            self._request = b""  # no retry once the node has answered: free the copy
        try:
            self._parse()
        except ValueError as exc:
            self._fail(UpstreamError("failed", f"malformed response: {exc}"))
            self._pool.active.discard(self)
            self._conn.abort()
            self._wake()
            return
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()
        if self.complete:
            self._pool.active.discard(self)
        self._wake()

    def _parse(self) -> None:
        buf = self._conn.buf
        if not self.head_done:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    raise ValueError("response head over 64 KiB")
                return
            head = bytes(buf[:end + 2])  # up to the CRLF of the last header line
            del buf[:end + 4]
            if not head.startswith(b"HTTP/1.") or head[12:13] not in (b" ", b"\r"):
                raise ValueError(f"bad status line {head[:80]!r}")
            status = int(head[9:12])
            if 100 <= status < 200:  # 100 Continue and friends: the real answer follows
                self._parse()
                return
            # Only the few headers the proxy acts on, found in the lower-cased head; a
            # dict of them all costs more than the rest of the parsing.
            self._head = head
            self._head_lower = low = head.lower()
            self.status = status
            self.head_done = True
            if not head.startswith(b"HTTP/1.1") or (
                    b"\r\nconnection:" in low and b"close" in self._value(b"connection")):
                self._conn.lost = True
            if b"\r\ntransfer-encoding:" in low and \
                    b"chunked" in self._value(b"transfer-encoding"):
                self._chunked = True
            elif b"\r\ncontent-length:" in low:
                self._length = int(self._value(b"content-length"))
            elif status in (204, 304):
                self._length = 0
            else:
                self._conn.lost = True  # the body ends with the connection
        if self._chunked:
            self._parse_chunks(buf)
        elif self._length is not None:
            if buf and self._length:
                take = bytes(buf[:self._length])
                del buf[:len(take)]
                self._length -= len(take)
                self._append(take)
            if self._length == 0:
                self.complete = True
        elif buf:
            self._append(bytes(buf))
            buf.clear()

    def _parse_chunks(self, buf: bytearray) -> None:
        while buf:
            if self._chunk_left == -1:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 1024:
                        raise ValueError("chunk size line too long")
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                del buf[:end + 2]
                self._chunk_left = size if size else -2
                continue
            if self._chunk_left == -2:  # after the last chunk: trailers, then an empty line
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[:end + 2]
                if end == 0:
                    self.complete = True
                    return
                continue
            if self._chunk_left > 0:
                take = bytes(buf[:self._chunk_left])
                del buf[:len(take)]
                self._chunk_left -= len(take)
                self._append(take)
            if self._chunk_left == 0:
                if len(buf) < 2:
                    return
                del buf[:2]  # the CRLF closing the chunk's data
                self._chunk_left = -1

    def _append(self, data: bytes) -> None:
        self._body.append(data)
        self._buffered += len(data)

    def _eof(self, exc: Exception | None = None) -> None:
        if self._reused and not self._got_bytes and not self.done and not self._released:
            self._reused = False  # once
            self._conn.response = None
            self._retry_task = self._loop.create_task(self._resend())
            return
        if not self.done:
            if self.head_done and self._length is None and not self._chunked:
                self.complete = True  # a read-until-close body
            else:
                where = "mid-body" if self.head_done else "before answering"
                self._fail(UpstreamError(
                    "failed", f"connection closed {where}" + (f": {exc}" if exc else "")))
        self._pool.active.discard(self)
        self._wake()

    async def _resend(self) -> None:
        try:
            conn = await self._pool._connect()
        except UpstreamError as exc:
            self._fail(exc)
            self._pool.active.discard(self)
            self._wake()
            return
        if self._released:
            conn.abort()
            return
        self._conn = conn
        conn.response = self
        self._last = self._loop.time()
        assert conn.transport is not None
        conn.transport.write(self._request)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _check_timeout(self, now: float) -> None:
        if self.done or now - self._last < self._read_timeout:
            return
        self._fail(UpstreamError("timeout", f"timed out: no data for {self._read_timeout:g} s"))
        self._pool.active.discard(self)
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
        if self._retry_task is not None and not self._retry_task.done():
            self._retry_task.cancel()
        self._pool.active.discard(self)
        self._conn.response = None
        if self.complete and not self._conn.lost and not self._conn.buf:
            self._pool._put(self._conn)
        else:
            self._conn.abort()


class Pool:
    """Keep-alive connections to one node."""

    def __init__(self, base_url: str, keepalive_s: float, connect_timeout: float,
                 loop: asyncio.AbstractEventLoop, active: set[Response],
                 tls: ssl.SSLContext | None = None) -> None:
        self.loop = loop
        self.connect_timeout = connect_timeout
        self.active = active  # calls waiting for bytes, watched for read timeouts
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream nodes are http(s)://host:port, got {base_url!r}")
        if parts.scheme == "https" and tls is None:
            raise ValueError(f"{base_url}: an https upstream needs a TLS context")
        self.host = parts.hostname
        # Certificates are checked against the URL's host name, as any HTTPS client does.
        self.tls = tls if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc
        self.keepalive_s = keepalive_s
        self._idle: deque[_Connection] = deque()
        self._starts: dict[str, str] = {}  # path -> request line and Host header

    def _put(self, conn: _Connection) -> None:
        if conn.lost or conn.transport is None or conn.transport.is_closing():
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        self._idle.append(conn)

    def _idle_conn(self) -> _Connection | None:
        now = self.loop.time()
        while self._idle:
            conn = self._idle.pop()  # the most recently used is the least likely closed
            if (conn.lost or now - conn.idle_since > self.keepalive_s
                    or conn.transport is None or conn.transport.is_closing()):
                conn.abort()
                continue
            return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        timeout = self.connect_timeout
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port, ssl=self.tls,
                                       server_hostname=self.host if self.tls else None),
                timeout)
        except asyncio.TimeoutError:
            raise UpstreamError("connect", f"connect timed out after {timeout:g} s") from None
        except OSError as exc:  # ssl.SSLError included: a certificate that fails to verify
            raise UpstreamError("connect", f"cannot connect: {exc}") from None
        return conn

    def _write(self, conn: _Connection, path: str, body: bytes, headers: dict[str, str],
               read_timeout: float, reused: bool) -> Response:
        start = self._starts.get(path)
        if start is None:
            start = self._starts[path] = \
                f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
        head = (start + f"Content-Length: {len(body)}\r\n"
                + "".join([f"{k}: {v}\r\n" for k, v in headers.items()]) + "\r\n")
        request = head.encode("latin-1") + body
        resp = Response(self, conn, request, reused, read_timeout)
        conn.response = resp
        assert conn.transport is not None
        conn.transport.write(request)
        return resp

    def send_nowait(self, path: str, body: bytes, headers: dict[str, str], *,
                    read_timeout: float) -> Response | None:
        """POST on an idle pooled connection, or None when there is none."""
        conn = self._idle_conn()
        if conn is None:
            return None
        return self._write(conn, path, body, headers, read_timeout, reused=True)

    async def send(self, path: str, body: bytes, headers: dict[str, str], *,
                   read_timeout: float) -> Response:
        """POST, connecting first if no pooled connection is idle; does not wait for the
        answer (see Response.head())."""
        resp = self.send_nowait(path, body, headers, read_timeout=read_timeout)
        if resp is not None:
            return resp
        conn = await self._connect()
        return self._write(conn, path, body, headers, read_timeout, reused=False)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abort()


class Upstreams:
    """A pool per node URL, and the watchdog that enforces read timeouts."""

    def __init__(self, keepalive_s: float, connect_timeout_s: float, tick_s: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.keepalive_s = keepalive_s
        self.tls = tls  # for https:// nodes
        self.connect_timeout_s = connect_timeout_s
        self.tick_s = tick_s  # timeouts fire up to this late
        self.active: set[Response] = set()
        self._pools: dict[str, Pool] = {}
        self._watchdog: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._watchdog = asyncio.create_task(self._watch(), name="upstream-read-timeouts")

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick_s)
            now = loop.time()
            for resp in list(self.active):
                resp._check_timeout(now)

    def pool(self, base_url: str) -> Pool:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = Pool(base_url, self.keepalive_s,
                                                self.connect_timeout_s,
                                                asyncio.get_running_loop(), self.active,
                                                self.tls)
        return pool

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            try:
                await self._watchdog
            except asyncio.CancelledError:
                pass
        for pool in self._pools.values():
            pool.close()


async def wait_any(*responses: Response, until: Callable[[], bool]) -> None:
    """Wait, without a task per call, until `until()` holds; every event of every response
    re-checks it."""
    loop = asyncio.get_running_loop()
    while not until():
        fut: asyncio.Future[None] = loop.create_future()
        for r in responses:
            r.waiter = fut
        try:
            await fut
        finally:
            for r in responses:
                if r.waiter is fut:
                    r.waiter = None
