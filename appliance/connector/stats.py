"""Transfer metrics, exposed through vLLM's connector stats hooks.

Workers accumulate into `TransferStats` (thread-safe: pushes finish on a thread pool);
each step vLLM collects a `PDConnectorStats` snapshot (`get_kv_connector_stats`),
aggregates it across workers, and logs `reduce()` periodically.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

# Why P's side channel refused a handshake or message: auth (a CURVE key not the
# cluster's), handshake (not CURVE, or not with our server key), invalid (undecodable),
# size, entries, blocks (beyond D's cache), session (a Mooncake session not D's own).
REJECT_REASONS = ("auth", "handshake", "invalid", "size", "entries", "blocks", "session")
# The Mooncake transport a worker installed, counted once per worker (its first snapshot), so
# workers' reports add up like the counters do.
TRANSPORTS = ("tcp", "rdma")
_COUNTERS = ("transfers", "bytes", "descriptors", "seconds", "failures", "expired",
             "recv_ok", "recv_failed", "rejected", *(f"rejected_{r}" for r in REJECT_REASONS),
             "peers_opened", "peers_closed", *(f"transport_{t}" for t in TRANSPORTS),
             "verified", "digest_mismatches", "unverified")


@dataclass
class PDConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for key in _COUNTERS:
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        self.data = {key: 0 for key in _COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _COUNTERS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        seconds = d["seconds"]
        return {
            "num_transfers": d["transfers"],
            "bytes": d["bytes"],
            "descriptors": d["descriptors"],
            "avg_transfer_ms": round(seconds / d["transfers"] * 1e3, 3) if d["transfers"] else 0,
            "throughput_gbps": round(d["bytes"] / seconds / 1e9, 3) if seconds else 0,
            "failed_transfers": d["failures"],
            "expired_requests": d["expired"],
            "received": d["recv_ok"],
            "failed_receives": d["recv_failed"],
            "rejected_messages": d["rejected"],
            **({"verified": d["verified"], "digest_mismatches": d["digest_mismatches"]}
               if d["verified"] or d["digest_mismatches"] else {}),
            **{f"rejected_{r}": d[f"rejected_{r}"] for r in REJECT_REASONS
               if d.get(f"rejected_{r}")},
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in _COUNTERS)


class TransferStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {key: 0 for key in _COUNTERS}
        self.totals: dict[str, Any] = {key: 0 for key in _COUNTERS}

    def _add(self, **values: float) -> None:
        with self._lock:
            for key, value in values.items():
                self._data[key] += value
                self.totals[key] += value

    def record_transfer(self, nbytes: int, descriptors: int, seconds: float) -> None:
        self._add(transfers=1, bytes=nbytes, descriptors=descriptors, seconds=seconds)

    def record_failure(self) -> None:
        self._add(failures=1)

    def record_expired(self) -> None:
        self._add(expired=1)

    def record_rejected(self, reason: str) -> None:
        assert reason in REJECT_REASONS, reason
        self._add(**{"rejected": 1, f"rejected_{reason}": 1})

    def record_recv(self, ok: bool) -> None:
        self._add(**({"recv_ok": 1} if ok else {"recv_failed": 1}))

    def record_verify(self, outcome: str) -> None:
        """A checked pull: "verified", "digest_mismatches" or "unverified" (no digest)."""
        assert outcome in ("verified", "digest_mismatches", "unverified"), outcome
        self._add(**{outcome: 1})

    def record_peer(self, opened: bool) -> None:
        self._add(**({"peers_opened": 1} if opened else {"peers_closed": 1}))

    def record_transport(self, transport: str) -> None:
        """Once per worker, after Mooncake started: what it installed."""
        assert transport in TRANSPORTS, transport
        self._add(**{f"transport_{transport}": 1})

    def snapshot(self) -> PDConnectorStats | None:
        """The counts since the last snapshot, or None when nothing happened."""
        with self._lock:
            if not any(self._data.values()):
                return None
            data, self._data = self._data, {key: 0 for key in _COUNTERS}
        return PDConnectorStats(data=data)


# Prometheus names (vLLM's /metrics on each server), one counter per stats key.
PROM_COUNTERS = {
    "transfers": ("vllm:pd_kv_transfers", "KV transfers pushed by this prefill server."),
    "bytes": ("vllm:pd_kv_transfer_bytes", "Bytes of KV pushed by this prefill server."),
    "descriptors": ("vllm:pd_kv_transfer_descriptors", "Transfer descriptors written."),
    "seconds": ("vllm:pd_kv_transfer_seconds", "Seconds spent in KV batch writes."),
    "failures": ("vllm:pd_kv_failed_transfers", "KV transfers or requests that failed."),
    "expired": ("vllm:pd_kv_expired_requests",
                "Prefilled requests freed because no decode node fetched their KV."),
    "recv_ok": ("vllm:pd_kv_received", "Requests whose KV arrived from a prefill node."),
    "recv_failed": ("vllm:pd_kv_failed_receives",
                    "Requests whose KV did not arrive (recomputed or failed by policy)."),
    "rejected": ("vllm:pd_side_channel_rejected",
                 "Side-channel handshakes and messages this prefill server refused."),
    "verified": ("vllm:pd_kv_verified",
                 "Pulls whose KV this decode server checked against P's digest (verify_kv)."),
    "digest_mismatches": ("vllm:pd_kv_digest_mismatches",
                          "Pulls whose KV did not match P's digest: recomputed, never used."),
    "unverified": ("vllm:pd_kv_unverified",
                   "Pulls chosen for a check that could not be made (KV not in whole words "
                   "on P or D): taken unchecked."),
    "peers_opened": ("vllm:pd_side_channel_peers_opened",
                     "Side-channel sockets this decode server opened to prefill workers."),
    "peers_closed": ("vllm:pd_side_channel_peers_closed",
                     "Side-channel sockets closed (the worker gone, idle, or past max_peers); "
                     "opened less closed are open."),
}


# 1 on the series of the transport this server's workers installed, 0 on the other.
PROM_TRANSPORT = ("vllm:pd_kv_transport_info",
                  "Mooncake transport this server's KV moves over (1: installed).")


def _configured_transport(vllm_config: Any) -> tuple[str, str]:
    """(role, protocol) from the kv-transfer config: a worker whose installed transport is
    not its protocol stops the server's start (transfers.mooncake), so a server that answers
    runs its protocol until its workers' own report (first engine step) says otherwise."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    role = {"kv_producer": "producer", "kv_consumer": "consumer"}.get(
        str(getattr(kv, "kv_role", "")), "")
    protocol = str(dict(getattr(kv, "kv_connector_extra_config", None) or {}).get(
        "protocol", "tcp"))
    return role, protocol


def build_prom_metrics(vllm_config: Any, metric_types: dict, labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> Any:
    from prometheus_client import Counter, Gauge
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.metrics.utils import create_metric_per_engine

    role, protocol = _configured_transport(vllm_config)

    class PDPromMetrics(KVConnectorPromMetrics):
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            counter_cls = metric_types[Counter]
            self.counters = {
                key: create_metric_per_engine(
                    counter_cls(name=name, documentation=doc, labelnames=labelnames),
                    per_engine_labelvalues)
                for key, (name, doc) in PROM_COUNTERS.items()}
            name, doc = PROM_TRANSPORT
            info = metric_types[Gauge](name=name, documentation=doc, multiprocess_mode="mostrecent",
                                       labelnames=[*labelnames, "role", "transport"])
            self.transport = {idx: {t: info.labels(*values, role, t) for t in TRANSPORTS}
                              for idx, values in per_engine_labelvalues.items()}
            for idx in self.transport:
                self._set_transport(idx, protocol)

        def _set_transport(self, engine_idx: int, installed: str) -> None:
            for t, gauge in self.transport[engine_idx].items():
                gauge.set(1 if t == installed else 0)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for key, per_engine in self.counters.items():
                value = transfer_stats_data.get(key, 0)
                if value:
                    per_engine[engine_idx].inc(value)
            for t in TRANSPORTS:
                if transfer_stats_data.get(f"transport_{t}"):
                    self._set_transport(engine_idx, t)

    return PDPromMetrics()
