"""Prometheus metrics, on a registry of their own so several proxies can live in one process.

The per-request ones (request counts, the latency and token histograms, in-flight) are
plain Python numbers turned into metric families at scrape time: prometheus_client's own
take a lock per update, a visible cost at thousands of requests per second on one event
loop (the ITL histogram is updated once per streamed chunk).

What the client felt is labelled by the request's path: split (P, then D from P's KV),
first_token (P's token led the stream), local (D alone, placed so), p_alone (P alone), and
d_alone (D alone after a fallback: no P, or P failed).
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
# Between two streamed tokens: a GPU's decode step is milliseconds, a stalled one seconds.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
               1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
                 131072)
PATHS = ("split", "first_token", "local", "p_alone", "d_alone")


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

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts by upper bound, as the exposition format has them."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out

    def family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.doc, buckets=self.buckets(),
                                     sum_value=self.total)


class PathHistogram:
    """One FastHistogram per request path, exported as one family labelled `path`."""

    __slots__ = ("name", "doc", "by_path")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.doc = name, doc
        self.by_path = {path: FastHistogram(name, doc, bounds) for path in PATHS}

    def observe(self, path: str, value: float) -> None:
        self.by_path[path].observe(value)

    def family(self) -> HistogramMetricFamily:
        out = HistogramMetricFamily(self.name, self.doc, labels=["path"])
        for path, h in self.by_path.items():
            if any(h.counts):
                out.add_metric([path], h.buckets(), sum_value=h.total)
        return out


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
        yield GaugeMetricFamily(
            "pd_proxy_client_bodies_receiving",
            "Requests whose body is still arriving (a stalled one stays up to body_timeout_s)",
            value=m.bodies_receiving)
        yield CounterMetricFamily(
            "pd_proxy_client_body_timeouts",
            "Requests whose body did not arrive within body_timeout_s: answered 408, their "
            "connection closed", value=m.body_timeouts)
        split = CounterMetricFamily(
            "pd_proxy_split_decisions",
            "Where requests were prefilled (adaptive disaggregation), by decision (remote: "
            "P, then its KV to D; local: D alone; p_alone: P alone) and reason (policy, "
            "unmeasured, itl_budget, backlog, sooner, balance)",
            labels=["decision", "reason"])
        for (decision, reason), n in sorted(m.split_counts.items()):
            split.add_metric([decision, reason], n)
        yield split
        if m.trace_spans is not None:
            spans = CounterMetricFamily(
                "pd_proxy_trace_spans", "The proxy's trace spans, by outcome (exported; "
                "dropped: the queue was full or the collector failed twice)",
                labels=["outcome"])
            for outcome, n in sorted(m.trace_spans.items()):
                spans.add_metric([outcome], n)
            yield spans
        yield m.decode_ttfb.family()
        yield m.prefill_latency.family()
        yield m.admission_wait.family()
        for h in (m.client_ttft, m.client_itl, m.client_e2e, m.decode_leg, m.prompt_tokens,
                  m.output_tokens):
            yield h.family()


class ProxyMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, in_flight: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.in_flight = in_flight
        self.request_counts: dict[tuple[str, int], int] = {}
        self.split_counts: dict[tuple[str, str], int] = {}  # the placement's, shared
        self.trace_spans: dict[str, int] | None = None  # the span exporter's, with tracing
        self.bodies_receiving = 0  # appliance.proxy.intake's
        self.body_timeouts = 0
        self.decode_ttfb = FastHistogram(
            "pd_proxy_decode_ttfb_seconds",
            "From the client's request to the answer's first body byte (D's, or P's token "
            "when it leads the stream)")
        self.prefill_latency = FastHistogram("pd_proxy_prefill_seconds",
                                             "P's answer time (prefill + one token): P's leg")
        self.admission_wait = FastHistogram(
            "pd_proxy_admission_wait_seconds",
            "How long requests waited for a decode slot (max_in_flight_per_decode)")
        self.client_ttft = PathHistogram(
            "pd_proxy_client_ttft_seconds",
            "Streams: from the client's request to its first token, by path")
        self.client_itl = PathHistogram(
            "pd_proxy_client_itl_seconds",
            "Streams: between two tokens the client received (tokens that came in one chunk: "
            "0), by path", ITL_BUCKETS)
        self.client_e2e = PathHistogram(
            "pd_proxy_client_e2e_seconds",
            "Answered requests (200): from the client's request to its answer's last byte, "
            "by path")
        self.decode_leg = PathHistogram(
            "pd_proxy_decode_leg_seconds",
            "The serving node's leg of answered requests: its request sent to its answer's "
            "last byte (D's, or P's for p_alone), by path")
        self.prompt_tokens = PathHistogram(
            "pd_proxy_prompt_tokens",
            "Answered requests' prompt tokens as an engine counted them (usage), by path",
            TOKEN_BUCKETS)
        self.output_tokens = PathHistogram(
            "pd_proxy_output_tokens",
            "Answered requests' output tokens (usage; streams: token events), by path",
            TOKEN_BUCKETS)
        r.register(_HotPath(self))
        self.fallbacks = Counter("pd_proxy_prefill_fallbacks",
                                 "Requests served by D alone, by reason", ["reason"], registry=r)
        self.migrations = Counter(
            "pd_proxy_migrations",
            "Answers that went on from another engine after theirs broke off: whole (asked "
            "again before the client's first byte), continued (a stream, after the tokens "
            "the client had)", ["how"], registry=r)
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
        self.passthrough = Counter(
            "pd_proxy_passthrough_requests",
            "Requests a decode node answered as it does (/tokenize, /detokenize, /version, "
            "/v1/models), by route and status", ["route", "status"], registry=r)
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

    def forget_backend(self, role: str, url: str) -> None:
        """A node dropped (it left, nothing in flight): its series go with it, or a cluster
        whose pods come and go would grow /metrics by a few series per pod for good."""
        # Each labelled (role, backend, then these), as declared above.
        for metric, more in ((self.backend_up, ()), (self.prefix_hits, ()),
                             (self.prefix_queries, ()), (self.upstream_errors, ("kind",))):
            for family in metric.collect():
                for sample in family.samples:
                    labels = sample.labels
                    if labels.get("role") == role and labels.get("backend") == url:
                        try:
                            metric.remove(role, url, *(labels[k] for k in more))
                        except KeyError:  # _total and _created name one series twice
                            pass

    def count_request(self, route: str, status: int) -> None:
        key = (route, status)
        self.request_counts[key] = self.request_counts.get(key, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
