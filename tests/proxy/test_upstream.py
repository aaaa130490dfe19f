"""The lean upstream client against raw servers that send exactly the bytes a test wants:
framing split at awkward places, keep-alive and its races, timeouts, cuts, back-pressure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from appliance.proxy.upstream.pool import Pool, Upstreams, wait_any
from appliance.proxy.upstream.response import Response, UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Runs `handler` per connection; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.disconnected = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.disconnected.set()
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


@pytest.fixture
async def upstreams() -> AsyncIterator[Upstreams]:
    u = Upstreams(keepalive_s=4.0, connect_timeout_s=1.0, tick_s=0.05)
    u.start()
    yield u
    await u.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[RawServer, str]]]]:
    servers: list[RawServer] = []

    async def start(handler: Handler) -> tuple[RawServer, str]:
        s = RawServer(handler)
        servers.append(s)
        return s, await s.start()

    yield start
    for s in servers:
        await s.stop()


async def post(pool: Pool, body: bytes = b"{}", timeout: float = 2.0) -> Response:
    return await pool.send("/v1/completions", body, {"Content-Type": "application/json"},
                           read_timeout=timeout)


async def test_content_length_body_byte_by_byte(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        assert await read_request(r) == b'{"x": 1}'
        for b in ok(b'{"answer": 42}', b"Content-Type: application/json\r\n"):
            w.write(bytes([b]))
            await w.drain()
        await r.read()

    _, url = await serve(handler)
    resp = await (await post(upstreams.pool(url), b'{"x": 1}')).head()
    assert resp.status == 200 and resp.content_type == "application/json"
    assert await resp.read() == b'{"answer": 42}'


async def test_chunked_body_split_everywhere_with_extensions_and_trailers(
        upstreams: Upstreams, serve) -> None:
    wire = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: text/event-stream\r\n\r\n"
            b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\n")

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        for i in range(0, len(wire), 3):
            w.write(wire[i:i + 3])
            await w.drain()
            await asyncio.sleep(0)
        await r.read()

    _, url = await serve(handler)
    resp = await (await post(upstreams.pool(url))).head()
    got = b"".join([c async for c in resp.chunks()])
    assert got == b"hello world"
    assert resp.complete


async def test_read_until_close_body(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nsome body")
        await w.drain()

    _, url = await serve(handler)
    resp = await post(upstreams.pool(url))
    assert await resp.read() == b"some body"


async def test_100_continue_is_skipped(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"done"))
        await r.read()

    _, url = await serve(handler)
    resp = await (await post(upstreams.pool(url))).head()
    assert resp.status == 200 and await resp.read() == b"done"


async def test_keep_alive_reuses_one_connection(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            body = await read_request(r)
            w.write(ok(body))

    server, url = await serve(handler)
    pool = upstreams.pool(url)
    for i in range(5):
        assert await (await post(pool, b"%d" % i)).read() == b"%d" % i
    assert server.connections == 1
    # Nothing left waiting for a timeout.
    assert not upstreams.active


async def test_connection_close_is_not_reused(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(ok(b"bye", b"Connection: close\r\n"))

    server, url = await serve(handler)
    pool = upstreams.pool(url)
    for _ in range(2):
        assert await (await post(pool)).read() == b"bye"
    assert server.connections == 2


async def test_idle_connection_closed_by_the_node_is_not_reused(upstreams: Upstreams,
                                                                 serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(ok(b"fine"))
        await w.drain()  # then close, as uvicorn does after its keep-alive timeout

    server, url = await serve(handler)
    pool = upstreams.pool(url)
    assert await (await post(pool)).read() == b"fine"
    await server.disconnected.wait()
    await asyncio.sleep(0.05)
    assert await (await post(pool)).read() == b"fine"
    assert server.connections == 2


async def test_a_request_that_reached_the_node_is_never_sent_twice(
        upstreams: Upstreams, serve) -> None:
    """The node reads the whole request on a reused connection, then the connection dies
    before any answer (a crash mid-request, or its idle close racing ours). It may have
    acted on it (a second prefill, a second pull of one transfer): the call fails, and
    nothing is sent again."""
    bodies: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        first = server.connections == 1
        bodies.append(await read_request(r))
        if first:
            w.write(ok(b"fine"))
            await w.drain()
            bodies.append(await read_request(r))  # the second request, read... and dropped
            return
        w.write(ok(b"again?"))
        await r.read()

    server, url = await serve(handler)
    pool = upstreams.pool(url)
    assert await (await post(pool)).read() == b"fine"
    resp = await post(pool)
    with pytest.raises(UpstreamError) as info:
        await resp.read()
    assert info.value.kind == "failed" and "before answering" in str(info.value)
    await asyncio.sleep(0.1)
    assert len(bodies) == 2 and server.connections == 1  # sent once, no new connection


@pytest.mark.parametrize("framing", [
    b"Transfer-Encoding: chunked\r\n\r\n-1\r\nxx\r\n0\r\n\r\n",    # negative size
    b"Transfer-Encoding: chunked\r\n\r\n0x2\r\nxx\r\n0\r\n\r\n",   # a 0x prefix
    b"Transfer-Encoding: chunked\r\n\r\n2\r\nxxYY0\r\n\r\n",         # no CRLF after data
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n",    # not hex
    b"Content-Length: -5\r\n\r\nxx",                                    # negative length
])
async def test_malformed_framing_is_an_error(upstreams: Upstreams, serve,
                                              framing: bytes) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\n" + framing)
        await r.read()

    server, url = await serve(handler)
    pool = upstreams.pool(url)
    with pytest.raises(UpstreamError) as info:
        await (await post(pool)).read()
    assert info.value.kind == "failed" and "malformed" in str(info.value)
    await server.disconnected.wait()  # the connection is cut, never reused


async def test_connections_per_node_are_capped(serve) -> None:
    u = Upstreams(keepalive_s=4.0, connect_timeout_s=2.0, tick_s=0.05, max_connections=2)
    u.start()
    open_now = most = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        try:
            while True:
                await read_request(r)
                await asyncio.sleep(0.05)
                w.write(ok(b"x"))
                await w.drain()
        finally:
            open_now -= 1

    server, url = await serve(handler)
    pool = u.pool(url)

    async def one() -> bytes:
        return await (await post(pool)).read()

    assert await asyncio.gather(*(one() for _ in range(6))) == [b"x"] * 6
    assert most == 2 and server.connections == 2 and pool.open == 2
    await u.close()


async def test_a_full_pool_fails_within_the_connect_timeout(serve) -> None:
    u = Upstreams(keepalive_s=4.0, connect_timeout_s=0.3, tick_s=0.05, max_connections=1)
    u.start()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await r.read()  # never answers

    _, url = await serve(handler)
    pool = u.pool(url)
    hung = await post(pool)
    started = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamError) as info:
        await post(pool)
    assert info.value.kind == "connect" and "stayed busy" in str(info.value)
    assert asyncio.get_running_loop().time() - started < 1.0
    hung.close()
    await u.close()


async def test_total_deadline_cuts_a_call_that_is_never_silent(serve) -> None:
    u = Upstreams(keepalive_s=4.0, connect_timeout_s=1.0, tick_s=0.05, deadline_s=0.4)
    u.start()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:  # a chunk every 50 ms: the read timeout never fires
            w.write(b"1\r\nx\r\n")
            await w.drain()
            await asyncio.sleep(0.05)

    server, url = await serve(handler)
    resp = await u.pool(url).send("/v1/completions", b"{}", {}, read_timeout=5.0)
    with pytest.raises(UpstreamError) as info:
        async for _ in resp.chunks():
            pass
    assert info.value.kind == "timeout" and "deadline" in str(info.value)
    await server.disconnected.wait()
    await u.close()


async def test_fresh_connection_closed_before_answer_fails(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)

    server, url = await serve(handler)
    resp = await post(upstreams.pool(url))
    with pytest.raises(UpstreamError) as info:
        await resp.head()
    assert info.value.kind == "failed" and "before answering" in str(info.value)
    assert server.connections == 1  # no retry on a fresh connection


async def test_idle_connections_expire(serve) -> None:
    u = Upstreams(keepalive_s=0.05, connect_timeout_s=1.0, tick_s=0.05)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(ok(b"x"))

    server, url = await serve(handler)
    pool = u.pool(url)
    await (await post(pool)).read()
    await asyncio.sleep(0.1)
    await (await post(pool)).read()
    assert server.connections == 2
    await u.close()


async def test_read_timeout_cuts_the_connection(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await r.read()  # until the client goes away

    server, url = await serve(handler)
    resp = await post(upstreams.pool(url), timeout=0.2)
    with pytest.raises(UpstreamError) as info:
        await resp.head()
    assert info.value.kind == "timeout"
    await asyncio.wait_for(server.disconnected.wait(), 2)


async def test_timeout_counts_silence_not_total_time(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(6):
            await asyncio.sleep(0.1)
            w.write(b"1\r\n.\r\n")
        w.write(b"0\r\n\r\n")
        await r.read()

    _, url = await serve(handler)
    resp = await post(upstreams.pool(url), timeout=0.3)
    assert await resp.read() == b"......"


async def test_cut_mid_body(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await w.drain()
        await asyncio.sleep(0.05)

    _, url = await serve(handler)
    resp = await post(upstreams.pool(url))
    got = []
    with pytest.raises(UpstreamError) as info:
        async for chunk in resp.chunks():
            got.append(chunk)
    assert got == [b"abc"] and "mid-body" in str(info.value)


async def test_connect_refused(upstreams: Upstreams, serve) -> None:
    server, url = await serve(read_request)  # type: ignore[arg-type]
    await server.stop()
    await asyncio.sleep(0.05)
    with pytest.raises(UpstreamError) as info:
        await post(upstreams.pool(url))
    assert info.value.kind == "connect"


async def test_malformed_status_line(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"SPDY/9 what\r\n\r\n")
        await r.read()

    _, url = await serve(handler)
    resp = await post(upstreams.pool(url))
    with pytest.raises(UpstreamError) as info:
        await resp.head()
    assert "malformed" in str(info.value)


async def test_close_before_the_end_tells_the_node(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await r.read()

    server, url = await serve(handler)
    resp = await (await post(upstreams.pool(url))).head()
    resp.close()
    await asyncio.wait_for(server.disconnected.wait(), 2)


async def test_wait_any_wakes_on_either(upstreams: Upstreams, serve) -> None:
    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await r.read()

    async def fast(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await asyncio.sleep(0.05)
        w.write(ok(b"first"))
        await r.read()

    _, slow_url = await serve(slow)
    _, fast_url = await serve(fast)
    a, b = await post(upstreams.pool(slow_url)), await post(upstreams.pool(fast_url))
    await asyncio.wait_for(wait_any(a, b, until=lambda: a.done or b.done), 2)
    assert b.complete and not a.done
    assert a.waiter is None and b.waiter is None
    a.close()
    b.close()


async def test_back_pressure_pauses_reading(upstreams: Upstreams, serve) -> None:
    big = b"x" * (3 << 20)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(ok(big))
        await w.drain()
        await r.read()

    _, url = await serve(handler)
    resp = await (await post(upstreams.pool(url))).head()
    await asyncio.sleep(0.2)  # nobody reads: the client stops reading past ~1 MiB
    assert resp._paused and resp._buffered < len(big)
    got = b"".join([c async for c in resp.chunks()])
    assert got == big


def test_only_plain_http_nodes() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError):
            Pool("https://node:443", 4.0, 1.0, loop, set())
    finally:
        loop.close()


async def test_headers_are_found_whatever_their_case(upstreams: Upstreams, serve) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 204 No Content\r\nCONTENT-TYPE:  text/plain \r\nX-A: 1\r\n\r\n")
        await r.read()

    _, url = await serve(handler)
    resp = await (await post(upstreams.pool(url))).head()
    assert resp.status == 204 and resp.content_type == "text/plain"
    assert resp.header("x-a") == "1" and resp.header("missing") is None
    assert await resp.read() == b""
