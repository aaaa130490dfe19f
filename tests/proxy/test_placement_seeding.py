"""`auto` from the first request (appliance.proxy.placement.seeding): a proxy in front of a
P with history reads it from P's metrics; a fresh P is timed at start; either way the
first request is placed by measurement, not `unmeasured`."""

from __future__ import annotations

import pytest

from appliance.proxy.placement.priors import engine_history
from tests.proxy.conftest import Cluster, MakeCluster


def _histograms(count: int, tokens: float, seconds: float, engines: int = 1) -> str:
    """P's two prefill histograms as vLLM 0.32 writes them, the same numbers for each of
    `engines` label sets (data-parallel engines)."""
    out = []
    for name, total in (("vllm:request_prefill_time_seconds", seconds),
                        ("vllm:request_prefill_kv_computed_tokens", tokens)):
        out += [f"# HELP {name} x", f"# TYPE {name} histogram"]
        for engine in range(engines):
            labels = f'engine="{engine}",model_name="tiny"'
            out += [f'{name}_bucket{{{labels},le="+Inf"}} {count}.0',
                    f"{name}_count{{{labels}}} {count}.0", f"{name}_sum{{{labels}}} {total}"]
    return "\n".join(out) + "\n"


def test_an_engines_history_is_summed_over_its_label_sets() -> None:
    history = engine_history(_histograms(3, 1200.0, 0.6))
    assert history.prefills == 3 and history.mean() == pytest.approx((400.0, 0.2))
    assert engine_history(_histograms(3, 1200.0, 0.6, engines=2)) == engine_history(
        _histograms(6, 2400.0, 1.2))
    assert engine_history("").mean() is None
    assert engine_history(_histograms(0, 0.0, 0.0)).prefills == 0


async def _seeded(c: Cluster) -> dict:
    async def done() -> bool:
        return (await c.status())["split"]["prefill"]["samples"] > 0
    await c.wait_for(done)
    return (await c.status())["split"]["prefill"]


async def _first_decision(c: Cluster) -> str:
    status, _, _ = await c.post()
    assert status == 200
    metrics = await c.metrics()
    return next(line for line in metrics.splitlines()
                if line.startswith("pd_proxy_split_decisions_total{") and line.endswith(" 1.0"))


async def test_a_restarted_proxy_reads_ps_history_and_places_its_first_request(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(split="auto", ready=False)
    c.prefill[0].metrics_text = _histograms(40, 40 * 500.0, 40 * 0.25)
    await c.wait_ready()
    prefill = await _seeded(c)
    assert prefill["samples"] == 1 and prefill["per_1k_tokens_ms"] == pytest.approx(500.0)
    assert c.upstream_requests() == 0  # nothing was sent to time it
    assert 'reason="unmeasured"' not in await _first_decision(c)


async def test_a_fresh_p_is_timed_at_start_through_the_split(
        make_cluster: MakeCluster) -> None:
    """A warm-up and four timed prompts, each prefilled on P and pulled by D: the prefill
    line from P's answers, the handoff from D's after them."""
    c = await make_cluster(split="auto", ready=False)
    c.prefill[0].metrics_text = _histograms(0, 0.0, 0.0)
    await c.wait_ready()
    await _seeded(c)
    split = (await c.status())["split"]
    assert split["prefill"]["samples"] == 4 and split["handoff"]["samples"] == 4
    on_p = [r for r in c.prefill[0].received if r.headers["X-Request-Id"].startswith("calib")]
    on_d = [r for r in c.decode[0].received if r.headers["X-Request-Id"].startswith("calib")]
    assert len(on_p) == len(on_d) == 5  # the warm-up is not timed
    for p_call, d_call in zip(on_p, on_d, strict=True):
        assert p_call.body["max_tokens"] == 1 and p_call.body["model"] == "tiny"
        assert p_call.kv is not None and p_call.kv["do_remote_decode"] is True
        assert d_call.kv is not None and d_call.kv["do_remote_prefill"] is True
        assert d_call.kv["transfer_id"] == p_call.kv["transfer_id"]
        assert d_call.kv["remote_engine_id"] == "engine-p0-dp0"
    assert 'reason="unmeasured"' not in await _first_decision(c)


@pytest.mark.parametrize("metrics,calibrate", [(None, True), ("fresh", False)])
async def test_without_metrics_or_calibration_nothing_is_sent(
        make_cluster: MakeCluster, metrics: str | None, calibrate: bool) -> None:
    c = await make_cluster(split="auto", ready=False, calibrate=calibrate)
    c.prefill[0].metrics_text = None if metrics is None else _histograms(0, 0.0, 0.0)
    await c.wait_ready()
    assert 'reason="unmeasured"' in await _first_decision(c)
    assert len(c.prefill[0].received) == 1  # the request itself, remote
