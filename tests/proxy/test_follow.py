"""A stream served by one engine alone (D alone, P alone) is followed by its token ids: the
engine is asked for them, the client's chunks are a plain server's, and when the engine
breaks off mid-stream another goes on after the tokens the client has, in the same stream
(appliance.proxy.exchange.clientstream, exchange.migration)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.proxy.exchange.clientstream import ClientStream, follow
from appliance.proxy.openai_api import CHAT, COMPLETIONS
from tests.proxy.conftest import Cluster, MakeCluster
from tests.proxy.test_first_token import events
from tests.proxy.test_first_token import texts as text

MESSAGES = [{"role": "user", "content": "hi"}]


def body(route: str, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "stream": True, **kw}
    if route == CHAT:
        return {**out, "messages": MESSAGES}
    return {**out, "prompt": "hello"}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ---- the stream's own chunks ---------------------------------------------------------------

def test_which_streams_are_followed():
    assert follow(body(COMPLETIONS), COMPLETIONS) is not None
    assert follow(body(CHAT), CHAT) is not None
    assert follow(body(COMPLETIONS, stream=False), COMPLETIONS) is None
    assert follow(body(COMPLETIONS, logprobs=2), COMPLETIONS) is None
    assert follow(body(CHAT, stop=["."]), CHAT) is None


def test_a_completion_stream_loses_its_ids_and_keeps_them():
    s = ClientStream(body(COMPLETIONS), COMPLETIONS)
    first = {"id": "cmpl-1", "object": "text_completion", "created": 3, "model": "tiny",
             "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": None,
                          "stop_reason": None, "prompt_token_ids": [1, 2, 3],
                          "token_ids": [10]}]}
    (got,) = events(s.feed(sse(first)))
    # As a plain server's chunk: the fields there, null.
    assert got["choices"][0]["prompt_token_ids"] is None
    assert got["choices"][0]["token_ids"] is None and got["choices"][0]["text"] == " a"
    later = {**first, "choices": [{**first["choices"][0], "text": "\ufffd",
                                   "prompt_token_ids": None, "token_ids": [11]}]}
    s.feed(sse(later))
    assert s.prompt_ids == [1, 2, 3] and s.done() == [10] and s.continuable
    assert (s.id, s.created, s.model) == ("cmpl-1", 3, "tiny")


def test_a_chat_stream_loses_its_ids_and_chunks_that_carry_only_ids():
    s = ClientStream(body(CHAT), CHAT)
    role = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 3,
            "model": "tiny", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                          "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": [1, 2], "prompt_text": None}

    def piece(content: str | None, ids: list[int], finish: str | None = None) -> dict:
        delta = {} if content is None else {"content": content}
        return {**role, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish, "token_ids": ids}]}

    (opening,) = events(s.feed(sse(role)))
    assert opening["prompt_token_ids"] is None  # a plain server's first chunk says null
    # A token that reads as nothing is a chunk only because its ids were asked for.
    out = events(s.feed(sse({k: v for k, v in piece(None, [5]).items()
                             if k != "prompt_token_ids"})))
    assert out == []
    (text,) = events(s.feed(sse(piece("é", [6]))))
    assert text["choices"][0]["token_ids"] is None
    assert s.prompt_ids == [1, 2] and s.done() == [5, 6]
    (end,) = events(s.feed(sse(piece(None, [7], "length"))))  # an end is sent either way
    assert end["choices"][0]["finish_reason"] == "length"


def test_a_parsers_chat_text_is_not_continued():
    s = ClientStream(body(CHAT), CHAT)
    s.feed(sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "prompt_token_ids": [1], "choices": [
                    {"index": 0, "delta": {"reasoning": "hm"}, "token_ids": [4],
                     "finish_reason": None}]}))
    assert not s.continuable


def test_continuing_a_stream_served_alone_counts_its_tokens_as_output():
    s = ClientStream(body(COMPLETIONS, stream_options={"include_usage": True}), COMPLETIONS)
    s.feed(sse({"id": "cmpl-1", "object": "text_completion", "created": 3, "model": "tiny",
                "choices": [{"index": 0, "text": " a", "prompt_token_ids": [1, 2, 3],
                             "token_ids": [10], "finish_reason": None}]}))
    s.resumed()
    out = events(s.feed(sse({"id": "cmpl-2", "object": "text_completion", "created": 9,
                             "model": "tiny", "choices": [{"index": 0, "text": " b",
                                                           "token_ids": [11],
                                                           "finish_reason": "length"}]})
                        + sse({"id": "cmpl-2", "choices": [], "usage": {
                            "prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}})))
    assert out[0]["id"] == "cmpl-1" and out[0]["choices"][0]["text"] == " b"
    assert out[1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert s.done() == [10, 11]


# ---- through the proxy, with fake nodes ----------------------------------------------------

async def stream(c: Cluster, route: str, b: dict[str, Any]) -> list[Any]:
    path = "/v1/chat/completions" if route == CHAT else "/v1/completions"
    async with c.http.post(f"{c.url}{path}", json=b) as r:
        assert r.status == 200
        return events(await r.read())


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
async def test_d_alone_killed_mid_stream_goes_on_from_p(make_cluster: MakeCluster,
                                                        route: str) -> None:
    c = await make_cluster(split="never")
    c.decode[0].die_after = 2
    evs = await stream(c, route, body(route))
    assert text(evs) == "t0 t1 t2 t3 " and evs[-1] == "[DONE]", evs
    assert not [e for e in evs if isinstance(e, dict) and "error" in e]
    for e in evs[:-1]:  # the client's chunks carry no ids, as a plain server's
        assert e.get("prompt_token_ids") is None
        assert all(ch.get("token_ids") is None for ch in e["choices"])
    (on_d,) = c.decode[0].bodies()
    assert on_d["return_token_ids"] is True
    on_p = c.prefill[0].received[-1]
    assert on_p.path == "/v1/completions"  # a completion of token ids, chat or not
    assert on_p.body["prompt"] == [1, 2, 3, 4, 5, 100, 101]
    assert on_p.body["max_tokens"] == 6 and "kv_transfer_params" not in on_p.body
    if route == CHAT:
        assert {e["id"] for e in evs[:-1]} == {"chatcmpl-d0"}
        assert {e["object"] for e in evs[:-1]} == {"chat.completion.chunk"}
    assert 'pd_proxy_migrations_total{how="continued"} 1.0' in await c.metrics()
    assert await c.counts_left() == {}


async def test_p_alone_killed_mid_stream_goes_on_from_another_p(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_prefill=2)
    async with c.http.post(f"{c.url}/admin/drain", json={"node": "decode"}) as r:
        assert r.status == 200  # no D: P serves requests whole
    for p in c.prefill:
        p.die_after = 2  # a continuation starts at the third token: it never dies
    evs = await stream(c, COMPLETIONS, body(COMPLETIONS))
    assert text(evs) == "t0 t1 t2 t3 " and evs[-1] == "[DONE]", evs
    (first,) = [p for p in c.prefill if p.received[0].body["prompt"] == "hello"]
    (other,) = [p for p in c.prefill if p is not first]
    assert other.received[-1].body["prompt"] == [1, 2, 3, 4, 5, 100, 101]
    assert not c.decode[0].received
    assert await c.counts_left() == {}


async def test_a_stream_not_followed_ends_with_an_error(make_cluster: MakeCluster) -> None:
    c = await make_cluster(split="never")
    c.decode[0].die_after = 2
    evs = await stream(c, COMPLETIONS, body(COMPLETIONS, logprobs=1))
    assert "return_token_ids" not in c.decode[0].bodies()[0]
    assert text(evs) == "t0 t1 " and "failed mid-stream" in evs[-1]["error"]["message"]
    assert len(c.prefill[0].received) == 0


async def test_a_followed_stream_broken_before_its_first_event_is_asked_again_whole(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(split="never")
    c.decode[0].die_after = 0
    evs = await stream(c, CHAT, body(CHAT))
    assert text(evs) == "t0 t1 t2 t3 " and evs[-1] == "[DONE]", evs
    again = c.prefill[0].received[-1]
    assert again.path == "/v1/chat/completions" and again.body["return_token_ids"] is True
    assert 'pd_proxy_migrations_total{how="whole"} 1.0' in await c.metrics()


async def test_without_migration_a_stream_is_not_followed(make_cluster: MakeCluster) -> None:
    """migration_limit 0: nothing can go on elsewhere, so no event is read."""
    c = await make_cluster(split="never", migration_limit=0)
    evs = await stream(c, COMPLETIONS, body(COMPLETIONS))
    assert text(evs) == "t0 t1 t2 t3 " and "return_token_ids" not in c.decode[0].bodies()[0]


def test_a_usage_chunk_passes_as_it_is():
    s = ClientStream(body(COMPLETIONS), COMPLETIONS)
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3}}\n\n'
    assert s.feed(usage) == usage and s.continuable is False  # nothing known yet
