"""What the access log line, the metrics and the trace say about one request: plain values,
written by the request's owner (appliance.proxy.flight) as it goes; nothing here is
control state."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.proxy.metrics import ProxyMetrics
    from appliance.proxy.placement import Decision

access_log = logging.getLogger("appliance.proxy.access")
# The fallback's reason when no decode node was in rotation at all: a P served it whole.
NO_DECODE = "no_decode"


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's X-Request-Id, when it is safe to send upstream verbatim."""
    given = headers.get("X-Request-Id")
    if given and len(given) <= 256 and given.isascii() and given.isprintable():
        return given
    return None


@dataclass(slots=True)
class AccessRecord:
    route: str
    request_id: str
    started: float
    own_request_id: bool = False
    transfer_id: str = "-"
    prefill: str = "-"
    decode: str = "-"
    status: int = 0
    prefill_s: float | None = None
    ttfb_s: float | None = None
    fallback: str | None = None
    # Times its answer went on from another engine after the one serving it broke off.
    migrated: int = 0
    error: str | None = None
    # Where the prompt was placed and why, with what `auto` weighed (appliance.proxy.placement).
    placed: Decision | None = None
    # The prompt's exact tokens by the prefix index, and what tokenizing them took (None:
    # not looked up).
    looked_up: int | None = None
    tokenize_s: float = 0.0
    # The prompt's characters and true tokens (P's usage), when P answered and D's first
    # token came (monotonic), its node's time per streamed token.
    prompt_chars: int = 0
    prompt_tokens: int | None = None
    prefilled_at: float | None = None
    decode_first_at: float | None = None
    step_s: float | None = None
    batch: float | None = None  # the requests its serving node held (mean of start and end)
    # What the client felt (the metrics' client histograms): whether it asked for a stream,
    # whether P's token led it, when its serving node was asked and its latest token went
    # out, the output tokens it got, and the answer's usage counts when it had them.
    stream: bool = False
    led_by_prefill: bool = False
    serve_sent_at: float | None = None
    last_token_at: float | None = None
    tokens_out: int = 0
    usage_prompt: int | None = None
    usage_output: int | None = None

    @property
    def local(self) -> bool:
        return self.placed is not None and self.placed.local

    @property
    def path(self) -> str:
        """The request's path, as the client histograms label it (metrics' PATHS)."""
        if self.fallback == NO_DECODE:  # no D in rotation: P served it whole
            return "p_alone"
        if self.fallback is not None or self.placed is None:
            return "d_alone"
        if self.placed.where != "remote":
            return self.placed.where
        return "first_token" if self.led_by_prefill else "split"

    def tokens_sent(self, n: int, now: float, metrics: ProxyMetrics) -> None:
        """`n` tokens went to the client in one write: the first one's gap since the last
        token is an ITL, the rest came with it (0)."""
        if n <= 0:
            return
        path = self.path
        if self.last_token_at is not None:
            metrics.client_itl.observe(path, now - self.last_token_at)
        for _ in range(n - 1):
            metrics.client_itl.observe(path, 0.0)
        self.last_token_at = now
        self.tokens_out += n

    def observe_client(self, metrics: ProxyMetrics, now: float) -> None:
        """The finished request's client-side times and token counts (answered ones)."""
        if self.status != 200:
            return
        path = self.path
        metrics.client_e2e.observe(path, now - self.started)
        if self.stream and self.ttfb_s is not None:
            metrics.client_ttft.observe(path, self.ttfb_s)
        if self.serve_sent_at is not None:
            metrics.decode_leg.observe(path, now - self.serve_sent_at)
        prompt = self.usage_prompt or self.prompt_tokens
        if prompt:
            metrics.prompt_tokens.observe(path, prompt)
        output = self.usage_output if self.usage_output is not None else self.tokens_out
        if output:
            metrics.output_tokens.observe(path, output)

    def log(self) -> None:
        total = time.monotonic() - self.started
        access_log.info(
            "%s %s xfer=%s p=%s d=%s status=%d split=%s cached=%s%s prefill_ms=%s "
            "ttfb_ms=%s total_ms=%.1f%s%s%s",
            self.route, self.request_id, self.transfer_id, self.prefill, self.decode,
            self.status, "-" if self.placed is None
            else f"{self.placed.where}:{self.placed.reason}",
            self._cached(), self._weighed(),
            _ms(self.prefill_s), _ms(self.ttfb_s), total * 1000,
            f" fallback={self.fallback}" if self.fallback else "",
            f" migrated={self.migrated}" if self.migrated else "",
            f" error={self.error!r}" if self.error else "")

    def _cached(self) -> str:
        """P's and D's cached prompt tokens of the prompt's, and what tokenizing it took."""
        if self.looked_up is None or self.placed is None:
            return "-"
        out = f"{self.placed.cached_p}/{self.placed.cached_d}/{self.looked_up}"
        if self.tokenize_s:
            out += f" tokenize_ms={self.tokenize_s * 1000:.1f}"
        return out

    def _weighed(self) -> str:
        """What `auto` weighed: each placement's first token, the ITL budget, and the
        decodes running on P and D (ms; "-" where not measured yet)."""
        e = None if self.placed is None else self.placed.estimates
        if e is None:
            return ""
        return (f" est_ms=remote:{_ms(e.remote_s, 0)},local:{_ms(e.local_s, 0)},"
                f"p_alone:{_ms(e.alone_s, 0)} budget_ms={_ms(e.itl_budget_s, 0)} "
                f"decodes={e.p_decodes}/{e.decodes_running}"
                + (f" dup_ms=p:{_ms(e.p_dup_s, 0)},d:{_ms(e.d_dup_s, 0)}"
                   if e.p_dup_s or e.d_dup_s else "")
                + (f" decode_gain_ms={_ms(e.decode_gain_s, 0)}" if e.decode_gain_s else ""))


def _ms(seconds: float | None, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f}"
