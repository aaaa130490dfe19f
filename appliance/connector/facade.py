"""The facade vLLM loads: PDConnector, through `kv_connector_module_path`.

    --kv-transfer-config '{"kv_connector": "PDConnector",
                           "kv_connector_module_path": "appliance.connector.facade",
                           "kv_role": "kv_producer" | "kv_consumer", "engine_id": "...",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"bootstrap_addr": "http://host:8998",
                                                        "protocol": "tcp" | "rdma", ...}}'

One facade hands each call to the scheduler side (`scheduler.PDScheduler`, EngineCore
process) or the worker side (`worker.PDWorker`, each worker process) by role. The request
protocol is vLLM's MooncakeConnector protocol (`kv_transfer_params`), so vLLM's example
proxy and ours both drive it. Settings: `settings.ConnectorSettings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from appliance.connector.metadata import PDConnectorMetadata
from appliance.connector.planning.groups import kv_groups
from appliance.connector.settings import ConnectorSettings
from appliance.connector.stats import PDConnectorStats

if TYPE_CHECKING:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from appliance.connector.transfers.transport import Transport


class PDConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.from_kv_transfer_config(vllm_config.kv_transfer_config)
        # At start-up, in both roles: a model whose KV cannot be moved is refused here, with
        # the feature named, never on its first request.
        groups = kv_groups(kv_cache_config)
        self.scheduler = None
        self.worker = None
        if not self.settings.is_producer and self.settings.idle_wait_ms > 0:
            from appliance.connector import engine_wait

            engine_wait.install()  # both processes: engine core (scheduler) and worker
        if role == KVConnectorRole.SCHEDULER:
            from appliance.connector.scheduler import PDScheduler

            if self.settings.side_channel_key_file:
                from appliance.connector import kvevents
                from appliance.sidechannel import curve

                # Before vLLM's scheduler builds its KV-event publisher (right after us).
                kvevents.install(curve.read_key(self.settings.side_channel_key_file))

            self.scheduler = PDScheduler(self.settings, groups,
                                         getattr(kv_cache_config, "hash_block_size", None))
        else:
            from appliance.connector.worker import PDWorker

            self.worker = PDWorker(self.settings, vllm_config, kv_cache_config,
                                   self.new_transport())

    def new_transport(self) -> Transport:
        """The KV transport the worker starts, picked here and only here: Mooncake's
        TransferEngine. This method is the connector's transport seam: tests that inject
        faults into real servers register a subclass (tests/faults/connector.py) that wraps
        what it returns, so the path a user runs carries no test hook."""
        from appliance.connector.transfers.mooncake import MooncakeTransport

        return MooncakeTransport()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Layer-compact, block-contiguous pages (LBHNC): each layer is one region whose
        consecutive blocks touch, so a run of blocks becomes one descriptor
        (docs/protocol.md step 28). Any other layout still transfers correctly, with more
        descriptors."""
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None or model_config.use_mla:
            return None
        return "LBHNC"

    # --- scheduler side -----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.kv_cache_manager = kv_cache_manager

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output.finished_recving)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
            self, request: Request,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    # --- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Called before the forward (and before the metadata is bound), in both of
        vLLM's model runners: see the hook table in worker.py."""
        assert self.worker is not None
        assert isinstance(kv_connector_metadata, PDConnectorMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """KV arrives whole before the request is scheduled; nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """The producer pushes whole requests after the forward (see wait_for_save)."""

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        meta = self._connector_metadata  # this step's, bound until after this call
        idle = isinstance(meta, PDConnectorMetadata) and meta.idle
        sending, recving, failed = self.worker.get_transfer_results(idle)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.get_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return PDConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from appliance.connector.stats import build_prom_metrics

        return build_prom_metrics(vllm_config, metric_types, labelnames,
                                  per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
