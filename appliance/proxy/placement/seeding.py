"""`auto` from the first request: before the proxy has timed a prefill of its own, it reads
the first P's history from P's metrics (appliance.proxy.placement.priors), so a restarted
proxy, or a second one, decides as the first did. A P that has served nothing (the node
just came up) is timed instead, through the whole split: a warm-up, then prompts of two
sizes, each prefilled on P (its answer times the prefill line) and pulled by the first D
(D's one-token answer after P's times the handoff); their usage says the true prompt
tokens. That also moves KV from P to D once before any client does: a transfer path that
does not work shows in the log at start. Without either, requests go remote `unmeasured`
until P has answered one (as before any of this).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from appliance.proxy.exchange.bodies import decode_body, new_transfer_id, prefill_body
from appliance.proxy.nodes.backends import Backend, PrefillBackend
from appliance.proxy.openai_api import COMPLETIONS
from appliance.proxy.placement.costmodel import Linear
from appliance.proxy.placement.priors import engine_history

log = logging.getLogger("appliance.proxy.placement")

# Prompt sizes timed on a fresh P (about; a word is a token or two): spread enough to fit
# the line's slope, short enough for any context length and a few ms of a GPU's time.
CALIBRATION_WORDS = (32, 256, 32, 256)
_WORD = " hello"


@dataclass
class Nodes:
    """What seeding needs of the proxy's nodes and client."""

    ready_prefill: Callable[[], Sequence[PrefillBackend]]
    ready_decode: Callable[[], Sequence[Backend]]
    rotation_changed: Callable[[float], Any]
    session: aiohttp.ClientSession
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 30.0
    recv_ms: int | None = None  # D's wait for P's KV (appliance.deadlines)


async def seed(prefill: Linear, handoff: Linear, nodes: Nodes, calibrate: bool) -> str:
    """Seeds the lines once a P and a D are in rotation; returns what it did (for the log
    and the tests): "measured" (the proxy timed a request itself first), "history",
    "calibrated" or "none"."""
    while not (nodes.ready_prefill() and nodes.ready_decode()):
        await nodes.rotation_changed(5.0)
    if prefill.samples:
        return "measured"
    p = nodes.ready_prefill()[0]
    timeout = aiohttp.ClientTimeout(total=nodes.timeout_s)
    text = await _get_text(nodes, f"{p.url}/metrics", timeout)
    if text is None:
        return "none"  # no metrics to tell a fresh engine from a busy one: leave it
    history = engine_history(text)
    mean = history.mean()
    if mean is not None:
        prefill.observe(*mean)
        log.info("auto: prefill line seeded from %s's history: %d prefills, %.0f tokens in "
                 "%.1f ms on average", p.url, history.prefills, mean[0], mean[1] * 1000)
        return "history"
    if history.prefills or not calibrate:
        return "none"
    d = nodes.ready_decode()[0]
    timed = await _calibrate(p, d, nodes, timeout)
    for tokens, p_s, handoff_s in timed:
        prefill.observe(tokens, p_s)
        handoff.observe(tokens, handoff_s)
    if timed:
        log.info("auto: prefill and handoff lines calibrated on %s and %s: %s", p.url, d.url,
                 ", ".join(f"{n} tokens: P {p_s * 1000:.1f} ms, then D {h_s * 1000:.1f} ms"
                           for n, p_s, h_s in timed))
        return "calibrated"
    log.warning("auto: calibration through %s and %s failed (see their logs): requests "
                "are placed unmeasured until P has answered one", p.url, d.url)
    return "none"


async def _get_text(nodes: Nodes, url: str, timeout: aiohttp.ClientTimeout) -> str | None:
    try:
        async with nodes.session.get(url, headers=nodes.headers, timeout=timeout) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def _post(nodes: Nodes, url: str, body: dict[str, Any], headers: dict[str, str],
                timeout: aiohttp.ClientTimeout) -> dict[str, Any] | None:
    try:
        async with nodes.session.post(url, json=body, headers={**nodes.headers, **headers},
                                      timeout=timeout) as r:
            answer = await r.json(content_type=None) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


async def _model(nodes: Nodes, p: PrefillBackend, timeout: aiohttp.ClientTimeout) -> str | None:
    try:
        async with nodes.session.get(f"{p.url}/v1/models", headers=nodes.headers,
                                     timeout=timeout) as r:
            models = await r.json(content_type=None) if r.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    data = models.get("data") if isinstance(models, dict) else None
    return data[0].get("id") if isinstance(data, list) and data else None


async def _calibrate(p: PrefillBackend, d: Backend, nodes: Nodes,
                     timeout: aiohttp.ClientTimeout) -> list[tuple[int, float, float]]:
    """(prompt tokens, P's seconds to its answer, D's seconds to its one-token answer after
    P's) per timed prompt; the warm-up's and any that failed are left out."""
    model = await _model(nodes, p, timeout)
    out: list[tuple[int, float, float]] = []
    for i, words in enumerate((4, *CALIBRATION_WORDS)):  # the first warms both up, untimed
        body: dict[str, Any] = {"prompt": _WORD * words, "max_tokens": 1, "temperature": 0}
        if model:
            body["model"] = model
        transfer_id = new_transfer_id()
        rank, engine_id = p.next_rank()
        started = time.monotonic()
        rank_header = {"X-data-parallel-rank": str(rank)} if len(p.engine_ids) > 1 else {}
        answer = await _post(nodes, f"{p.url}/v1/completions",
                             prefill_body(body, COMPLETIONS, transfer_id),
                             {"X-Request-Id": f"calibrate-{transfer_id}", **rank_header},
                             timeout)
        answered = time.monotonic()
        if answer is None:
            continue
        pulled = await _post(nodes, f"{d.url}/v1/completions",
                             decode_body(body, transfer_id, p.bootstrap_url, engine_id,
                                         nodes.recv_ms),
                             {"X-Request-Id": f"calibrate-{transfer_id}"}, timeout)
        usage = answer.get("usage")
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if i and pulled is not None and isinstance(tokens, int) and tokens > 0:
            out.append((tokens, answered - started, time.monotonic() - answered))
    return out
