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

# A body past this is refused (413) rather than passed on uninspected; a decode request,
# prompt included, is far smaller.
MAX_INSPECT_BYTES = 64 << 20


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One value per key: parsers disagree on which duplicate wins (Python's last, others
    first), so a body whose meaning depends on it is refused."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(f"the request body names {key!r} twice")
        out[key] = value
    return out


def parse_body(body: bytes) -> tuple[Any, str | None]:
    """(the parsed JSON, None) or (None, why it is refused). Decided on the parsed keys,
    never on the raw bytes: an escape ("kv_transfer_param\\u0073") names the same key."""
    try:
        return json.loads(body, object_pairs_hook=_no_duplicates), None
    except _Duplicate as exc:
        return None, str(exc)
    except (ValueError, RecursionError):
        # What this parser cannot read, vLLM's must not be trusted to read differently.
        return None, "the request body is not valid JSON"


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


def _error(message: str, status: int) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": "kv_transfer_params", "code": status}}).encode()


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
        status, problem = (413, f"the request body exceeds {MAX_INSPECT_BYTES} bytes") \
            if more else (400, None)
        if problem is None:
            parsed, problem = parse_body(body)
            if problem is None and isinstance(parsed, dict):
                problem = bootstrap_problem(settings, parsed)
        if problem:
            log.warning("refused %s: %s", scope.get("path"), problem)
            payload = _error(problem, status)
            await send({"type": "http.response.start", "status": status,
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
