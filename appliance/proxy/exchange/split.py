"""The split (docs/protocol.md steps 8-10): one client request becomes a P request and a D request.

Pure functions on decoded JSON bodies, so the exact bodies P and D receive are easy to test.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from appliance.proxy.errors import ProxyError

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# P's one token is thrown away: one choice is enough (n > 1 would prefill once per choice and
# offer D the same transfer several times), and min_tokens would make it refuse max_tokens=1.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "n", "best_of")


def uuid4_str() -> str:
    """str(uuid.uuid4()) at a third of the cost (it runs twice per request)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def new_transfer_id() -> str:
    return f"xfer-{uuid4_str()}"


def parse_request(raw: bytes, route: str) -> dict[str, Any]:
    """Decode and check a client body; a ProxyError(400) means nothing goes upstream."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object")
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


def prefill_body(body: dict[str, Any], route: str, transfer_id: str) -> dict[str, Any]:
    """P computes the prompt's KV and one token, answers at once, and sends the KV to D."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["max_tokens"] = 1
    if route == CHAT:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return out


def decode_body(body: dict[str, Any], transfer_id: str, bootstrap_addr: str,
                engine_id: str, recv_timeout_ms: int | None = None) -> dict[str, Any]:
    """D gets the client's request as is, plus where to pull the KV from."""
    out = dict(body)
    out["kv_transfer_params"] = pull_params(transfer_id, bootstrap_addr, engine_id,
                                            recv_timeout_ms)
    return out


def pull_params(transfer_id: str, bootstrap_addr: str, engine_id: str,
                recv_timeout_ms: int | None = None) -> dict[str, Any]:
    """D's `kv_transfer_params`: pull this transfer's KV from that prefill engine, waiting
    for it at most `recv_timeout_ms` (appliance.deadlines; None: D's own default)."""
    params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": bootstrap_addr,
        "remote_engine_id": engine_id,
        "transfer_id": transfer_id,
    }
    if recv_timeout_ms is not None:
        params["recv_timeout_ms"] = recv_timeout_ms
    return params


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


def text_only(message: Any) -> bool:
    """A chat message whose content is text alone (a string or text parts)."""
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" for part in content)
