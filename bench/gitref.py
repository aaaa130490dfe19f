"""A detached git worktree of another commit, for the benchmarks' `--compare-ref`: the
before/after of a change measured side by side in one run."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checkout(ref: str, where: Path) -> Path:
    """`ref` checked out at `where` (made anew each run); its package is what a process
    started there imports."""
    remove(where)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), ref],
                   check=True, capture_output=True)
    return where


def remove(where: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                   capture_output=True)
