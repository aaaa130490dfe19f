"""D calls waiting on a P's KV, failed over (D alone) when that P goes down.

A call whose blocks D's KV events show cached is kept: its pull is over. But the events
name blocks, not requests: another request with the same full blocks can make a call that
still waits on the dead P look landed. So the kept calls are checked again a moment later
against D's own count of KV loads not finished (vLLM's `num_requests_kv_fetch_by_stage`):
when D has more of them than this proxy's calls waiting there on live Ps, some kept call is
one of them, and the kept calls still waiting are failed over too (D alone: its prefix cache
holds what did land, so a call wrongly suspected costs little).
"""

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

    def kept(self, p_url: str) -> dict[str, list[PrefillKV]]:
        """The calls on this (down) P still waiting, by the D they wait on."""
        out: dict[str, list[PrefillKV]] = {}
        for kv in self._by_node.get(p_url, ()):
            if kv.holder is Holder.ASKED and kv.d_call is not None and not kv.d_call.done:
                out.setdefault(kv.d_url, []).append(kv)
        return out

    def waiting_elsewhere(self, d_url: str, p_url: str) -> int:
        """This proxy's calls on `d_url` still waiting on the KV of Ps other than `p_url`."""
        return sum(1 for url, group in self._by_node.items() if url != p_url
                   for kv in group if kv.d_url == d_url and kv.holder is Holder.ASKED)

    def recheck(self, p_url: str, d_url: str, loading: int | None, why: str) -> list[str]:
        """Fail over the kept calls on `d_url` when D has more KV loads unfinished
        (`loading`; None: unknown) than this proxy's calls on live Ps there; returns
        their transfer ids."""
        suspects = self.kept(p_url).get(d_url, [])
        if not suspects or (loading is not None
                            and loading <= self.waiting_elsewhere(d_url, p_url)):
            return []
        for kv in suspects:
            assert kv.d_call is not None
            kv.d_call.abort(UpstreamError(PREFILL_DOWN, why))
        return [kv.transfer_id for kv in suspects]
