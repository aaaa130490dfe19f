"""Worker side of the connector (runs in each vLLM worker process, one per TP rank).

Registers the KV cache with its transport (Mooncake's Transfer Engine; docs/protocol.md
steps 1, 3, 5), then hands each step's metadata to the producer's `Sender` or the
consumer's `Receiver`, which run on a background loop; vLLM's forward pass never waits on
the network.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from appliance.connector import engine_wait
from appliance.connector.cpu_features import enable_amx
from appliance.connector.metadata import PDConnectorMetadata
from appliance.connector.planning.groups import layer_groups
from appliance.connector.planning.plan import Region, TensorInfo, registration_spans
from appliance.connector.planning.tpplan import head_major
from appliance.connector.settings import ConnectorSettings
from appliance.connector.sidechannel.loop import LoopThread
from appliance.connector.stats import PDConnectorStats, TransferStats
from appliance.connector.transfers.digest import digester_for
from appliance.connector.transfers.transport import Transport

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.appliance.connector.worker")


def layer_order(name: str) -> tuple[int, str]:
    """Sort key: layer index first (both sides enumerate regions identically)."""
    match = re.search(r"\.(\d+)\.", f".{name}.")
    return (int(match.group(1)) if match else -1, name)


def block_major(tensor: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, int | None]:
    """The tensor with vLLM's (manager) block as dimension 0, when that is knowable.

    vLLM 0.32 hands every attention layer over as a logical `[B, H, N, C]` view whose
    strides carry the physical layout (LBHNC, BLHNC, ...). When kernel blocks subdivide a
    manager block, `B` is `num_blocks * ratio`: group them back so one region block is one
    scheduler block. Other shapes (older layouts such as flash-attention's
    `[2, B, N, H, D]`) are left for the planner to read from shape and strides.
    """
    if tensor.dim() and tensor.shape[0] == num_blocks:
        return tensor, 0
    if tensor.dim() and tensor.shape[0] > num_blocks and tensor.shape[0] % num_blocks == 0:
        return tensor.unflatten(0, (num_blocks, -1)), 0
    return tensor, None


def kv_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int,
               group_of: dict[str, int] | None = None,
               kv_heads: int = 0) -> tuple[list[Region], list[TensorInfo]]:
    """Regions of every layer's KV cache, in layer order, from their real shapes and
    strides (never from an assumed layout), each tagged with its layer's KV-cache group.
    With vLLM's hybrid allocator layers of different groups share one tensor: their regions
    overlay, and each group's own block ids keep them apart. With `kv_heads` (this rank's
    KV heads) each region says whether its blocks are head-major (see tpplan)."""
    regions: list[Region] = []
    infos: list[TensorInfo] = []
    for name in sorted(kv_caches, key=layer_order):
        tensor, block_dim = block_major(kv_caches[name], num_blocks)
        info = TensorInfo.from_tensor(tensor)
        for r in info.regions(num_blocks, block_dim, (group_of or {}).get(name, 0)):
            heads = head_major(info.shape, info.strides, info.elem_size, block_dim, kv_heads,
                               r.block_bytes) if kv_heads else 0
            regions.append(dataclasses.replace(r, heads=heads))
        infos.append(info)
    return regions, infos


def compute_fence(device: Any) -> Callable[[], None] | None:
    """Something to wait on until the KV written by this step's forward really exists.

    On the CPU the forward has returned, so the KV is there. On a GPU the kernels may still
    run: record an event on the current stream and let the push thread wait for it. A
    blocking-sync event lets that thread sleep instead of spinning a core meanwhile.
    """
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    event = torch.cuda.Event(blocking=True)
    event.record()
    return event.synchronize


def kv_heads_of(vllm_config: Any) -> tuple[int, int | None]:
    """(KV heads on this rank, KV heads of the model): what a head slice is cut from when P
    and D differ in TP. MLA's one latent is (1, 0): every rank holds it whole."""
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return 0, None
    if getattr(model, "use_mla", False):
        return 1, 0
    return (int(model.get_num_kv_heads(vllm_config.parallel_config)),
            int(model.get_total_num_kv_heads()))


def dp_rank_of(parallel_config: Any) -> int:
    """This engine's data-parallel rank, as the bootstrap sidecar and the proxy count them.

    vLLM 0.32 resets `data_parallel_rank` to 0 in every engine of a dense model (DP is then
    independent engines, with no process group across them) and keeps the rank in
    `data_parallel_index`: reading the former makes every rank register as rank 0.
    """
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(index or 0)


def thread_binder(device: Any) -> Callable[[], None] | None:
    """What each push thread runs first: bind it to the worker's GPU.

    A new thread starts on CUDA device 0. Mooncake's copies out of GPU memory (TCP stages
    through host memory) and the fence's event belong to the worker's own device; on TP
    ranks > 0 a thread left on device 0 makes a context there and its copies fail or cross
    GPUs. KV in CPU memory needs nothing.
    """
    if getattr(device, "type", "cpu") != "cuda":
        return None
    index = device.index if device.index is not None else 0

    def bind() -> None:
        import torch

        torch.cuda.set_device(index)

    return bind


class ReadySends:
    """Prompts whose KV is computed (or is being computed by this step's forward) and that
    have not been handed to the sender yet: req_id -> (transfer_id, block ids per group).

    vLLM's worker thread adds and takes; on a CPU host a timer on the side-channel loop may
    take too, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, tuple[str, list[list[int]]]] = {}

    def add(self, ready: dict[str, tuple[str, list[list[int]]]]) -> None:
        with self._lock:
            self._items.update(ready)

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._items)

    def take(self, only: set[str] | None = None) -> list[tuple[str, str, list[list[int]]]]:
        """Remove and return (req_id, transfer_id, block_ids), all of them or those in only."""
        with self._lock:
            picked = [r for r in self._items if only is None or r in only]
            return [(r, *self._items.pop(r)) for r in picked]


class PDWorker:
    def __init__(self, settings: ConnectorSettings, vllm_config: Any,
                 kv_cache_config: Any, transport: Transport) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.settings = settings
        device_config = getattr(vllm_config, "device_config", None)
        if getattr(device_config, "device_type", "cpu") == "cpu":
            # Before the first forward: a decode node's first one reaches vLLM's AMX
            # attention kernel without anything else having asked for AMX (SIGILL).
            enable_amx()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.dp_rank = dp_rank_of(vllm_config.parallel_config)
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.group_of = layer_groups(kv_cache_config)
        self.kv_heads, self.total_heads = kv_heads_of(vllm_config)
        self.host = settings.resolved_host()
        self.stats = TransferStats()
        self.transport = transport  # not started yet (PDConnector.new_transport)
        self.transport.start(self.host, settings.protocol, settings.device_name)
        self.stats.record_transport(self.transport.transport)  # /metrics, `pdctl status`
        self.loop = LoopThread(f"pd-{settings.role}-tp{self.tp_rank}")
        self.side: Any = None
        self._device: Any = None
        self._ready = ReadySends()
        self._preemptions_seen: PDConnectorMetadata | None = None
        log.info("%s %s worker tp %d/%d: Mooncake %s session %s", settings.role,
                 settings.engine_id, self.tp_rank, self.tp_size, self.transport.transport,
                 self.transport.session_id)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        regions, infos = kv_regions(kv_caches, self.num_blocks, self.group_of, self.kv_heads)
        spans = registration_spans(infos)
        self.transport.register(spans)
        self._device = next(iter(kv_caches.values())).device
        log.info("registered %d layers as %d regions of %d KV-cache groups in %d spans "
                 "(%.1f MiB), block %d B", len(infos), len(regions),
                 len({r.group for r in regions}), len(spans),
                 sum(n for _, n in spans) / 2**20, regions[0].block_bytes if regions else 0)
        if self.settings.is_producer:
            self.side = self.loop.run(self._make_sender(regions), timeout=30)
            log.info("side channel %s", self.side.side_channel_addr)
        else:
            self.side = self.loop.run(self._make_receiver(regions), timeout=30)

    async def _make_sender(self, regions: list[Region]):
        from appliance.connector.transfers.sender import Sender

        sender = Sender(self.settings, self.transport, regions, self.host, self.tp_rank,
                        self.tp_size, self.dp_rank, self.stats,
                        thread_init=thread_binder(self._device), total_heads=self.total_heads,
                        digester=digester_for(self._device))
        await sender.start()
        return sender

    async def _make_receiver(self, regions: list[Region]):
        from appliance.connector.transfers.receiver import Receiver

        return Receiver(self.settings, self.transport, regions, self.host, self.tp_rank,
                        self.tp_size, self.stats, total_heads=self.total_heads,
                        digester=digester_for(self._device))

    # --- per step -------------------------------------------------------------------------
    #
    # Where vLLM 0.32 calls the worker hooks in one engine step. Our loads are asynchronous,
    # so `scheduler_output.has_sync_kv_loads` is false and start_load_kv follows the forward.
    #
    #   V1 runner (v1/worker/gpu_model_runner.py; the CPU build's CPUModelRunner):
    #     execute_model: handle_preemptions (before _update_states; also with no tokens)
    #       -> _get_kv_connector_output: bind metadata -> forward -> start_load_kv
    #       -> wait_for_save -> get_transfer_results -> clear metadata
    #   V2 runner (v1/worker/gpu/model_runner.py + kv_connector.py; CUDA's default):
    #     execute_model -> pre_forward: handle_preemptions -> bind metadata
    #       -> forward -> finish_forward;  (no tokens: no_forward runs the same hooks)
    #     sample_tokens (sampling launched) -> post_forward: start_load_kv
    #       -> wait_for_save -> get_transfer_results -> clear metadata
    #
    # handle_preemptions is thus the one hook before a forward that may rewrite freed blocks:
    # preemptions are resolved there. start_load_kv then wait_for_save follow the forward in
    # both runners. With synchronous loads (another connector's) start_load_kv would precede
    # the forward, which this code also allows: a step's own prompts are handed over no
    # earlier than wait_for_save, which always follows the forward.

    def handle_preemptions(self, meta: PDConnectorMetadata) -> None:
        """Before this step's forward: vLLM preempted these prefills after their KV was
        marked ready and freed their blocks, which this forward may rewrite. Forget their
        pending hand-over and tell the sender, waiting for it, so that once this returns a
        transfer not written yet waits for the recomputed blocks and a write under way stops
        at its next batch and is reported failed (D recomputes)."""
        if (self.side is None or not self.settings.is_producer
                or self._preemptions_seen is meta):
            return
        self._preemptions_seen = meta  # once per step, whichever hook comes first
        if not meta.preempted_sends:
            return
        preempted = set(meta.preempted_sends)
        self._ready.take(preempted)  # their blocks are gone
        try:
            self.loop.call_wait(self.side.on_preempted, preempted, timeout=10)
        except Exception:  # noqa: BLE001 - never take the engine down for it
            log.exception("preemption of %s not handled in time", sorted(preempted))

    def start_load_kv(self, meta: PDConnectorMetadata) -> None:
        if self.side is None:
            return
        if meta.trace_parents:  # before the sends and pulls they belong to, in loop order
            self.loop.call(self.side.spans.parents, dict(meta.trace_parents))
        if self.settings.is_producer:
            # A runner that never called handle_preemptions (none in vLLM 0.32) still gets
            # them handled, as early as it lets us.
            self.handle_preemptions(meta)
            if self.settings.early_push:
                # Whatever an earlier step computed and has not pushed yet goes now.
                self._hand_over(self._ready.take())
            else:  # the reference's timing: only once the request has finished
                self._hand_over(self._ready.take(set(meta.finished_sends)))
            self._ready.add(meta.ready_sends)  # computed by this step's forward
            if meta.finished_sends:
                self.loop.call(self.side.on_finished, set(meta.finished_sends))
            if meta.aborted_sends:
                self.loop.call(self.side.on_aborted, set(meta.aborted_sends))
            if meta.released_sends:  # after on_ready and on_finished, in loop order
                self.loop.call(self.side.on_released, set(meta.released_sends))
            return
        engine_wait.idle_step(meta.idle)  # and for the next step after this one
        for req_id, spec in meta.recvs.items():  # protocol step 19
            self.loop.call(self.side.on_recv, req_id, spec)
        for req_id, transfer_id in meta.cancelled_recvs.items():
            self.loop.call(self.side.on_cancel, req_id, transfer_id)
        for spec in meta.releases:
            self.loop.call(self.side.on_release, spec)

    def wait_for_save(self) -> None:
        """After this step's forward: the prompts completed in it may be pushed now.

        KV in GPU memory goes at once (behind a CUDA event; the copy is DMA). KV in CPU
        memory goes at the next step's start or after `cpu_push_delay_ms`, whichever comes
        first: the push's copies would otherwise share the cores with this step's sampling
        and output when the engine is idle, and a busy engine's next step can be seconds away.
        """
        if not self.settings.early_push or self.side is None:
            return
        delay = self.settings.cpu_push_delay_ms / 1000
        if delay <= 0 or getattr(self._device, "type", "cpu") != "cpu":
            self._hand_over(self._ready.take())
            return
        computed = self._ready.ids()  # not whatever a later step adds before the timer
        if computed:
            self.loop.call_later(delay, self._hand_over_ids, computed)

    def _hand_over_ids(self, ids: set[str]) -> None:
        self._hand_over(self._ready.take(ids))

    def _hand_over(self, items: list[tuple[str, str, list[list[int]]]]) -> None:
        if not items or self.side is None:
            return
        fence = compute_fence(self._device)
        for req_id, transfer_id, block_ids in items:
            self.loop.call(self.side.on_ready, req_id, transfer_id, block_ids, fence)

    def get_transfer_results(self, idle: bool = False) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving); `idle`: this step computes
        nothing, so D may wait idle_wait_ms for a pull to end."""
        if self.side is None:
            return set(), set(), set()
        if self.settings.is_producer:
            return self.side.take_finished(), set(), set()
        wait = self.settings.idle_wait_ms / 1000 if idle else 0.0
        done, failed = self.side.take_results(wait)
        return set(), done, failed

    def get_stats(self) -> PDConnectorStats | None:
        return self.stats.snapshot()

    def shutdown(self) -> None:
        if self.side is not None:
            try:
                self.loop.run(self.side.close(), timeout=5)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                log.debug("side channel close failed", exc_info=True)
        self.loop.stop()
        self.transport.close()
