"""`pdctl top`'s arithmetic (rates and quantiles over a window), its frame, and its errors.
The view on a loaded real node, in a terminal: tests/e2e/test_pd_top.py."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from appliance.httperrors import request_outcome
from appliance.pdctl.top.view import NodeSample, Sample, frame, quantile, render
from tests.conftest import free_port
from tests.pdctl.conftest import error_lines

INF = math.inf


@pytest.mark.parametrize("cumulative,q,want", [
    ({0.1: 0, 0.2: 10, INF: 10}, 0.5, 0.15),     # halfway into the bucket (0.1, 0.2]
    ({0.1: 5, 0.2: 10, INF: 10}, 0.5, 0.1),      # the rank is the first bucket's top
    ({0.1: 0, 0.2: 0, INF: 4}, 0.99, 0.2),       # past the last bound: the bound
    ({0.1: 0, INF: 0}, 0.5, None),               # nothing observed
    ({}, 0.5, None),
])
def test_quantile_as_prometheus_interpolates(cumulative, q, want) -> None:
    got = quantile(cumulative, q)
    assert got == (None if want is None else pytest.approx(want))


def _hist(name: str, counts: dict[str, float], path: str = "split"):
    return [(f"{name}_bucket", {"le": le, "path": path}, n) for le, n in counts.items()]


def test_a_frame_is_the_window_between_two_samples() -> None:
    ttft = "pd_proxy_client_ttft_seconds"
    a_proxy = [("pd_proxy_requests_total", {"route": "/v1/completions", "status": "200"}, 100.0),
               ("pd_proxy_requests_total", {"route": "/v1/completions", "status": "502"}, 1.0),
               *_hist(ttft, {"0.05": 90, "0.1": 100, "+Inf": 100})]
    b_proxy = [("pd_proxy_requests_total", {"route": "/v1/completions", "status": "200"}, 120.0),
               ("pd_proxy_requests_total", {"route": "/v1/completions", "status": "502"}, 2.0),
               # clients that hung up: neither answered nor an error of the node's
               ("pd_proxy_requests_total", {"route": "/v1/completions", "status": "499"}, 7.0),
               ("pd_proxy_requests_in_flight", {}, 3.0),
               *_hist(ttft, {"0.05": 90, "0.1": 110, "+Inf": 110}),
               *_hist(ttft, {"0.05": 0, "0.1": 10, "+Inf": 10}, path="local")]
    p = [("vllm:pd_kv_transfers_total", {}, 10.0), ("vllm:pd_kv_transfer_bytes_total", {}, 0.0),
         ("vllm:kv_cache_usage_perc", {}, 0.25)]
    p2 = [("vllm:pd_kv_transfers_total", {}, 30.0),
          ("vllm:pd_kv_transfer_bytes_total", {}, 4e9), ("vllm:kv_cache_usage_perc", {}, 0.5)]
    status = {"split": {"policy": "auto", "last_minute": {"remote": 3, "local": 4}}}
    a = Sample(0.0, a_proxy, status, [NodeSample("prefill", "http://p", True, 1, p),
                                      NodeSample("decode", "http://d", True, 2, None)])
    b = Sample(2.0, b_proxy, status, [NodeSample("prefill", "http://p", True, 1, p2),
                                      NodeSample("decode", "http://d", False, 2, None)])
    f = frame(a, b)
    assert f["requests_per_s"] == 10 and f["errors_per_s"] == 0.5
    # The window's 20 first tokens, all in (0.05, 0.1]: not the 90 fast ones before it.
    assert 50 < f["ttft_p50_ms"] <= 100 and f["itl_p50_ms"] is None
    assert f["in_flight"] == 3 and (f["prefill_in_flight"], f["decode_in_flight"]) == (1, 2)
    p_node, d_node = f["nodes"]
    assert p_node["transfers_per_s"] == 10 and p_node["transfer_gb_per_s"] == 2.0
    assert p_node["kv_usage"] == 0.5
    assert d_node == {"role": "decode", "url": "http://d", "in_rotation": False,
                      "in_flight": 2, "up": False}
    assert "3 remote" in f["split"]
    console = Console(width=160, record=True)
    console.print(render(f, "http://proxy"))
    text = console.export_text()
    assert "10.0" in text and "http://p" in text and "50.0" in text  # req/s, P's KV %


def test_a_proxy_that_does_not_answer_is_one_line(pdctl) -> None:
    res = pdctl("top", "--proxy", f"http://127.0.0.1:{free_port()}", "--once")
    assert res.exit_code == 1
    (line,) = error_lines(res)
    assert line.startswith("pdctl: error: cannot read the proxy at http://127.0.0.1:")


@pytest.mark.parametrize("args,message", [
    (("--interval", "0"), "--interval must be positive"),
    (("--proxy", "http://x", "--local"), "give one of --proxy"),
])
def test_bad_flags_are_one_line(pdctl, args, message) -> None:
    res = pdctl("top", *args)
    assert res.exit_code == 2
    (line,) = error_lines(res)
    assert message in line


def test_a_client_that_hung_up_is_counted_apart() -> None:
    assert [request_outcome(s) for s in (200, "204", 499, "499", 400, 502, "")] == \
        ["ok", "ok", "cancelled", "cancelled", "failed", "failed", "failed"]
