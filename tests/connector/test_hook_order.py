"""The connector's worker side driven in the order vLLM 0.32's model runners call it.

The orders are read off vLLM 0.32's sources (the table in appliance/connector/worker.py):
V1 (`v1/worker/gpu_model_runner.py` + `kv_connector_model_runner_mixin.py`, which the CPU
build runs) and V2 (`v1/worker/gpu/model_runner.py` + `gpu/kv_connector.py`, CUDA's
default), each with and without a forward, and V1 as it would run with synchronous loads
(start_load_kv before the forward). Whatever the order: a prompt is never handed to the
sender before the forward that computes its KV, a preemption reaches the sender before the
next forward, a preempted prompt's old blocks are never pushed, and the scheduler's
"finished" for a request never overtakes its hand-over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from appliance.connector import engine_wait
from appliance.connector.facade import PDConnector
from appliance.connector.metadata import PDConnectorMetadata, RecvSpec
from appliance.connector.settings import ConnectorSettings
from appliance.connector.sidechannel.loop import LoopThread
from appliance.connector.worker import PDWorker, ReadySends

V1 = ("handle_preemptions", "bind", "forward", "start_load_kv", "wait_for_save",
      "get_transfer_results", "clear")
V1_NO_FORWARD = ("handle_preemptions", "bind", "start_load_kv", "wait_for_save",
                 "get_transfer_results", "clear")
V1_SYNC_LOADS = ("handle_preemptions", "bind", "start_load_kv", "forward", "wait_for_save",
                 "get_transfer_results", "clear")
V2 = ("handle_preemptions", "bind", "forward", "finish_forward", "sample", "start_load_kv",
      "wait_for_save", "get_transfer_results", "clear")
V2_NO_FORWARD = ("handle_preemptions", "bind", "finish_forward", "start_load_kv",
                 "wait_for_save", "get_transfer_results", "clear")
RUNNERS = {"v1": (V1, V1_NO_FORWARD), "v1-sync-loads": (V1_SYNC_LOADS, V1_NO_FORWARD),
           "v2": (V2, V2_NO_FORWARD)}


class Recorder:
    """Stands in for the Sender and the Receiver: records what reaches it, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.lock = threading.Lock()
        self.waits: list[float] = []  # the wait each take_results was allowed

    def _add(self, *call) -> None:
        with self.lock:
            self.calls.append(call)

    def on_ready(self, req_id, transfer_id, block_ids, fence) -> None:
        self._add("ready", req_id, tuple(block_ids[0]))

    def on_preempted(self, req_ids) -> None:
        self._add("preempted", *sorted(req_ids))

    def on_finished(self, req_ids) -> None:
        self._add("finished", *sorted(req_ids))

    def on_aborted(self, transfer_ids) -> None:
        self._add("aborted", *sorted(transfer_ids))

    def on_released(self, transfer_ids) -> None:
        self._add("released", *sorted(transfer_ids))

    def take_finished(self) -> set[str]:
        return set()

    def on_recv(self, req_id, spec) -> None:
        self._add("recv", req_id)

    def on_cancel(self, req_id, transfer_id) -> None:
        self._add("cancel", req_id)

    def on_release(self, spec) -> None:
        self._add("release", spec.transfer_id)

    def take_results(self, wait_s: float = 0.0):
        self.waits.append(wait_s)
        return set(), set()


def connector(role: str, **settings) -> PDConnector:
    """The facade vLLM calls, over a worker with its real loop thread and a Recorder."""
    w = PDWorker.__new__(PDWorker)
    w.settings = ConnectorSettings(engine_id="e", role=role, **settings)
    w.loop = LoopThread("test-hooks")
    w.side = Recorder()
    w._device = None  # KV in CPU memory
    w._ready = ReadySends()
    w._preemptions_seen = None
    c = PDConnector.__new__(PDConnector)
    c._connector_metadata = None
    c.worker, c.scheduler = w, None
    return c


class Step:
    """Runs one engine step's hooks in a runner's order; `forward` snapshots what the
    sender had been told when the forward began."""

    def __init__(self, c: PDConnector) -> None:
        self.c = c
        self.at_forward: list[tuple] = []

    def seen(self) -> list[tuple]:
        w = self.c.worker
        w.loop.call_wait(lambda: None, timeout=5)  # everything queued so far has run
        with w.side.lock:
            return list(w.side.calls)

    def run(self, order: tuple[str, ...], meta: PDConnectorMetadata) -> list[tuple]:
        c = self.c
        hooks: dict[str, Callable[[], object]] = {
            "handle_preemptions": lambda: c.handle_preemptions(meta),
            "bind": lambda: c.bind_connector_metadata(meta),
            "forward": lambda: self.at_forward.append(tuple(self.seen())),
            "finish_forward": c.finish_forward,
            "sample": lambda: None,
            "start_load_kv": lambda: c.start_load_kv(None),
            "wait_for_save": c.wait_for_save,
            "get_transfer_results": lambda: c.get_transfer_results(set()),
            "clear": c.clear_connector_metadata,
        }
        for hook in order:
            hooks[hook]()
        return self.seen()


@pytest.fixture(params=sorted(RUNNERS))
def runner(request):
    return RUNNERS[request.param]


@pytest.mark.parametrize("delay_ms", [0, 60_000])  # GPU-like at once; CPU at the next step
def test_producer_in_each_runners_order(runner, delay_ms) -> None:
    with_forward, no_forward = runner
    c = connector("producer", cpu_push_delay_ms=delay_ms)
    step = Step(c)
    try:
        seen = step.run(with_forward, PDConnectorMetadata(
            ready_sends={"r1": ("x1", [[1, 2]]), "r3": ("x3", [[3]])}))
        assert step.at_forward[-1] == ()  # their KV is being computed by this forward
        at_once = [("ready", "r1", (1, 2)), ("ready", "r3", (3,))]
        assert seen == (at_once if delay_ms == 0 else [])

        # The next step preempts r3 (its blocks are freed) and r1's request finished.
        seen = step.run(with_forward, PDConnectorMetadata(preempted_sends={"r3"},
                                                          finished_sends={"r1"}))
        before = step.at_forward[-1]
        assert ("preempted", "r3") in before  # told before this forward began
        if delay_ms == 0:
            assert seen == at_once + [("preempted", "r3"), ("finished", "r1")]
        else:  # r3's old blocks are never pushed; r1 goes before its "finished"
            assert seen == [("preempted", "r3"), ("ready", "r1", (1, 2)), ("finished", "r1")]

        # r3 is recomputed into new blocks; an empty step follows, then it finishes.
        step.run(with_forward, PDConnectorMetadata(ready_sends={"r3": ("x3", [[7]])}))
        step.run(no_forward, PDConnectorMetadata())
        seen = step.run(no_forward, PDConnectorMetadata(finished_sends={"r3"}))
        assert seen[-2:] == [("ready", "r3", (7,)), ("finished", "r3")]
        assert [call for call in seen if call[:2] == ("ready", "r3")] == (
            [("ready", "r3", (3,)), ("ready", "r3", (7,))] if delay_ms == 0
            else [("ready", "r3", (7,))])
    finally:
        c.worker.loop.stop()


def test_preemption_is_handled_once_per_step(runner) -> None:
    """handle_preemptions comes first; start_load_kv must not tell the sender again."""
    c = connector("producer", cpu_push_delay_ms=60_000)
    step = Step(c)
    try:
        step.run(runner[0], PDConnectorMetadata(ready_sends={"r1": ("x1", [[1]])}))
        seen = step.run(runner[0], PDConnectorMetadata(preempted_sends={"r1"}))
        assert seen == [("preempted", "r1")]
    finally:
        c.worker.loop.stop()


def test_reference_timing_hands_over_at_finish_in_each_order(runner) -> None:
    c = connector("producer", early_push=False)
    step = Step(c)
    try:
        step.run(runner[0], PDConnectorMetadata(ready_sends={"r1": ("x1", [[4]])}))
        assert step.run(runner[1], PDConnectorMetadata()) == []
        seen = step.run(runner[1], PDConnectorMetadata(finished_sends={"r1"}))
        assert seen == [("ready", "r1", (4,)), ("finished", "r1")]
    finally:
        c.worker.loop.stop()


def test_consumer_in_each_runners_order(runner) -> None:
    c = connector("consumer")
    step = Step(c)
    try:
        spec = RecvSpec("x1", [[5, 6]], "p", "http://127.0.0.1:1")
        seen = step.run(runner[0], PDConnectorMetadata(recvs={"d1": spec}))
        assert seen == [("recv", "d1")]
        seen = step.run(runner[1], PDConnectorMetadata(cancelled_recvs={"d1": "x1"}))
        assert seen == [("recv", "d1"), ("cancel", "d1")]
    finally:
        c.worker.loop.stop()


def test_only_a_step_that_computes_nothing_waits_for_a_pull(runner) -> None:
    """D's engine only waiting for KV: the worker may wait idle_wait_ms for a pull's end
    (engine_wait); a step with tokens returns at once, whatever came before it."""
    c = connector("consumer", idle_wait_ms=25)
    step = Step(c)
    try:
        step.run(runner[1], PDConnectorMetadata(idle=True))
        step.run(runner[0], PDConnectorMetadata())
        step.run(runner[1], PDConnectorMetadata(idle=True))
        assert c.worker.side.waits == [0.025, 0.0, 0.025]
    finally:
        c.worker.loop.stop()
        engine_wait.idle_step(False)
