"""What the worker tells vLLM at its next step: request ids whose transfer is over (and,
on D, which of them failed). Filled on the side-channel loop, taken on vLLM's thread.

On D, a step that computes nothing (the engine only waits for KV) may wait a little for
the next report instead of returning at once (appliance.connector.engine_wait): vLLM's
engine loop steps again after a 1 ms nap whenever requests wait on a connector. A report
wakes the wait at once, so no transfer is reported later; what a wait can delay is a new
request arriving meanwhile, by at most the wait.
"""

from __future__ import annotations

import threading


class Reports:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._done: set[str] = set()
        self._failed: set[str] = set()

    def add(self, req_id: str, ok: bool = True) -> None:
        with self._cond:
            self._done.add(req_id)
            if not ok:
                self._failed.add(req_id)
            self._cond.notify_all()

    def take(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """(done, failed) since the last call; failed is a subset. With `wait_s`, waits up
        to that long for a first one when there is none."""
        with self._cond:
            if wait_s > 0 and not self._done:
                self._cond.wait(wait_s)
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed
