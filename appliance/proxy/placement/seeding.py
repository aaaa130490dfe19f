"""`auto` from the first request: before the proxy has timed a prefill of its own, it reads
the first P's history from P's metrics (appliance.proxy.placement.priors), so a restarted
proxy, or a second one, decides as the first did. A P that has served nothing (the node
just came up) is timed instead: one warm-up prefill, then prompts of two sizes, each a
one-token completion; their usage says the true prompt tokens. Without either, requests
go remote `unmeasured` until P has answered one (as before any of this).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from appliance.proxy.nodes.backends import PrefillBackend
from appliance.proxy.placement.costmodel import Linear
from appliance.proxy.placement.priors import engine_history

log = logging.getLogger("appliance.proxy.placement")

# Prompt sizes timed on a fresh P (about; a word is a token or two): spread enough to fit
# the line's slope, short enough for any context length and a few ms of a GPU's time.
CALIBRATION_WORDS = (32, 256, 32, 256)
_WORD = " hello"


async def seed(prefill: Linear, ready_prefill: Callable[[], Sequence[PrefillBackend]],
               rotation_changed: Callable[[float], Any], session: aiohttp.ClientSession,
               headers: dict[str, str], timeout_s: float, calibrate: bool) -> str:
    """Seeds `prefill` once the first P is in rotation; returns what it did (for the log
    and the tests): "measured" (the proxy timed one itself first), "history", "calibrated"
    or "none"."""
    while not ready_prefill():
        await rotation_changed(5.0)
    if prefill.samples:
        return "measured"
    p = ready_prefill()[0]
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(f"{p.url}/metrics", headers=headers, timeout=timeout) as r:
            text = await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        text = None
    if text is None:
        return "none"  # no metrics to tell a fresh engine from a busy one: leave it
    history = engine_history(text)
    mean = history.mean()
    if mean is not None and not prefill.samples:
        prefill.observe(*mean)
        log.info("auto: prefill line seeded from %s's history: %d prefills, %.0f tokens in "
                 "%.1f ms on average", p.url, history.prefills, mean[0], mean[1] * 1000)
        return "history"
    if history.prefills or not calibrate:
        return "none"
    samples = await _calibrate(p, session, headers, timeout)
    for tokens, seconds in samples:
        prefill.observe(tokens, seconds)
    log.info("auto: prefill line calibrated on %s: %s", p.url,
             ", ".join(f"{n} tokens in {s * 1000:.1f} ms" for n, s in samples) or "no answer")
    return "calibrated" if samples else "none"


async def _calibrate(p: PrefillBackend, session: aiohttp.ClientSession,
                     headers: dict[str, str], timeout: aiohttp.ClientTimeout
                     ) -> list[tuple[int, float]]:
    """(prompt tokens, seconds to the one-token answer) per timed prompt; the warm-up's and
    any that failed are left out."""
    try:
        async with session.get(f"{p.url}/v1/models", headers=headers, timeout=timeout) as r:
            models = await r.json(content_type=None) if r.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        models = {}
    data = models.get("data") if isinstance(models, dict) else None
    model = data[0].get("id") if isinstance(data, list) and data else None
    out: list[tuple[int, float]] = []
    for i, words in enumerate((4, *CALIBRATION_WORDS)):  # the first warms P up, untimed
        body = {"prompt": _WORD * words, "max_tokens": 1, "temperature": 0}
        if model:
            body["model"] = model
        started = time.monotonic()
        try:
            async with session.post(f"{p.url}/v1/completions", json=body, timeout=timeout,
                                    headers={**headers, "X-Request-Id":
                                             f"calibrate-{uuid.uuid4()}"}) as r:
                answer = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            answer = None
        seconds = time.monotonic() - started
        usage = answer.get("usage") if isinstance(answer, dict) else None
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if i and isinstance(tokens, int) and tokens > 0:
            out.append((tokens, seconds))
    return out
