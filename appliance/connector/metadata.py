"""What the scheduler side hands the worker side each step (inside SchedulerOutput).

Built by `scheduler.PDScheduler.build_connector_meta` (docs/protocol.md steps 13, 18, 26)
and read by `worker.PDWorker` in `start_load_kv` / `wait_for_save` (steps 14, 19, 27).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class RecvSpec:
    """Consumer: pull a request's prompt KV from a producer into these local blocks (one
    list per KV-cache group)."""

    transfer_id: str
    block_ids: list[list[int]]
    remote_engine_id: str
    remote_bootstrap_addr: str
    # The request's own receive deadline (`recv_timeout_ms`, sent by the proxy: see
    # appliance.deadlines); None: the connector's recv_timeout_s.
    timeout_s: float | None = None


@dataclass
class ReleaseSpec:
    """Consumer: tell the producer to free a transfer's blocks without writing."""

    transfer_id: str
    remote_engine_id: str
    remote_bootstrap_addr: str


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    # Producer: requests whose prompt KV is complete once this step's forward has run,
    # req_id -> (transfer_id, block ids per KV-cache group). The worker may push right after
    # the forward (wait_for_save), one scheduler step earlier than the reference (protocol step 26).
    ready_sends: dict[str, tuple[str, list[list[int]]]] = field(default_factory=dict)
    # Producer: requests whose blocks the scheduler now holds for the worker; the worker
    # reports them in finished_sending once their transfer is over (step 32).
    finished_sends: set[str] = field(default_factory=set)
    # Producer: requests vLLM preempted after their KV was marked ready (possible with
    # async scheduling or pipeline parallelism, where the next step is scheduled before the
    # previous one's output is in): those blocks are freed and the prompt is recomputed, so
    # the worker forgets them and waits for the new ones.
    preempted_sends: set[str] = field(default_factory=set)
    # Producer: transfer ids whose request ended before its KV was computed (aborted,
    # rejected): any decode node waiting on them is told at once.
    aborted_sends: set[str] = field(default_factory=set)
    # Producer: transfer ids no decode node will ask for (the request stopped at its first
    # token and the proxy answers from P alone): free their blocks without waiting.
    released_sends: set[str] = field(default_factory=set)
    # This step schedules no tokens: the engine only waits (on D, for KV). The worker may
    # then wait a little for a pull to end instead of returning at once (reports module).
    idle: bool = False
    # Both: the `traceparent` of the requests of this step's sends and pulls, transfer_id
    # -> header value (appliance.connector.spans; only requests sent with one).
    trace_parents: dict[str, str] = field(default_factory=dict)
    # Consumer: new pulls, req_id -> spec (step 18).
    recvs: dict[str, RecvSpec] = field(default_factory=dict)
    # Consumer: requests aborted while waiting for remote KV, req_id -> transfer_id.
    cancelled_recvs: dict[str, str] = field(default_factory=dict)
    # Consumer: transfers that will never be pulled (request ended before it was
    # scheduled, or a full local prefix hit): the producer may free them now.
    releases: list[ReleaseSpec] = field(default_factory=list)
