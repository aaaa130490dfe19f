"""The proxy's health checks: every interval each P's /health and its sidecar's /query
(the engine ids), each D's /health (and /v1/models once, for its max_model_len); a node
discovery adds is checked at once. Results land in Backends.set_health, the one place a
node's health changes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence

import aiohttp

from appliance.bootstrap.wire import decode_query
from appliance.proxy.nodes.backends import Backend, Backends, PrefillBackend
from appliance.proxy.settings import DecodeNode, PrefillNode, ProxySettings

log = logging.getLogger("appliance.proxy.nodes.health")


class HealthPoller:
    """Every interval: each P's /health then its bootstrap's /query, each D's /health."""

    def __init__(self, backends: Backends, session: aiohttp.ClientSession,
                 settings: ProxySettings, headers: dict[str, str]) -> None:
        self.backends = backends
        self.session = session
        self.interval = settings.health_interval_s
        self.timeout = aiohttp.ClientTimeout(total=settings.health_timeout_s)
        self.headers = headers  # for P and D (vLLM's --api-key)
        self.bootstrap_headers = ({"Authorization": f"Bearer {settings.bootstrap_token}"}
                                  if settings.bootstrap_token else None)
        self._task: asyncio.Task[None] | None = None
        self._first_checks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="proxy-health-poller")

    async def stop(self) -> None:
        for task in list(self._first_checks):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    def reconcile(self, prefill: Sequence[PrefillNode], decode: Sequence[DecodeNode]) -> None:
        """Membership from discovery, and each new node checked now, not at the next round:
        in a rollout the node it replaces leaves moments after the new one is Ready, and
        until the new one's first check passes no node of that role would be in rotation."""
        for b in self.backends.reconcile(prefill, decode):
            check = (self._check_prefill(b) if isinstance(b, PrefillBackend)
                     else self._check_decode(b))
            task = asyncio.create_task(check, name=f"proxy-health-first-{b.role}")
            self._first_checks.add(task)
            task.add_done_callback(self._first_checks.discard)

    async def poll_once(self) -> None:
        # The nodes known now: ones added since the last round are checked, dropped ones not.
        self.backends.sweep()
        checks = [self._check_prefill(b) for b in self.backends.prefill]
        checks += [self._check_decode(b) for b in self.backends.decode]
        await asyncio.gather(*checks)

    async def _get(self, url: str, headers: dict[str, str] | None = None) -> bytes:
        async with self.session.get(url, timeout=self.timeout, headers=headers) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {url} answered {resp.status}")
            return body

    async def _check_decode(self, b: Backend) -> None:
        try:
            await self._get(f"{b.url}/health", self.headers)
        except Exception as exc:  # noqa: BLE001 - any failure takes the node out
            b.max_model_len = None  # a restarted node may serve another length
            self.backends.set_health(b, False, _reason(exc))
            return
        self.backends.set_health(b, True)
        if b.max_model_len is None:
            try:
                b.max_model_len = _max_model_len(
                    await self._get(f"{b.url}/v1/models", self.headers))
            except Exception as exc:  # noqa: BLE001 - only an optimisation depends on it
                log.debug("decode %s: no max_model_len from /v1/models: %s", b.url, exc)

    async def _check_prefill(self, b: PrefillBackend) -> None:
        try:
            await self._get(f"{b.url}/health", self.headers)
        except Exception as exc:  # noqa: BLE001
            # A restarted P registers a new engine id: forget the old ones.
            self.backends.set_health(b, False, _reason(exc), engine_ids={})
            return
        try:
            answer = decode_query(await self._get(f"{b.bootstrap_url}/query",
                                                  self.bootstrap_headers))
            engine_ids = {int(rank): view.engine_id for rank, view in answer.items()}
            side_channels = {int(rank): [addr for pps in view.worker_addr.values()
                                         for addr in pps.values()]
                             for rank, view in answer.items()}
        except Exception as exc:  # noqa: BLE001
            self.backends.set_health(b, True, f"bootstrap: {_reason(exc)}", engine_ids={})
            return
        error = None if engine_ids else "bootstrap knows no engine id yet"
        self.backends.set_health(b, True, error, engine_ids=engine_ids,
                                 side_channels=side_channels)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def _max_model_len(raw: bytes) -> int | None:
    """The smallest `max_model_len` vLLM's /v1/models lists (None: none listed)."""
    data = json.loads(raw).get("data") or []
    lengths = [m["max_model_len"] for m in data
               if isinstance(m, dict) and type(m.get("max_model_len")) is int]
    return min(lengths) if lengths else None
