"""A lean HTTP/1.1 client for the two hot upstream calls (P's request, D's request).

Why not aiohttp's client here: per call it costs more than the whole aiohttp server request
in front of it (measured ~110-150 us per call against ~75 us for a fake vLLM request), and
every proxied request makes two calls. This client does only what vLLM's servers (uvicorn,
HTTP/1.1) need: keep-alive connections pooled per node (at most `max_connections` each),
responses parsed by llhttp (`appliance.proxy.upstream.response`), streamed reads, connect, read and
total timeouts, and closing the connection to cancel a request. It needs no task per call:
sending is a write on a pooled connection, and the protocol's callbacks resolve whatever
future the caller waits on. A request is never sent twice. Health checks, /query and
/v1/models still use aiohttp's client.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

from appliance.proxy.upstream.response import Connection, Response, UpstreamError
from appliance.proxy.waitqueue import WaitQueue


class Pool:
    """Keep-alive connections to one node, at most `max_connections` open at once."""

    def __init__(self, base_url: str, keepalive_s: float, connect_timeout: float,
                 loop: asyncio.AbstractEventLoop, active: set[Response],
                 tls: ssl.SSLContext | None = None, max_connections: int = 1024,
                 deadline_s: float | None = None) -> None:
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
        self.max_connections = max_connections
        self.deadline_s = deadline_s  # the longest one call may take, streaming included
        self.open = 0  # connections open or being opened
        self._idle: deque[Connection] = deque()
        self._free = WaitQueue()  # callers waiting for a connection to free up
        self._starts: dict[str, str] = {}  # path -> request line and Host header

    def put(self, conn: Connection) -> None:
        if conn.lost or conn.transport is None or conn.transport.is_closing():
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        self._idle.append(conn)
        self._free.wake_one()

    def closed(self, conn: Connection) -> None:
        """A connection is gone (its connection_lost): its slot is free."""
        self.open -= 1
        try:
            self._idle.remove(conn)  # not left queued, dead, until someone pops it
        except ValueError:
            pass
        self._free.wake_one()

    def _idle_conn(self) -> Connection | None:
        now = self.loop.time()
        while self._idle:
            conn = self._idle.pop()  # the most recently used is the least likely closed
            if (conn.lost or now - conn.idle_since > self.keepalive_s
                    or conn.transport is None or conn.transport.is_closing()):
                conn.abort()
                continue
            return conn
        return None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        timeout = self.connect_timeout
        self.open += 1
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(self), self.host, self.port,
                                       ssl=self.tls,
                                       server_hostname=self.host if self.tls else None),
                timeout)
        except asyncio.TimeoutError:
            self._connect_failed()
            raise UpstreamError("connect", f"connect timed out after {timeout:g} s") from None
        except OSError as exc:  # ssl.SSLError included: a certificate that fails to verify
            self._connect_failed()
            raise UpstreamError("connect", f"cannot connect: {exc}") from None
        except BaseException:
            self._connect_failed()
            raise
        return conn

    def _connect_failed(self) -> None:
        self.open -= 1
        self._free.wake_one()

    async def _acquire(self) -> Connection:
        """An idle connection, a new one within the cap, or the first one freed before the
        connect timeout."""
        deadline = self.loop.time() + self.connect_timeout
        while True:
            conn = self._idle_conn()
            if conn is not None:
                return conn
            if self.open < self.max_connections:
                return await self._connect()
            left = deadline - self.loop.time()
            if left <= 0:
                raise UpstreamError("connect", f"all {self.max_connections} connections to "
                                    f"{self.host_header} stayed busy for "
                                    f"{self.connect_timeout:g} s")
            await self._free.wait(left)

    def _write(self, conn: Connection, path: str, body: bytes, headers: dict[str, str],
               read_timeout: float) -> Response:
        start = self._starts.get(path)
        if start is None:
            start = self._starts[path] = \
                f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
        head = (start + f"Content-Length: {len(body)}\r\n"
                + "".join([f"{k}: {v}\r\n" for k, v in headers.items()]) + "\r\n")
        deadline = None if self.deadline_s is None else self.loop.time() + self.deadline_s
        resp = Response(self, conn, read_timeout, deadline)
        conn.response = resp
        assert conn.transport is not None
        conn.transport.write(head.encode("latin-1") + body)
        return resp

    def send_nowait(self, path: str, body: bytes, headers: dict[str, str], *,
                    read_timeout: float) -> Response | None:
        """POST on an idle pooled connection, or None when there is none."""
        conn = self._idle_conn()
        if conn is None:
            return None
        return self._write(conn, path, body, headers, read_timeout)

    async def send(self, path: str, body: bytes, headers: dict[str, str], *,
                   read_timeout: float) -> Response:
        """POST on a pooled connection or a new one (waiting, within the connect timeout,
        for one to free up when the node has max_connections open); does not wait for the
        answer (see Response.head())."""
        conn = await self._acquire()
        return self._write(conn, path, body, headers, read_timeout)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abort()


class Upstreams:
    """A pool per node URL, and the watchdog that enforces read timeouts."""

    def __init__(self, keepalive_s: float, connect_timeout_s: float, tick_s: float,
                 tls: ssl.SSLContext | None = None, max_connections: int = 1024,
                 deadline_s: float | None = None) -> None:
        self.keepalive_s = keepalive_s
        self.tls = tls  # for https:// nodes
        self.max_connections = max_connections  # per node
        self.deadline_s = deadline_s  # per call, streaming included
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
                                                self.tls, self.max_connections,
                                                self.deadline_s)
        return pool

    def forget(self, base_url: str) -> None:
        """A node the proxy dropped: close its idle connections (a call still on one
        finishes; a node added again later gets a new pool)."""
        pool = self._pools.pop(base_url, None)
        if pool is not None:
            pool.close()

    def fail_node(self, base_url: str, why: str) -> int:
        """Fail every call in flight to this node (it is down); returns how many."""
        pool = self._pools.get(base_url)
        if pool is None:
            return 0
        return self._fail([r for r in self.active if r.pool is pool], "down", why)

    def fail_all(self, why: str) -> int:
        """Fail every call in flight (the proxy is shutting down); returns how many."""
        return self._fail(list(self.active), "failed", why)

    @staticmethod
    def _fail(calls: list[Response], kind: str, why: str) -> int:
        calls = [r for r in calls if not r.done]
        for resp in calls:
            resp.abort(UpstreamError(kind, why))
        return len(calls)

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
