"""The bodies of one split request (docs/protocol.md steps 8-10): one client request
becomes a P request and a D request.

Pure functions on decoded JSON bodies, so the exact bodies P and D receive are easy to test.
"""

from __future__ import annotations

import os
from typing import Any

from appliance.proxy.openai_api import CHAT, RESPONSES

# P's one token is thrown away: one choice is enough (n > 1 would prefill once per choice and
# offer D the same transfer several times), and min_tokens would make it refuse max_tokens=1.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "n", "best_of")


def uuid4_str() -> str:
    """str(uuid.uuid4()) at a third of the cost (it runs twice per request)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def new_transfer_id() -> str:
    return f"xfer-{uuid4_str()}"


def prefill_body(body: dict[str, Any], route: str, transfer_id: str) -> dict[str, Any]:
    """P computes the prompt's KV and one token, answers at once, and sends the KV to D."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    if route == RESPONSES:
        out["max_output_tokens"] = 1
        # P's one-token answer is no response of the client's: not kept in P's store (vLLM
        # never frees it), and not run in the background (the proxy waits for it).
        out["store"] = False
        out["background"] = False
    else:
        out["max_tokens"] = 1
    if route == CHAT:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return out


def decode_body(body: dict[str, Any], transfer_id: str, bootstrap_addr: str,
                engine_id: str, recv_timeout_ms: int | None = None) -> dict[str, Any]:
    """D gets the client's request as is, plus where to pull the KV from."""
    out = dict(body)
    out["kv_transfer_params"] = pull_params(transfer_id, bootstrap_addr, engine_id,
                                            recv_timeout_ms)
    return out


def pull_params(transfer_id: str, bootstrap_addr: str, engine_id: str,
                recv_timeout_ms: int | None = None) -> dict[str, Any]:
    """D's `kv_transfer_params`: pull this transfer's KV from that prefill engine, waiting
    for it at most `recv_timeout_ms` (appliance.deadlines; None: D's own default)."""
    params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": bootstrap_addr,
        "remote_engine_id": engine_id,
        "transfer_id": transfer_id,
    }
    if recv_timeout_ms is not None:
        params["recv_timeout_ms"] = recv_timeout_ms
    return params
