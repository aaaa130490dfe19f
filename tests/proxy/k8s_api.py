"""A stand-in for the Kubernetes API server as the proxy's discovery uses it: core v1 pods
of one namespace, listed and watched by equality label selectors, on 127.0.0.1.

It keeps a resourceVersion counter and the event history a watch resumes from, sends
bookmarks when asked, can expire the history (a watch from before it gets an ERROR event
with code 410, as the real one sends), drop every watch stream mid-way, be stopped and
started again on the same port (an outage), and checks the bearer token (401 otherwise).
The one seam to swap for a real API server later.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.proxy.fakes import FakeServer


@dataclass
class _Watch:
    selector: dict[str, str]
    bookmarks: bool
    request: web.Request
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


def _parse_selector(raw: str) -> dict[str, str]:
    out = {}
    for term in filter(None, raw.split(",")):
        key, _, value = term.partition("=")
        out[key.strip()] = value.strip()
    return out


def _matches(selector: dict[str, str], pod: dict[str, Any]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class FakeKubeApi(FakeServer):
    def __init__(self, namespace: str = "pd", token: str = "token-1") -> None:
        super().__init__()
        self.namespace = namespace
        self.token = token  # the one accepted
        self.version = 1000
        self.pods: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, dict[str, Any], dict[str, Any]]] = []  # rv, event, pod
        self.oldest = 0  # a watch from before this resourceVersion is expired (410)
        self.watches: list[_Watch] = []
        self.lists = 0
        self.watch_starts = 0
        self.watched_from: list[int] = []  # each watch's resourceVersion
        self.refused = 0  # requests with a wrong token
        self.app = self._fresh_app()

    def _fresh_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(f"/api/v1/namespaces/{self.namespace}/pods", self._pods)
        return app

    # ---- what tests change -----------------------------------------------------------

    def set_pod(self, name: str, labels: dict[str, str], ip: str | None = None,
                ready: bool = True, terminating: bool = False) -> None:
        self.version += 1
        status: dict[str, Any] = {"phase": "Running" if ip else "Pending", "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"}]}
        if ip:
            status["podIP"] = ip
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": labels,
                                "resourceVersion": str(self.version), "uid": f"uid-{name}"}
        if terminating:
            meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
        kind = "MODIFIED" if name in self.pods else "ADDED"
        pod = self.pods[name] = {"kind": "Pod", "apiVersion": "v1", "metadata": meta,
                                 "spec": {}, "status": status}
        self._emit(kind, pod)

    def delete_pod(self, name: str) -> None:
        self.version += 1
        pod = self.pods.pop(name)
        pod["metadata"]["resourceVersion"] = str(self.version)
        self._emit("DELETED", pod)

    def bookmark(self) -> None:
        self.version += 1
        for w in self.watches:
            if w.bookmarks:
                w.queue.put_nowait({"type": "BOOKMARK", "object": {
                    "kind": "Pod", "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.version)}}})

    def expire(self) -> None:
        """Compact the history: every watch gets 410 Gone, and so does any resuming before
        now."""
        self.oldest = self.version + 1
        self.history.clear()
        for w in self.watches:
            w.queue.put_nowait(_gone())

    def drop_watches(self) -> None:
        """Cut every watch stream mid-way (no end of the chunked body)."""
        for w in list(self.watches):
            if w.request.transport is not None:
                w.request.transport.abort()
            w.queue.put_nowait(None)

    async def stop(self) -> None:
        self.drop_watches()  # else the server's shutdown waits for the streams
        await super().stop()

    def _emit(self, kind: str, pod: dict[str, Any]) -> None:
        event = {"type": kind, "object": pod}
        self.history.append((self.version, event, pod))
        for w in self.watches:
            if _matches(w.selector, pod):
                w.queue.put_nowait(event)

    # ---- the API -----------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.refused += 1
            return web.json_response({"kind": "Status", "status": "Failure", "code": 401,
                                      "reason": "Unauthorized"}, status=401)
        selector = _parse_selector(request.query.get("labelSelector", ""))
        if request.query.get("watch") in ("1", "true"):
            return await self._watch(request, selector)
        self.lists += 1
        return web.json_response({
            "kind": "PodList", "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.version)},
            "items": [p for p in self.pods.values() if _matches(selector, p)]})

    async def _watch(self, request: web.Request,
                     selector: dict[str, str]) -> web.StreamResponse:
        self.watch_starts += 1
        since = int(request.query["resourceVersion"])
        self.watched_from.append(since)
        timeout = float(request.query.get("timeoutSeconds", "3600"))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if since < self.oldest - 1:
            await resp.write(_line(_gone()))
            return resp
        w = _Watch(selector, request.query.get("allowWatchBookmarks") == "true", request)
        for rv, event, pod in self.history:
            if rv > since and _matches(selector, pod):
                w.queue.put_nowait(event)
        self.watches.append(w)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        try:
            while True:
                try:
                    event = await asyncio.wait_for(w.queue.get(), end - loop.time())
                except asyncio.TimeoutError:  # timeoutSeconds: the server ends the watch
                    await resp.write_eof()
                    return resp
                if event is None:
                    return resp
                await resp.write(_line(event))
                if event["type"] == "ERROR":  # as the real one: the watch ends there
                    await resp.write_eof()
                    return resp
        finally:
            self.watches.remove(w)


def _gone() -> dict[str, Any]:
    return {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
                                       "status": "Failure", "reason": "Expired", "code": 410,
                                       "message": "too old resource version"}}


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"
