"""The servers bench/proxy_overhead.py measures the proxy against, each run in a process of
its own (`python bench/overhead_servers.py --fake PORT BOOTSTRAP_PORT [--lean] |
--otlp-receiver PORT`): a fake P (with its bootstrap) or D that answers at once (D streams
CHUNKS SSE events when asked to), server-like (aiohttp) or lean (llhttp, canned bytes), and
an OTLP/HTTP or OTLP/gRPC (`--grpc`) receiver."""

from __future__ import annotations

import argparse
import asyncio
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNKS = 16


def _answers() -> tuple[list[bytes], list[bytes], bytes, bytes, bytes]:
    """The fakes' answers: a stream's SSE events (without and with token ids, as vLLM's
    compact JSON has them), one token (P's answer; with token ids in the proxy's
    first-token mode), and CHUNKS tokens."""
    def event(i: int, finish: str | None, ids: bool) -> bytes:
        choice: dict = {"index": 0, "text": f" tok{i}", "logprobs": None,
                        "finish_reason": finish, "stop_reason": None,
                        "token_ids": [7] if ids else None,
                        "prompt_token_ids": list(range(90)) if ids and i == 0 else None}
        return b"data: " + json.dumps({
            "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "tiny",
            "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"

    stream_body, stream_ids = ([event(i, "length" if i == CHUNKS - 1 else None, ids)
                                for i in range(CHUNKS)] + [b"data: [DONE]\n\n"]
                               for ids in (False, True))

    def full(n: int, token_ids: bool = False) -> bytes:
        choice = {"index": 0, "text": " tok" * n, "finish_reason": "length"}
        if token_ids:
            choice.update(token_ids=[7] * n, prompt_token_ids=list(range(90)))
        return json.dumps({
            "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "tiny",
            "choices": [choice], "usage": {"prompt_tokens": 90, "completion_tokens": n}}).encode()

    return stream_body, stream_ids, full(1), full(1, token_ids=True), full(CHUNKS)


_QUERY = json.dumps({"0": {"engine_id": "engine-bench",
                           "worker_addr": {"0": {"0": "tcp://127.0.0.1:1"}}}}).encode()


def _pick(body: dict, one: bytes, one_ids: bytes, many: bytes) -> bytes:
    if body.get("max_tokens") == 1:
        return one_ids if body.get("return_token_ids") else one
    return many


def run_fake(port: int, bootstrap_port: int | None) -> None:
    """A server-like fake: aiohttp, as a small Python HTTP service costs per request."""
    from aiohttp import web

    stream_body, stream_ids, one, one_ids, many = _answers()

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            events = stream_ids if body.get("return_token_ids") else stream_body
            for chunk in events:  # one write per event, as vLLM does
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        return web.Response(body=_pick(body, one, one_ids, many),
                            content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def query(request: web.Request) -> web.Response:
        return web.Response(body=_QUERY, content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", generate)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        if bootstrap_port is not None:
            bapp = web.Application()
            bapp.router.add_get("/query", query)
            brunner = web.AppRunner(bapp, access_log=None)
            await brunner.setup()
            await web.TCPSite(brunner, "127.0.0.1", bootstrap_port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def run_lean_fake(port: int, bootstrap_port: int | None) -> None:
    """The same answers at a fraction of the cost: llhttp (httptools) on an asyncio.Protocol,
    canned bytes. Two proxies compared side by side meet these, so that the proxy's own core
    is what limits the rate: with the server-like fakes, the fakes and the load generator
    kept the other core 90-98% busy at concurrency 64, and whatever a proxy made run there
    (a span exporter, its receiver) slowed both the fakes and the proxy's batching."""
    import httptools
    import msgspec

    stream_body, stream_ids, one, one_ids, many = _answers()
    decode = msgspec.json.decode

    def reply(status: bytes, ctype: bytes, body: bytes) -> bytes:
        return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    canned = {key: reply(b"200 OK", b"application/json", body)
              for key, body in ((one, one), (one_ids, one_ids), (many, many))}
    health = reply(b"200 OK", b"text/plain", b"ok")
    query = reply(b"200 OK", b"application/json", _QUERY)
    missing = reply(b"404 Not Found", b"text/plain", b"not found")
    stream_head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n")
    # One write per event, as vLLM does; each its own chunk.
    stream_chunks, stream_chunks_ids = ([b"%x\r\n%s\r\n" % (len(c), c) for c in events]
                                        + [b"0\r\n\r\n"] for events in (stream_body, stream_ids))

    class Conn(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""
            self.body: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            url, body = self.url, b"".join(self.body)
            self.url, self.body = b"", []
            write = self.transport.write
            if self.parser.get_method() == b"POST" and url == b"/v1/completions":
                req = decode(body)
                if req.get("stream"):
                    write(stream_head)
                    for chunk in stream_chunks_ids if req.get("return_token_ids") \
                            else stream_chunks:
                        write(chunk)
                else:
                    write(canned[_pick(req, one, one_ids, many)])
            elif url == b"/health":
                write(health)
            elif url == b"/query":
                write(query)
            else:
                write(missing)
            if not self.parser.should_keep_alive():
                self.transport.close()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for p in (port, bootstrap_port):
            if p:
                await loop.create_server(Conn, "127.0.0.1", p)
        await asyncio.Event().wait()

    asyncio.run(main())


def run_otlp_receiver(port: int) -> None:
    """An OTLP/HTTP endpoint in a process of its own (a collector is one: in the load
    generator's process it would slow the load by its share of the GIL), keeping
    connections alive, taking every export and answering 200 at once."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def run_otlp_grpc_receiver(port: int) -> None:
    """The same over OTLP/gRPC (the TraceService's Export, its request left undecoded)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(lambda _req, _ctx: b"")})
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake", nargs=2, type=int, metavar=("PORT", "BOOTSTRAP_PORT"))
    ap.add_argument("--otlp-receiver", type=int, metavar="PORT")
    ap.add_argument("--grpc", action="store_true", help="the receiver speaks OTLP/gRPC")
    ap.add_argument("--lean", action="store_true",
                    help="the fake on llhttp and canned bytes, at a fraction of aiohttp's cost")
    args = ap.parse_args()
    if args.fake:
        (run_lean_fake if args.lean else run_fake)(args.fake[0], args.fake[1] or None)
    elif args.otlp_receiver:
        (run_otlp_grpc_receiver if args.grpc else run_otlp_receiver)(args.otlp_receiver)
