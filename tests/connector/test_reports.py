"""The worker's reports to vLLM, and the short wait of a step that computes nothing."""

from __future__ import annotations

import threading
import time

from appliance.connector.reports import Reports


def test_take_returns_what_was_added_once() -> None:
    r = Reports()
    r.add("a")
    r.add("b", ok=False)
    assert r.take() == ({"a", "b"}, {"b"})
    assert r.take() == (set(), set())


def test_a_report_ends_the_wait_at_once() -> None:
    r = Reports()
    threading.Timer(0.05, r.add, ("x",)).start()
    started = time.monotonic()
    assert r.take(wait_s=10) == ({"x"}, set())
    assert time.monotonic() - started < 5  # woken by the report, not the 10 s


def test_the_wait_is_bounded_and_skipped_when_something_is_there() -> None:
    r = Reports()
    started = time.monotonic()
    assert r.take(wait_s=0.05) == (set(), set())
    assert time.monotonic() - started >= 0.05
    r.add("y")
    assert r.take(wait_s=10) == ({"y"}, set())
