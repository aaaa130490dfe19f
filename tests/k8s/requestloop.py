"""A bounded request loop through the proxy's Service while a test rolls, deletes or drains
pods (test_rollouts.py): streams and plain JSON, each answer checked token for token.

`RequestLoop` runs in a thread of its own (its own event loop) from `with` until the block
ends, `max_s` passed or `max_requests` were sent, whichever comes first. A fresh connection
per request: each goes through the Service's load balancing as a new client's would, so a
pod leaving the endpoints (or one still in them while it stops) shows at once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


class Failed(RuntimeError):
    """One request's failure, with the proxy's request id (to find it in the pods' logs)."""

    def __init__(self, message: str, request_id: str | None) -> None:
        super().__init__(message)
        self.request_id = request_id


async def _answer(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                  want: str) -> None:
    """One completion or chat answer, streamed or not, checked against `want`; raises
    Failed (naming the proxy's request id) on any failure."""
    chat = url.endswith("/chat/completions")
    async with http.post(url, json=body) as r:
        rid = r.headers.get("X-Request-Id")
        try:
            got, detail = await _text(r, body, chat)
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError,
                KeyError) as exc:
            raise Failed(f"request_id={rid} {type(exc).__name__}: {exc}", rid) from exc
        if got != want:
            raise Failed(f"request_id={rid} answer differs ({detail}): {got!r} != {want!r}",
                         rid)


async def _text(r: aiohttp.ClientResponse, body: dict[str, Any], chat: bool
                ) -> tuple[str, str]:
    """The answer's text and, for a plain JSON one, its finish reason and token count."""
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
    if not body.get("stream"):
        data = await r.json()
        choice = data["choices"][0]
        detail = (f"finish_reason={choice.get('finish_reason')} "
                  f"usage={data.get('usage')}")
        return (choice["message"]["content"] if chat else choice["text"]), detail
    pieces, done = [], False
    async for raw in r.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices", []):
                pieces.append((choice.get("delta") or {}).get("content") or ""
                              if chat else choice.get("text") or "")
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(pieces), "stream"


@dataclass
class Outcome:
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    failed_at: list[float] = field(default_factory=list)  # time.monotonic() of each failure
    failed_ids: list[str | None] = field(default_factory=list)  # the proxy's X-Request-Id
    latencies: list[float] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return len(self.failures)

    @property
    def baseline_s(self) -> float:
        """The median latency of the first ten answers (before the event, mostly)."""
        first = sorted(self.latencies[:10])
        return first[len(first) // 2] if first else 0.0

    @property
    def worst_added_s(self) -> float:
        return max(self.latencies, default=0.0) - self.baseline_s


class RequestLoop:
    def __init__(self, proxy: str, requests: list[tuple[str, dict[str, Any], str]],
                 concurrency: int = 2, max_s: float = 600, max_requests: int = 5000,
                 timeout_s: float = 120) -> None:
        self.proxy, self.requests, self.concurrency = proxy, requests, concurrency
        self.max_s, self.max_requests, self.timeout_s = max_s, max_requests, timeout_s
        self.outcome = Outcome()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()),
                                        name="request-loop", daemon=True)

    def __enter__(self) -> RequestLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 30)

    def wait_answers(self, n: int, within: float = 120) -> None:
        """Until n requests were answered (the loop is warm, before the event)."""
        deadline = time.monotonic() + within
        while len(self.outcome.latencies) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(self.outcome.latencies)} answers in "
                                     f"{within:.0f} s: {self.outcome.failures[:3]}")
            time.sleep(0.2)

    async def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        out = self.outcome

        def more() -> bool:
            return (out.sent < self.max_requests and time.monotonic() < deadline
                    and not self._stop.is_set())

        async def client(http: aiohttp.ClientSession, i: int) -> None:
            while more():
                path, body, want = self.requests[i % len(self.requests)]
                i += 1
                out.sent += 1
                start = time.monotonic()
                try:
                    await _answer(http, self.proxy + path, body, want)
                except (Failed, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    out.failures.append(f"{path} stream={bool(body.get('stream'))}: "
                                        f"{type(exc).__name__}: {exc}"[:400])
                    out.failed_at.append(time.monotonic())
                    out.failed_ids.append(getattr(exc, "request_id", None))
                out.latencies.append(time.monotonic() - start)

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            await asyncio.gather(*(client(http, k * 3) for k in range(self.concurrency)))
