"""`pdctl top`: the node at a glance, refreshed every second: request rate and errors, what
clients felt (TTFT, ITL, end to end at p50/p99), in flight per role, each P's and D's queue
and KV usage, transfers per second and GB/s, fallbacks, answers moved to another engine
(exchange.migration), and where requests were placed.

Everything comes from the proxy: its /metrics (rates and the client histograms, over the
window between two samples), its /status (the nodes it knows, in every mode: local,
compose, a cluster description, Kubernetes discovery), and each node's /metrics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from appliance.httperrors import request_outcome
from appliance.pdctl.node.status import fetch, metric_samples, split_summary

Samples = list[tuple[str, dict[str, str], float]]

# The histograms whose p50/p99 the view shows: (label, the proxy's metric).
CLIENT = (("ttft", "pd_proxy_client_ttft_seconds"), ("itl", "pd_proxy_client_itl_seconds"),
          ("e2e", "pd_proxy_client_e2e_seconds"))
# Per node: (label, vLLM's or the PDConnector's series, counter?) from its /metrics.
NODE = (("running", "vllm:num_requests_running", False),
        ("waiting", "vllm:num_requests_waiting", False),
        ("kv_usage", "vllm:kv_cache_usage_perc", False),
        ("transfers", "vllm:pd_kv_transfers_total", True),
        ("transfer_bytes", "vllm:pd_kv_transfer_bytes_total", True),
        ("received", "vllm:pd_kv_received_total", True),
        ("failed", "vllm:pd_kv_failed_transfers_total", True))


@dataclass
class NodeSample:
    role: str
    url: str
    in_rotation: bool
    in_flight: int
    samples: Samples | None  # None: no answer


@dataclass
class Sample:
    at: float
    proxy: Samples
    status: dict[str, Any]
    nodes: list[NodeSample] = field(default_factory=list)
    error: str = ""  # the proxy did not answer


def take(proxy_url: str, api_key: str | None = None, timeout: float = 2.0) -> Sample:
    """One look at the proxy and at every node it knows (in parallel: a hung node costs
    the frame `timeout`, not one per node)."""
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    at = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        metrics = pool.submit(fetch, f"{proxy_url}/metrics", timeout, auth)
        status_reply = fetch(f"{proxy_url}/status", timeout, auth)
        status = status_reply.json() if status_reply.status == 200 else None
        if not isinstance(status, dict):
            return Sample(at, [], {}, error=status_reply.error or f"HTTP {status_reply.status}")
        known = [(role, b) for role in ("prefill", "decode") for b in status.get(role) or []
                 if isinstance(b, dict) and b.get("url")]
        replies = list(pool.map(lambda rb: fetch(f"{rb[1]['url']}/metrics", timeout), known))
        proxy = metric_samples(metrics.result().body)
    nodes = [NodeSample(role, b["url"], bool(b.get("in_rotation")), int(b.get("in_flight") or 0),
                        metric_samples(r.body) if r.status == 200 else None)
             for (role, b), r in zip(known, replies, strict=True)]
    return Sample(at, proxy, status, nodes)


# ---- arithmetic (pure) ------------------------------------------------------------------

def total(samples: Samples, name: str, **match: str) -> float:
    return sum(v for n, labels, v in samples
               if n == name and all(labels.get(k) == want for k, want in match.items()))


def buckets(samples: Samples, name: str) -> dict[float, float]:
    """A histogram's cumulative counts by upper bound, summed over its other labels."""
    out: dict[float, float] = {}
    for n, labels, v in samples:
        if n == f"{name}_bucket":
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + v
    return out


def quantile(cumulative: Mapping[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in; None
    with no observations."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return lower  # past the last finite bound: its bound is all one can say
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _rate(a: float, b: float, dt: float) -> float:
    return max(0.0, b - a) / dt if dt > 0 else 0.0


def frame(a: Sample, b: Sample) -> dict[str, Any]:
    """The numbers of one view, over the window from sample `a` to sample `b`."""
    dt = b.at - a.at
    out: dict[str, Any] = {"window_s": round(dt, 3), "proxy_error": b.error or None}
    if b.error:
        return out

    def requests(s: Samples, outcome: str) -> float:
        return sum(v for n, labels, v in s if n == "pd_proxy_requests_total"
                   and request_outcome(labels.get("status", "")) == outcome)

    out["requests_per_s"] = _rate(requests(a.proxy, "ok"), requests(b.proxy, "ok"), dt)
    # Clients that hung up are no errors of the node's.
    out["errors_per_s"] = _rate(requests(a.proxy, "failed"), requests(b.proxy, "failed"), dt)
    for key, metric in (("overloaded_per_s", "pd_proxy_overloaded_total"),
                        ("fallbacks_per_s", "pd_proxy_prefill_fallbacks_total"),
                        ("migrations_per_s", "pd_proxy_migrations_total"),
                        ("upstream_errors_per_s", "pd_proxy_upstream_errors_total")):
        out[key] = _rate(total(a.proxy, metric), total(b.proxy, metric), dt)
    out["in_flight"] = total(b.proxy, "pd_proxy_requests_in_flight")
    for key, metric in CLIENT:
        before, after = buckets(a.proxy, metric), buckets(b.proxy, metric)
        window = {le: n - before.get(le, 0.0) for le, n in after.items()}
        for q in (0.5, 0.99):
            value = quantile(window, q)
            out[f"{key}_p{round(q * 100)}_ms"] = None if value is None else round(value * 1000, 1)
    split = b.status.get("split")
    out["split"] = split_summary(split) if isinstance(split, dict) else None
    before_nodes = {n.url: n for n in a.nodes}
    out["nodes"] = [_node(before_nodes.get(n.url), n, dt) for n in b.nodes]
    for role in ("prefill", "decode"):
        out[f"{role}_in_flight"] = sum(n.in_flight for n in b.nodes if n.role == role)
    return out


def _node(a: NodeSample | None, b: NodeSample, dt: float) -> dict[str, Any]:
    out: dict[str, Any] = {"role": b.role, "url": b.url, "in_rotation": b.in_rotation,
                           "in_flight": b.in_flight, "up": b.samples is not None}
    if b.samples is None:
        return out
    for key, metric, counter in NODE:
        if not any(n == metric for n, _, _ in b.samples):
            continue
        now = total(b.samples, metric)
        if counter:
            before = total(a.samples, metric) if a is not None and a.samples else now
            out[f"{key}_per_s"] = _rate(before, now, dt)
        else:
            out[key] = now
    if "transfer_bytes_per_s" in out:
        out["transfer_gb_per_s"] = out.pop("transfer_bytes_per_s") / 1e9
    return out


# ---- the view ---------------------------------------------------------------------------

def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(f: Mapping[str, Any], proxy_url: str) -> Group:
    head = Text(f"pd-appliance node · proxy {proxy_url} · window {f['window_s']:.1f} s",
                style="bold")
    if f.get("proxy_error"):
        return Group(head, Text(f"proxy: no answer ({f['proxy_error']})", style="red"))
    summary = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("req/s", "errors/s", "429/s", "fallbacks/s", "moved/s", "in flight P/D",
                "TTFT p50/p99 ms", "ITL p50/p99 ms", "e2e p50/p99 ms"):
        summary.add_column(col, justify="right")
    errors = f["errors_per_s"]
    summary.add_row(
        _num(f["requests_per_s"]), Text(_num(errors), style="red" if errors else ""),
        _num(f["overloaded_per_s"]), _num(f["fallbacks_per_s"]), _num(f["migrations_per_s"]),
        f"{f['prefill_in_flight']}/{f['decode_in_flight']}",
        f"{_ms(f['ttft_p50_ms'])} / {_ms(f['ttft_p99_ms'])}",
        f"{_ms(f['itl_p50_ms'])} / {_ms(f['itl_p99_ms'])}",
        f"{_ms(f['e2e_p50_ms'])} / {_ms(f['e2e_p99_ms'])}")
    nodes = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("role", "node", "up", "rotation", "in flight", "running", "waiting", "KV %",
                "transfers/s", "GB/s", "received/s"):
        nodes.add_column(col, justify="left" if col in ("role", "node") else "right",
                         overflow="fold")
    for n in f["nodes"]:
        up = Text("yes" if n["up"] else "no", style="green" if n["up"] else "red")
        kv = n.get("kv_usage")
        nodes.add_row(
            n["role"], n["url"], up, "in" if n["in_rotation"] else "out", str(n["in_flight"]),
            _num(n.get("running"), "{:.0f}"), _num(n.get("waiting"), "{:.0f}"),
            _num(None if kv is None else kv * 100), _num(n.get("transfers_per_s")),
            _num(n.get("transfer_gb_per_s"), "{:.3g}"), _num(n.get("received_per_s")))
    parts: list[Any] = [head, summary, nodes]
    if f.get("split"):
        parts.append(Text(str(f["split"])))
    return Group(*parts)
