"""How the relay reads D's event stream, per API: which events carry a token, how a stream
that ended completely looks, and how the proxy says it failed.

- chat and completions: `data:` chunks, the last one `data: [DONE]`;
- the Responses API: `event: <type>` + `data:` per event, no [DONE]: the stream's last
  event is `response.completed`. vLLM sends `response.created` and `response.in_progress`
  before its engine has the request (before D's connector pulls or frees P's KV), so
  those are held back until the next event: the client's first byte then means what it
  means for chat (the engine produced output), a D asked again alone after its P went
  down opens the stream afresh, and a whole local answer's first token times its prefill.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from appliance.httperrors import error_body
from appliance.proxy.errors import sse_error_event
from appliance.proxy.openai_api import RESPONSES

_encode = msgspec.json.encode


def token_events(chunk: bytes) -> int:
    """The SSE events in `chunk` that carry a token: not [DONE], a usage-only event or a
    chat stream's opening role event (vLLM's compact JSON, and the proxy's)."""
    return (chunk.count(b"data: ") - chunk.count(b"data: [DONE]") - chunk.count(b'"choices":[]')
            - chunk.count(b'"delta":{"role":"assistant","content":""}'))


class EventStream(Protocol):
    """One stream's reading (each stream gets its own: it keeps state)."""

    end: str  # what a complete stream ends with, for the error that says it did not

    def hold(self, chunk: bytes) -> bytes:
        """What of D's bytes may go to the client now (the rest comes with a later chunk)."""
        ...

    def restart(self) -> None:
        """D is asked again: what was held of its first answer is dropped."""
        ...

    def flush(self) -> bytes:
        """What is still held when D's stream ends."""
        ...

    def seen(self, chunk: bytes) -> None:
        """`chunk` went to the client."""
        ...

    @property
    def complete(self) -> bool: ...

    def tokens(self, chunk: bytes) -> int: ...

    def steps(self, chunk: bytes) -> int:
        """Events in `chunk` that count for D's time per step."""
        ...

    def step_s(self, first: float, last: float, steps: int) -> float | None:
        """D's time per decode step, from its first event to its last counted one."""
        ...

    def error(self, status: int, message: str) -> bytes:
        """The event a failed stream ends with."""
        ...


class DataStream:
    """Chat and completions streams."""

    end = "[DONE]"

    def __init__(self) -> None:
        self._tail = b""

    def hold(self, chunk: bytes) -> bytes:
        return chunk

    def restart(self) -> None:
        pass

    def flush(self) -> bytes:
        return b""

    def seen(self, chunk: bytes) -> None:
        self._tail = (self._tail + chunk[-32:])[-32:]

    @property
    def complete(self) -> bool:
        return b"[DONE]" in self._tail

    def tokens(self, chunk: bytes) -> int:
        return token_events(chunk)

    def steps(self, chunk: bytes) -> int:
        return chunk.count(b"data: ")

    def step_s(self, first: float, last: float, steps: int) -> float | None:
        # The role event and [DONE] are events too.
        return (last - first) / (steps - 2) if steps > 3 else None

    def error(self, status: int, message: str) -> bytes:
        return sse_error_event(status, message)


# Events vLLM sends before its engine has the request.
_PREAMBLE = frozenset({b"response.created", b"response.in_progress"})
# Events that end a Responses stream (vLLM 0.32 sends the first; the rest are the API's).
_ENDS = (b"event: response.completed\n", b"event: response.incomplete\n",
         b"event: response.failed\n", b"event: error\n")
_CARRY = max(len(e) for e in _ENDS)


class ResponseEvents:
    """Responses API streams (the module's doc)."""

    end = "response.completed"

    def __init__(self) -> None:
        self._held = b""
        self._open = False
        self._carry = b""
        self._complete = False

    def hold(self, chunk: bytes) -> bytes:
        if self._open:
            return chunk
        self._held += chunk
        if not _past_preamble(self._held):
            return b""
        self._open = True
        out, self._held = self._held, b""
        return out

    def restart(self) -> None:
        self._held = b""

    def flush(self) -> bytes:
        out, self._held = self._held, b""
        return out

    def seen(self, chunk: bytes) -> None:
        # A raw newline never occurs inside an event's JSON: an end marker is an event's.
        window = self._carry + chunk
        if any(end in window for end in _ENDS):
            self._complete = True
        self._carry = window[-_CARRY:]

    @property
    def complete(self) -> bool:
        return self._complete

    def tokens(self, chunk: bytes) -> int:
        # One delta event (output text, reasoning, a tool call's arguments) per engine step.
        return chunk.count(b".delta\n")

    def steps(self, chunk: bytes) -> int:
        return self.tokens(chunk)

    def step_s(self, first: float, last: float, steps: int) -> float | None:
        return (last - first) / (steps - 1) if steps > 2 else None

    def error(self, status: int, message: str) -> bytes:
        # The API's error event; its `error` member is what makes the openai SDK raise.
        body = error_body(status, message)
        data = {"type": "error", "code": body["error"]["type"], "message": message,
                "param": None, **body}
        return b"event: error\ndata: " + _encode(data) + b"\n\n"


def _past_preamble(buffer: bytes) -> bool:
    """Whether `buffer` holds a whole event other than vLLM's opening two (or one of no
    type: nothing to hold it back for)."""
    *events, _partial = buffer.split(b"\n\n")
    for event in events:
        if not event.strip():
            continue
        kind = None
        for line in event.split(b"\n"):
            if line.startswith(b"event:"):
                kind = line[6:].strip()
        if kind not in _PREAMBLE:
            return True
    return False


def event_stream(route: str) -> EventStream:
    return ResponseEvents() if route == RESPONSES else DataStream()
