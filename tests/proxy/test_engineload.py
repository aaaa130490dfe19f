"""Other proxies' work on the same engines (appliance.proxy.nodes.engineload): the engines'
own gauges, less this proxy's requests, count in `auto`'s estimates."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.nodes.backends import Backend, Backends
from appliance.proxy.nodes.engineload import LoadPoller, engine_counts, kv_loads, others
from appliance.proxy.placement import Placement
from appliance.proxy.settings import ProxySettings

# As vLLM 0.32 writes them: one series per engine of a data-parallel server.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 9.0
vllm:num_requests_swapped 7
"""


def test_engine_counts_sum_the_engines_and_skip_other_series() -> None:
    assert engine_counts(METRICS) == (5, 4)
    assert engine_counts("vllm:num_requests_running 1\n") == (1, 0)
    assert engine_counts("# nothing of vLLM's\nprocess_cpu_seconds_total 3.0\n") is None
    assert engine_counts("") is None


def test_kv_loads_count_what_has_not_finished() -> None:
    text = ('vllm:num_requests_kv_fetch_by_stage{engine="0",stage="waiting_to_start"} 1.0\n'
            'vllm:num_requests_kv_fetch_by_stage{engine="0",stage="in_progress"} 2.0\n'
            'vllm:num_requests_kv_fetch_by_stage{engine="0",stage="completed_waiting"} 5.0\n')
    assert kv_loads(text) == 3
    assert kv_loads("vllm:num_requests_running 1\n") is None


def test_others_are_what_the_engine_holds_beyond_this_proxys() -> None:
    assert others(running=5, waiting=4, own=3) == (4, 2)  # waiting first: ours may run
    assert others(running=5, waiting=0, own=3) == (0, 2)
    assert others(running=2, waiting=1, own=6) == (0, 0)  # ours not arrived yet
    assert others(running=0, waiting=0, own=0) == (0, 0)


def _trained(**load: int) -> tuple[Placement, Backend, Backend]:
    """Prefills 1 ms a token, a free handoff, D busy with a prefill of 1,500 tokens; P as
    loaded."""
    place = Placement("auto", itl_slo_ms=None)
    for n in (100, 1000):
        place.prefill.observe(n, n * 0.001)
    place.handoff.observe(100, 0.0)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d", prefill_tokens=1500)
    for k, v in load.items():
        setattr(p, k, v)
    return place, p, d


def test_another_proxys_queue_on_p_sends_requests_to_d() -> None:
    """Idle as far as this proxy knows, P is sooner (remote). With four prompts another
    proxy sent waiting on P's engine, each as long as the recent ones, D is."""
    body = {"prompt": list(range(1000))}
    place, p, d = _trained()
    assert place.choose(body, "/v1/completions", p, d)[0].where == "remote"
    place, p, d = _trained(others_waiting=4)
    place.work.observe(1000)
    decision, ticket, _ = place.choose(body, "/v1/completions", p, d)
    assert decision.where == "local"
    assert decision.estimates is not None and decision.estimates.remote_s == pytest.approx(
        place.prefill.predict(5000))
    assert ticket.ahead == 1500  # D's queue


def test_another_proxys_decodes_on_d_count_as_running() -> None:
    place, p, d = _trained()
    d.others_running = 3
    e = place.estimates(100, p, d, 0.0)
    assert e.decodes_running == 3 and e.placed() == (0, 3)


@pytest.fixture
async def engine() -> tuple[str, dict]:
    state = {"text": METRICS, "status": 200, "during": None}

    async def metrics(_req: web.Request) -> web.Response:
        if state["during"] is not None:  # what happens in the proxy while this is rendered
            state["during"]()
        return web.Response(text=state["text"], status=state["status"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", state
    await runner.cleanup()


async def test_each_reading_stands_alone_less_what_was_ours_during_it(engine) -> None:
    url, state = engine
    backends = Backends(ProxySettings(prefill=[], decode=[{"url": url}]), ProxyMetrics())
    d = backends.decode[0]
    d.healthy, d.in_flight = True, 3
    async with aiohttp.ClientSession() as http:
        poller = LoadPoller(backends, http, {}, 1.0, 2.0)
        await poller.poll_once()
        assert (d.others_waiting, d.others_running) == (4, 2)
        # Another proxy's load rises: seen at the very next reading.
        state["text"] = METRICS.replace("} 3.0", "} 6.0")
        await poller.poll_once()
        assert (d.others_waiting, d.others_running) == (4, 5)
        # Three of ours end while the engine renders its gauges (counted there): the count
        # as the read began is ours, not another proxy's.
        state["during"] = lambda: setattr(d, "in_flight", 0)
        await poller.poll_once()
        assert d.in_flight == 0 and (d.others_waiting, d.others_running) == (4, 5)
        state["during"] = None
        state["text"] = METRICS.replace("} 3.0", "} 0.0").replace("} 2.0", "} 0.0")
        await poller.poll_once()
        assert (d.others_waiting, d.others_running) == (4, 0)
        state["status"] = 500  # no reading: nothing counted
        await poller.poll_once()
        assert (d.others_waiting, d.others_running) == (0, 0)
        assert d.describe()["others"] == {"waiting": 0, "running": 0}
