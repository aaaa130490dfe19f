"""Recording fakes of vLLM prefill/decode servers and of the bootstrap sidecar, on loopback.

Each fake is a real aiohttp server run with handler_cancellation, so a proxy closing its
connection shows up here as a cancelled request. Behaviour is switched per test through
plain attributes (status, hang, chunk delays, dying mid-stream).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from appliance.sidechannel import messages as m
from tests.proxy import fake_responses as fr


@dataclass
class Received:
    path: str
    headers: Mapping[str, str]  # case-insensitive, as received
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    chunks_sent: int = 0
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # handler left, any way

    @property
    def kv(self) -> dict[str, Any] | None:
        return self.body.get("kv_transfer_params")


class FakeServer:
    def __init__(self) -> None:
        self.app = web.Application()
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.tls: ssl.SSLContext | None = None  # set before start(): serve https

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True,
                           ssl_context=self.tls)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        """Closes the socket (later connects are refused); start() reopens the same port."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
            self.app = self._fresh_app()

    def _fresh_app(self) -> web.Application:
        return web.Application()


class FakeSideChannel:
    """A P worker's ZMQ ROUTER as far as the proxy sees it: records the releases it gets."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"
        self.released: list[str] = []  # transfer ids
        self._task = asyncio.ensure_future(self._listen())

    async def _listen(self) -> None:
        while True:
            identity, payload = await self.sock.recv_multipart()
            msg = m.decode_side_channel(payload)
            assert isinstance(msg, m.CancelRequest), msg
            self.released += [e.transfer_id for e in msg.reqs]
            await self.sock.send_multipart([identity, m.encode_response(m.TransferResponse(
                status=m.Status.FINISH, failed={e.d_req_id: "cancelled" for e in msg.reqs}))])

    def close(self) -> None:
        self._task.cancel()
        self.sock.close(0)
        self.ctx.term()


class FakeBootstrap(FakeServer):
    """`GET /query` answers dp rank -> engine id as the MooncakeConnector's bootstrap does;
    every rank's one worker is `side` (a real ROUTER socket, see FakeSideChannel)."""

    def __init__(self, engines: dict[int, str] | None = None) -> None:
        super().__init__()
        self.engines: dict[int, str] = dict(engines or {})
        self.fail = False
        self.queries = 0
        self.last_headers: Mapping[str, str] = {}
        self.side: FakeSideChannel | None = None
        self.app = self._fresh_app()

    async def start(self) -> None:
        if self.side is None:
            self.side = FakeSideChannel()
        await super().start()

    def _fresh_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/query", self._query)
        return app

    async def _query(self, request: web.Request) -> web.Response:
        self.queries += 1
        self.last_headers = request.headers.copy()
        if self.fail:
            return web.json_response({"error": "boom"}, status=500)
        assert self.side is not None
        return web.json_response({
            str(rank): {"engine_id": eid, "worker_addr": {"0": {"0": self.side.addr}}}
            for rank, eid in self.engines.items()})


class FakeVLLM(FakeServer):
    """A vLLM OpenAI server good enough for the proxy: records every generation request."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.received: list[Received] = []
        self.arrived = asyncio.Event()
        # Behaviour switches.
        self.healthy = True
        self.status = 200
        self.error_body: dict[str, Any] | None = None
        self.hang = False  # never answer (no headers)
        self.hang_after_headers = False  # SSE headers, then silence (D waiting for KV)
        self.wait_for_kv = False  # a request with kv_transfer_params never gets its KV
        self.delay = 0.0  # before the headers
        self.chunks = 4
        self.chunk_delay = 0.0
        self.die_after: int | None = None  # abort the connection after this many chunks
        self.skip_done = False  # end the stream cleanly but without [DONE]
        self.finish_reason = "length"
        self.prompt_token_ids = [1, 2, 3, 4, 5]
        self.max_model_len = 2048
        self.metrics_text: str | None = None  # what GET /metrics answers (None: 404)
        self.app = self._fresh_app()

    def _fresh_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post(fr.PATH, self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._tokenize)
        app.router.add_get("/version", self._tokenize)
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_text is None:
            return web.Response(status=404)
        return web.Response(text=self.metrics_text, content_type="text/plain")

    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.received]

    async def wait_requests(self, n: int, timeout: float = 5.0) -> None:
        async def _wait() -> None:
            while len(self.received) < n:
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(_wait(), timeout)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "tiny", "object": "model", "owned_by": self.name,
             "max_model_len": self.max_model_len}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """/tokenize (one id per word), /detokenize, /version; recorded, switched by
        `hang`, `delay` and `status` as the generation routes are."""
        body = await request.json() if request.can_read_body else {}
        rec = Received(request.path, request.headers.copy(), body)
        self.received.append(rec)
        self.arrived.set()
        try:
            if self.hang:
                await asyncio.Event().wait()
            await asyncio.sleep(self.delay)
            if self.status >= 400:
                return web.json_response(self.error_body or {"error": {
                    "message": f"{self.name} says no", "type": "BadRequestError",
                    "code": self.status}}, status=self.status)
            if request.path == "/version":
                return web.json_response({"version": f"fake-{self.name}"})
            if request.path == "/detokenize":
                return web.json_response({"prompt": " ".join(f"w{t}" for t in body["tokens"])})
            ids = list(range(len(body.get("prompt", "").split())))
            return web.json_response({"count": len(ids), "max_model_len": self.max_model_len,
                                      "tokens": ids, "token_strs": None})
        except asyncio.CancelledError:
            rec.cancelled = True
            raise
        finally:
            rec.finished.set()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        rec = Received(request.path, request.headers.copy(), await request.json())
        self.received.append(rec)
        self.arrived.set()
        try:
            return await self._answer(request, rec)
        except asyncio.CancelledError:
            rec.cancelled = True
            raise
        finally:
            rec.finished.set()

    async def _answer(self, request: web.Request, rec: Received) -> web.StreamResponse:
        if self.hang:
            await asyncio.Event().wait()
        responses = rec.path == fr.PATH
        if self.wait_for_kv and rec.kv:
            if rec.body.get("stream"):  # vLLM sends a stream's head before any token
                resp = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream; charset=utf-8"})
                await resp.prepare(request)
                if responses:  # and a Responses stream its opening events
                    await resp.write(fr.preamble(self.name, rec.body))
            await asyncio.Event().wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.status >= 400:
            body = self.error_body or {"error": {"message": f"{self.name} says no",
                                                 "type": "BadRequestError",
                                                 "code": self.status}}
            return web.json_response(body, status=self.status)
        chat = rec.path.endswith("/chat/completions")
        if responses:
            return await self._respond(request, rec)
        if not rec.body.get("stream"):
            if self.die_after is not None:  # killed while it decodes a whole answer
                await _crash(request)
                return web.Response()
            full = _full(self.name, chat, self.finish_reason, rec.body.get("max_tokens"))
            if rec.body.get("return_token_ids"):  # as vLLM: chat puts the prompt's at the top
                ids = {"token_ids": [7] if rec.body.get("max_tokens") == 1 else [7, 8, 9, 10]}
                (full if chat else ids)["prompt_token_ids"] = self.prompt_token_ids
                full["choices"][0].update(ids)
            return web.json_response(full)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        if self.hang_after_headers:
            await asyncio.Event().wait()
        # A stream asking for its token ids back (the first-token path's D, an answer
        # continued elsewhere, a stream served alone): "greedy" tokens by position, token i
        # is 100 + i, so one continued after k of them goes on with the k+1-th (tests of
        # appliance.proxy.exchange.migration). As vLLM, a chat stream says its prompt's ids
        # at the top of its first chunk, a completion in its first choice.
        ids = bool(rec.body.get("return_token_ids"))
        prompt = rec.body.get("prompt")
        prompt = prompt if isinstance(prompt, list) else self.prompt_token_ids
        shift = sum(1 for t in prompt if t >= 100) if ids else 0
        for i in range(shift, max(shift, self.chunks)):
            if self.die_after is not None and i - shift == self.die_after:
                await _crash(request)
                return resp
            last = i == self.chunks - 1
            chunk = _chunk(self.name, chat, i, self.finish_reason if last else None)
            if ids:
                chunk["choices"][0]["token_ids"] = [100 + i]
                first = prompt if i == shift else None
                if chat:
                    if i == shift:
                        chunk["prompt_token_ids"] = first
                else:
                    chunk["choices"][0]["prompt_token_ids"] = first
            await resp.write(_sse(chunk))
            rec.chunks_sent += 1
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
        if not self.skip_done:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


    async def _respond(self, request: web.Request, rec: Received) -> web.StreamResponse:
        """/v1/responses: the response object, or its events (tests.proxy.fake_responses)."""
        if not rec.body.get("stream"):
            return web.json_response(fr.whole(self.name, rec.body, self.finish_reason))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write(fr.preamble(self.name, rec.body))
        if self.hang_after_headers:
            await asyncio.Event().wait()
        await resp.write(fr.opening_item(self.name))
        for i in range(self.chunks):
            if self.die_after is not None and i == self.die_after:
                await _crash(request)
                return resp
            await resp.write(fr.delta(self.name, i))
            rec.chunks_sent += 1
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
        if not self.skip_done:
            await resp.write(fr.closing(self.name, rec.body, self.chunks, self.finish_reason))
        await resp.write_eof()
        return resp


async def _crash(request: web.Request) -> None:
    """The connection cut mid-answer; the chunks written reach the proxy first (a crash,
    not a lost write buffer)."""
    await asyncio.sleep(0.1)
    assert request.transport is not None
    request.transport.abort()
    await asyncio.sleep(0)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(name: str, chat: bool, i: int, finish: str | None) -> dict[str, Any]:
    if chat:
        return {"id": f"chatcmpl-{name}", "object": "chat.completion.chunk", "created": 0,
                "model": "tiny",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": f"t{i} "},
                             "finish_reason": finish}]}
    return {"id": f"cmpl-{name}", "object": "text_completion", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": finish}]}


def _full(name: str, chat: bool, finish: str, max_tokens: int | None) -> dict[str, Any]:
    text = "t0" if max_tokens == 1 else "t0 t1 t2 t3"
    usage = {"prompt_tokens": 5, "completion_tokens": 1 if max_tokens == 1 else 4}
    if chat:
        return {"id": f"chatcmpl-{name}", "object": "chat.completion", "created": 0,
                "model": "tiny", "usage": usage,
                "choices": [{"index": 0, "finish_reason": finish,
                             "message": {"role": "assistant", "content": text}}]}
    return {"id": f"cmpl-{name}", "object": "text_completion", "created": 0, "model": "tiny",
            "usage": usage, "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
