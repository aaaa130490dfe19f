"""The one seam for external commands (nvidia-smi, ibv_devinfo, ip, docker, docker compose).

Tests hand pdctl a fake runner with canned outputs; everything else uses `SubprocessRunner`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

NOT_FOUND = 127


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def missing(self) -> bool:
        """The executable itself was not found."""
        return self.returncode == NOT_FOUND

    def reason(self) -> str:
        """The first non-empty line of stderr (or stdout): what to show in one line."""
        for text in (self.stderr, self.stdout):
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            if lines:
                return lines[0]
        return f"exit code {self.returncode}"


class Runner(Protocol):
    def run(self, argv: Sequence[str], timeout: float = 30.0) -> CommandResult: ...


class SubprocessRunner:
    def run(self, argv: Sequence[str], timeout: float = 30.0) -> CommandResult:
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            return CommandResult(NOT_FOUND, stderr=f"{argv[0]}: command not found")
        except subprocess.TimeoutExpired:
            return CommandResult(124, stderr=f"{' '.join(argv)}: timed out after {timeout:.0f}s")
        except OSError as exc:
            return CommandResult(126, stderr=f"{argv[0]}: {exc.strerror or exc}")
        return CommandResult(proc.returncode, proc.stdout, proc.stderr)
