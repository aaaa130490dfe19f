"""The producer's ledger of transfers: which prefill request's blocks are held for which
transfer, and the one place a transfer's blocks go back to vLLM (seeds steps 31-32).

Each P request's KV has one owner at a time: vLLM's scheduler until the request finishes,
then this ledger (`by_req`) until the transfer is settled, then vLLM again, told through
`take_finished`. Runs on the side-channel loop; `take_finished` is also read from vLLM's
worker thread (appliance.connector.reports).
"""

from __future__ import annotations

from collections import OrderedDict

from appliance.connector.reports import Reports
from appliance.connector.transfers.outgoing import Outgoing

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

