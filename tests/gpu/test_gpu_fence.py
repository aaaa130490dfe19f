"""The early push must not read KV that the GPU is still computing.

On a GPU, `wait_for_save` runs while the forward pass's kernels may still be queued: the
worker records a CUDA event there (`worker.compute_fence`) and the push thread waits on it
before Mooncake reads P's memory. Here a kernel on its own stream sleeps and then writes the
KV; the push starts at once from another thread. With the fence D receives the final values;
without it (the control) D receives the stale ones, which shows the test can tell.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from appliance.connector.planning.descriptors import build_descriptors
from appliance.connector.planning.plan import registration_spans
from appliance.connector.transfers.mooncake import MooncakeTransport
from appliance.connector.transfers.outgoing import write as _write
from appliance.connector.worker import compute_fence, kv_regions
from tests.connector.conftest import bootstrap_url  # noqa: F401 - a fixture
from tests.connector.test_side_channel import BLOCKS, Pair

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of one SM at H100/H200 clocks: the "forward pass"


class Peer:
    """One layer of KV on the GPU, registered with its own Mooncake engine."""

    def __init__(self) -> None:
        self.kv = torch.zeros(BLOCKS, 2, 16, 64, dtype=torch.bfloat16, device="cuda")
        self.regions, infos = kv_regions({"model.layers.0.self_attn.attn": self.kv}, BLOCKS)
        self.transport = MooncakeTransport()
        self.transport.start("127.0.0.1")
        self.transport.register(registration_spans(infos))


def _forward_then_push(p: Peer, d: Peer, stream, value: float, fenced: bool):
    """Queue a slow kernel writing `value` into P's KV, then push blocks 0-7 at once."""
    descs = build_descriptors(p.regions, d.regions, list(range(8)), list(range(8, 16)))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        p.kv.fill_(value)
        fence = compute_fence(p.kv.device) if fenced else None
    start = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:  # the sender's push pool
        result, _ = pool.submit(_write, p.transport, fence, d.transport.session_id, descs,
                                1024).result()
    torch.cuda.synchronize()
    return d.kv[8:16], result, time.perf_counter() - start


def test_push_waits_for_the_kernels_writing_the_kv() -> None:
    p, d = Peer(), Peer()
    stream = torch.cuda.Stream()
    try:
        got, result, seconds = _forward_then_push(p, d, stream, 1.0, fenced=True)
        assert bool((got == 1.0).all()), "D received KV the GPU had not finished writing"
        assert result.nbytes == 8 * 2 * 16 * 64 * 2 and seconds > 0.1  # it really waited
        got, _, _ = _forward_then_push(p, d, stream, 2.0, fenced=False)
        if bool((got == 2.0).all()):
            pytest.skip("Mooncake's copy waited for the compute stream by itself: the "
                        "control cannot show the fence matters here")
        assert bool((got == 1.0).all())  # the stale values: the fence is what made it right
    finally:
        p.transport.close()
        d.transport.close()


async def test_sender_pushes_gpu_kv_after_the_fence(bootstrap_url):  # noqa: F811
    """The whole worker path on GPU memory: side channel, bootstrap, fence, Mooncake."""
    pair = Pair(bootstrap_url, device="cuda")
    await pair.start()
    try:
        stream = torch.cuda.Stream()
        p_layers = list(pair.p.caches.values())
        expected = [t.clone() for t in p_layers]
        for t in p_layers:
            t.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):  # the forward pass that computes the prompt's KV
            torch.cuda._sleep(SLEEP_CYCLES)
            for t, want in zip(p_layers, expected, strict=True):
                t.copy_(want)
            fence = compute_fence(p_layers[0].device)
        pair.receiver.on_recv("d1", pair.spec("x1", [10, 11, 12, 40]))
        pair.sender.on_ready("p1", "x1", [[3, 4, 5, 9]], fence)
        assert await pair.results() == ({"d1"}, set())
        torch.cuda.synchronize()
        pair.assert_copied([3, 4, 5, 9], [10, 11, 12, 40])
        pair.assert_untouched({10, 11, 12, 40})
        pair.sender.on_finished({"p1"})
        assert await pair.finished_sending() == {"p1"}
    finally:
        await pair.close()


def test_worker_hands_gpu_kv_over_at_once_with_a_fence() -> None:
    """With GPU KV the worker does not wait for the next step (that is for CPU KV): the
    prompt goes to the sender right after the forward, with a fence on this step's stream."""
    from appliance.connector.metadata import PDConnectorMetadata
    from tests.connector.test_worker_push import producer_worker

    handed: list[tuple[str, object]] = []
    done = threading.Event()

    class Sender:
        def on_ready(self, req_id, transfer_id, block_ids, fence) -> None:
            handed.append((req_id, fence))
            done.set()

    w = producer_worker(Sender(), "cuda")  # the default cpu_push_delay_ms (20) applies
    stream = torch.cuda.Stream()
    try:
        w.start_load_kv(PDConnectorMetadata(ready_sends={"r1": ("x1", [[1]])}))
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # this step's kernels, still running
            w.wait_for_save()
        assert done.wait(0.05), "GPU KV waited for a timer or the next step"
        (req_id, fence), = handed
        assert req_id == "r1" and callable(fence)
        start = time.perf_counter()
        fence()
        assert time.perf_counter() - start > 0.1  # it waited for the queued kernel
    finally:
        w.loop.stop()
