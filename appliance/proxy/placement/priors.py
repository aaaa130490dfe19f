"""What an engine's own metrics say about its history, before this proxy has measured
anything (a fresh proxy, a restart in a rollout, a second proxy in front of the same
node): pure functions on vLLM's Prometheus text.

P's `vllm:request_prefill_time_seconds` and `vllm:request_prefill_kv_computed_tokens`
(histograms, per request) give the mean prefill: that many computed tokens in that many
seconds, a first point of the prefill line. A D's or P's numbers mix in work a prefill
does not do (D's remote requests wait for KV in their "prefill"), so only P's are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

PREFILL_SECONDS = "vllm:request_prefill_time_seconds"
PREFILL_TOKENS = "vllm:request_prefill_kv_computed_tokens"


@dataclass(frozen=True, slots=True)
class History:
    """An engine's finished prefills (all of its model's, summed over its label sets)."""

    prefills: int
    tokens: float  # computed prompt tokens, summed
    seconds: float  # time in the prefill phase, summed

    def mean(self) -> tuple[float, float] | None:
        """(tokens, seconds) of the mean prefill; None with no history."""
        if self.prefills <= 0 or self.tokens <= 0:
            return None
        return self.tokens / self.prefills, self.seconds / self.prefills


def engine_history(text: str) -> History:
    """The prefills an engine's /metrics reports (0 for an engine that served none)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (PREFILL_SECONDS, PREFILL_TOKENS):
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                sums[family.name] = sums.get(family.name, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                counts[family.name] = counts.get(family.name, 0.0) + sample.value
    return History(int(min(counts.get(PREFILL_SECONDS, 0), counts.get(PREFILL_TOKENS, 0))),
                   sums.get(PREFILL_TOKENS, 0.0), sums.get(PREFILL_SECONDS, 0.0))
