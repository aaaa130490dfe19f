"""A real Prometheus scraping a loaded real node (proxy, P and D, with the shipped alert
rules): every query of the Grafana dashboard returns data, and no alert fires."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

from appliance.observability.dashboard import PANELS
from tests.e2e.observe import stream_load
from tests.observability.conftest import prometheus_bin, running_prometheus  # noqa: F401


def _host(url: str) -> str:
    return url.removeprefix("http://")


async def test_every_dashboard_query_returns_data(pd_node, prometheus_bin: Path,  # noqa: F811
                                                  tmp_path: Path) -> None:
    s = pd_node.spec
    targets = {"proxy": [_host(s.proxy_url)], "prefill": [_host(s.prefill_url)],
               "decode": [_host(s.decode_url)]}
    with running_prometheus(prometheus_bin, tmp_path, targets) as prom:
        stop = asyncio.Event()
        load = asyncio.create_task(stream_load(s.proxy_url, stop))
        try:
            await asyncio.sleep(8)  # several scrapes under load: rates over them
            missing = []
            for panel in PANELS:
                for q in panel.queries:
                    result = await asyncio.to_thread(prom.query, q.expr)
                    values = [float(r["value"][1]) for r in result]
                    if not values or all(math.isnan(v) for v in values):
                        missing.append(f"{panel.title}: {q.expr} -> {result}")
            assert not missing, "dashboard queries without data:\n" + "\n".join(missing)
            up = await asyncio.to_thread(prom.query, "up")
            assert len(up) == 3 and all(r["value"][1] == "1" for r in up), up
            firing = {k: v for k, v in (await asyncio.to_thread(prom.alerts)).items()}
            assert not firing, firing
        finally:
            stop.set()
            await load
