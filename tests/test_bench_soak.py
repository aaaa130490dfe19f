"""bench/soak.py: its checks without servers, then a short soak of the real
local node (slow): D killed and restarted and the side channel reset under a mixed load,
every answer exact, nothing held after."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmod import BENCH, load

soak = load("soak")
soakfaults = load("soakfaults")


def test_answers_are_read_as_clients_read_them() -> None:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    assert soak.answer(comp, False, json.dumps(
        {"choices": [{"text": "ab"}], "usage": {"prompt_tokens": 9}})) == ("ab", 9)
    assert soak.answer(chat, False, json.dumps(
        {"choices": [{"message": {"content": "ab"}}]})) == ("ab", 0)
    events = [{"choices": [{"delta": {"role": "assistant"}}]},
              {"choices": [{"delta": {"content": "a"}}]},
              {"choices": [{"delta": {"content": "b"}}]},
              {"choices": [], "usage": {"prompt_tokens": 7}}]
    raw = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    assert soak.answer(chat, True, raw + "data: [DONE]\n\n") == ("ab", 7)
    assert soak.answer(chat, True, raw) == (None, 0)  # cut off: no [DONE]
    broken = raw + 'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n'
    assert soak.answer(chat, True, broken) == (None, 0)


def test_the_mix_is_seeded_and_mixed() -> None:
    work = soak.items(3, 8)
    assert work == soak.items(3, 8) and work != soak.items(4, 8)
    assert {w.path for w in work} == {"/v1/completions", "/v1/chat/completions"}
    assert all(w.body["temperature"] == 0 for w in work)


def test_unknown_faults_are_refused_in_one_line() -> None:
    res = subprocess.run([sys.executable, str(BENCH / "soak.py"), "--faults", "d_killed,nope"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown faults ['nope']" in res.stderr


@pytest.mark.slow
def test_a_short_soak_loses_nothing(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, str(BENCH / "soak.py"), "--minutes", "1.5", "--concurrency", "2",
         "--prompts", "6", "--faults", "d_killed,link_reset", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "soak-1.json").read_text())
    results = summary["results"]
    assert summary["sent"] > 10 and "other_text" not in results, results
    # Every answer whole and a plain server's: one cut by D's kill goes on elsewhere.
    assert set(results) == {"exact"}, results
    assert [f["recovery_s"] is not None for f in summary["faults"]] == [True, True]
    assert summary["KV usage once idle (P, D)"] == [0.0, 0.0]


def test_memory_growth_is_read_past_warm_up_and_before_a_restart() -> None:
    samples = [(0.0, 1, 60_000, 0), (10.0, 1, 70_000, 900), (20.0, 1, 70_500, 1000),
               (30.0, 1, 71_400, 1000), (40.0, 1, 71_400, 1000),
               (45.0, 2, 50_000, None)]  # pid 2: the proxy started again
    assert soak.growth(samples) == "70000 -> 71400 KiB (+2.0%); index 900 -> 1000 blocks"
    assert soak.growth([]) == "-"
