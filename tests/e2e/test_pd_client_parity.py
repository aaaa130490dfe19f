"""The whole surface a vLLM client uses, through the node under each split, against one
plain vLLM server: every kind of request below answers as the plain server does, field for
field (less what names the response itself: its id and creation time). A new vLLM release
that adds or changes a parameter shows up here."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import token_prompt

pytestmark = pytest.mark.slow

PROMPT = "The sea is"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
IDS = token_prompt(30, seed=5)

# (name, route, body less the model): greedy unless seeded, short answers.
COMPLETIONS: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"prompt": PROMPT}),
    ("token ids", {"prompt": IDS}),
    ("batched prompts", {"prompt": [PROMPT, "A ship"]}),
    ("batched token ids", {"prompt": [IDS, IDS[:10]]}),
    ("echo", {"prompt": PROMPT, "echo": True}),
    ("logprobs", {"prompt": PROMPT, "logprobs": 3}),
    ("prompt logprobs", {"prompt": PROMPT, "prompt_logprobs": 2}),
    ("stop string", {"prompt": PROMPT, "stop": [" the"]}),
    ("stop token ids", {"prompt": IDS, "stop_token_ids": [IDS[3]]}),
    ("include stop", {"prompt": PROMPT, "stop": [" the"], "include_stop_str_in_output": True}),
    ("n=2 greedy", {"prompt": PROMPT, "n": 2}),  # vLLM refuses it: the same 400
    ("n=2 seeded", {"prompt": PROMPT, "n": 2, "temperature": 0.8, "seed": 11}),
    ("penalties", {"prompt": PROMPT, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                   "repetition_penalty": 1.2}),
    ("logit bias", {"prompt": PROMPT, "logit_bias": {"100": 5, "200": -100}}),
    ("min tokens", {"prompt": PROMPT, "min_tokens": 6}),
    ("ignore eos", {"prompt": PROMPT, "ignore_eos": True}),
    ("return token ids", {"prompt": PROMPT, "return_token_ids": True}),
    ("seeded sampling", {"prompt": PROMPT, "temperature": 0.8, "seed": 42}),
    ("top-k top-p", {"prompt": PROMPT, "temperature": 0.8, "top_k": 5, "top_p": 0.9,
                     "seed": 7}),
    ("regex", {"prompt": PROMPT, "structured_outputs": {"regex": "[a-z ]{3,12}"}}),
    ("max tokens 1", {"prompt": PROMPT, "max_tokens": 1}),
]
CHATS: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"messages": MESSAGES}),
    ("chat logprobs", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}),
    ("chat stop", {"messages": MESSAGES, "stop": ["."]}),
    ("chat n=2", {"messages": MESSAGES, "n": 2, "temperature": 0.8, "seed": 5}),
    ("chat max_completion_tokens", {"messages": MESSAGES, "max_completion_tokens": 3}),
    ("chat system", {"messages": [{"role": "system", "content": "Be brief."}, *MESSAGES]}),
    ("chat multi-turn", {"messages": [*MESSAGES, {"role": "assistant", "content": "It is."},
                                      {"role": "user", "content": "More."}]}),
    ("chat json schema", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}},
            "required": ["a"]}}}}),
    ("chat seeded", {"messages": MESSAGES, "temperature": 0.8, "seed": 3}),
]
CASES = ([(name, "/v1/completions", body) for name, body in COMPLETIONS]
         + [(name, "/v1/chat/completions", body) for name, body in CHATS])
# What names the response itself, not what it says.
VOLATILE = {"id", "created", "system_fingerprint"}


def _said(value: Any) -> Any:
    """The answer less what names it (its ids and times, at any depth)."""
    if isinstance(value, dict):
        return {k: _said(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_said(v) for v in value]
    return value


async def _answer(base: str, path: str, body: dict) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(base + path, json=body) as r:
            raw = await r.text()
            status = r.status
    if status != 200:  # an error is one JSON body, stream or not
        return status, json.loads(raw)
    if body.get("stream"):
        events = [json.loads(e[6:]) for e in raw.split("\n\n")
                  if e.startswith("data: ") and e != "data: [DONE]"]
        return status, [_said(e) for e in events]
    return status, _said(json.loads(raw))


@pytest.mark.parametrize("name,path,part", CASES, ids=[c[0] for c in CASES])
async def test_each_kind_of_request_answers_as_a_plain_server(
        plain_server, split_proxies, name, path, part):
    for stream in (False, True):
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0, **part, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if stream and ("echo" in part or "prompt_logprobs" in part):
            continue  # vLLM refuses these streamed; the JSON case covers them
        expected = await _answer(plain_server, path, body)
        for split in ("always", "never", "auto"):
            got = await _answer(split_proxies[split], path, body)
            if expected[0] != 200:  # refused: the same status and message
                assert got[0] == expected[0], (name, split, stream, got)
                assert _message(got[1]) == _message(expected[1]), (name, split, stream)
            elif stream:  # the same text and usage, however the node chunks its events
                assert _joined(got[1]) == _joined(expected[1]), (name, split)
            else:
                assert got == expected, (name, split, stream)


def _message(answer: Any) -> str:
    """An error answer's message."""
    return answer["error"]["message"] if isinstance(answer, dict) and "error" in answer else ""


def _joined(events: list[dict]) -> tuple[dict[int, str], Any]:
    """A stream's text per choice, and its usage."""
    texts: dict[int, str] = {}
    usage = None
    for e in events:
        usage = e.get("usage") or usage
        for c in e.get("choices", ()):
            piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts, usage
