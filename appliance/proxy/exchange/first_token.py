"""First token from P: a streaming client gets P's token the moment P answers.

In the classic split the proxy discards P's one token (docs/protocol.md steps 24-25) and
the client's first token is D's (38-39): D waits for the KV, recomputes the last prompt
token, and only then speaks, so TTFT = P's prefill + the transfer + one D step. Here P's
token goes to the client at once, and D is asked only after P has answered, with P's prompt
token ids plus that token as its prompt (`remote_num_tokens` tells D's connector which
prefix P's KV covers): D continues the sequence P started instead of sampling its own first
token, so the text is the one text a single server would produce (token for token under
greedy decoding).

Only requests whose meaning survives the split take this path (see `ineligible`); the rest
use the classic split. Pure functions on decoded JSON; the client's stream, P's token and
D's chunks rewritten, is exchange.clientstream's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from appliance.proxy.exchange.bodies import prefill_body, pull_params
from appliance.proxy.openai_api import CHAT, RESPONSES, text_only

_decode = msgspec.json.decode
_encode = msgspec.json.encode

# Sampling fields D applies to its continuation exactly as one server would from the second
# token on; D's body keeps only these (a chat request reaches D as a completion of token ids).
_CONTINUED = frozenset({
    "model", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed",
    "repetition_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "user", "priority",
    "cache_salt", "include_stop_str_in_output",
})
# Fields that only shape P's prompt or must hold the neutral value checked below.
_CHECKED = frozenset({
    "max_tokens", "min_tokens", "n", "best_of", "presence_penalty", "frequency_penalty",
    "stop", "logprobs", "echo", "response_format", "add_special_tokens", "use_beam_search",
})
_CHAT_ONLY = frozenset({
    "messages", "max_completion_tokens", "add_generation_prompt", "continue_final_message",
    "chat_template", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls",
    "top_logprobs", "documents",
})
_COMPLETIONS_ONLY = frozenset({"prompt", "suffix"})
_KNOWN_CHAT = _CONTINUED | _CHECKED | _CHAT_ONLY
_KNOWN_COMPLETIONS = _CONTINUED | _CHECKED | _COMPLETIONS_ONLY
# Field -> the values that leave its feature off.
_OFF: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "stop": (None, "", []),
    "logprobs": (None, False), "echo": (None, False), "use_beam_search": (None, False),
    "suffix": (None, ""), "tools": (None, []), "top_logprobs": (None, 0),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
}


def ineligible(body: dict[str, Any], route: str) -> str | None:
    """Why this request must use the classic split, or None when P's token may lead.

    Anything that makes a token depend on more than the sequence before it (stop strings
    and bad words spanning tokens, presence/frequency penalties counting output tokens,
    structured output, logprobs, several choices) keeps the classic split, as does any field
    this module does not know.
    """
    if route == RESPONSES:
        return "Responses API"  # its events are not completion chunks to continue
    if body.get("stream") is not True:
        return "not streaming"  # a whole answer gains nothing from an early first token
    known = _KNOWN_CHAT if route == CHAT else _KNOWN_COMPLETIONS
    unknown = body.keys() - known
    if unknown:
        return f"field {min(unknown)!r}"
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            return f"{key} > 1"
    for key in _OFF.keys() & body.keys():  # asked on every stream: only the fields it has
        if not any(_same(body[key], v) for v in _OFF[key]):
            return key
    limit = _max_tokens(body, route)
    if limit is not None and (not isinstance(limit, int) or limit <= 1):
        return "max_tokens <= 1"
    if not isinstance(body.get("min_tokens", 0) or 0, int):
        return "min_tokens"
    if route == CHAT:
        if not all(text_only(m) for m in body["messages"]):
            return "non-text message content"
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str) and not all(type(t) is int for t in prompt):
            return "several prompts"
    return None


def _same(value: Any, off: Any) -> bool:
    """value == off, except that a boolean only equals a boolean (in Python False == 0)."""
    if isinstance(value, bool) or isinstance(off, bool) or off is None:
        return value is off
    return value == off


def fits(body: dict[str, Any], route: str, answer: PrefillAnswer,
         max_model_len: int | None) -> bool:
    """Whether D can take the continuation (None: D's length is not known, assume so).

    D would refuse prompt + max_tokens beyond its context only after the client's stream
    had started with P's token: such a request goes the classic way, and the client gets
    D's 400 as JSON, as from one server.
    """
    if max_model_len is None:
        return True
    return len(answer.prompt_token_ids) + (_max_tokens(body, route) or 1) <= max_model_len


def _max_tokens(body: dict[str, Any], route: str) -> Any:
    if route == CHAT and body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"]
    return body.get("max_tokens")



def prefill_request(body: dict[str, Any], route: str, transfer_id: str) -> dict[str, Any]:
    """P's body: the classic one, plus the token ids D will need, and P frees its KV by
    itself when its one token ends the answer (no D will come)."""
    out = prefill_body(body, route, transfer_id)
    out["return_token_ids"] = True
    out["kv_transfer_params"]["send_on_stop"] = False
    if body.get("min_tokens"):
        out["min_tokens"] = 1  # no EOS as the first token, as one server would ensure
    return out


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    """The parts of P's one-token answer that lead the client's stream."""

    id: str
    created: int
    model: str
    text: str
    token_id: int
    prompt_token_ids: list[int]
    finish_reason: str
    stop_reason: Any
    usage: dict[str, Any] | None

    @property
    def stopped(self) -> bool:
        """P's token ends the answer (EOS, a stop token): nothing for D to do."""
        return self.finish_reason == "stop"


def parse_prefill_answer(raw: bytes, route: str) -> PrefillAnswer | None:
    """P's answer, or None when it cannot lead the stream (then D answers classically)."""
    try:
        data = _decode(raw)
        choice = data["choices"][0]
        if route == CHAT:
            message = choice["message"]
            if message.get("reasoning") or message.get("reasoning_content") \
                    or message.get("tool_calls"):
                return None  # a server-side parser owns this text: D must see all of it
            text = message.get("content") or ""
            prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        else:
            text = choice["text"]
            prompt_ids = choice.get("prompt_token_ids")
        token_ids = choice["token_ids"]
        answer = PrefillAnswer(
            id=data["id"], created=data["created"], model=data["model"], text=text,
            token_id=token_ids[0], prompt_token_ids=prompt_ids,
            finish_reason=choice["finish_reason"], stop_reason=choice.get("stop_reason"),
            usage=data.get("usage"))
    except (msgspec.DecodeError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if (len(token_ids) != 1 or type(answer.token_id) is not int or not isinstance(text, str)
            or not isinstance(prompt_ids, list) or not prompt_ids
            or not all(type(t) is int for t in prompt_ids)
            or answer.finish_reason not in ("length", "stop")):
        return None
    if text.endswith("\ufffd"):
        return None  # part of a multi-byte character: only D's detokenizer can finish it
    if not text and answer.finish_reason == "length":
        # A token that reads as nothing may be the first bytes of a character (P's answer
        # holds them back). Put at the end of D's prompt, they make D's detokenizer start
        # its output from an earlier offset: D's first chunk repeats the prompt's text.
        return None
    return answer


def continuation_request(body: dict[str, Any], route: str, answer: PrefillAnswer,
                         transfer_id: str, bootstrap_addr: str, engine_id: str,
                         recv_timeout_ms: int | None = None) -> dict[str, Any]:
    """D's body: a completion of P's prompt ids plus P's token, pulling P's KV."""
    out = resumed_request(body, route, answer.prompt_token_ids, [answer.token_id])
    out["kv_transfer_params"] = {
        **pull_params(transfer_id, bootstrap_addr, engine_id, recv_timeout_ms),
        "remote_num_tokens": len(answer.prompt_token_ids)}
    return out


def resumed_request(body: dict[str, Any], route: str, prompt_ids: Sequence[int],
                    done: Sequence[int]) -> dict[str, Any]:
    """A completion of the prompt's ids and the output tokens `done` already (P's token,
    those the client has), for the rest of the answer (limits less what is done). Its token
    ids come back with each chunk (clientstream.ClientStream keeps them and takes them out):
    if the engine answering it breaks off, another continues after them
    (appliance.proxy.exchange.migration)."""
    out = {k: v for k, v in body.items() if k in _CONTINUED}
    limit = _max_tokens(body, route)
    if limit is not None:
        out["max_tokens"] = limit - len(done)
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, body["min_tokens"] - len(done))
    out["prompt"] = [*prompt_ids, *done]
    out["return_token_ids"] = True
    return out
