"""Prometheus metrics, on a registry of their own so several proxies can live in one process.

The per-request ones (request counts, the two latency histograms, in-flight) are plain
Python numbers turned into metric families at scrape time: prometheus_client's own take a
lock per update, a visible cost at thousands of requests per second on one event loop.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


class FastHistogram:
    """observe() is a bisect and two additions; exported cumulatively at scrape time."""

    __slots__ = ("name", "doc", "bounds", "counts", "total")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self) -> HistogramMetricFamily:
        buckets, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.total)


class _HotPath(Collector):
    def __init__(self, metrics: ProxyMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        requests = CounterMetricFamily("pd_proxy_requests", "Requests by route and final status",
                                       labels=["route", "status"])
        for (route, status), n in sorted(m.request_counts.items()):
            requests.add_metric([route, str(status)], n)
        yield requests
        yield GaugeMetricFamily("pd_proxy_requests_in_flight", "Generation requests being served",
                                value=m.in_flight())
        split = CounterMetricFamily(
            "pd_proxy_split_decisions",
            "Where requests were prefilled (adaptive disaggregation), by decision (remote: "
            "P, then its KV to D; local: D alone) and reason (policy, unmeasured, "
            "itl_budget, backlog, sooner)", labels=["decision", "reason"])
        for (decision, reason), n in sorted(m.split_counts.items()):
            split.add_metric([decision, reason], n)
        yield split
        yield m.decode_ttfb.family()
        yield m.prefill_latency.family()


class ProxyMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, in_flight: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.in_flight = in_flight
        self.request_counts: dict[tuple[str, int], int] = {}
        self.split_counts: dict[tuple[str, str], int] = {}  # the placement's, shared
        self.decode_ttfb = FastHistogram(
            "pd_proxy_decode_ttfb_seconds",
            "From the client's request to the answer's first body byte (D's, or P's token "
            "when it leads the stream)")
        self.prefill_latency = FastHistogram("pd_proxy_prefill_seconds",
                                             "P's answer time (prefill + one token)")
        r.register(_HotPath(self))
        self.fallbacks = Counter("pd_proxy_prefill_fallbacks",
                                 "Requests served by D alone, by reason", ["reason"], registry=r)
        self.first_token = Counter(
            "pd_proxy_first_token",
            "Streaming requests by who gave the first token: prefill_led (P's token, then D), "
            "prefill_only (P's token ended the answer), decode (classic split: request not "
            "eligible, or P's answer could not lead)", ["outcome"], registry=r)
        self.kv_releases = Counter(
            "pd_proxy_kv_releases",
            "Releases of P's KV that no decode node would pull (D refused or never got the "
            "request, or the client left first), by outcome: sent, failed, no_address (P's "
            "side channel unknown; P frees after its send_timeout_s), refused (P's side "
            "channel refused the proxy's CURVE handshake)", ["outcome"], registry=r)
        self.overloaded = Counter(
            "pd_proxy_overloaded",
            "Requests answered 429 because every decode node was full "
            "(max_in_flight_per_decode), by reason: queue_full, queue_timeout", ["reason"],
            registry=r)
        self.upstream_errors = Counter("pd_proxy_upstream_errors",
                                       "Failed upstream requests by backend and kind",
                                       ["role", "backend", "kind"], registry=r)
        self.prefix_hits = Counter(
            "pd_proxy_prefix_predicted_hits",
            "Prompt tokens the prefix index predicted cached on the node that computes the "
            "prompt (compare with the node's vllm:prefix_cache_hits)", ["role", "backend"],
            registry=r)
        self.prefix_queries = Counter(
            "pd_proxy_prefix_predicted_queries",
            "Prompt tokens sent to be computed, per node (compare with the node's "
            "vllm:prefix_cache_queries)", ["role", "backend"], registry=r)
        self.backend_up = Gauge("pd_proxy_backend_up", "1 when the node is in rotation",
                                ["role", "backend"], registry=r)
        self.membership = Counter(
            "pd_proxy_backend_membership_changes",
            "Changes of the proxy's node set (static settings at start, or discovery), by "
            "role and change: added, removed (out of rotation, its requests finish), "
            "returned (added again before it was dropped), dropped (left, nothing in flight)",
            ["role", "change"], registry=r)
        self.backends_known = Gauge("pd_proxy_backends",
                                    "Nodes the proxy knows, by role (leaving ones included)",
                                    ["role"], registry=r)

    def count_request(self, route: str, status: int) -> None:
        key = (route, status)
        self.request_counts[key] = self.request_counts.get(key, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
