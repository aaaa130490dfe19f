"""First token from P: which requests qualify, the bodies P and D get, the client's stream
(P's token first, D's continuation rewritten), and every failure after P has answered."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.proxy.exchange.clientstream import ClientStream
from appliance.proxy.exchange.first_token import (
    PrefillAnswer,
    continuation_request,
    fits,
    ineligible,
    parse_prefill_answer,
    prefill_request,
)
from appliance.proxy.openai_api import CHAT, COMPLETIONS
from tests.proxy.conftest import Cluster, MakeCluster

MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 8, "stream": True,
            **kw}


# ---- which requests qualify ----------------------------------------------------------------

@pytest.mark.parametrize("body", [
    completion(),
    completion(prompt=[1, 2, 3], temperature=0.7, top_p=0.9, seed=3, stop=[], n=1,
               presence_penalty=0.0, logprobs=None, echo=False,
               stream_options={"include_usage": True}),
    completion(max_tokens=None, min_tokens=4, stop_token_ids=[2], ignore_eos=True),
    chat(tools=[], tool_choice="none", response_format={"type": "text"},
         messages=[{"role": "system", "content": None},
                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
    chat(max_completion_tokens=None, max_tokens=5, chat_template_kwargs={"x": 1}),
])
def test_eligible(body):
    route = CHAT if "messages" in body else COMPLETIONS
    assert ineligible(body, route) is None


@pytest.mark.parametrize(("body", "why"), [
    (completion(stream=False), "not streaming"),
    ({**completion(), "stream": None}, "not streaming"),
    (completion(n=2), "n > 1"),
    (completion(best_of=3), "best_of > 1"),
    (completion(stop=["\n"]), "stop"),
    (completion(stop="x"), "stop"),
    (completion(presence_penalty=0.5), "presence_penalty"),
    (completion(frequency_penalty=1), "frequency_penalty"),
    (completion(logprobs=0), "logprobs"),
    (completion(echo=True), "echo"),
    (completion(suffix="end"), "suffix"),
    (completion(max_tokens=1), "max_tokens <= 1"),
    (completion(prompt=["a", "b"]), "several prompts"),
    (completion(prompt=[[1, 2]]), "several prompts"),
    (completion(guided_json={}), "field 'guided_json'"),
    (completion(bad_words=["x"]), "field 'bad_words'"),
    (completion(structured_outputs={"regex": "a"}), "field 'structured_outputs'"),
    (chat(logprobs=True), "logprobs"),
    (chat(tools=[{"type": "function"}]), "tools"),
    (chat(tool_choice="auto"), "tool_choice"),
    (chat(response_format={"type": "json_object"}), "response_format"),
    (chat(max_completion_tokens=1, max_tokens=50), "max_tokens <= 1"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "non-text message content"),
    (chat(reasoning_effort="high"), "field 'reasoning_effort'"),
])
def test_ineligible(body, why):
    route = CHAT if "messages" in body else COMPLETIONS
    assert ineligible(body, route) == why


# ---- the bodies ----------------------------------------------------------------------------

def test_prefill_request():
    body = completion(min_tokens=3, stream_options={"include_usage": True})
    assert prefill_request(body, COMPLETIONS, "x1") == {
        "model": "tiny", "prompt": "hello", "max_tokens": 1, "stream": False,
        "min_tokens": 1, "return_token_ids": True,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "transfer_id": "x1", "send_on_stop": False}}


ANSWER = PrefillAnswer(id="cmpl-r1", created=5, model="tiny", text=" the", token_id=77,
                       prompt_token_ids=[1, 2, 3], finish_reason="length", stop_reason=None,
                       usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})


def test_continuation_of_a_chat_is_a_completion_of_token_ids():
    body = chat(temperature=0, min_tokens=2, chat_template="{{x}}", tool_choice="none",
                stream_options={"include_usage": True}, seed=1)
    assert continuation_request(body, CHAT, ANSWER, "x1", "http://b:8998", "e0") == {
        "model": "tiny", "stream": True, "temperature": 0, "seed": 1,
        "stream_options": {"include_usage": True},
        "max_tokens": 7, "min_tokens": 1, "prompt": [1, 2, 3, 77], "return_token_ids": True,
        "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True,
                               "remote_bootstrap_addr": "http://b:8998",
                               "remote_engine_id": "e0", "transfer_id": "x1",
                               "remote_num_tokens": 3}}


def test_continuation_without_a_limit_has_none():
    body = completion(max_tokens=None)
    out = continuation_request(body, COMPLETIONS, ANSWER, "x1", "http://b:8998", "e0")
    assert "max_tokens" not in out and "min_tokens" not in out
    assert out["prompt"] == [1, 2, 3, 77]


def test_fits():
    assert fits(completion(max_tokens=45), COMPLETIONS, ANSWER, 48)  # 3 + 45
    assert not fits(completion(max_tokens=46), COMPLETIONS, ANSWER, 48)
    assert fits(completion(max_tokens=None), COMPLETIONS, ANSWER, 4)
    assert not fits(completion(max_tokens=None), COMPLETIONS, ANSWER, 3)
    assert fits(chat(max_completion_tokens=10**6), CHAT, ANSWER, None)  # length unknown


def test_parse_prefill_answers():
    raw = json.dumps({"id": "cmpl-r1", "created": 5, "model": "tiny", "usage": ANSWER.usage,
                      "choices": [{"index": 0, "text": " the", "finish_reason": "length",
                                   "stop_reason": None, "token_ids": [77],
                                   "prompt_token_ids": [1, 2, 3]}]}).encode()
    assert parse_prefill_answer(raw, COMPLETIONS) == ANSWER
    chat_raw = json.dumps({"id": "chatcmpl-r1", "created": 5, "model": "tiny",
                           "prompt_token_ids": [1, 2, 3],
                           "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": 2,
                                        "token_ids": [2], "message": {
                                            "role": "assistant", "content": "",
                                            "reasoning": None}}]}).encode()
    got = parse_prefill_answer(chat_raw, CHAT)
    assert got is not None and got.stopped and got.text == "" and got.stop_reason == 2


@pytest.mark.parametrize("change", [
    {"text": "\u00e9\ufffd"},  # half of a multi-byte character
    {"text": ""},  # the first bytes of a character, held back: D would repeat its prompt
    {"token_ids": []},
    {"token_ids": None},
    {"prompt_token_ids": None},
    {"prompt_token_ids": [1, "2"]},
    {"finish_reason": None},
    {"finish_reason": "abort"},
])
def test_prefill_answers_that_cannot_lead(change):
    choice = {"index": 0, "text": " the", "finish_reason": "length", "token_ids": [77],
              "prompt_token_ids": [1, 2, 3], **change}
    raw = json.dumps({"id": "c", "created": 1, "model": "m", "choices": [choice]}).encode()
    assert parse_prefill_answer(raw, COMPLETIONS) is None
    assert parse_prefill_answer(b"not json", COMPLETIONS) is None


def test_chat_answers_owned_by_a_parser_cannot_lead():
    for message in ({"content": None, "reasoning": "<think>"},
                    {"content": None, "tool_calls": [{"id": "t"}]}):
        raw = json.dumps({"id": "c", "created": 1, "model": "m", "prompt_token_ids": [1],
                          "choices": [{"index": 0, "finish_reason": "length",
                                       "token_ids": [5], "message": message}]}).encode()
        assert parse_prefill_answer(raw, CHAT) is None


# ---- the client's stream -------------------------------------------------------------------

def events(data: bytes) -> list[Any]:
    out = []
    for ev in data.decode().split("\n\n"):
        if ev:
            assert ev.startswith("data: ")
            out.append(ev[6:] if ev[6:] == "[DONE]" else json.loads(ev[6:]))
    return out


def d_chunk(text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    obj: dict[str, Any] = {"id": "cmpl-r1", "object": "text_completion", "created": 6,
                           "model": "tiny", "choices": [{"index": 0, "text": text,
                                                         "finish_reason": finish,
                                                         "stop_reason": None}]}
    if usage is not None:
        obj = {**obj, "choices": [], "usage": usage}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_completion_stream_keeps_d_token_ids_and_takes_them_out():
    """D's chunks say their token ids (asked for, so the answer can go on elsewhere); the
    client's chunks carry none, as a plain server's, and only whole events come out."""
    s = ClientStream(completion(), COMPLETIONS, ANSWER)
    (first,) = events(s.head())
    assert first["choices"][0]["text"] == " the" and first["choices"][0]["finish_reason"] is None
    assert first["id"] == "cmpl-r1"

    def with_ids(text: str, ids: list[int], prompt: list[int] | None = None) -> bytes:
        obj = json.loads(d_chunk(text)[6:])
        obj["choices"][0].update(token_ids=ids, prompt_token_ids=prompt)
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    chunk = with_ids(" cat", [5], [1, 2, 3, 77])
    assert s.feed(chunk[:10]) == b""
    (got,) = events(s.feed(chunk[10:]))
    assert got["choices"][0]["text"] == " cat"
    assert got["choices"][0]["token_ids"] is None and got["choices"][0]["prompt_token_ids"] is None
    # Half a character: its id waits for the text that completes it.
    events(s.feed(with_ids("\ufffd", [6]) + with_ids("", [8])))
    assert s.done() == [77, 5]
    events(s.feed(with_ids("é!", [9])))
    assert s.done() == [77, 5, 6, 8, 9] and s.exact
    events(s.feed(d_chunk(" no ids")))
    assert not s.exact


def test_usage_after_the_answer_went_on_elsewhere_counts_every_sent_token_as_output():
    s = ClientStream(completion(stream_options={"include_usage": True}), COMPLETIONS, ANSWER)
    for text, ids in ((" cat", [5]), (" sat", [6])):
        obj = json.loads(d_chunk(text)[6:])
        obj["choices"][0]["token_ids"] = ids
        s.feed(b"data: " + json.dumps(obj).encode() + b"\n\n")
    s.feed(d_chunk(" on")[:12])  # the broken engine's partial event is dropped
    s.resumed()  # the new engine's prompt: P's 3, P's token, and 2 sent
    assert s.done() == [77, 5, 6]
    (usage,) = events(s.feed(d_chunk("", usage={"prompt_tokens": 6, "completion_tokens": 2,
                                                 "total_tokens": 8})))
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_usage_counts_p_token_as_output():
    s = ClientStream(completion(stream_options={"include_usage": True}), COMPLETIONS, ANSWER)
    stream = d_chunk(" cat") + d_chunk(" sat", "length") + d_chunk(
        "", usage={"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}) + \
        b"data: [DONE]\n\n"
    # Split anywhere: only whole events come out, in order.
    out = b"".join(s.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + s.flush()
    evs = events(out)
    assert [e["choices"][0]["text"] for e in evs[:2]] == [" cat", " sat"]
    assert evs[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert evs[3] == "[DONE]"


def test_chat_stream_from_completion_chunks():
    answer = PrefillAnswer(id="chatcmpl-r1", created=5, model="tiny", text=" the",
                           token_id=77, prompt_token_ids=[1, 2, 3], finish_reason="length",
                           stop_reason=None, usage=None)
    s = ClientStream(chat(), CHAT, answer)
    role, first = events(s.head())
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["delta"] == {"content": " the"}
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-r1"
    out = s.feed(d_chunk(" cat") + d_chunk(" sat", "length") + b"data: [DONE]\n\n")
    a, b, done = events(out)
    assert a["id"] == b["id"] == "chatcmpl-r1" and a["object"] == "chat.completion.chunk"
    assert a["choices"] == [{"index": 0, "delta": {"content": " cat"}, "logprobs": None,
                             "finish_reason": None}]
    assert b["choices"][0]["finish_reason"] == "length" and done == "[DONE]"
    err = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    assert s.feed(err) == err  # errors pass as they are


def test_prefill_stopped_is_the_whole_stream():
    answer = PrefillAnswer(id="cmpl-r1", created=5, model="tiny", text="", token_id=2,
                           prompt_token_ids=[1, 2, 3], finish_reason="stop", stop_reason=None,
                           usage={"prompt_tokens": 3, "completion_tokens": 1,
                                  "total_tokens": 4})
    s = ClientStream(completion(stream_options={"include_usage": True}), COMPLETIONS, answer)
    first, usage, done = events(s.head())
    assert first["choices"][0]["finish_reason"] == "stop"
    assert usage["usage"]["completion_tokens"] == 1 and usage["choices"] == []
    assert done == "[DONE]"


# ---- through the proxy, with fake nodes ----------------------------------------------------

@pytest.fixture
async def ft(make_cluster: MakeCluster) -> Cluster:
    return await make_cluster(first_token_from_prefill=True)


async def stream(cluster: Cluster, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    async with cluster.http.post(f"{cluster.url}{path}", json=body,
                                 headers={"X-Request-Id": "r1"}) as r:
        text = await r.text()
        if r.status != 200:
            return r.status, [json.loads(text)]
        assert r.headers["Content-Type"].startswith("text/event-stream")
        return r.status, events(text.encode())


def texts(evs: list[Any]) -> str:
    out = ""
    for e in evs:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            out += c["delta"].get("content") or "" if "delta" in c else c["text"]
    return out


async def test_p_token_leads_and_d_continues(ft: Cluster) -> None:
    status, evs = await stream(ft, "/v1/completions", completion(temperature=0))
    assert status == 200
    assert texts(evs) == "t0" + "t0 t1 t2 t3 " and evs[-1] == "[DONE]"
    (p,), (d,) = ft.prefill[0].received, ft.decode[0].received
    assert d.at >= p.at and p.finished.is_set()  # D asked after P answered
    xfer = p.kv["transfer_id"]
    assert p.body["return_token_ids"] is True and p.kv["send_on_stop"] is False
    assert d.path == "/v1/completions"
    assert d.body["prompt"] == [1, 2, 3, 4, 5, 7] and d.body["max_tokens"] == 7
    assert d.kv == {"do_remote_decode": False, "do_remote_prefill": True,
                    "remote_bootstrap_addr": ft.bootstraps[0].url,
                    "remote_engine_id": "engine-p0-dp0", "transfer_id": xfer,
                    "remote_num_tokens": 5,
                    # P answered: D waits for the write alone (appliance.deadlines)
                    "recv_timeout_ms": 1000 * ft.proxy.proxy.settings.kv_transfer_s}
    assert 'pd_proxy_first_token_total{outcome="prefill_led"} 1.0' in await ft.metrics()


async def test_chat_continuation(ft: Cluster) -> None:
    status, evs = await stream(ft, "/v1/chat/completions", chat())
    assert status == 200
    assert texts(evs) == "t0t0 t1 t2 t3 "
    assert {e["object"] for e in evs if isinstance(e, dict)} == {"chat.completion.chunk"}
    assert ft.decode[0].received[0].path == "/v1/completions"


async def test_p_stopped_answers_alone(ft: Cluster) -> None:
    ft.prefill[0].finish_reason = "stop"
    status, evs = await stream(ft, "/v1/completions", completion())
    assert status == 200 and texts(evs) == "t0"
    assert evs[0]["choices"][0]["finish_reason"] == "stop" and evs[-1] == "[DONE]"
    assert ft.decode[0].received == []
    assert 'outcome="prefill_only"' in await ft.metrics()


async def test_ineligible_request_uses_the_classic_split(ft: Cluster) -> None:
    status, evs = await stream(ft, "/v1/completions", completion(stop=["x"]))
    assert status == 200 and texts(evs) == "t0 t1 t2 t3 "
    (p,), (d,) = ft.prefill[0].received, ft.decode[0].received
    assert "return_token_ids" not in p.body and d.body["prompt"] == "hello"
    assert 'outcome="decode"' in await ft.metrics()


async def test_answer_that_cannot_lead_goes_to_d_classically(ft: Cluster) -> None:
    ft.prefill[0].prompt_token_ids = None  # P did not say what it prefilled
    status, evs = await stream(ft, "/v1/completions", completion())
    assert status == 200 and texts(evs) == "t0 t1 t2 t3 "
    (p,), (d,) = ft.prefill[0].received, ft.decode[0].received
    assert d.body["prompt"] == "hello" and d.kv["transfer_id"] == p.kv["transfer_id"]
    assert "remote_num_tokens" not in d.kv


async def test_p_refuses(ft: Cluster) -> None:
    ft.prefill[0].status = 400
    status, (body,) = await stream(ft, "/v1/completions", completion())
    assert status == 400 and body["error"]["message"] == "p0 says no"
    assert ft.decode[0].received == []


async def test_p_unreachable_falls_back_to_d_alone(ft: Cluster) -> None:
    await ft.prefill[0].stop()
    status, evs = await stream(ft, "/v1/completions", completion())
    assert status == 200 and texts(evs) == "t0 t1 t2 t3 "
    assert "kv_transfer_params" not in ft.decode[0].received[0].body


async def test_d_refuses_after_p_token(ft: Cluster) -> None:
    ft.decode[0].status = 400
    status, evs = await stream(ft, "/v1/completions", completion())
    assert status == 200  # the stream had started with P's token
    assert texts(evs[:1]) == "t0"
    assert "d0 says no" in evs[-1]["error"]["message"]


async def test_d_unreachable_before_p_token(make_cluster: MakeCluster) -> None:
    c = await make_cluster(first_token_from_prefill=True, migration_limit=0)
    await c.decode[0].stop()
    status, (body,) = await stream(c, "/v1/completions", completion())
    assert status == 502 and "unreachable" in body["error"]["message"]


async def test_d_unreachable_before_p_token_p_answers_whole(ft: Cluster) -> None:
    await ft.decode[0].stop()
    status, evs = await stream(ft, "/v1/completions", completion())
    assert status == 200 and evs[-1] == "[DONE]" and texts(evs) == "t0 t1 t2 t3 "
    whole = ft.prefill[0].received[-1].body
    assert "kv_transfer_params" not in whole and whole["prompt"] == completion()["prompt"]


async def test_d_dies_mid_stream_the_answer_goes_on_from_p(ft: Cluster) -> None:
    """After P's token and two of D's, D is killed: P goes on after those three tokens
    (their ids), with what is left of max_tokens; the client's stream has no gap and no
    repeat, and one [DONE]."""
    ft.decode[0].die_after = 2
    body = completion()
    status, evs = await stream(ft, "/v1/completions", body)
    assert status == 200 and texts(evs) == "t0t0 t1 t2 t3 ", evs
    assert evs[-1] == "[DONE]" and not any("error" in e for e in evs if isinstance(e, dict))
    on_p = ft.prefill[0].received[-1].body
    assert on_p["prompt"] == [1, 2, 3, 4, 5, 7, 100, 101] and on_p["return_token_ids"] is True
    assert on_p["max_tokens"] == body["max_tokens"] - 3 and "kv_transfer_params" not in on_p
    metrics = await (await ft.http.get(f"{ft.url}/metrics")).text()
    assert 'pd_proxy_migrations_total{how="continued"} 1.0' in metrics


async def test_d_dies_mid_stream(make_cluster: MakeCluster) -> None:
    ft = await make_cluster(first_token_from_prefill=True, migration_limit=0)
    ft.decode[0].die_after = 2
    status, evs = await stream(ft, "/v1/completions", completion())
    assert status == 200 and texts(evs[:3]) == "t0t0 t1 "
    assert "failed mid-stream" in evs[-1]["error"]["message"]


async def test_client_leaving_cancels_d(ft: Cluster) -> None:
    ft.decode[0].chunk_delay = 0.5
    async with ft.http.post(f"{ft.url}/v1/completions", json=completion()) as r:
        await r.content.readuntil(b"\n\n")  # P's token
        r.close()
    await ft.wait_for(lambda: bool(ft.decode[0].received)
                      and ft.decode[0].received[0].finished.is_set())
    assert ft.decode[0].received[0].cancelled


async def test_too_long_for_d_goes_classic_and_gets_d_json_error(ft: Cluster) -> None:
    """P accepts (it computes one token); D would refuse prompt + max_tokens: the client
    gets D's refusal as JSON, not a stream that starts with P's token and then fails."""
    node = ft.proxy.proxy.backends.decode[0]
    await ft.wait_for(lambda: node.max_model_len == 2048)  # read from D's /v1/models
    node.max_model_len = 100
    ft.decode[0].status = 400
    status, (body,) = await stream(ft, "/v1/completions", completion(max_tokens=96))
    assert status == 400 and body["error"]["message"] == "d0 says no"
    (d,) = ft.decode[0].received
    assert d.body["prompt"] == "hello"  # the classic body, after P answered
    ft.decode[0].status = 200
    status, evs = await stream(ft, "/v1/completions", completion(max_tokens=95))
    assert status == 200 and ft.decode[0].received[1].body["prompt"] == [1, 2, 3, 4, 5, 7]
