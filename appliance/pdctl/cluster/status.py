"""`pdctl status --cluster FILE`: the whole cluster a description names: every P and D
instance's health, each host's bootstrap sidecar, the proxy, and whether the proxy has each
instance in rotation (an instance it does not list at all is a problem: its backends were
not rendered from this description)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from appliance.pdctl.cluster.description import ClusterPlan
from appliance.pdctl.node.status import (
    Reply,
    counters,
    fetch,
    metric_samples,
    proxy_split,
    split_summary,
)

# The transfer counters each instance shows (appliance/connector/stats.py), and the ones
# that mean KV did not move: D then recomputes the prompt (kv_load_failure_policy), so the
# answer is right and only these counters tell.
_KV = {"prefill": (("sent", "vllm:pd_kv_transfers_total"),
                   ("refused", "vllm:pd_side_channel_rejected_total"),
                   ("failed", "vllm:pd_kv_failed_transfers_total")),
       "decode": (("received", "vllm:pd_kv_received_total"),
                  ("failed", "vllm:pd_kv_failed_receives_total"))}
_KV_WARNINGS = {
    "refused": "refused {n:.0f} side-channel messages (its log says why: a D's session "
               "address outside host.internal_networks, or a wrong key)",
    "failed": "{n:.0f} KV transfers failed (D recomputed those prompts itself)"}


@dataclass
class Member:
    name: str  # "<host>/prefill-0", "<host>/bootstrap", "<host>/proxy"
    url: str
    devices: str
    healthy: bool
    health: str
    in_rotation: bool | None = None  # P and D: as the proxy says; None: unknown
    kv: dict[str, float] = field(default_factory=dict)  # P and D: transfer counters


@dataclass
class ClusterStatus:
    members: list[Member]
    problems: list[str] = field(default_factory=list)
    # Serving, but not as it should (counters since start): shown, the exit code unchanged.
    warnings: list[str] = field(default_factory=list)
    # The proxy's placement: its policy and the last minute's {"remote": n, "local": m}.
    split: dict[str, Any] | None = None

    @property
    def healthy(self) -> bool:
        return not self.problems and all(
            m.healthy and m.in_rotation is not False for m in self.members)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "healthy": self.healthy}


def _health(reply: Reply) -> tuple[bool, str]:
    if reply.status == 200:
        return True, "ok"
    return False, reply.error or f"HTTP {reply.status}"


def gather(plan: ClusterPlan, headers: Mapping[str, str] | None = None,
           timeout: float = 3.0) -> ClusterStatus:
    members: list[Member] = []
    warnings: list[str] = []
    for inst in plan.instances:
        ok, why = _health(fetch(f"{inst.url}/health", timeout))
        member = Member(f"{inst.host}/{inst.role}-{inst.index}", inst.url,
                        ",".join(map(str, inst.devices)), ok, why)
        if ok:
            member.kv = counters(metric_samples(fetch(f"{inst.url}/metrics", timeout).body),
                                 _KV[inst.role])
            warnings += [f"{member.name}: {_KV_WARNINGS[k].format(n=n)}"
                         for k, n in member.kv.items() if k in _KV_WARNINGS and n]
        members.append(member)
    for url in plan.sidecars:
        host = next(i.host for i in plan.of("prefill") if i.bootstrap_url == url)
        ok, why = _health(fetch(f"{url}/health", timeout))
        members.append(Member(f"{host}/bootstrap", url, "", ok, why))
    status = ClusterStatus(members, warnings=warnings)
    if plan.proxy_url is None:  # a host without the proxy: nothing to ask about rotation
        return status
    reply = fetch(f"{plan.proxy_url}/status", timeout, headers)
    ok, why = _health(reply)
    members.append(Member(f"{plan.proxy_host}/proxy", plan.proxy_url, "", ok, why))
    answer = reply.json() if ok else None
    if not isinstance(answer, dict):
        return status
    status.split = proxy_split(answer)
    listed = {b.get("url"): bool(b.get("in_rotation"))
              for role in ("prefill", "decode") for b in answer.get(role) or []
              if isinstance(b, dict)}
    for m in members[:len(plan.instances)]:  # the instances come first
        if m.url in listed:
            m.in_rotation = listed[m.url]
        else:
            status.problems.append(f"{m.name}: the proxy does not list {m.url} (render its "
                                   f"backends from this description)")
    return status


def add_containers(status: ClusterStatus, states: Mapping[str, Any],
                   services: tuple[str, ...]) -> None:
    """A cluster host's compose services: one problem per container not running healthy."""
    for name in services:
        c = states.get(name)
        if c is None:
            status.problems.append(f"{name}: no container (run `pdctl up` on this host)")
        elif not c.ok:
            status.problems.append(f"{name}: container {c.state}"
                                   f"{f', {c.health}' if c.health else ''}, {c.restarts} "
                                   f"restarts (`pdctl logs {name}`)")


def render_table(status: ClusterStatus, console: Console) -> None:
    table = Table(title="cluster " + ("healthy" if status.healthy else "NOT healthy"))
    for col in ("member", "url", "devices", "health", "in rotation", "kv"):
        table.add_column(col)
    for m in status.members:
        rotation = "-" if m.in_rotation is None else ("yes" if m.in_rotation else "NO")
        kv = ", ".join(f"{k} {v:.0f}" for k, v in m.kv.items())
        table.add_row(m.name, m.url, m.devices, m.health if m.healthy else f"[red]{m.health}",
                      rotation, kv)
    console.print(table)
    if status.split is not None:
        console.print(f"proxy: {split_summary(status.split)}")
    for line in status.problems:
        console.print(f"[red]problem:[/] {line}")
    for line in status.warnings:
        console.print(f"[yellow]warning:[/] {line}")
