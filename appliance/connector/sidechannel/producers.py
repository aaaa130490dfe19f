"""Consumer (D) side, docs/protocol.md step 20: which producer workers hold a request's
KV, looked up through the producer's bootstrap sidecar and cached per (sidecar, engine id).

With the producer's TP equal to ours, our rank pulls from its own rank (the reference's
only case); with a larger producer TP, from each producer rank holding some of our heads
(appliance.connector.planning.tpplan). One lookup per producer at a time; a cached entry naming a
dead worker, or missing a rank that registered later, is looked up again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from appliance.bootstrap.client import BootstrapClient, BootstrapError
from appliance.connector.planning.plan import PlanError
from appliance.connector.planning.tpplan import pulls_for, unpulled_ranks
from appliance.connector.settings import ConnectorSettings

Key = tuple[str, str]  # (bootstrap sidecar URL, producer engine id)


class Producers:
    def __init__(self, settings: ConnectorSettings, tp_rank: int, tp_size: int,
                 total_heads: int | None, gone: Callable[[str], bool],
                 replaced: Callable[[str], None] = lambda addr: None) -> None:
        self.settings = settings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.total_heads = total_heads  # the model's KV heads; 0: MLA; None: unknown
        self._gone = gone  # whether a side-channel address's link has dropped
        # Told each address the sidecar no longer names for its engine and rank: a worker
        # restarted elsewhere, so the old one writes nothing more.
        self._replaced = replaced
        self._named: dict[tuple[Key, int], str] = {}  # what the sidecar last named
        self._clients: dict[str, BootstrapClient] = {}
        self._engines: dict[Key, dict[int, str]] = {}  # tp_rank -> side-channel address
        self._tp_sizes: dict[Key, int] = {}
        self._lookups: dict[Key, asyncio.Future] = {}

    async def resolve(self, bootstrap: str, engine_id: str, again: bool = True) -> list[str]:
        """Side-channel addresses of the producer workers that hold our KV heads; raises
        BootstrapError or PlanError."""
        key = (bootstrap, engine_id)
        if not self._ranks_known(key):
            # Unknown, or cached before this rank's producer worker registered (TP ranks
            # register one by one): ask the sidecar again.
            pending = self._lookups.get(key)
            if pending is None:
                pending = self._lookups[key] = asyncio.ensure_future(self._query(bootstrap))
                pending.add_done_callback(lambda _f: self._lookups.pop(key, None))
            await asyncio.shield(pending)
        workers = self._engines.get(key)
        if not workers:
            raise BootstrapError(f"engine {engine_id!r} is not registered at {bootstrap}")
        ranks = self._source_ranks(key)
        missing = [r for r in ranks if r not in workers]
        if missing:
            raise BootstrapError(f"engine {engine_id!r} has no worker for tp rank "
                                 f"{missing[0]} (it has {sorted(workers)})")
        addrs = [workers[r] for r in ranks]
        if again and any(self._gone(a) for a in addrs):
            # A dead worker's address, cached (or still registered) after its link dropped:
            # a restarted P has registered anew by the time it is asked to prefill.
            del self._engines[key]
            return await self.resolve(bootstrap, engine_id, again=False)
        return addrs

    def unpulled(self, bootstrap: str, engine_id: str) -> list[tuple[int, str | None]]:
        """The producer ranks no consumer rank pulls from (its TP larger than ours), with
        their side-channel addresses (None: not registered); empty when unknown."""
        key = (bootstrap, engine_id)
        workers = self._engines.get(key, {})
        if not workers:
            return []
        try:
            ranks = unpulled_ranks(self._tp_sizes.get(key) or self.tp_size, self.tp_size,
                                   self.total_heads)
        except PlanError:
            return []
        return [(r, workers.get(r)) for r in ranks]

    def forget(self, addr: str) -> None:
        """A producer worker given up on may be restarting at another address (same engine
        id): the next pull asks the sidecar again."""
        for key, workers in list(self._engines.items()):
            if addr in workers.values():
                del self._engines[key]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    def _source_ranks(self, key: Key) -> list[int]:
        """The producer's TP ranks holding our heads: ours alone when its TP equals ours."""
        p_tp = self._tp_sizes.get(key) or self.tp_size
        return [p.p_rank for p in pulls_for(self.tp_rank, self.tp_size, p_tp,
                                            self.total_heads)]

    def _ranks_known(self, key: Key) -> bool:
        if key not in self._engines:
            return False
        try:
            return all(r in self._engines[key] for r in self._source_ranks(key))
        except PlanError:
            return True  # resolve raises it with the producer's answer in hand

    async def _query(self, bootstrap: str) -> None:
        client = self._clients.get(bootstrap)
        if client is None:
            client = self._clients[bootstrap] = BootstrapClient(
                bootstrap, self.settings.bootstrap_token,
                timeout=min(10.0, self.settings.recv_timeout_s))
        answer = await client.query()
        for view in answer.values():
            key = (bootstrap, view.engine_id)
            workers = self._engines[key] = {
                int(tp): pps["0"] for tp, pps in view.worker_addr.items() if "0" in pps}
            for rank, addr in workers.items():
                before = self._named.get((key, rank))
                self._named[(key, rank)] = addr
                if before is not None and before != addr:
                    self._replaced(before)
            # A sidecar that does not know the producer's TP size (vLLM's own) leaves it
            # out: then it is assumed equal to ours, the reference's only case.
            self._tp_sizes[key] = view.tp_size
