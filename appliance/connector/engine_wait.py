"""How a decode node's vLLM processes wait for each other while the engine only waits for
KV: the one seam to vLLM's inter-process queue (vLLM 0.32's shm_broadcast.SpinCondition).

vLLM's engine core and its worker process pass each step through a shared-memory queue
whose reader spins (sched_yield) for a second after its last read before it sleeps on a
socket. While requests wait for KV the engine steps with nothing to compute every
millisecond, so both processes spin without pause: a D that only waits burns a whole core
(measured, bench/idle_wait.py). Two changes, both only while the current step computes
nothing:

- the worker waits up to `idle_wait_ms` for a pull to end (appliance.connector.reports)
  instead of returning at once; a pull's end wakes it at once;
- each process's queue reader spins only `IDLE_SPIN_S` before it sleeps on vLLM's own
  notification socket (the path it takes anyway after a second without reads).

A step with tokens to compute clears the switch first: decoding keeps vLLM's full spin.
Where the queue is not what this module knows (another vLLM), nothing is changed and the
node only spins as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("vllm.appliance.connector.engine_wait")

IDLE_SPIN_S = 0.0005
_idle = threading.Event()  # this process's current step computes nothing
_installed = False
_lock = threading.Lock()


def idle_step(idle: bool) -> None:
    """This process's step computes nothing (True) or has tokens to compute (False)."""
    if idle:
        _idle.set()
    else:
        _idle.clear()


def short_spin(wait: Any) -> Any:
    """`SpinCondition.wait`, spinning only IDLE_SPIN_S while the step is idle."""
    def wait_idle(self: Any, timeout_ms: int | None = None) -> None:
        if not _idle.is_set() or not getattr(self, "is_reader", False):
            return wait(self, timeout_ms)
        full = self.busy_loop_s
        self.busy_loop_s = min(full, IDLE_SPIN_S)
        try:
            return wait(self, timeout_ms)
        finally:
            self.busy_loop_s = full
    return wait_idle


def install() -> bool:
    """Once per process; False (and a log line) when vLLM's queue is not the one known."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from vllm.distributed.device_communicators import shm_broadcast
        except ImportError:
            return False
        cls = getattr(shm_broadcast, "SpinCondition", None)
        if cls is None or not callable(getattr(cls, "wait", None)) \
                or "busy_loop_s" not in cls.__init__.__code__.co_varnames:
            log.info("vLLM's shared-memory queue is not the one this connector knows: a "
                     "decode node waiting for KV spins its core as vLLM does")
            return False
        cls.wait = short_spin(cls.wait)
        _installed = True
        return True
