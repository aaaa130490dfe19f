"""The bootstrap's in-memory map: dp rank -> engine id -> (tp, pp) -> side-channel address.

Goes beyond the reference: every worker entry carries a last-seen time and disappears when
it is not refreshed within the TTL, so a dead prefill node drops out of `/query`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.bootstrap.wire import EngineView, QueryAnswer, Registration


class RegistryConflict(Exception):
    """A registration that contradicts what is already known (answered with 400)."""


@dataclass
class _Worker:
    addr: str
    last_seen: float


@dataclass
class _Engine:
    engine_id: str
    workers: dict[tuple[int, int], _Worker] = field(default_factory=dict)
    tp_size: int = 0


class Registry:
    """Registrations keyed by dp rank. `ttl <= 0` keeps entries until deleted."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._by_dp: dict[int, _Engine] = {}

    def register(self, reg: Registration) -> bool:
        """Add or refresh a worker. Returns True when the entry is new."""
        self.expire()
        engine = self._by_dp.get(reg.dp_rank)
        if engine is not None and engine.engine_id != reg.engine_id:
            raise RegistryConflict(
                f"dp rank {reg.dp_rank} is held by engine {engine.engine_id!r}, "
                f"not {reg.engine_id!r}"
            )
        for dp, other in self._by_dp.items():
            if dp != reg.dp_rank and other.engine_id == reg.engine_id:
                raise RegistryConflict(
                    f"engine {reg.engine_id!r} is already registered for dp rank {dp}"
                )
        key = (reg.tp_rank, reg.pp_rank)
        now = self._clock()
        if engine is None:
            engine = _Engine(reg.engine_id, tp_size=reg.tp_size)
        elif engine.tp_size != reg.tp_size:
            raise RegistryConflict(
                f"engine {reg.engine_id!r} registered with tp size {engine.tp_size}, now "
                f"{reg.tp_size}")
        worker = engine.workers.get(key)
        if worker is not None and worker.addr != reg.addr and reg.replace:
            # A restarted worker (same engine id, new side channel): its predecessor is gone,
            # and a decode node sent to the old address would wait for KV that never comes.
            del engine.workers[key]
            worker = None
        if worker is not None and worker.addr != reg.addr:
            raise RegistryConflict(
                f"worker tp {reg.tp_rank} pp {reg.pp_rank} of engine {reg.engine_id!r} is "
                f"registered at {worker.addr}, not {reg.addr}"
            )
        self._by_dp[reg.dp_rank] = engine
        if worker is None:
            engine.workers[key] = _Worker(reg.addr, now)
            return True
        worker.last_seen = now
        return False

    def delete(self, engine_id: str) -> int:
        """Forget every dp rank of an engine (clean shutdown). Returns the count removed."""
        gone = [dp for dp, e in self._by_dp.items() if e.engine_id == engine_id]
        for dp in gone:
            del self._by_dp[dp]
        return len(gone)

    def expire(self) -> list[str]:
        """Drop workers not refreshed within the TTL; returns engine ids that vanished."""
        if self.ttl <= 0:
            return []
        deadline = self._clock() - self.ttl
        vanished = []
        for dp in list(self._by_dp):
            engine = self._by_dp[dp]
            for key in [k for k, w in engine.workers.items() if w.last_seen < deadline]:
                del engine.workers[key]
            if not engine.workers:
                vanished.append(engine.engine_id)
                del self._by_dp[dp]
        return vanished

    def query(self) -> QueryAnswer:
        self.expire()
        answer: QueryAnswer = {}
        for dp in sorted(self._by_dp):
            engine = self._by_dp[dp]
            addrs: dict[str, dict[str, str]] = {}
            for (tp, pp), worker in sorted(engine.workers.items()):
                addrs.setdefault(str(tp), {})[str(pp)] = worker.addr
            answer[str(dp)] = EngineView(engine_id=engine.engine_id, worker_addr=addrs,
                                         tp_size=engine.tp_size)
        return answer

    def __len__(self) -> int:
        return len(self._by_dp)
