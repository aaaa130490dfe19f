"""The lock-free hot-path metrics export as Prometheus expects."""

from __future__ import annotations

from appliance.proxy.metrics import FastHistogram, ProxyMetrics


def test_histogram_buckets_are_cumulative_and_le() -> None:
    h = FastHistogram("x_seconds", "x", bounds=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    fam = h.family()
    buckets = {s.labels["le"]: s.value for s in fam.samples if s.name == "x_seconds_bucket"}
    assert buckets == {"0.1": 2, "1.0": 4, "+Inf": 5}
    sums = {s.name: s.value for s in fam.samples}
    assert sums["x_seconds_count"] == 5 and abs(sums["x_seconds_sum"] - 4.65) < 1e-9


def test_exposition() -> None:
    m = ProxyMetrics(in_flight=lambda: 7)
    m.count_request("/v1/completions", 200)
    m.count_request("/v1/completions", 200)
    m.count_request("/v1/chat/completions", 502)
    m.prefill_latency.observe(0.2)
    text = m.render().decode()
    assert 'pd_proxy_requests_total{route="/v1/completions",status="200"} 2.0' in text
    assert 'pd_proxy_requests_total{route="/v1/chat/completions",status="502"} 1.0' in text
    assert "pd_proxy_requests_in_flight 7.0" in text
    assert 'pd_proxy_prefill_seconds_bucket{le="0.25"} 1.0' in text
    assert "# TYPE pd_proxy_decode_ttfb_seconds histogram" in text
