"""What a worker sets up before its first forward: AMX permission on CPUs that have AMX,
and push threads bound to the worker's GPU. The CPU and the GPU are stood in for here
(each through its one seam); tests/e2e runs the AMX path for real where the CPU has it."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from appliance.connector.cpu_features import enable_amx
from appliance.connector.settings import ConnectorSettings
from appliance.connector.stats import TransferStats
from appliance.connector.transfers.sender import Sender
from appliance.connector.worker import thread_binder


class FakeCPU:
    def __init__(self, amx: bool, granted: bool = True) -> None:
        self.amx, self.granted, self.asked = amx, granted, 0

    def _is_amx_tile_supported(self) -> bool:
        return self.amx

    def _init_amx(self) -> bool:
        self.asked += 1
        return self.granted


@pytest.fixture
def cpu_log(caplog):
    logger = logging.getLogger("vllm.appliance.connector.cpu")
    logger.addHandler(caplog.handler)  # vLLM's "vllm" logger does not propagate to root
    caplog.set_level(logging.INFO, logger.name)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_amx_cpu_asks_for_permission_and_says_so(cpu_log) -> None:
    cpu = FakeCPU(amx=True)
    assert enable_amx(cpu) is True
    assert cpu.asked == 1
    assert "AMX in use" in cpu_log.text


def test_amx_refused_by_the_kernel_is_a_warning_with_the_fix(cpu_log) -> None:
    cpu = FakeCPU(amx=True, granted=False)
    assert enable_amx(cpu) is False
    assert "refused AMX permission" in cpu_log.text and "kernel" in cpu_log.text


def test_cpu_without_amx_asks_nothing(cpu_log) -> None:
    cpu = FakeCPU(amx=False)
    assert enable_amx(cpu) is False
    assert cpu.asked == 0 and "AMX" not in cpu_log.text


def test_this_cpu_answers_for_real() -> None:
    """The real torch.cpu: permission is granted wherever the CPU has AMX."""
    assert enable_amx() is torch.cpu._is_amx_tile_supported()


def test_push_threads_bind_to_the_workers_gpu(monkeypatch) -> None:
    bound: list[tuple[int, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda index: bound.append((index, threading.current_thread().name)))
    bind = thread_binder(torch.device("cuda", 3))
    assert bind is not None
    bind()
    assert bound == [(3, threading.current_thread().name)]
    assert thread_binder(torch.device("cpu")) is None
    assert thread_binder(None) is None


def test_every_push_thread_runs_the_binder_first() -> None:
    seen: list[str] = []
    settings = ConnectorSettings(engine_id="p", role="producer", num_workers=2,
                                 bootstrap_addr="http://127.0.0.1:1")
    sender = Sender(settings, None, [], "127.0.0.1", 0, 1, 0, TransferStats(),  # type: ignore[arg-type]
                    thread_init=lambda: seen.append(threading.current_thread().name))
    try:
        names = {sender._pool.submit(lambda: threading.current_thread().name).result(5)  # noqa: SLF001
                 for _ in range(8)}
        assert names and set(seen) >= names
        assert all(name.startswith("pd-push") for name in seen)
    finally:
        sender._pool.shutdown()  # noqa: SLF001


def test_dp_rank_is_vllms_data_parallel_index() -> None:
    """vLLM resets data_parallel_rank to 0 in each engine of a dense model; the rank the
    sidecar and proxy count is data_parallel_index."""
    from types import SimpleNamespace

    from appliance.connector.worker import dp_rank_of

    assert dp_rank_of(SimpleNamespace(data_parallel_rank=0, data_parallel_index=1)) == 1
    assert dp_rank_of(SimpleNamespace(data_parallel_rank=2)) == 2
    assert dp_rank_of(SimpleNamespace()) == 0
