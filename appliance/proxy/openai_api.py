"""The OpenAI API as the proxy reads it: its two routes, the checks on a client's body, a
chat message that is text alone, and what the proxy reads of an answer (the first choice's
`finish_reason`, the usage).

The bottom of the proxy: the split (`exchange`), placement, the prefix index and the entry
(`app`) build on it, and it imports nothing of the proxy but `errors` and `jsonbody`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from appliance.proxy.errors import ProxyError
from appliance.proxy.jsonbody import decode_object

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def parse_request(raw: bytes, route: str) -> dict[str, Any]:
    """Decode and check a client body; a ProxyError(400) means nothing goes upstream."""
    body = decode_object(raw)
    if route == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ProxyError(400, "'messages' is required and must be a non-empty list")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ProxyError(400, "'prompt' is required and must be a string or a list")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ProxyError(400, "'stream' must be a boolean")
    # A client must never steer D to a bootstrap address of its choosing.
    body.pop("kv_transfer_params", None)
    return body


def text_only(message: Any) -> bool:
    """A chat message whose content is text alone (a string or text parts)."""
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" for part in content)


class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _PrefillAnswer(msgspec.Struct):
    """What the proxy reads of P's answer (the rest is skipped, not decoded)."""

    choices: list[_Choice] = []
    usage: _Usage | None = None


_prefill_answer = msgspec.json.Decoder(_PrefillAnswer)


def _answer(raw: bytes) -> _PrefillAnswer | None:
    try:
        return _prefill_answer.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def prefill_finish_reason(raw: bytes) -> str | None:
    """`finish_reason` of P's one choice; None when the body is not what vLLM sends."""
    a = _answer(raw)
    return a.choices[0].finish_reason if a is not None and a.choices else None


def prefill_prompt_tokens(raw: bytes) -> int | None:
    """The prompt's tokens as P counted them (its usage), or None."""
    a = _answer(raw)
    return a.usage.prompt_tokens if a is not None and a.usage is not None else None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_answer_usage = msgspec.json.Decoder(_Answer)


def answer_usage(raw: bytes) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens of a whole answer's usage; None where it has none."""
    try:
        u = _answer_usage.decode(raw).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    return (None, None) if u is None else (u.prompt_tokens, u.completion_tokens)
