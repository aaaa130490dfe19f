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


async def _call(settings: ConnectorSettings, body: dict[str, Any]) -> tuple[int, bool]:
    """The guard in front of an app that answers 200: (status, whether the app ran)."""
    reached = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = KVParamsGuard(app)
    guard._settings, guard._keys = settings, bearer.Keys([])  # as _load() finds them
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                receive, send)
    assert not reached or reached == [raw]  # the body reaches vLLM unchanged
    return sent[0]["status"], bool(reached)


async def test_guard_is_on_with_networks_alone() -> None:
    assert await _call(PODS, _pull("http://10.244.7.1:8998")) == (200, True)
    assert await _call(PODS, _pull("http://192.168.1.1:8998")) == (400, False)
    open_node = ConnectorSettings(engine_id="d", role="consumer")
    assert await _call(open_node, _pull("http://192.168.1.1:8998")) == (200, True)
