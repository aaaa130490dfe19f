"""The split as pure functions: what P and D are sent, and which client bodies are refused."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from appliance.proxy.errors import ProxyError, sse_error_event, upstream_error_body
from appliance.proxy.exchange.bodies import decode_body, new_transfer_id, prefill_body, uuid4_str
from appliance.proxy.openai_api import CHAT, COMPLETIONS, parse_request, prefill_finish_reason

XFER = "xfer-00000000-0000-4000-8000-000000000000"
UUID4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


def test_transfer_id_is_xfer_uuid4() -> None:
    ids = {new_transfer_id() for _ in range(100)}
    assert len(ids) == 100
    for t in ids:
        assert re.fullmatch(f"xfer-{UUID4}", t)


def test_prefill_body_completions() -> None:
    client = {"model": "m", "prompt": "hi", "max_tokens": 128, "temperature": 0,
              "stream": True, "stream_options": {"include_usage": True}}
    assert prefill_body(client, COMPLETIONS, XFER) == {
        "model": "m", "prompt": "hi", "max_tokens": 1, "temperature": 0, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "transfer_id": XFER},
    }
    assert client["max_tokens"] == 128 and "stream_options" in client  # not mutated


def test_prefill_body_chat_caps_both_token_limits() -> None:
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
              "max_completion_tokens": 50, "min_tokens": 4}
    body = prefill_body(client, CHAT, XFER)
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert body["stream"] is False
    assert "min_tokens" not in body  # would make P refuse max_tokens=1


def test_prefill_body_asks_one_choice() -> None:
    """P's token is thrown away: n copies would prefill n times for one transfer."""
    body = prefill_body({"model": "m", "prompt": "hi", "n": 3, "best_of": 4}, COMPLETIONS, XFER)
    assert "n" not in body and "best_of" not in body


def test_decode_body_keeps_client_fields() -> None:
    client = {"model": "m", "prompt": "hi", "max_tokens": 128, "stream": True,
              "stream_options": {"include_usage": True}}
    assert decode_body(client, XFER, "http://10.0.0.1:8998", "eng-0") == {
        **client,
        "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True,
                               "remote_bootstrap_addr": "http://10.0.0.1:8998",
                               "remote_engine_id": "eng-0", "transfer_id": XFER},
    }


def test_parse_request_drops_client_kv_transfer_params() -> None:
    raw = json.dumps({"prompt": "x", "kv_transfer_params": {
        "remote_bootstrap_addr": "http://evil:1", "do_remote_prefill": True}}).encode()
    assert parse_request(raw, COMPLETIONS) == {"prompt": "x"}


@pytest.mark.parametrize(("raw", "route", "fragment"), [
    (b"{not json", COMPLETIONS, "not valid JSON"),
    (b"[1, 2]", COMPLETIONS, "JSON object"),
    (b'{"model": "m"}', COMPLETIONS, "'prompt'"),
    (b'{"prompt": ""}', COMPLETIONS, "'prompt'"),
    (b'{"prompt": 3}', COMPLETIONS, "'prompt'"),
    (b'{"prompt": "x"}', CHAT, "'messages'"),
    (b'{"messages": []}', CHAT, "'messages'"),
    (b'{"prompt": "x", "stream": "yes"}', COMPLETIONS, "'stream'"),
])
def test_parse_request_refuses(raw: bytes, route: str, fragment: str) -> None:
    with pytest.raises(ProxyError) as info:
        parse_request(raw, route)
    assert info.value.status == 400
    assert fragment in info.value.message


def test_prompt_as_token_ids_is_accepted() -> None:
    assert parse_request(b'{"prompt": [1, 2, 3]}', COMPLETIONS)["prompt"] == [1, 2, 3]


def test_prefill_finish_reason() -> None:
    assert prefill_finish_reason(b'{"choices": [{"finish_reason": "stop"}]}') == "stop"
    assert prefill_finish_reason(b'{"choices": [{"finish_reason": "length"}]}') == "length"
    assert prefill_finish_reason(b'{"choices": []}') is None
    assert prefill_finish_reason(b"garbage") is None


def test_upstream_error_bodies_are_made_uniform() -> None:
    new = upstream_error_body(400, b'{"error": {"message": "too long", "type": "BadRequestError",'
                                   b' "code": 400}}', "prefill node p")
    assert new == {"error": {"message": "too long", "type": "BadRequestError", "code": 400}}
    old = upstream_error_body(400, b'{"object": "error", "message": "too long", '
                                   b'"type": "BadRequestError", "code": 400}', "prefill node p")
    assert old["error"]["message"] == "too long"
    html = upstream_error_body(502, b"<html>bad gateway</html>", "prefill node p")
    assert html["error"]["message"].startswith("prefill node p answered 502")
    assert html["error"]["code"] == 502


def test_sse_error_event_shape() -> None:
    event = sse_error_event(502, "gone")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {"error": {"message": "gone", "type": "upstream_error",
                                               "code": 502}}


def test_uuid4_str_is_a_uuid4() -> None:
    for _ in range(50):
        value = uuid4_str()
        parsed = uuid.UUID(value)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122 and str(parsed) == value
