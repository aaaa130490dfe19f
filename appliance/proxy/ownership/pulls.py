"""D calls waiting on a P's KV, failed over (D alone) when that P goes down."""

from __future__ import annotations

from collections.abc import Callable

from appliance.proxy.ownership.kv import PREFILL_DOWN, Holder, PrefillKV
from appliance.proxy.upstream.response import Response, UpstreamError


class Pulls:
    """D calls waiting on P's KV, by P node: when a P goes down they are failed over
    (D alone) instead of waiting for D's `recv_timeout_s`."""

    def __init__(self, landed: Callable[[PrefillKV], bool] = lambda kv: False) -> None:
        self._by_node: dict[str, set[PrefillKV]] = {}
        self._landed = landed  # D holds the KV already (see PrefillKV.lands)

    def waiting(self, kv: PrefillKV, d_call: Response) -> None:
        if kv.holder is not Holder.ASKED:
            return
        kv.d_call = d_call
        self._by_node.setdefault(kv.p.url, set()).add(kv)

    def done(self, kv: PrefillKV) -> None:
        group = self._by_node.get(kv.p.url)
        if group is not None:
            group.discard(kv)
            if not group:
                del self._by_node[kv.p.url]

    def fail_over(self, p_url: str, why: str) -> tuple[list[str], list[str]]:
        """Fail the D calls still waiting on this P's KV, not those whose KV D holds already
        (a whole answer says nothing until its decode ends: they would be computed twice);
        returns (failed, kept) transfer ids."""
        failed, kept = [], []
        for kv in list(self._by_node.get(p_url, ())):
            call = kv.d_call
            if kv.holder is Holder.ASKED and call is not None and not call.done:
                if self._landed(kv):
                    kept.append(kv.transfer_id)
                    continue
                call.abort(UpstreamError(PREFILL_DOWN, why))
                failed.append(kv.transfer_id)
        return failed, kept
