"""When the worker hands computed prompts to the sender (the early push), without vLLM.

KV in CPU memory: at the next step's start, or `cpu_push_delay_ms` after the forward,
whichever is first; never a prompt whose forward has not run; never twice; and always
before the scheduler's "finished" for the same request, so the sender never frees blocks
it has not been told about.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from appliance.connector.metadata import PDConnectorMetadata
from appliance.connector.settings import ConnectorSettings
from appliance.connector.sidechannel.loop import LoopThread
from appliance.connector.worker import PDWorker, ReadySends


class RecordingSender:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def on_ready(self, req_id, transfer_id, block_ids, fence) -> None:
        with self.lock:
            self.calls.append(("ready", req_id))

    def on_finished(self, req_ids) -> None:
        with self.lock:
            self.calls += [("finished", r) for r in sorted(req_ids)]

    def on_aborted(self, transfer_ids) -> None:
        pass


def producer_worker(side, device: str, **settings) -> PDWorker:
    """A producer worker with its real loop thread and the given sender (the vLLM- and
    Mooncake-facing parts left out); stop it with `w.loop.stop()`."""
    w = PDWorker.__new__(PDWorker)
    w.settings = ConnectorSettings(engine_id="p", role="producer", **settings)
    w.loop = LoopThread("test-push")
    w.side = side
    w._device = torch.device(device)
    w._ready = ReadySends()
    w._preemptions_seen = None
    return w


@pytest.fixture
def worker():
    w = producer_worker(RecordingSender(), "cpu", cpu_push_delay_ms=150)
    yield w
    w.loop.stop()


def step(w: PDWorker, **meta) -> None:
    w.start_load_kv(PDConnectorMetadata(**meta))
    w.wait_for_save()


def calls(w: PDWorker, settle: float = 0.05) -> list[tuple[str, str]]:
    time.sleep(settle)
    with w.side.lock:
        return list(w.side.calls)


def test_idle_engine_pushes_at_the_next_step(worker) -> None:
    step(worker, ready_sends={"r1": ("x1", [[1, 2]])})
    assert calls(worker) == []  # not during this step's sampling and output
    step(worker, finished_sends={"r1"})  # the next step: handed over first, then finished
    assert calls(worker) == [("ready", "r1"), ("finished", "r1")]
    assert calls(worker, settle=0.2) == [("ready", "r1"), ("finished", "r1")]  # no repeat


def test_busy_engine_pushes_after_the_delay(worker) -> None:
    step(worker, ready_sends={"r1": ("x1", [[1]])})
    start = time.monotonic()
    while not calls(worker, settle=0.01):
        assert time.monotonic() - start < 5
    assert calls(worker) == [("ready", "r1")]
    assert time.monotonic() - start >= 0.1


def test_a_later_steps_prompt_waits_for_its_own_forward(worker) -> None:
    step(worker, ready_sends={"r1": ("x1", [[1]])})
    worker.start_load_kv(PDConnectorMetadata(ready_sends={"r2": ("x2", [[2]])}))
    # r1 went at this step's start; r2's forward has not run: neither timer may send it
    assert calls(worker, settle=0.3) == [("ready", "r1")]
    worker.wait_for_save()
    assert calls(worker, settle=0.3) == [("ready", "r1"), ("ready", "r2")]


def test_zero_delay_pushes_right_after_the_forward(worker) -> None:
    worker.settings = worker.settings.model_copy(update={"cpu_push_delay_ms": 0})
    step(worker, ready_sends={"r1": ("x1", [[1]])})
    assert calls(worker) == [("ready", "r1")]


def test_reference_timing_waits_for_finished(worker) -> None:
    worker.settings = worker.settings.model_copy(update={"early_push": False})
    step(worker, ready_sends={"r1": ("x1", [[1]])})
    step(worker)
    assert calls(worker, settle=0.3) == []
    step(worker, finished_sends={"r1"})
    assert calls(worker) == [("ready", "r1"), ("finished", "r1")]


def test_ready_sends_take_only_what_is_asked() -> None:
    ready = ReadySends()
    ready.add({"a": ("x", [1]), "b": ("y", [2])})
    assert ready.take({"b", "zz"}) == [("b", "y", [2])]
    assert ready.ids() == {"a"}
    assert ready.take() == [("a", "x", [1])] and ready.take() == []


class PreemptionSender(RecordingSender):
    def on_preempted(self, req_ids) -> None:
        time.sleep(0.1)  # the worker thread must wait for this
        with self.lock:
            self.calls += [("preempted", r) for r in sorted(req_ids)]


def test_preempted_prompt_is_dropped_and_the_sender_told_before_the_forward() -> None:
    w = producer_worker(PreemptionSender(), "cpu", cpu_push_delay_ms=150)
    try:
        w.start_load_kv(PDConnectorMetadata(ready_sends={"r1": ("x1", [[1]]), "r2": ("x2", [[2]])}))
        w.wait_for_save()
        # The next step preempts r1 before its KV was handed over: only r2 goes.
        w.start_load_kv(PDConnectorMetadata(preempted_sends={"r1"}))
        with w.side.lock:  # on_preempted has run by the time start_load_kv returned
            assert w.side.calls[:1] == [("preempted", "r1")]
        assert calls(w) == [("preempted", "r1"), ("ready", "r2")]
    finally:
        w.loop.stop()
