"""Fixtures of the connector tests: a real bootstrap sidecar on loopback; a clean
MC_FORCE_TCP around each test."""

from __future__ import annotations

import pytest
from aiohttp import web

from appliance.bootstrap import BootstrapSettings, build_app


@pytest.fixture(autouse=True)
def no_force_tcp(monkeypatch) -> None:
    """A tcp transport sets MC_FORCE_TCP in this process (transfers.mooncake): each test
    starts without it, and what it set is undone after."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)


@pytest.fixture
async def bootstrap_url():
    runner = web.AppRunner(build_app(BootstrapSettings(ttl=0)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001
    await runner.cleanup()
