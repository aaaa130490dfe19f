"""D's HTTP guard of kv_transfer_params (appliance.connector.httpguard) when D is given
networks rather than addresses (Kubernetes: P pods change IP on every restart). The guard
with addresses alone is tested in tests/pdctl/test_security.py."""

from __future__ import annotations

import json
from typing import Any

from appliance import bearer
from appliance.connector.httpguard import KVParamsGuard, bootstrap_problem
from appliance.connector.settings import ConnectorSettings

PODS = ConnectorSettings(engine_id="d", role="consumer",
                         allowed_bootstrap_networks=("10.244.0.0/16",))


def _pull(addr: str) -> dict[str, Any]:
    return {"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True,
                                                   "remote_bootstrap_addr": addr}}


def test_problem_with_networks_alone() -> None:
    assert bootstrap_problem(PODS, _pull("http://10.244.7.1:8998")) is None
    assert "not a bootstrap address" in bootstrap_problem(PODS, _pull("http://10.0.0.1:8998"))
    assert "not a bootstrap address" in bootstrap_problem(PODS, _pull("http://evil:8998"))


async def _call(settings: ConnectorSettings, body: dict[str, Any] | bytes,
                chunks: int = 1) -> tuple[int, bool]:
    """The guard in front of an app that answers 200: (status, whether the app ran). `body`
    as given when bytes (escapes, duplicates), sent in `chunks` messages."""
    reached = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = KVParamsGuard(app)
    guard._settings, guard._keys = settings, bearer.Keys([])  # as _load() finds them
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    step = -(-len(raw) // chunks)
    parts = [raw[i:i + step] for i in range(0, len(raw), step)]

    async def receive() -> dict[str, Any]:
        part = parts.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(parts)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                receive, send)
    assert not reached or reached == [raw] or chunks > 1  # the body reaches vLLM unchanged
    return sent[0]["status"], bool(reached)


async def test_guard_is_on_with_networks_alone() -> None:
    assert await _call(PODS, _pull("http://10.244.7.1:8998")) == (200, True)
    assert await _call(PODS, _pull("http://192.168.1.1:8998")) == (400, False)
    open_node = ConnectorSettings(engine_id="d", role="consumer")
    assert await _call(open_node, _pull("http://192.168.1.1:8998")) == (200, True)


EVIL = "http://192.168.1.1:8998"


async def test_an_escaped_key_is_the_same_key() -> None:
    """vLLM's JSON parser reads "kv_transfer_param\\u0073" as kv_transfer_params: so does the
    guard (it decides on parsed keys, not on bytes)."""
    raw = ('{"prompt": "hi", "kv_transfer_param\\u0073": {"do_remote_prefill": true, '
           f'"remote_bootstrap_addr": "{EVIL}"}}}}').encode()
    assert json.loads(raw)["kv_transfer_params"]["remote_bootstrap_addr"] == EVIL
    assert await _call(PODS, raw) == (400, False)
    escaped_value = raw.replace(b'"do_remote_prefill"', b'"do_remote_\\u0070refill"')
    assert await _call(PODS, escaped_value) == (400, False)


async def test_duplicate_keys_are_refused() -> None:
    """Parsers differ on which duplicate wins: a body whose meaning depends on it is refused,
    at the top and inside kv_transfer_params."""
    good = '{"do_remote_prefill": true, "remote_bootstrap_addr": "http://10.244.7.1:8998"}'
    bad = f'{{"do_remote_prefill": true, "remote_bootstrap_addr": "{EVIL}"}}'
    twice = f'{{"prompt": "hi", "kv_transfer_params": {bad}, "kv_transfer_params": {good}}}'
    assert await _call(PODS, twice.encode()) == (400, False)
    inner = ('{"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": true, '
             f'"remote_bootstrap_addr": "{EVIL}", "remote_bootstrap_addr": '
             '"http://10.244.7.1:8998"}}')
    assert await _call(PODS, inner.encode()) == (400, False)


async def test_nesting_and_chunks_and_bad_json() -> None:
    # kv_transfer_params nested elsewhere is not vLLM's: passed on
    nested = {"prompt": "hi", "extra": {"kv_transfer_params": _pull(EVIL)["kv_transfer_params"]}}
    assert await _call(PODS, nested) == (200, True)
    # split across many messages: parsed whole
    assert await _call(PODS, _pull(EVIL), chunks=7) == (400, False)
    assert await _call(PODS, _pull("http://10.244.7.1:8998"), chunks=7) == (200, True)
    # what the guard cannot parse is not handed to another parser
    assert await _call(PODS, b'{"prompt": "hi", "kv_transfer_params": {') == (400, False)
    assert await _call(PODS, b"[" * 100_000) == (400, False)


async def test_a_body_too_large_to_inspect_is_refused(monkeypatch) -> None:
    from appliance.connector import httpguard

    monkeypatch.setattr(httpguard, "MAX_INSPECT_BYTES", 1000)
    big = {**_pull(EVIL), "prompt": "x" * 5000}
    assert await _call(PODS, big, chunks=10) == (413, False)
