"""Which TCP sockets a set of processes listens on (`ss -Hltnp`), for the tests that check
nothing of a node listens on a wildcard address but what is configured to."""

from __future__ import annotations

import subprocess
from pathlib import Path

WILDCARDS = {"0.0.0.0", "*", "::"}


def listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    """(local address, port, pid) of every TCP socket these processes listen on."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        local, users = fields[3], " ".join(fields[5:])
        addr, _, port = local.rpartition(":")
        for pid in pids:
            if f"pid={pid}," in users:
                found.append((addr.strip("[]"), int(port), pid))
    return found


def descendants(roots: set[int]) -> set[int]:
    """These processes and all their children, grandchildren..."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found
