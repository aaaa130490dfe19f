"""The connector as fault-injection tests run it inside real vLLM servers.

A test names this module as the server's `kv_connector_module_path` (tests.faults.launch)
and sets `PD_FAULT_INJECTION` (tests.faults.plan) in its environment; vLLM then loads this
`PDConnector` in place of the product's. The class keeps the product's name so that what
keys on it (vLLM's config, appliance.connector.httpguard) treats it as ours. Without a plan
in the environment it is the product's connector, unchanged. Each fault goes through a
seam the product has anyway:
- P's writes: the transport the connector picks (`new_transport`), wrapped;
- P's held prefills: the scheduler hook vLLM calls (`get_num_new_matched_tokens`);
- D's dropped replies: the receiver's public `on_response`, which its side channel calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from appliance.connector import facade
from tests.faults.plan import Faults, from_env
from tests.faults.transport import FaultyTransport

if TYPE_CHECKING:
    import torch
    from vllm.v1.request import Request

    from appliance.connector.transfers.transport import Transport


def holds(faults: Faults | None, producer: bool, params: dict[str, Any] | None) -> bool:
    """Whether P's scheduler keeps this request queued: a prefill for a decode node while
    the plan's hold file exists."""
    return (faults is not None and producer and bool(params)
            and bool(params.get("do_remote_decode")) and not params.get("do_remote_prefill")
            and faults.holding_prefills())


def dropping(faults: Faults, on_response: Any) -> Any:
    """`on_response` (D's, on its side-channel loop), losing replies by the plan."""

    def maybe(peer: Any, resp: Any) -> None:
        if not faults.drop_reply():
            on_response(peer, resp)

    return maybe


class PDConnector(facade.PDConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        self.faults = from_env()  # first: the worker's transport is picked inside super()
        super().__init__(vllm_config, role, kv_cache_config)

    def new_transport(self) -> Transport:
        transport = super().new_transport()
        if self.faults is None or not self.settings.is_producer:
            return transport
        return FaultyTransport(transport, self.faults)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if holds(self.faults, self.settings.is_producer, request.kv_transfer_params):
            return None, False  # waits in the queue, as in a backlog; asked again next step
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self.faults is None or self.settings.is_producer or self.worker is None:
            return
        receiver = self.worker.side  # built by super(): its side channel has no peer yet
        receiver.on_response = dropping(self.faults, receiver.on_response)
