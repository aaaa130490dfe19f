"""The Responses API's pieces as pure functions: the body checks, P's body, what the proxy
reads of an answer, the event stream's reading, the prompt as chat messages, and the
turn that says where a response must be served."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.proxy.access import AccessRecord
from appliance.proxy.errors import ProxyError
from appliance.proxy.exchange.bodies import prefill_body
from appliance.proxy.exchange.first_token import ineligible
from appliance.proxy.exchange.sse import DataStream, ResponseEvents, event_stream
from appliance.proxy.nodes.backends import Backend, PrefillBackend
from appliance.proxy.openai_api import (
    RESPONSES,
    answer_usage,
    parse_request,
    prefill_finish_reason,
    prefill_prompt_tokens,
    responses_messages,
)
from appliance.proxy.placement import Decision
from appliance.proxy.placement.costmodel import prompt_size
from appliance.proxy.prefix.tokens import tokenize_body
from appliance.proxy.responses import Homes, Turn, new_response_id
from tests.proxy import fake_responses as fr

XFER = "xfer-00000000-0000-4000-8000-000000000000"


@pytest.mark.parametrize(("raw", "fragment"), [
    (b'{"model": "m"}', "'input'"),
    (b'{"input": ""}', "'input'"),
    (b'{"input": []}', "'input'"),
    (b'{"input": 3}', "'input'"),
    (b'{"input": "x", "stream": 1}', "'stream'"),
])
def test_parse_request_refuses_bad_responses_bodies(raw: bytes, fragment: str) -> None:
    with pytest.raises(ProxyError) as info:
        parse_request(raw, RESPONSES)
    assert info.value.status == 400 and fragment in info.value.message


def test_parse_request_drops_a_clients_kv_transfer_params() -> None:
    raw = json.dumps({"input": [{"role": "user", "content": "x"}],
                      "kv_transfer_params": {"do_remote_prefill": True}}).encode()
    assert parse_request(raw, RESPONSES) == {"input": [{"role": "user", "content": "x"}]}


def test_prefill_body_for_a_response() -> None:
    client = {"model": "m", "input": "hi", "max_output_tokens": 64, "stream": True,
              "store": True, "request_id": "resp_1", "temperature": 0}
    assert prefill_body(client, RESPONSES, XFER) == {
        "model": "m", "input": "hi", "max_output_tokens": 1, "stream": False,
        "store": False, "background": False, "request_id": "resp_1", "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "transfer_id": XFER},
    }
    assert client["max_output_tokens"] == 64 and client["store"] is True  # not mutated


def test_what_the_proxy_reads_of_a_response() -> None:
    one = json.dumps(fr.whole("p", {"max_output_tokens": 1}, "length")).encode()
    assert prefill_finish_reason(one) == "length"
    assert prefill_prompt_tokens(one) == 5
    stopped = json.dumps(fr.whole("p", {"max_output_tokens": 1}, "stop")).encode()
    assert prefill_finish_reason(stopped) == "stop"
    assert answer_usage(json.dumps(fr.whole("d", {}, "length")).encode()) == (5, 4)


def test_no_first_token_mode_for_responses() -> None:
    assert ineligible({"input": "hi", "stream": True}, RESPONSES) == "Responses API"


def _stream() -> bytes:
    body: dict[str, Any] = {}
    return (fr.preamble("d", body) + fr.opening_item("d") + fr.delta("d", 0)
            + fr.delta("d", 1) + fr.closing("d", body, 2, "length"))


def test_response_events_hold_the_opening_events_back() -> None:
    raw = _stream()
    s = ResponseEvents()
    opening = fr.preamble("d", {})
    assert s.hold(opening[:10]) == b"" and s.hold(opening[10:]) == b""
    # The next event, whole, lets everything through, in order.
    rest = raw[len(opening):]
    cut = rest.index(b"\n\n") + 1  # its line end not there yet: still held
    assert s.hold(rest[:cut]) == b""
    assert s.hold(rest[cut:]) == raw
    assert s.hold(b"more") == b"more"


def test_response_events_restart_drops_the_first_answers_opening() -> None:
    s = ResponseEvents()
    assert s.hold(fr.preamble("d", {})) == b""
    s.restart()
    assert s.flush() == b""


def test_response_events_complete_and_count_tokens_across_chunks() -> None:
    raw = _stream()
    s = ResponseEvents()
    at = raw.index(b"event: response.completed") + 12  # the marker cut in two
    for part in (raw[:at], raw[at:]):
        s.seen(part)
    assert s.complete
    assert s.tokens(raw) == 2 and s.steps(raw) == 2
    cut = ResponseEvents()
    cut.seen(raw[:raw.index(b"event: response.output_text.done")])
    assert not cut.complete and cut.end == "response.completed"
    assert s.step_s(1.0, 2.0, 3) == 0.5 and s.step_s(1.0, 2.0, 2) is None


def test_response_error_event_makes_the_sdk_raise() -> None:
    raw = ResponseEvents().error(502, "decode node gone")
    kind, data = raw.decode().strip().split("\n")
    assert kind == "event: error"
    payload = json.loads(data.removeprefix("data: "))
    assert payload["type"] == "error" and payload["message"] == "decode node gone"
    assert payload["error"]["code"] == 502  # what the openai SDK raises APIError for


def test_chat_streams_read_as_before() -> None:
    assert isinstance(event_stream("/v1/chat/completions"), DataStream)
    s = DataStream()
    assert s.hold(b"data: x\n\n") == b"data: x\n\n"
    s.seen(b"data: x\n\ndata: [DONE]\n\n")
    assert s.complete and s.steps(b"data: x\n\ndata: [DONE]\n\n") == 2


def test_responses_prompt_as_chat_messages() -> None:
    assert responses_messages({"input": "hi", "instructions": "be brief"}) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    items = [{"role": "user", "content": "a"},
             {"type": "message", "role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}]
    assert responses_messages({"input": items}) == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}]
    for body in ({"input": "hi", "previous_response_id": "resp_1"},
                 {"input": "hi", "tools": [{"type": "function", "name": "f"}]},
                 {"input": [{"role": "user", "content": [{"type": "input_text",
                                                           "text": "x"}]}]},
                 {"input": [{"type": "function_call_output", "call_id": "c",
                             "output": "x"}]},
                 {"input": [{"role": "user", "content": "a"},
                            {"role": "assistant", "content": "partial"}]}):
        assert responses_messages(body) is None, body
    assert tokenize_body({"model": "m", "input": "hi"}, RESPONSES) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert prompt_size({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "abcd"}]}], "instructions": "xy"}, RESPONSES) == (0, 6)


def test_a_response_that_may_be_stored_gets_an_id_of_vllms_form() -> None:
    homes = Homes()
    body: dict[str, Any] = {"input": "hi"}
    turn = Turn.begin(body, homes)
    assert turn.response_id == body["request_id"]
    assert len(new_response_id()) == len("resp_") + 16
    assert Turn.begin({"input": "hi", "request_id": "mine"}, homes).response_id == "mine"
    unstored: dict[str, Any] = {"input": "hi", "store": False}
    assert Turn.begin(unstored, homes).response_id is None and "request_id" not in unstored


def test_homes_keep_the_latest() -> None:
    homes = Homes(limit=2)
    homes.remember("a", "http://d0")
    homes.remember("b", "http://d1")
    assert homes.home("a") == "http://d0"  # used: now the latest
    homes.remember("c", "http://d0")
    assert homes.home("b") is None and homes.home("a") == "http://d0"


def _nodes(ranks: int = 1) -> tuple[PrefillBackend, Backend]:
    p = PrefillBackend("prefill", "http://p", bootstrap_url="http://b")
    p.engine_ids = {r: f"e{r}" for r in range(ranks)}
    return p, Backend("decode", "http://d")


def _placed(turn: Turn, p: PrefillBackend, d: Backend, where: str = "remote") -> Decision:
    overrule = turn.overrule(p, d)
    assert overrule is not None
    return overrule(Decision(where, "policy", 10))  # type: ignore[arg-type]


def test_what_must_be_served_whole() -> None:
    homes = Homes()
    p, d = _nodes()
    assert Turn.begin({"input": "x"}, homes).overrule(p, d) is None
    assert Turn.begin({"input": "x", "tools": [{"type": "function"}]},
                      homes).overrule(p, d) is None
    for body, reason in (({"input": "x", "background": True}, "background"),
                         ({"input": "x", "tools": [{"type": "mcp"}]}, "server_tools"),
                         ({"input": "x", "previous_response_id": "resp_x"},
                          "previous_response")):
        decision = _placed(Turn.begin(body, homes), p, d)
        assert (decision.where, decision.reason, decision.tokens) == ("local", reason, 10)
    # P alone stays where the policy chose it.
    assert _placed(Turn.begin({"input": "x", "background": True}, homes), p, d,
                   "p_alone").where == "p_alone"
    dp2, _ = _nodes(ranks=2)
    assert _placed(Turn.begin({"input": "x"}, homes), dp2, d).reason == "dp_ranks"


def test_a_continued_response_goes_where_the_last_one_was_answered() -> None:
    homes = Homes()
    p, d = _nodes()
    rec = AccessRecord(RESPONSES, "r", 0.0)
    first = Turn.begin({"input": "x"}, homes)
    rec.decode = p.url  # P served it alone
    first.answered(200, rec)
    assert first.response_id is not None
    turn = Turn.begin({"input": "y", "previous_response_id": first.response_id}, homes)
    assert turn.home([p, d]) is p
    assert _placed(turn, p, d, "local").where == "p_alone"
    rec.decode = d.url
    first.answered(200, rec)
    assert _placed(turn, p, d).where == "local"
    # A failed answer is stored nowhere.
    failed = Turn.begin({"input": "z"}, homes)
    failed.answered(502, rec)
    assert failed.response_id is not None and homes.home(failed.response_id) is None
