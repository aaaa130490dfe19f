"""pdctl's error type: one line per problem, and the exit code it maps to."""

from __future__ import annotations

from collections.abc import Iterable

USAGE = 2  # bad flags or bad config
RUNTIME = 1  # something on the host or in a service failed


class PdctlError(Exception):
    """Printed as `pdctl: error: <line>` for each line; exits with `code`."""

    def __init__(self, lines: str | Iterable[str], code: int = RUNTIME, detail: str = "") -> None:
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        self.code = code
        # Printed as is after the error lines (e.g. the last lines of a service's log).
        self.detail = detail
        super().__init__("; ".join(self.lines))


class ConfigError(PdctlError):
    def __init__(self, lines: str | Iterable[str]) -> None:
        super().__init__(lines, USAGE)
