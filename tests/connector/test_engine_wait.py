"""The idle switch on vLLM's inter-process queue: a short spin only while the step computes
nothing, vLLM's own spin otherwise, and the real class it patches is the one it knows."""

from __future__ import annotations

import pytest

from appliance.connector import engine_wait


class FakeSpin:
    def __init__(self, is_reader: bool) -> None:
        self.is_reader = is_reader
        self.busy_loop_s = 1.0
        self.seen: list[float] = []

    def wait(self, timeout_ms: int | None = None) -> None:
        self.seen.append(self.busy_loop_s)


@pytest.fixture(autouse=True)
def _not_idle():
    yield
    engine_wait.idle_step(False)


def test_only_an_idle_step_shortens_a_readers_spin() -> None:
    wait = engine_wait.short_spin(FakeSpin.wait)
    reader, writer = FakeSpin(True), FakeSpin(False)
    wait(reader)
    engine_wait.idle_step(True)
    wait(reader)
    wait(writer)
    engine_wait.idle_step(False)
    wait(reader)
    assert reader.seen == [1.0, engine_wait.IDLE_SPIN_S, 1.0]
    assert writer.seen == [1.0]
    assert reader.busy_loop_s == 1.0  # restored after each wait


def test_installs_on_the_vllm_queue_it_knows() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.device_communicators import shm_broadcast

    before = shm_broadcast.SpinCondition.wait
    try:
        assert engine_wait.install() is True
        assert engine_wait.install() is True  # once
        assert shm_broadcast.SpinCondition.wait is not before
    finally:
        shm_broadcast.SpinCondition.wait = before
        engine_wait._installed = False
