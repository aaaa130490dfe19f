"""bench/serve.py's one-core setup: its workload at half the load (no vLLM)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # its sibling modules, as when run as a script
_spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
assert _spec is not None and _spec.loader is not None
serve = importlib.util.module_from_spec(_spec)
sys.modules["bench_serve"] = serve
_spec.loader.exec_module(serve)


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
