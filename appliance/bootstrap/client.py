"""Client of the bootstrap sidecar, used by prefill workers (register, refresh, delete) and by
decode workers (query). docs/protocol.md steps 4 and 20."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec

from appliance.bootstrap.wire import QueryAnswer, Registration, decode_query

log = logging.getLogger("appliance.bootstrap.client")


class BootstrapError(Exception):
    """The bootstrap sidecar could not be reached or refused a request."""


class BootstrapClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def register(self, reg: Registration) -> None:
        """One registration attempt; a 4xx answer (conflict, auth) is not worth retrying."""
        url = f"{self.base_url}/register"
        try:
            async with self._http().post(url, data=msgspec.json.encode(reg),
                                         headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    raise BootstrapError(f"{url} answered {resp.status}: {await _reason(resp)}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise BootstrapError(f"{url} unreachable: {exc!r}") from None

    async def register_with_retry(self, reg: Registration, attempts: int = 5,
                                  first_delay: float = 0.5, max_delay: float = 10.0) -> None:
        delay = first_delay
        for attempt in range(1, attempts + 1):
            try:
                await self.register(reg)
                return
            except BootstrapError as exc:
                if attempt == attempts:
                    raise
                log.warning("bootstrap register attempt %d/%d failed: %s; retrying in %.1fs",
                            attempt, attempts, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_delay)

    async def query(self) -> QueryAnswer:
        url = f"{self.base_url}/query"
        try:
            async with self._http().get(url) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise BootstrapError(f"{url} answered {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise BootstrapError(f"{url} unreachable: {exc!r}") from None
        try:
            return decode_query(body)
        except ValueError as exc:
            raise BootstrapError(str(exc)) from None

    async def delete(self, engine_id: str) -> None:
        url = f"{self.base_url}/engines/{engine_id}"
        try:
            async with self._http().delete(url) as resp:
                if resp.status not in (200, 404):
                    raise BootstrapError(f"{url} answered {resp.status}: {await _reason(resp)}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise BootstrapError(f"{url} unreachable: {exc!r}") from None


async def _reason(resp: aiohttp.ClientResponse) -> str:
    try:
        body = await resp.json(content_type=None)
        return body["error"]["message"]
    except Exception:  # noqa: BLE001 - any unreadable body: show its head
        return (await resp.text())[:200]
