"""`pdctl status`: every service up/down and healthy, what the bootstrap and the proxy know,
and the counters from the metrics, as one table or JSON."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from appliance.httperrors import request_outcome

SERVICES = ("bootstrap", "prefill", "decode", "proxy")


@dataclass(frozen=True)
class Endpoints:
    bootstrap: str
    prefill: str
    decode: str
    proxy: str
    prefill_engine_id: str | None = None

    def url(self, service: str) -> str:
        return getattr(self, service)


@dataclass(frozen=True)
class ProcessState:
    """What runs a service: a local process group or a container."""
    state: str  # "running", "exited", "missing", a container state
    ok: bool
    detail: str = ""
    restarts: int | None = None
    exit_code: int | None = None  # containers: the last exit code Docker recorded
    cause: tuple[str, ...] = ()  # not ok: the error lines of its log (node.logcause)


@dataclass
class ServiceStatus:
    name: str
    url: str
    state: str
    running: bool
    healthy: bool
    health: str
    detail: str = ""
    restarts: int | None = None
    exit_code: int | None = None
    cause: list[str] = field(default_factory=list)


@dataclass
class NodeStatus:
    mode: str
    services: list[ServiceStatus]
    engine_ids: list[str] = field(default_factory=list)
    backends: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int | None = None
    # The proxy's placement: its policy and the last minute's {"remote": n, "local": m}.
    split: dict[str, Any] | None = None
    counters: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.problems and all(s.running and s.healthy for s in self.services)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["healthy"] = self.healthy
        return out


# ---- HTTP -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    status: int | None  # None: no answer
    body: str = ""
    error: str = ""

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def fetch(url: str, timeout: float = 3.0, headers: Mapping[str, str] | None = None) -> Reply:
    req = urllib.request.Request(url, headers=dict(headers or {}))
    # This host's own proxy over TLS: its certificate names the client-facing host, not the
    # local address asked here.
    ctx = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            return Reply(resp.status, resp.read().decode(errors="replace"))
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read().decode(errors="replace"), f"HTTP {exc.code}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return Reply(None, error=str(reason) or type(exc).__name__)


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    try:
        return [(s.name, dict(s.labels), float(s.value))
                for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError):
        return []


def sum_samples(samples: list[tuple[str, dict[str, str], float]], name: str,
         **match: str) -> float | None:
    values = [v for n, labels, v in samples
              if n == name and all(labels.get(k) == want for k, want in match.items())]
    return sum(values) if values else None


# ---- gathering --------------------------------------------------------------------------

# Counters shown from each service's /metrics. The proxy counts requests (by final status)
# and fallbacks to D alone; P and D report their engines' queues and the PDConnector's
# transfer counters (appliance/connector/stats.py).
_PROXY_COUNTERS = (("fallbacks", "pd_proxy_prefill_fallbacks_total"),
                   ("upstream_errors", "pd_proxy_upstream_errors_total"))
_VLLM_GAUGES = (("running", "vllm:num_requests_running"),
                ("waiting", "vllm:num_requests_waiting"))
_TRANSFER_COUNTERS = {
    "prefill": (("transfers", "vllm:pd_kv_transfers_total"),
                ("transfer_bytes", "vllm:pd_kv_transfer_bytes_total"),
                ("transfer_failures", "vllm:pd_kv_failed_transfers_total"),
                ("expired", "vllm:pd_kv_expired_requests_total")),
    "decode": (("received", "vllm:pd_kv_received_total"),
               ("receive_failures", "vllm:pd_kv_failed_receives_total"),
               ("transfer_failures", "vllm:pd_kv_failed_transfers_total")),
}


# 1 on the series of the Mooncake transport a P or D server's workers installed.
_TRANSPORT_INFO = "vllm:pd_kv_transport_info"


def transport(samples: list[tuple[str, dict[str, str], float]]) -> str | None:
    """The transport a P or D server reports, "rdma" or "tcp" (both, comma-separated, when
    its engines differ); None when it reports none."""
    names = {labels.get("transport", "?") for n, labels, v in samples
             if n == _TRANSPORT_INFO and v == 1}
    return ",".join(sorted(names)) or None


def counters(samples: list[tuple[str, dict[str, str], float]],
             named: Sequence[tuple[str, str]], prefix: str = "") -> dict[str, float]:
    """{prefix + label: the series' sum} for each (label, metric) present."""
    out: dict[str, float] = {}
    for label, metric in named:
        value = sum_samples(samples, metric)
        if value is not None:
            out[prefix + label] = value
    return out


def gather(endpoints: Endpoints, processes: Mapping[str, ProcessState] | None, mode: str,
           problems: list[str] | None = None, timeout: float = 3.0,
           api_key: str | None = None, bootstrap_token: str | None = None) -> NodeStatus:
    status = NodeStatus(mode=mode, services=[], problems=list(problems or []))
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    boot_auth = {"Authorization": f"Bearer {bootstrap_token}"} if bootstrap_token else None
    for name in SERVICES:
        url = endpoints.url(name)
        proc = (processes or {}).get(name)
        health = fetch(f"{url}/health", timeout, auth if name == "proxy" else None)
        healthy = health.status == 200
        if health.status is None:
            health_text = f"no answer ({health.error})"
        elif healthy:
            health_text = "healthy"
        else:
            reason = (health.json() or {}).get("reason") if health.status == 503 else None
            health_text = f"unhealthy: {reason or f'HTTP {health.status}'}"
        if proc is None:  # nothing tells us about the process: the answer is the evidence
            state, running, restarts, code = ("running" if health.status else "unknown"), \
                health.status is not None, None, None
        else:
            state, running, restarts, code = proc.state + (
                f" ({proc.detail})" if proc.detail else ""), proc.ok, proc.restarts, \
                proc.exit_code
        svc = ServiceStatus(name, url, state, running, healthy, health_text, restarts=restarts,
                            exit_code=code, cause=list(proc.cause) if proc else [])
        status.services.append(svc)
        if health.status is None:
            continue
        if name == "bootstrap":
            query = fetch(f"{url}/query", timeout, boot_auth).json() or {}
            if isinstance(query, dict):
                status.engine_ids = sorted(str(v.get("engine_id")) for v in query.values()
                                           if isinstance(v, dict))
            svc.detail = "engines: " + (", ".join(status.engine_ids) or "none registered")
            want = endpoints.prefill_engine_id
            if want and healthy and want not in status.engine_ids:
                status.problems.append(f"bootstrap: prefill engine {want} is not registered")
        elif name in ("prefill", "decode"):
            samples = metric_samples(fetch(f"{url}/metrics", timeout).body)
            parts = []
            for label, metric in _VLLM_GAUGES:
                value = sum_samples(samples, metric)
                if value is not None:
                    parts.append(f"{label} {value:.0f}")
            if kind := transport(samples):
                parts.append(f"transport {kind}")
            transfers = counters(samples, _TRANSFER_COUNTERS[name], f"{name}.")
            status.counters.update(transfers)
            parts += [f"{k.split('.', 1)[1]} {v:.0f}" for k, v in transfers.items()]
            svc.detail = ", ".join(parts)
        elif name == "proxy":
            _proxy_details(status, svc, url, timeout, auth)
    return status


def _proxy_details(status: NodeStatus, svc: ServiceStatus, url: str, timeout: float,
                   auth: Mapping[str, str]) -> None:
    body = fetch(f"{url}/status", timeout, auth).json()
    if isinstance(body, dict):
        status.in_flight = body.get("in_flight")
        status.split = proxy_split(body)
        for role in ("prefill", "decode"):
            for b in body.get(role) or []:
                status.backends.append({"role": role, **b})
    samples = metric_samples(fetch(f"{url}/metrics", timeout, auth).body)
    # A client that hung up is counted apart: no failure of the node's.
    by_outcome = {"ok": 0.0, "cancelled": 0.0, "failed": 0.0}
    for n, labels, v in samples:
        if n == "pd_proxy_requests_total":
            by_outcome[request_outcome(labels.get("status", ""))] += v
    status.counters.update({f"requests_{k}": v for k, v in by_outcome.items()})
    for label, metric in _PROXY_COUNTERS:
        status.counters[label] = sum_samples(samples, metric) or 0.0
    ready = {role: sum(1 for b in status.backends if b["role"] == role and b.get("in_rotation"))
             for role in ("prefill", "decode")}
    total = {role: sum(1 for b in status.backends if b["role"] == role)
             for role in ("prefill", "decode")}
    svc.detail = (f"backends P {ready['prefill']}/{total['prefill']}, D {ready['decode']}/"
                  f"{total['decode']} in rotation; in flight {status.in_flight or 0}")
    if status.split is not None:
        svc.detail += "; " + split_summary(status.split)


def proxy_split(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The placement part of the proxy's /status: policy and the last minute's counts."""
    split = body.get("split")
    if not isinstance(split, dict):
        return None
    return {"policy": split.get("policy"), "last_minute": split.get("last_minute") or {}}


def split_summary(split: Mapping[str, Any]) -> str:
    """`split auto, last minute: 12 remote (P then D), 30 local (D alone), 9 p_alone
    (P alone)`."""
    last = split.get("last_minute") or {}
    return (f"split {split.get('policy')}, last minute: {last.get('remote', 0)} remote "
            f"(P then D), {last.get('local', 0)} local (D alone), "
            f"{last.get('p_alone', 0)} p_alone (P alone)")


# ---- output -----------------------------------------------------------------------------

def render_table(status: NodeStatus, console: Console) -> None:
    table = Table(title=f"pd-appliance node ({status.mode})", title_justify="left")
    for col in ("service", "state", "health", "url", "details"):
        table.add_column(col, overflow="fold")
    for s in status.services:
        state = s.state + (f", restarts {s.restarts}" if s.restarts else "") + (
            f", exit code {s.exit_code}" if s.exit_code is not None else "")
        color = "green" if s.running and s.healthy else "red"
        table.add_row(s.name, state, f"[{color}]{s.health}[/]", s.url, s.detail)
    console.print(table)
    for s in status.services:
        for line in s.cause:
            console.print(f"[red]{s.name}:[/] {line}", markup=True, highlight=False)
    if status.backends:
        backends = Table(title="proxy backends", title_justify="left")
        for col in ("role", "url", "healthy", "in rotation", "in flight", "engine ids",
                    "last error"):
            backends.add_column(col, overflow="fold")
        for b in status.backends:
            engines = ", ".join(f"{k}:{v}" for k, v in (b.get("engine_ids") or {}).items())
            backends.add_row(b["role"], str(b.get("url", "")), _yes(b.get("healthy")),
                             _yes(b.get("in_rotation")), str(b.get("in_flight", "")),
                             engines or "-", str(b.get("last_error") or "-"))
        console.print(backends)
    if status.counters:
        console.print("counters: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                               status.counters.items()))
    for problem in status.problems:
        console.print(f"[red]problem:[/] {problem}")
    console.print("[green]healthy[/]" if status.healthy else "[red]not healthy[/]")


def _yes(value: Any) -> str:
    return "yes" if value else "no"
