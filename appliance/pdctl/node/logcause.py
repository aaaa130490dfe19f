"""Why a service failed, in a few lines of its own log: the error lines (exception
messages, ERROR records, the preflight's verdict) with vLLM's process and time prefixes
stripped, each once, the root cause first as the log had it. Pure text in, lines out; the
callers fetch the log (containers: the Docker API; local processes: their log file)."""

from __future__ import annotations

import re

# "(EngineCore pid=12) ERROR 12-02 06:29:03 [core.py:1510] " and "(APIServer pid=1) "
_PROC = re.compile(r"^\((?:[A-Za-z_][\w-]*)(?: pid=\d+)?\)\s*")
_RECORD = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d"
                     r"(?:\.\d+)?\s+\[[^\]]*\]\s*")
# An exception's message line: "RuntimeError: ...", "torch._inductor.exc.InductorError: ..."
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)"
                        r"(?::|$)")
_VERDICT = re.compile(r"(?:^|\s)(?:error|fatal|FATAL|ERROR)(?::|\s)")
# Lines that name the failure without being it.
_NOISE = ("Traceback (most recent call last)", "See root cause above",
          "please check the stack trace above", "warnings.warn(")


def _strip(line: str) -> str:
    line = _PROC.sub("", line.rstrip())
    return _RECORD.sub("", line).strip()


def _below_error(line: str) -> bool:
    """A DEBUG/INFO/WARNING record: never the failure, whatever words it uses."""
    level = _PROC.sub("", line.lstrip()).split(" ", 1)[0]
    return level in ("DEBUG", "INFO", "WARNING") and bool(_RECORD.match(_PROC.sub("", line)))


def _is_error(line: str) -> bool:
    if not line or line.startswith(("File \"", "^", "~")) or any(n in line for n in _NOISE):
        return False
    return bool(_EXCEPTION.match(line)) or bool(_VERDICT.search(line))


def _continues_not(line: str) -> bool:
    return line.startswith(("File \"", "^", "~", "For further information"))


def error_excerpt(text: str, limit: int = 4) -> list[str]:
    """Up to `limit` distinct error lines, oldest first (the root cause tends to come
    first); the last lines of the log when none looks like an error."""
    seen: dict[str, None] = {}
    last: str | None = None  # the error line a continuation line would belong to
    for raw in text.splitlines():
        line = _strip(raw)
        if not _below_error(raw) and _is_error(line):
            seen.pop(line, None)  # a repeat moves to the end: its latest place counts
            seen[line] = None
            last = line
        elif last is not None and raw[:1].isspace() and line and not _continues_not(line):
            # A multi-line message (pydantic's "1 validation error for X" + "  Value error,
            # ..."): its first continuation belongs to it.
            seen.pop(last)
            last = f"{last}: {line}"
            seen[last] = None
            last = None
        else:
            last = None
    found = list(seen)
    if not found:
        tail = [s for s in (_strip(r) for r in text.splitlines()) if s]
        return [line[:300] for line in tail[-limit:]]
    # An exception chained through several processes repeats its message with a wrapper
    # ("Worker failed with error 'X'"): keep the first lines, they carry the cause.
    picked = found[:limit - 1] + found[-1:] if len(found) > limit else found
    return [line[:300] for line in picked]
