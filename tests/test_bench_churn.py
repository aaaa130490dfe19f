"""bench/churn.py's report arithmetic (no vLLM): counters followed across restarts, a
window's failures, mismatches, added latency and tokens prefilled twice, P's KV samples; its
--events and --split arguments."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import pytest

from tests.benchmod import load

churn = load("churn")


def test_counter_follows_a_restart() -> None:
    c = churn.Counter()
    for value in (100, 150, 150, 20, 50):  # restarted between 150 and 20
        c.update(value)
    assert c.total == 50 + 20 + 30


def _r(seed: int, start: float, end: float, ok: bool = True, text: str = "a",
       tokens: int = 100) -> object:
    return churn.Result(seed, tokens, start, end, ok, text)


def test_summarize_a_window() -> None:
    results = [_r(1, 0, 1), _r(2, 1, 2, text="b"), _r(1, 2, 7, ok=False, text=""),
               _r(3, 3, 4, ok=False, text=""), _r(2, 5, 6.5)]
    s = churn.summarize(results, {1: "a", 2: "a"}, base_p50=0.5, computed=450)
    assert s["requests"] == 5 and s["failed"] == 2
    assert s["failing_s"] == 7 - 2
    assert s["mismatches"] == 1  # seed 2 answered "b" once against its reference "a"
    assert s["worst_added_s"] == 5 - 0.5
    assert s["prefilled_twice_tokens"] == 450 - 300  # three answers of 100 tokens
    assert s["prefilled_twice_prompts"] == 1.5


def test_summarize_a_baseline_uses_its_own_p50() -> None:
    s = churn.summarize([_r(1, 0, 1), _r(1, 0, 2), _r(1, 0, 3)], {}, None, 300)
    assert s["p50_s"] == 2 and s["worst_added_s"] == 1
    assert s["failed"] == 0 and s["failing_s"] == 0 and s["prefilled_twice_tokens"] == 0


def test_summarize_p50_of_the_answered_only() -> None:
    # an even count takes the upper middle; failed requests count for the worst, not the p50
    s = churn.summarize([_r(1, 0, 4), _r(1, 0, 1), _r(1, 0, 3), _r(1, 0, 2), _r(1, 0, 9, ok=False)],
                        {}, None, 400)
    assert s["p50_s"] == 3 and s["worst_added_s"] == 9 - 3
    s = churn.summarize([_r(1, 0, 5, ok=False)], {}, None, 0)
    assert math.isnan(s["p50_s"]) and math.isnan(s["worst_added_s"])
    assert math.isnan(s["prefilled_twice_prompts"])


def test_kv_report() -> None:
    samples = [(0.0, 5.0), (1.0, None), (2.0, 9.0), (3.0, 4.0), (13.0, None), (13.5, 1.0)]
    assert churn.kv_report(samples, 0.5, 20, 12.5) == (9.0, 1.0)
    assert churn.kv_report(samples, 0.5, 20, None) == (9.0, None)
    assert churn.kv_report(samples, 30, 40, 50) == (None, None)


def test_parse_answer() -> None:
    stream = ('data: {"choices": [{"text": "he"}]}\n\n'
              'data: {"choices": [{"text": "llo"}]}\n\ndata: [DONE]\n\n')
    assert churn.parse_answer(stream, True) == (True, "hello")
    assert churn.parse_answer('data: {"choices": [{"text": "he"}]}\n\n', True)[0] is False
    assert churn.parse_answer('data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n',
                              True)[0] is False
    assert churn.parse_answer('{"choices": [{"text": "hi"}]}', False) == (True, "hi")
    assert churn.parse_answer("not json", False)[0] is False
    assert len(churn.prompt(7)) in range(64, 257) and churn.prompt(7) == churn.prompt(7)


def test_parse_events() -> None:
    assert churn.parse_events("p-restart,p-freeze,d-restart") == list(churn.EVENTS)
    assert churn.parse_events(" d-restart, p-restart,d-restart") == ["p-restart", "d-restart"]
    for bad in ("", ",", "p-restart,q-restart", "P restart"):
        with pytest.raises(argparse.ArgumentTypeError):
            churn.parse_events(bad)
    assert [churn.EVENTS[e][0] for e in churn.EVENTS] == ["P restart", "P frozen 6 s",
                                                           "D restart"]


def test_split_reaches_the_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """--split is handed to the proxy after NodeSpec's default proxy arguments."""
    got: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def fake_node(spec: object) -> None:
        got["spec"] = spec
        raise Stop

    monkeypatch.setattr(churn, "LocalNode", fake_node)
    monkeypatch.setattr(churn.signal, "signal", lambda *_: None)  # keep pytest's SIGTERM
    monkeypatch.setattr(sys, "argv", ["churn.py", "--split", "always", "--model-dir", "/none",
                                      "--log-dir", "/tmp/none"])
    with pytest.raises(Stop):
        churn.main()
    assert got["spec"].proxy_args == (*churn.NodeSpec.proxy_args, "--split", "always")
