"""Smoke test: bench/transfer.py runs end to end on a tiny shape and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_transfer_runs() -> None:
    pytest.importorskip("mooncake.engine")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "transfer.py"),
            "--layers",
            "2",
            "--blocks",
            "4",
            "--p-first",
            "1",
            "--d-first",
            "3",
            "--reps",
            "1",
            "--slice",
            "default",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "ours/raw" in out and "fragmented" in out and "memcpy" in out


@pytest.mark.slow
def test_bench_transfer_model_shapes_run() -> None:
    """MLA, sliding window and both TP plans against raw Mooncake (each asserts inside that
    its descriptors move exactly the bytes written out by hand)."""
    pytest.importorskip("mooncake.engine")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "transfer.py"), "--model", "all", "--reps", "1",
         "--small"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    for case in ("mla", "sliding", "tp1-2", "tp2-1"):
        assert case in out
    assert "ours/raw" in out


@pytest.mark.slow
def test_bench_transfer_side_channel_auth_runs() -> None:
    """The whole side-channel path through a real Sender and Receiver, CURVE off and on."""
    pytest.importorskip("mooncake.engine")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "transfer.py"), "--auth", "both", "--layers", "2",
         "--blocks", "4", "--p-first", "1", "--d-first", "3", "--reps", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert "CURVE off ms" in out and "CURVE on ms" in out and "on/off" in out


@pytest.mark.slow
def test_bench_transfer_verify_runs() -> None:
    """The same path with D checking no pull, then every pull, against P's digest."""
    pytest.importorskip("mooncake.engine")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "transfer.py"), "--verify", "both", "--layers",
         "2", "--blocks", "4", "--p-first", "1", "--d-first", "3", "--reps", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert "verify_kv off ms" in out and "verify_kv all ms" in out and "all/off" in out
