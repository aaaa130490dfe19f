"""Settings from flags, files and the environment; routing policies on their own."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from appliance.proxy.nodes.backends import Backend, PrefillBackend
from appliance.proxy.placement.routing import LeastOutstanding, RoundRobin, Router
from appliance.proxy.settings import API_KEYS_ENV, load_settings


def test_flags() -> None:
    s = load_settings(["--port", "8100", "--prefill", "http://10.0.0.1:8010",
                       "--prefill", "http://10.0.0.2:8010,http://10.0.0.2:9000/",
                       "--decode", "http://10.0.0.3:8020/", "--policy", "least_outstanding",
                       "--no-fallback", "--api-key", "k1"], environ={})
    assert s.port == 8100
    assert [(n.url, n.bootstrap_url) for n in s.prefill] == [
        ("http://10.0.0.1:8010", "http://10.0.0.1:8998"),  # bootstrap on P's host by default
        ("http://10.0.0.2:8010", "http://10.0.0.2:9000"),
    ]
    assert [n.url for n in s.decode] == ["http://10.0.0.3:8020"]
    assert s.policy == "least_outstanding"
    assert s.fallback_to_decode is False
    assert s.api_keys == ["k1"]


def test_config_file_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "proxy.toml"
    cfg.write_text("""
[proxy]
port = 9000
policy = "least_outstanding"
prefill_timeout_s = 30
api_keys = ["from-file"]

[[proxy.prefill]]
url = "http://p1:8010"
bootstrap_url = "http://p1:8998"

[[proxy.decode]]
url = "http://d1:8020"
""")
    s = load_settings(["--config", str(cfg)], environ={})
    assert (s.port, s.policy, s.prefill_timeout_s) == (9000, "least_outstanding", 30)
    assert s.prefill[0].bootstrap_url == "http://p1:8998"
    assert s.api_keys == ["from-file"]
    s = load_settings(["--config", str(cfg), "--port", "9001", "--decode", "http://d2:8020"],
                      environ={API_KEYS_ENV: "a, b"})
    assert s.port == 9001
    assert [n.url for n in s.decode] == ["http://d2:8020"]
    assert s.api_keys == ["a", "b"]


@pytest.mark.parametrize("argv", [
    ["--decode", "ftp://d:1"],
    ["--prefill", "not a url"],
    ["--health-interval", "0"],
])
def test_bad_settings_are_refused(argv: list[str]) -> None:
    with pytest.raises(ValidationError):
        load_settings(argv, environ={})


def test_unknown_config_key_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "proxy.toml"
    cfg.write_text("prot = 1\n")
    with pytest.raises(ValidationError):
        load_settings(["--config", str(cfg)], environ={})


def test_round_robin_cycles_and_skips_nothing() -> None:
    nodes = [Backend("decode", f"http://d{i}") for i in range(3)]
    rr = RoundRobin()
    assert [rr.pick(nodes).url for _ in range(6)] == [n.url for n in nodes] * 2


def test_least_outstanding_prefers_idle_then_turns() -> None:
    a, b = Backend("decode", "http://a"), Backend("decode", "http://b")
    router = Router("least_outstanding")
    a.in_flight = 3
    assert router.pick_decode([a, b]) is b
    a.in_flight = b.in_flight = 0
    picks = [router.pick_decode([a, b]).url for _ in range(5)]
    # a catches up on the turn b had, then they alternate.
    assert picks == ["http://a", "http://a", "http://b", "http://a", "http://b"]
    assert LeastOutstanding().pick([a, b]) in (a, b)


def test_dp_ranks_in_turn() -> None:
    p = PrefillBackend("prefill", "http://p", bootstrap_url="http://p:8998",
                       engine_ids={1: "e1", 0: "e0"})
    assert [p.next_rank() for _ in range(3)] == [(0, "e0"), (1, "e1"), (0, "e0")]
