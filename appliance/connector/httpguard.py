"""An ASGI middleware for vLLM's API server (`--middleware appliance.connector.httpguard.
KVParamsGuard`): a decode node refuses, with a 400, `kv_transfer_params` that name a
bootstrap sidecar outside its allow-list (addresses, and networks the sidecar's IP may be
in), before the request reaches the engine.

The connector's scheduler refuses those too (it prefills locally instead, nothing fetched),
but it runs inside the engine, where no HTTP error can be given; this answers the caller.
The settings are the connector's own (vLLM's `--kv-transfer-config`, read from the app's
state), so the allow-list lives in one place. vLLM adds user middleware outermost, ahead
of its `--api-key` check: a request without a valid key is passed on untouched, so it gets
vLLM's 401, never a hint about the allow-list.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from appliance import bearer
from appliance.connector.settings import ConnectorSettings

log = logging.getLogger("vllm.appliance.connector.httpguard")

# Bodies larger than this are left to vLLM (which bounds them itself); a prompt with
# kv_transfer_params is far smaller.
MAX_INSPECT_BYTES = 64 << 20
_MARKER = b"kv_transfer_params"


def bootstrap_problem(settings: ConnectorSettings, body: dict[str, Any]) -> str | None:
    """Why this request body must be refused (None: it may go on). Pure."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    addr = params.get("remote_bootstrap_addr")
    if not isinstance(addr, str) or not settings.bootstrap_allowed(addr):
        return (f"kv_transfer_params.remote_bootstrap_addr {addr!r} is not a bootstrap "
                "address this decode node may pull KV through")
    return None


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": "kv_transfer_params", "code": 400}}).encode()


class KVParamsGuard:
    def __init__(self, app: Any) -> None:
        self.app = app
        self._settings: ConnectorSettings | None = None
        self._keys: bearer.Keys | None = None

    def _load(self, scope: dict[str, Any]) -> ConnectorSettings | None:
        if self._keys is None:
            state = scope["app"].state
            cfg = state.vllm_config.kv_transfer_config
            if cfg is not None and cfg.kv_connector == "PDConnector":
                self._settings = ConnectorSettings.from_kv_transfer_config(cfg)
            from vllm import envs

            self._keys = bearer.Keys(state.args.api_key or [envs.VLLM_API_KEY])
        return self._settings

    def _authenticated(self, scope: dict[str, Any]) -> bool:
        assert self._keys is not None
        if not self._keys:
            return True
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        return self._keys.admit(header.decode("latin-1"))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        settings = self._load(scope)
        if (settings is None or settings.is_producer or not settings.guards_bootstrap
                or not self._authenticated(scope)):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > MAX_INSPECT_BYTES:
                break
        body = b"".join(chunks)
        if not more and _MARKER in body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None  # vLLM answers malformed JSON itself
            problem = bootstrap_problem(settings, parsed) if isinstance(parsed, dict) else None
            if problem:
                log.warning("refused %s: %s", scope.get("path"), problem)
                payload = _error(problem)
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(payload)).encode())]})
                await send({"type": "http.response.body", "body": payload})
                return

        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": more}
            return await receive()

        await self.app(scope, replay, send)
