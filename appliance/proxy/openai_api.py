"""The OpenAI API as the proxy reads it: its routes, the checks on a client's body, a
chat message that is text alone, and what the proxy reads of an answer (the first choice's
`finish_reason`, or a Responses answer's `status`; the usage).

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
RESPONSES = "/v1/responses"  # the Responses API: appliance.proxy.responses


def parse_request(raw: bytes, route: str) -> dict[str, Any]:
    """Decode and check a client body; a ProxyError(400) means nothing goes upstream."""
    body = decode_object(raw)
    if route == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ProxyError(400, "'messages' is required and must be a non-empty list")
    elif route == RESPONSES:
        given = body.get("input")
        if not isinstance(given, (str, list)) or not given:
            raise ProxyError(400, "'input' is required and must be a string or a non-empty list")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ProxyError(400, "'prompt' is required and must be a string or a list")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ProxyError(400, "'stream' must be a boolean")
    # A client must never steer D to a bootstrap address of its choosing.
    body.pop("kv_transfer_params", None)
    return body


def seeded_sampling(body: dict[str, Any]) -> bool:
    """A request that samples with its own seed: vLLM seeds one random stream per request,
    which a split would restart on D after P drew the first token, so its text would not be
    a plain server's. Greedy (temperature 0) is exact either way."""
    seed, temperature = body.get("seed"), body.get("temperature")
    if not isinstance(seed, int) or isinstance(seed, bool):
        return False
    return not isinstance(temperature, (int, float)) or temperature > 0


def batched_prompts(body: dict[str, Any]) -> bool:
    """A completions request of several prompts: vLLM runs one engine request per prompt,
    and every one of P's would carry the request's one transfer id (only the first could
    be sent; D would recompute the rest)."""
    prompt = body.get("prompt")
    return (isinstance(prompt, list) and len(prompt) > 1
            and not all(type(t) is int for t in prompt))


def text_only(message: Any) -> bool:
    """A chat message whose content is text alone (a string or text parts)."""
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" for part in content)


# Responses input items that vLLM passes to the chat template as they are (roles with text).
_PLAIN_ROLES = frozenset({"system", "developer", "user", "assistant"})


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A Responses body's prompt as the chat messages vLLM renders it from: `instructions`
    as a system message, a string `input` as the user's message, message items of text as
    they are. None where vLLM would render anything else: tool calls and outputs, content
    parts (images, files), reasoning, tools, a final assistant message (continued, not
    answered), or history kept on a node (`previous_response_id`)."""
    if any(body.get(k) for k in ("previous_response_id", "previous_input_messages",
                                 "tools", "reasoning")):
        return None
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            return None
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not isinstance(given, list):
        return None
    for item in given:
        if (not isinstance(item, dict) or item.get("role") not in _PLAIN_ROLES
                or not isinstance(item.get("content"), str)
                or item.get("type", "message") != "message"
                or not item.keys() <= {"type", "role", "content"}):
            return None
        out.append({"role": item["role"], "content": item["content"]})
    if not out or out[-1]["role"] == "assistant":
        return None
    return out


class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    input_tokens: int | None = None  # the Responses API's names
    output_tokens: int | None = None

    def counts(self) -> tuple[int | None, int | None]:
        """(prompt, completion) tokens, under either API's names."""
        prompt = self.prompt_tokens if self.prompt_tokens is not None else self.input_tokens
        out = self.completion_tokens if self.completion_tokens is not None else self.output_tokens
        return prompt, out


class _PrefillAnswer(msgspec.Struct):
    """What the proxy reads of P's answer (the rest is skipped, not decoded)."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    status: str | None = None  # a Responses answer's


_prefill_answer = msgspec.json.Decoder(_PrefillAnswer)


def _answer(raw: bytes) -> _PrefillAnswer | None:
    try:
        return _prefill_answer.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# A Responses answer's status as a finish reason: vLLM says "incomplete" when the output
# hit max_output_tokens, "completed" otherwise (its one token was EOS or a stop token).
_STATUS_FINISH = {"incomplete": "length", "completed": "stop"}


def prefill_finish_reason(raw: bytes) -> str | None:
    """`finish_reason` of P's one choice; None when the body is not what vLLM sends."""
    a = _answer(raw)
    if a is None:
        return None
    if a.choices:
        return a.choices[0].finish_reason
    return _STATUS_FINISH.get(a.status) if a.status is not None else None


def prefill_prompt_tokens(raw: bytes) -> int | None:
    """The prompt's tokens as P counted them (its usage), or None."""
    a = _answer(raw)
    return a.usage.counts()[0] if a is not None and a.usage is not None else None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_answer_usage = msgspec.json.Decoder(_Answer)


def answer_usage(raw: bytes) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens of a whole answer's usage; None where it has none."""
    try:
        u = _answer_usage.decode(raw).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    return (None, None) if u is None else u.counts()
