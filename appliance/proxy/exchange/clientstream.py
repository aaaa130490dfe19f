"""The client's SSE stream where the proxy follows its token ids, so that another engine can
go on after the tokens the client has (appliance.proxy.exchange.migration).

Two kinds of stream are followed:
- led by P's token (exchange.first_token): P's token first, then D's completion of token
  ids, rewritten into the client's format (chat chunks from completion chunks, usage counted
  as if one server had answered);
- served by one engine alone (D alone, P alone: `follow`): the engine answers in the
  client's own format, asked for its token ids too. Its chunks only lose those ids (and a
  chat chunk that carries nothing but ids, which a plain server does not send).
Once the answer goes on elsewhere, the engine continuing it answers a completion of token
ids, rewritten as in the first case.
"""

from __future__ import annotations

from typing import Any

import msgspec

from appliance.proxy.exchange.first_token import PrefillAnswer, ineligible
from appliance.proxy.openai_api import CHAT

_decode = msgspec.json.decode
_encode = msgspec.json.encode
DONE = b"data: [DONE]\n\n"
# What a chat delta may hold for its text to be continued by a completion: anything else
# (reasoning, tool calls) is a server-side parser's, which a completion does not run.
_PLAIN_DELTA = frozenset({"role", "content"})


def _event(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def _wants_usage(body: dict[str, Any]) -> tuple[bool, bool]:
    opts = body.get("stream_options")
    if not isinstance(opts, dict):
        return False, False
    return bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats"))


def follow(body: dict[str, Any], route: str) -> ClientStream | None:
    """A stream served by one engine alone, followed by its token ids; None where a
    continuation could not give one server's answer (first_token.ineligible says why)."""
    return None if ineligible(body, route) else ClientStream(body, route)


class ClientStream:
    """The client's stream: P's token first (`answer`) or the engine's own chunks, then
    the chunks of whatever engine answers, rewritten as needed.

    Each chunk's token ids are kept here and taken out, so the client's chunks are a plain
    server's. `done()`: the output ids whose text reached the client whole (a token that
    reads as nothing, or as half a character, waits for the next one's text), what a
    continuation elsewhere goes on after."""

    def __init__(self, body: dict[str, Any], route: str,
                 answer: PrefillAnswer | None = None) -> None:
        self.chat = route == CHAT
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.answer = answer
        self.include_usage, self.continuous_usage = _wants_usage(body)
        self._pending = b""
        # The engine answering speaks the client's format (a stream served alone, until it
        # goes on elsewhere); else a completion of token ids.
        self.native = answer is None
        # The stream's identity and prompt: P's answer's, or the engine's first chunk's.
        self.id: str | None = None if answer is None else answer.id
        self.created: int | None = None if answer is None else answer.created
        self.model: str | None = None if answer is None else answer.model
        self.prompt_ids: list[int] | None = None if answer is None else answer.prompt_token_ids
        self._lead = [] if answer is None else [answer.token_id]  # P's token
        # Output tokens in the prompt of the engine answering now (P's token, then those a
        # continuation goes on after): its usage counts them as prompt, one server as output.
        self._shift = len(self._lead)
        self._shown: list[int] = []
        self._unshown: list[int] = []
        self.exact = True  # every chunk said its token ids

    @property
    def continuable(self) -> bool:
        return self.exact and self.prompt_ids is not None

    def done(self) -> list[int]:
        """The output ids a continuation's prompt adds after the prompt's."""
        return [*self._lead, *self._shown]

    # ---- P's part ----

    def _envelope(self, choices: list[dict[str, Any]],
                  usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": self.object, "created": self.created,
               "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _chunk(self, delta_or_text: Any, finish: str | None, stop_reason: Any = None
               ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta" if self.chat else "text": delta_or_text,
                                  "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        prompt = len(self.prompt_ids or ())
        usage = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
        return self._envelope([choice], usage if self.continuous_usage else None)

    def head(self) -> bytes:
        """P's token, as the stream's first chunk(s); the whole stream if P stopped."""
        a = self.answer
        assert a is not None, "only a stream led by P's token has a head"
        finish = a.finish_reason if a.stopped else None
        parts = []
        if self.chat:  # vLLM opens a chat stream with the role, content empty
            parts.append(_event(self._chunk({"role": "assistant", "content": ""}, None)))
            parts.append(_event(self._chunk({"content": a.text}, finish, a.stop_reason)))
        else:
            parts.append(_event(self._chunk(a.text, finish, a.stop_reason)))
        if a.stopped:
            if self.include_usage and a.usage is not None:
                parts.append(_event(self._envelope([], a.usage)))
            parts.append(DONE)
        return b"".join(parts)

    # ---- the engines' part ----

    def feed(self, data: bytes) -> bytes:
        """The engine's bytes as they come -> the client's bytes (whole events only)."""
        buf = self._pending + data if self._pending else data
        if len(buf) > 2 and buf.find(b"\n\n") == len(buf) - 2:  # one event: as engines write
            self._pending = b""
            out = self._rewrite(buf[:-2])
            return out + b"\n\n" if out else b""
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._pending = buf
            return b""
        self._pending = buf[cut + 2:]
        out = (self._rewrite(ev) for ev in buf[:cut].split(b"\n\n") if ev)
        return b"".join(ev + b"\n\n" for ev in out if ev)

    def flush(self) -> bytes:
        """A last event the engine did not end with a blank line."""
        rest, self._pending = self._pending, b""
        return self._rewrite(rest.strip()) if rest.strip() else rest

    def resumed(self) -> None:
        """Another engine continues after `done()`, as a completion of token ids: the
        broken engine's partial event is dropped, and the new one's usage counts those
        tokens as prompt."""
        self.native = False
        self._pending = b""
        self._unshown = []
        self._shift = len(self._lead) + len(self._shown)

    def _rewrite(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event[6:].strip() == b"[DONE]":
            return event
        if self.native and (out := self._own_fast(event)) is not None:
            return out
        try:
            obj = _decode(event[6:])
        except msgspec.DecodeError:
            return event
        if not isinstance(obj, dict) or "error" in obj:
            return event
        if self.native:
            return self._own(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            # The engine counted P's token (and those it continues after) as prompt: one
            # server counts them as output.
            for key, step in (("prompt_tokens", -self._shift),
                              ("completion_tokens", self._shift)):
                if isinstance(usage.get(key), int):
                    usage[key] += step
        choices = obj.get("choices")
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict):
                    self._take(c, c.get("text"))
            obj["id"] = self.id
            if self.chat:
                obj["object"] = self.object
                obj["choices"] = [_chat_choice(c) for c in choices if isinstance(c, dict)]
        return b"data: " + _encode(obj)

    def _own_fast(self, event: bytes) -> bytes | None:
        """`_own` on the usual chunk (one choice, a plain delta), its ids taken out of the
        bytes as they are: a stream served alone costs a typed decode per event, not a
        decode and an encode (bench/proxy_overhead.py --proxy-arg=--split
        --proxy-arg=never). None: not such a chunk."""
        try:
            chunk = _read_chunk(event[6:])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if chunk.error is not None or len(chunk.choices) > 1:
            return None
        if not chunk.choices:  # usage alone: nothing to keep or take out
            return event if chunk.prompt_token_ids is None else None
        c = chunk.choices[0]
        prompt = chunk.prompt_token_ids if self.chat else c.prompt_token_ids
        out = _null_ids(event, c.token_ids is not None, prompt is not None)
        if out is None:
            return None
        if self.id is None:
            self.id, self.created, self.model = chunk.id, chunk.created, chunk.model
        if prompt is not None:
            self.prompt_ids = prompt
        delta = c.delta
        text = (delta.content if delta is not None else None) if self.chat else c.text
        self._keep(c.token_ids, text)
        if self.chat and _ids_only(c.token_ids, delta is None or delta.empty,
                                   c.finish_reason, c.logprobs):
            return b""
        return out

    def _own(self, obj: dict[str, Any]) -> bytes:
        """A chunk in the client's own format: its ids kept and taken out."""
        if self.id is None:
            self.id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        if "prompt_token_ids" in obj:  # chat: on the stream's first chunk
            self._prompt(obj)
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return b"data: " + _encode(obj)
        kept = []
        for c in choices:
            if not isinstance(c, dict):
                continue
            if not self.chat:
                self._prompt(c)
                self._take(c, c.get("text"))
                kept.append(c)
                continue
            delta = c.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            if delta.keys() - _PLAIN_DELTA:
                self.exact = False
            ids = c.get("token_ids")
            self._take(c, delta.get("content"))
            if _ids_only(ids, not delta, c.get("finish_reason"), c.get("logprobs")):
                continue
            kept.append(c)
        if choices and not kept:
            return b""
        obj["choices"] = kept
        return b"data: " + _encode(obj)

    def _prompt(self, obj: dict[str, Any]) -> None:
        ids = obj.get("prompt_token_ids")
        if isinstance(ids, list) and all(type(t) is int for t in ids):
            self.prompt_ids = ids
        if ids is not None:
            obj["prompt_token_ids"] = None

    def _take(self, c: dict[str, Any], text: Any) -> None:
        """A choice's token ids kept (and nulled, as the client did not ask for them)."""
        ids = c.get("token_ids")
        if "token_ids" in c:
            c["token_ids"] = None
        if not self.native and c.get("prompt_token_ids") is not None:
            c["prompt_token_ids"] = None
        self._keep(ids, text)

    def _keep(self, ids: Any, text: Any) -> None:
        if not isinstance(ids, list):
            if text:
                self.exact = False
            return
        self._unshown += ids
        if isinstance(text, str) and text and not text.endswith("\ufffd"):
            self._shown += self._unshown
            self._unshown = []


def _ids_only(ids: Any, no_delta: bool, finish: Any, logprobs: Any) -> bool:
    """A chat chunk that carries only a token's ids (a token that reads as nothing, sent
    because ids were asked for): a plain server sends no chunk for it."""
    return bool(ids) and no_delta and finish is None and logprobs is None


def _null_ids(raw: bytes, ids: bool, prompt: bool) -> bytes | None:
    """The event with its token ids (`ids`) and prompt ids (`prompt`) made null, as vLLM's
    compact JSON writes them (a JSON string holds no bare quote, so no text looks like
    this); None where they are not found so."""
    for key, there in ((b'"token_ids":[', ids), (b'"prompt_token_ids":[', prompt)):
        if not there:
            continue
        i = raw.find(key)
        j = raw.find(b"]", i)
        if i < 0 or j < 0:
            return None
        raw = b"".join((raw[:i + len(key) - 1], b"null", raw[j + 1:]))
    return raw


class _Delta(msgspec.Struct, forbid_unknown_fields=True):
    """A chat delta a completion can continue (any other field: the slow path decides)."""

    role: str | None = None
    content: str | None = None

    @property
    def empty(self) -> bool:
        return self.role is None and self.content is None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: Any = None


class _Chunk(msgspec.Struct):
    id: str | None = None
    created: int | None = None
    model: str | None = None
    choices: list[_Choice] = []
    prompt_token_ids: list[int] | None = None
    error: Any = None


_read_chunk = msgspec.json.Decoder(_Chunk).decode


def _chat_choice(c: dict[str, Any]) -> dict[str, Any]:
    out = {"index": c.get("index", 0), "delta": {"content": c.get("text", "")},
           "logprobs": None, "finish_reason": c.get("finish_reason")}
    if "stop_reason" in c and c.get("finish_reason") is not None:
        out["stop_reason"] = c["stop_reason"]
    return out
