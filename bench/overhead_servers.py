"""The servers bench/proxy_overhead.py measures the proxy against, each run in a process of
its own (`python bench/overhead_servers.py --fake PORT BOOTSTRAP_PORT | --otlp-receiver PORT`):
a fake P (with its bootstrap) or D that answers at once (D streams CHUNKS SSE events when
asked to), and an OTLP/HTTP or OTLP/gRPC (`--grpc`) receiver."""

from __future__ import annotations

import argparse
import asyncio
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNKS = 16


def run_fake(port: int, bootstrap_port: int | None) -> None:
    from aiohttp import web

    def event(i: int, finish: str | None) -> bytes:
        return b"data: " + json.dumps({
            "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "text": f" tok{i}", "finish_reason": finish}]}).encode() \
            + b"\n\n"

    stream_body = [event(i, "length" if i == CHUNKS - 1 else None) for i in range(CHUNKS)]
    stream_body.append(b"data: [DONE]\n\n")

    def full(n: int, token_ids: bool = False) -> bytes:
        choice = {"index": 0, "text": " tok" * n, "finish_reason": "length"}
        if token_ids:  # what P answers in the proxy's first-token mode
            choice.update(token_ids=[7] * n, prompt_token_ids=list(range(90)))
        return json.dumps({
            "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "tiny",
            "choices": [choice], "usage": {"prompt_tokens": 90, "completion_tokens": n}}).encode()

    one, one_ids, many = full(1), full(1, token_ids=True), full(CHUNKS)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in stream_body:  # one write per event, as vLLM does
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        if body.get("max_tokens") == 1:
            return web.Response(body=one_ids if body.get("return_token_ids") else one,
                                content_type="application/json")
        return web.Response(body=many, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def query(request: web.Request) -> web.Response:
        return web.json_response({"0": {"engine_id": "engine-bench",
                                        "worker_addr": {"0": {"0": "tcp://127.0.0.1:1"}}}})

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
    args = ap.parse_args()
    if args.fake:
        run_fake(args.fake[0], args.fake[1] or None)
    elif args.otlp_receiver:
        (run_otlp_grpc_receiver if args.grpc else run_otlp_receiver)(args.otlp_receiver)
