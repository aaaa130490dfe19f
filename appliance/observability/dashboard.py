"""The Grafana dashboard of a pd-appliance node, built with grafana-foundation-sdk and
written to config/grafana/pd-appliance.json (the chart ships it as a ConfigMap):

    .venv/bin/python -m appliance.observability.dashboard [--check]

`PANELS` is the one list of what the dashboard shows, with the PromQL of each query: the
test that runs a real Prometheus against a loaded node asks it every one of them. Series
are selected by the `pd_role` label of config/prometheus/prometheus.yml.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "config" / "grafana" / "pd-appliance.json"
UID = "pd-appliance-node"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


def _quantiles(metric: str) -> tuple[Query, ...]:
    return tuple(Query(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[1m])))",
                       f"p{round(q * 100)}") for q in (0.5, 0.99))


# `or vector(0)`: a panel of things that should not happen shows 0, not "no data".
PANELS: tuple[Panel, ...] = (
    Panel("Requests by status", "reqps", (
        Query('sum by (status) (rate(pd_proxy_requests_total{pd_role="proxy"}[1m]))',
              "{{status}}"),)),
    Panel("Errors (non-2xx) and 429s", "reqps", (
        Query('sum(rate(pd_proxy_requests_total{status!~"2.."}[1m])) or vector(0)', "errors"),
        Query("sum(rate(pd_proxy_overloaded_total[1m])) or vector(0)", "429 (overloaded)"))),
    Panel("Client TTFT", "s", _quantiles("pd_proxy_client_ttft_seconds"),
          "Streams: the client's request to its first token, at the proxy"),
    Panel("Client ITL", "s", _quantiles("pd_proxy_client_itl_seconds"),
          "Between two streamed tokens the client received"),
    Panel("Client end to end", "s", _quantiles("pd_proxy_client_e2e_seconds")),
    Panel("Where requests were placed", "reqps", (
        Query("sum by (decision) (rate(pd_proxy_split_decisions_total[1m]))",
              "{{decision}}"),),
          "remote: P prefills, its KV goes to D; local: D alone; p_alone: P alone"),
    Panel("Queue (waiting) and running", "short", (
        Query("sum by (pd_role) (vllm:num_requests_waiting)", "{{pd_role}} waiting"),
        Query("sum by (pd_role) (vllm:num_requests_running)", "{{pd_role}} running"))),
    Panel("KV cache usage", "percentunit", (
        Query("max by (pd_role, instance) (vllm:kv_cache_usage_perc)",
              "{{pd_role}} {{instance}}"),)),
    Panel("KV transfer throughput", "GBs", (
        Query("sum(rate(vllm:pd_kv_transfer_bytes_total[1m])) / 1e9", "GB/s"),)),
    Panel("KV transfer time per request", "s", (
        Query("sum(rate(vllm:pd_kv_transfer_seconds_total[1m])) / "
              "clamp_min(sum(rate(vllm:pd_kv_transfers_total[1m])), 1e-9)", "seconds"),)),
    Panel("Fallbacks to D alone and failed transfers", "reqps", (
        Query("sum by (reason) (rate(pd_proxy_prefill_fallbacks_total[1m])) or vector(0)",
              "fallback {{reason}}"),
        Query("sum(rate(vllm:pd_kv_failed_transfers_total[1m])) or vector(0)",
              "failed transfers"),
        Query("sum(rate(vllm:pd_kv_digest_mismatches_total[1m])) or vector(0)",
              "KV digest mismatches (recomputed)"))),
    Panel("Nodes in rotation", "short", (
        Query("sum by (role) (pd_proxy_backend_up)", "{{role}}"),)),
)


def build() -> dict:
    """The dashboard as Grafana's JSON model."""
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (dashboard.Dashboard("pd-appliance node").uid(UID).tags(["pd-appliance"])
             .refresh("10s").time("now-30m", "now")
             .with_variable(dashboard.DatasourceVariable("datasource").type("prometheus")))
    for panel in PANELS:
        p = (timeseries.Panel().title(panel.title).unit(panel.unit).datasource(source)
             .span(12).height(8))
        if panel.description:
            p = p.description(panel.description)
        for i, q in enumerate(panel.queries):
            p = p.with_target(prometheus.Dataquery().expr(q.expr).legend_format(q.legend)
                              .ref_id(chr(ord("A") + i)).datasource(source))
        board = board.with_panel(p)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed JSON is not what the code builds")
    args = parser.parse_args()
    text = render()
    if args.check:
        sys.exit(0 if OUT.read_text() == text else 1)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
