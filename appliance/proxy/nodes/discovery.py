"""Kubernetes discovery (`--discovery kubernetes`): P and D are the Ready pods that two
label selectors match in one namespace; every change feeds `Backends.reconcile`.

Why a hand-written list and watch rather than the `kubernetes` client package: it is one
resource and two calls (list the pods, then watch them as JSON lines), and aiohttp is
already the proxy's HTTP stack, so a large client (with its own threads, or an asyncio
fork of it) would add to the slim image for little. Pods rather than EndpointSlices: the
core v1 Pods API is the same on every Kubernetes version (1.20 included), and a pod says
itself whether it is Ready, has an IP, or is terminating.

Per selector: `GET /api/v1/namespaces/NS/pods?labelSelector=...`, then a watch from that
list's resourceVersion (with bookmarks, which only move the resourceVersion on). A watch
the server ends (its timeoutSeconds) is resumed from the last resourceVersion seen; a 410
Gone (an HTTP status or an ERROR event: the version expired), any other error or a dropped
stream leads to a fresh list after a back-off that doubles up to `retry_max_s`. While the
API server cannot be reached the last known set stays: a broken watch never empties the
rotation (the health checks still take dead nodes out of it).

A pod is a backend when it has a podIP, no deletionTimestamp and a Ready condition True:
P as `http://IP:prefill_port` with its sidecar at `http://IP:bootstrap_port`, D as
`http://IP:decode_port`. The bearer token is re-read whenever its file changes (bound
service account tokens rotate, the kubelet swaps the file) and after a 401.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from appliance.netaddr import host_port
from appliance.proxy.settings import DecodeNode, KubernetesSettings, PrefillNode

log = logging.getLogger("appliance.proxy.nodes.discovery")

Node = PrefillNode | DecodeNode
Reconcile = Callable[[list[PrefillNode], list[DecodeNode]], None]

_RETRY_MIN_S = 0.5
_LIST_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=10)
_MAX_LINE = 16 << 20  # one watch event (a pod object is a few KiB)


class Gone(Exception):
    """The resourceVersion expired (410): list again."""


class TokenFile:
    """The bearer token, read again when the file changes (inode, mtime or size)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._token = ""

    def read(self) -> str:
        st = os.stat(self.path)  # follows the kubelet's ..data symlink
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            with open(self.path) as fh:
                self._token = fh.read().strip()
            if self._stamp is not None:
                log.info("kubernetes: token file %s changed: using the new token", self.path)
            self._stamp = stamp
        return self._token

    def forget(self) -> None:
        """Read it afresh next time (the API server refused it)."""
        self._stamp = None


class ApiClient:
    """GETs against the API server with the current token."""

    def __init__(self, k8s: KubernetesSettings) -> None:
        assert k8s.api_server is not None and k8s.namespace is not None  # resolved
        self.base = k8s.api_server
        self.pods_path = f"/api/v1/namespaces/{k8s.namespace}/pods"
        self.ca_file = k8s.ca_file
        self.token = TokenFile(k8s.token_file)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Made at first use, so a CA file mounted late is an error that is retried.
            tls = (ssl.create_default_context(cafile=self.ca_file)
                   if self.base.startswith("https://") else None)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=tls if tls is not None else True),
                cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    @asynccontextmanager
    async def get(self, params: dict[str, str],
                  timeout: aiohttp.ClientTimeout) -> AsyncIterator[aiohttp.ClientResponse]:
        headers = {"Authorization": f"Bearer {self.token.read()}",
                   "Accept": "application/json"}
        async with self._open().get(self.base + self.pods_path, params=params,
                                    headers=headers, timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone
            if resp.status != 200:
                if resp.status == 401:
                    self.token.forget()
                text = (await resp.text(errors="replace"))[:200].strip()
                raise RuntimeError(f"GET {self.base}{self.pods_path} answered {resp.status}: "
                                   f"{text}")
            yield resp

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def backend_of(pod: dict[str, Any], role: str,
               k8s: KubernetesSettings) -> tuple[Node | None, str]:
    """The node a pod is now, or None and why it is none."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None, "terminating"
    ip = status.get("podIP")
    if not ip:
        return None, "no pod IP"
    if not any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or ()):
        return None, "not Ready"
    if role == "prefill":
        return PrefillNode(url=f"http://{host_port(ip, k8s.prefill_port)}",
                           bootstrap_url=f"http://{host_port(ip, k8s.bootstrap_port)}"), "Ready"
    return DecodeNode(url=f"http://{host_port(ip, k8s.decode_port)}"), "Ready"


class PodWatch:
    """One role's pods: list, watch, list again; `nodes` is pod name -> node."""

    def __init__(self, role: str, selector: str, k8s: KubernetesSettings, api: ApiClient,
                 on_change: Callable[[], None]) -> None:
        self.role = role
        self.selector = selector
        self.k8s = k8s
        self.api = api
        self.on_change = on_change
        self.nodes: dict[str, Node] = {}

    async def run(self) -> None:
        first = min(_RETRY_MIN_S, self.k8s.retry_max_s)
        delay = first
        while True:
            try:
                version = await self._list()
                delay = first
                while True:  # the server ends each watch after watch_timeout_s: resume
                    started = asyncio.get_running_loop().time()
                    version = await self._watch(version)
                    if asyncio.get_running_loop().time() - started < 1.0:
                        await asyncio.sleep(_RETRY_MIN_S)  # a server ending them at once
            except asyncio.CancelledError:
                raise
            except Gone:
                log.info("kubernetes: %s pods: resourceVersion expired (410): listing again",
                         self.role)
            except Exception as exc:  # noqa: BLE001 - any failure: keep the set, retry
                log.warning("kubernetes: %s pods (%s): %s; keeping the %d known, listing "
                            "again in %.1f s", self.role, self.selector, _reason(exc),
                            len(self.nodes), delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.k8s.retry_max_s)

    async def _list(self) -> str:
        async with self.api.get({"labelSelector": self.selector}, _LIST_TIMEOUT) as resp:
            body = await resp.json(content_type=None)
        pods = {p["metadata"]["name"]: backend_of(p, self.role, self.k8s)
                for p in body.get("items") or ()}
        for name in [n for n in self.nodes if n not in pods]:
            self._set(name, None, "gone")
        for name, (node, why) in pods.items():
            self._set(name, node, why)
        self.on_change()  # the whole set, after every list
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        params = {"labelSelector": self.selector, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self.k8s.watch_timeout_s)}
        # No total timeout: a watch lasts; a silence past the server's own end is a dead link.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10,
                                        sock_read=self.k8s.watch_timeout_s + 30)
        async with self.api.get(params, timeout) as resp:
            async for event in _json_lines(resp):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                meta = obj.get("metadata") or {}
                version = str(meta.get("resourceVersion") or version)
                if kind == "DELETED":
                    changed = self._set(meta.get("name", ""), None, "deleted")
                elif kind in ("ADDED", "MODIFIED"):
                    changed = self._set(meta.get("name", ""),
                                        *backend_of(obj, self.role, self.k8s))
                else:  # BOOKMARK: only the resourceVersion moves on
                    continue
                if changed:
                    self.on_change()
        return version

    def _set(self, name: str, node: Node | None, why: str) -> bool:
        old = self.nodes.get(name)
        if node == old:
            return False
        if node is None:
            assert old is not None
            del self.nodes[name]
            log.info("kubernetes: %s pod %s is no backend any more (%s): %s", self.role,
                     name, why, old.url)
        else:
            self.nodes[name] = node
            log.info("kubernetes: %s pod %s is Ready%s: %s", self.role, name,
                     f" (was {old.url})" if old else "", node.url)
        return True


async def _json_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """A watch's events, one JSON object a line (split here: a pod may outgrow aiohttp's
    line limit)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
        if len(buf) > _MAX_LINE:
            raise RuntimeError(f"a watch event over {_MAX_LINE} bytes")
    if buf.strip():
        yield json.loads(buf)


class KubernetesDiscovery:
    """Both roles' watches; each change hands the whole set to `reconcile`."""

    def __init__(self, k8s: KubernetesSettings, reconcile: Reconcile) -> None:
        assert k8s.prefill_selector and k8s.decode_selector  # checked by the settings
        self.api = ApiClient(k8s)
        self.reconcile = reconcile
        self.watches = [PodWatch("prefill", k8s.prefill_selector, k8s, self.api, self._push),
                        PodWatch("decode", k8s.decode_selector, k8s, self.api, self._push)]
        self._tasks: list[asyncio.Task[None]] = []

    def _push(self) -> None:
        nodes = [n for w in self.watches for n in w.nodes.values()]
        self.reconcile([n for n in nodes if isinstance(n, PrefillNode)],
                       [n for n in nodes if isinstance(n, DecodeNode)])

    def start(self) -> None:
        self._tasks = [asyncio.create_task(w.run(), name=f"k8s-discovery-{w.role}")
                       for w in self.watches]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.api.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
