"""The producer's ledger of transfers: which prefill request's blocks are held for which
transfer, and the one place a transfer's blocks go back to vLLM (docs/protocol.md steps 31-32).

Each P request's KV has one owner at a time: vLLM's scheduler until the request finishes,
then this ledger (`by_req`) until the transfer is settled, then vLLM again, told through
`take_finished`. Runs on the side-channel loop; `take_finished` is also read from vLLM's
worker thread (appliance.connector.reports).
"""

from __future__ import annotations

from collections import OrderedDict

from appliance.connector.reports import Reports
from appliance.connector.transfers.outgoing import Outgoing
from appliance.connector.transfers.state import TransferState

# How many finished transfer ids are remembered to reject a transfer_id seen twice.
_SEEN_IDS = 65536


class Ledger:
    def __init__(self) -> None:
        self.by_transfer: dict[str, Outgoing] = {}
        self.by_req: dict[str, Outgoing] = {}
        self._seen: OrderedDict[str, str] = OrderedDict()  # finished transfer id -> outcome
        self._reports = Reports()

    def take_finished(self) -> set[str]:
        """Prefill requests whose blocks vLLM may free now (finished_sending). Never waits:
        P's held KV is pulled within moments, and a wait would delay P's next prefill."""
        return self._reports.take()[0]

    def _settle(self, t: Outgoing) -> None:
        """A transfer reached a terminal state: free its blocks if the scheduler is done."""
        if self._unlist(t):
            self._remember(t.transfer_id, t.state.value if not t.error else t.error)
        if t.p_req_id is None or t.scheduler_finished:
            self._retire(t)

    def _unlist(self, t: Outgoing) -> bool:
        """Drops t from by_transfer if it is the one listed there; a refused duplicate
        shares the transfer id of a live transfer, which stays."""
        if self.by_transfer.get(t.transfer_id) is t:
            del self.by_transfer[t.transfer_id]
            return True
        return False

    def _retire(self, t: Outgoing) -> None:
        self._unlist(t)
        if t.p_req_id is not None and self.by_req.pop(t.p_req_id, None) is not None:
            if t.scheduler_finished:
                self._report(t.p_req_id)

    def _report(self, req_id: str) -> None:
        self._reports.add(req_id)

    def _remember(self, transfer_id: str, outcome: str) -> None:
        self._seen[transfer_id] = outcome
        self._seen.move_to_end(transfer_id)
        while len(self._seen) > _SEEN_IDS:
            self._seen.popitem(last=False)


    def expire(self, now: float) -> int:
        """P frees KV that no decode node fetched, and fails decode nodes whose prefill
        never finished, once their transfer's deadline (send_timeout_s) passed. Returns
        how many prefilled transfers no decode node asked for (counted as expired)."""
        expired = 0
        for t in list(self.by_transfer.values()):
            if now < t.deadline:
                continue
            if t.state is TransferState.TRANSFERRING and not t.writing:
                # Some decode ranks were served, another never asked (it died, or its
                # request was dropped): free the blocks rather than hold them for it.
                t.fail(f"decode ranks {sorted(t.served)} of {t.legs} were served, the "
                       "others never asked within send_timeout_s", p_req=t.p_req_id,
                       d_req=t.d_req_id)
                self._settle(t)
                continue
            if t.state is not TransferState.WAITING_FOR_INPUT:
                continue
            if t.p_req_id is None:
                why = "prefill did not finish within send_timeout_s"
            else:
                why = "no decode node asked for the KV within send_timeout_s"
                expired += 1
            t.fail(why, p_req=t.p_req_id, d_req=t.d_req_id)
            t.ready.set()
            if t.d_req_id is None:
                self._settle(t)
        return expired
