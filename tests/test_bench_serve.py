"""bench/serve.py's one-core setup: its workload at half the load (no vLLM)."""

from __future__ import annotations

from tests.benchmod import load

serve = load("serve")


def test_half_the_load_halves_concurrency_and_arrival_rate_only() -> None:
    mixed = list(serve.WORKLOADS["mixed"].args)
    got = serve.halved(mixed)
    assert got[got.index("--request-rate") + 1] == "0.75"
    assert got[got.index("--max-concurrency") + 1] == "3"
    assert got[got.index("--num-prompts") + 1] == mixed[mixed.index("--num-prompts") + 1]
    tiny = serve.halved(list(serve.WORKLOADS["tiny"].args))
    assert tiny[tiny.index("--max-concurrency") + 1] == "4"
    assert "--request-rate" not in tiny
    assert serve.halved(["--max-concurrency", "1"]) == ["--max-concurrency", "1"]
