"""Seeded sampling through the node equals a plain vLLM server's, whatever the split
(issue: a split restarted the request's random stream on D after P drew the first token).
The proxy serves a seeded sampled request whole, by one engine: completions and chat, JSON
and streams, one choice and two, under split always, never and auto."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.e2e.conftest import token_prompt

pytestmark = pytest.mark.slow


async def _choices(base: str, path: str, body: dict) -> list[str]:
    """Each choice's text, by index (a stream's joined from its events)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(base + path, json=body) as r:
            raw = await r.text()
            assert r.status == 200, raw
    texts: dict[int, str] = {}
    if body.get("stream"):
        assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
        chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    else:
        chunks = [json.loads(raw)]
    for chunk in chunks:
        for c in chunk.get("choices", ()):
            piece = (c.get("text") or (c.get("delta") or {}).get("content")
                     or (c.get("message") or {}).get("content") or "")
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return [texts[i] for i in sorted(texts)]


CASES = [
    ("/v1/completions", {"prompt": token_prompt(40, seed=77)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]}),
]


@pytest.mark.parametrize("path,request_part", CASES)
async def test_seeded_sampling_equals_a_plain_server_under_every_split(
        plain_server, split_proxies, path, request_part):
    for stream in (False, True):
        for n in (1, 2):
            body = {"model": "tiny", **request_part, "max_tokens": 12, "temperature": 0.9,
                    "seed": 1234, "n": n, "stream": stream}
            expected = await _choices(plain_server, path, body)
            assert len(expected) == n and any(expected)
            for split in ("always", "never", "auto"):
                got = await _choices(split_proxies[split], path, body)
                assert got == expected, (split, stream, n)
