"""The local node's state file and its processes, found by the run id they carry.

`pdctl up --local` writes the state file (each service's process group and the run id that
every process of the node, vLLM's children too, carries in its environment); `pdctl status`,
`drain` and `down --local` read it back and find exactly these processes, nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from appliance.pdctl.errors import PdctlError
from appliance.pdctl.node.status import Endpoints, ProcessState

RUN_ID_ENV = "PDCTL_RUN_ID"
STATE_FILE = "state.json"


@dataclass
class ServiceRecord:
    name: str
    pid: int  # the process group leader; its pid is the group id
    url: str
    log: str


@dataclass
class LocalState:
    run_id: str
    supervisor_pid: int | None
    started_at: float
    model: str
    endpoints: dict[str, Any]
    services: list[ServiceRecord]

    @classmethod
    def load(cls, run_dir: Path) -> LocalState | None:
        try:
            data = json.loads((run_dir / STATE_FILE).read_text())
            data["services"] = [ServiceRecord(**s) for s in data["services"]]
            return cls(**data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise PdctlError(f"{run_dir / STATE_FILE}: unreadable state file ({exc}); remove "
                             f"it once no node process is left") from None

    def save(self, run_dir: Path) -> None:
        tmp = run_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(run_dir / STATE_FILE)

    def endpoints_obj(self) -> Endpoints:
        return Endpoints(**self.endpoints)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of a live pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[2])


def marked_processes(run_id: str) -> dict[int, int]:
    """pid -> process group of every live process carrying this run's id."""
    marker = f"{RUN_ID_ENV}={run_id}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if marker in env.split(b"\0"):
            stat = _proc_stat(int(entry))
            if stat is not None and stat[0] not in ("Z", "X"):
                found[int(entry)] = stat[1]
    return found


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def process_states(state: LocalState) -> dict[str, ProcessState]:
    live = marked_processes(state.run_id)
    out = {}
    for rec in state.services:
        members = sum(1 for pgid in live.values() if pgid == rec.pid)
        if rec.pid in live:
            out[rec.name] = ProcessState("running", True, f"pid {rec.pid}, {members} "
                                                           f"process{'es' if members > 1 else ''}")
        elif members:
            out[rec.name] = ProcessState("degraded", False,
                                         f"leader {rec.pid} gone, {members} left")
        else:
            out[rec.name] = ProcessState("exited", False, f"pid {rec.pid}")
    return out


def wait_gone(run_id: str, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        left = marked_processes(run_id)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_marked(run_id: str, groups: set[int], grace: float) -> dict[int, int]:
    """SIGTERM this run's process groups (and stray members), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        left = marked_processes(run_id)
        if not left:
            return {}
        for pgid in {g for g in left.values() if g in groups}:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid, pgid in left.items():
            if pgid not in groups:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        left = wait_gone(run_id, wait)
    return left
