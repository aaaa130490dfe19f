"""A fault plan and its draws. A vLLM server started with `PD_FAULT_INJECTION` in its
environment and this package's connector (tests.faults.connector), e.g.
`write_fail=16,reply_drop=16,write_delay_ms=5,seed=1`, gets:

- `write_fail=N`: 1 in N of P's transport writes fails (as a lost peer would);
- `write_corrupt=N`: 1 in N of P's writes lands with 8 bytes of D's first block overwritten
  and is reported written (a bad NIC, a bug): D's `verify_kv` must catch it;
- `reply_drop=N`: 1 in N of the side-channel replies D receives is dropped, as if lost on
  the way (D waits for its deadline, then asks again or recomputes);
- `write_delay_ms=M`: every write of P starts M ms late (a slow or congested link);
- `prefill_hold_file=PATH`: while PATH exists, P's scheduler starts no new prefill for a
  decode node (they wait in its queue, as behind a backlog, and an abort removes one
  before it is computed); removing the file lets them run;
- `seed=S`: the draws, so that a run can be repeated.

Whatever is injected, a request must end with a plain server's exact output (D recomputes
what it did not get) or an error, never another text: that is what the tests check.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Under vLLM's logger, so that the lines reach the server's log with vLLM's own.
log = logging.getLogger("vllm.tests.faults")

ENV = "PD_FAULT_INJECTION"


@dataclass(frozen=True)
class FaultPlan:
    write_fail: int = 0
    write_corrupt: int = 0
    reply_drop: int = 0
    write_delay_ms: float = 0.0
    seed: int = 0
    prefill_hold_file: str = ""

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """`key=value,...`; ValueError naming the bad part."""
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            if not sep or key not in cls.__dataclass_fields__:
                raise ValueError(f"{ENV}: {part!r} is not one of write_fail=N, "
                                 "write_corrupt=N, reply_drop=N, write_delay_ms=M, "
                                 "prefill_hold_file=PATH, seed=S")
            if key == "prefill_hold_file":
                values[key] = raw
                continue
            try:
                values[key] = float(raw) if key == "write_delay_ms" else int(raw)
            except ValueError:
                raise ValueError(f"{ENV}: {part!r} needs a number") from None
            if values[key] < 0:
                raise ValueError(f"{ENV}: {part!r} must not be negative")
        return cls(**values)


class Faults:
    """The draws of one process; thread-safe (writes run on the push threads)."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._lock = threading.Lock()
        self.injected = {"write_fail": 0, "write_corrupt": 0, "reply_drop": 0}

    def _one_in(self, n: int, what: str) -> bool:
        if n <= 0:
            return False
        with self._lock:
            hit = self._rng.randrange(n) == 0
            if hit:
                self.injected[what] += 1
        return hit

    def drop_reply(self) -> bool:
        dropped = self._one_in(self.plan.reply_drop, "reply_drop")
        if dropped:
            log.warning("fault injection: a side-channel reply dropped")
        return dropped

    def fail_write(self) -> bool:
        failed = self._one_in(self.plan.write_fail, "write_fail")
        if failed:
            log.warning("fault injection: a Mooncake write failed")
        return failed

    def corrupt_write(self) -> bool:
        corrupt = self._one_in(self.plan.write_corrupt, "write_corrupt")
        if corrupt:
            log.warning("fault injection: a Mooncake write landed corrupted")
        return corrupt

    def holding_prefills(self) -> bool:
        """P's scheduler: whether new prefills wait (prefill_hold_file exists)."""
        return bool(self.plan.prefill_hold_file) and os.path.exists(self.plan.prefill_hold_file)


def from_env(environ: Mapping[str, str] | None = None) -> Faults | None:
    text = (os.environ if environ is None else environ).get(ENV, "")
    if not text:
        return None
    plan = FaultPlan.parse(text)
    log.warning("fault injection ON (%s=%s): for tests only", ENV, text)
    return Faults(plan)
