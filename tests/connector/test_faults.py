"""The fault-injection seam: parsed from the environment, off by default, seeded draws."""

from __future__ import annotations

import pytest

from appliance.connector import faults
from appliance.connector.transfers.mooncake import TransferError


def test_off_unless_the_environment_asks():
    assert faults.from_env({}) is None
    f = faults.from_env({faults.ENV: "write_fail=16,reply_drop=4,write_delay_ms=2.5,seed=7"})
    assert f is not None and f.plan == faults.FaultPlan(16, 4, 2.5, 7)


def test_a_hold_file_holds_new_prefills_while_it_exists(tmp_path):
    hold = tmp_path / "hold"
    f = faults.from_env({faults.ENV: f"prefill_hold_file={hold}"})
    assert f is not None and not f.holding_prefills()
    hold.touch()
    assert f.holding_prefills()
    assert faults.Faults(faults.FaultPlan()).holding_prefills() is False


@pytest.mark.parametrize("text, words", [
    ("write_fail", "is not one of"), ("explode=1", "is not one of"),
    ("write_fail=x", "needs a number"), ("reply_drop=-1", "must not be negative")])
def test_bad_plans_are_one_line_errors(text, words):
    with pytest.raises(ValueError, match=words):
        faults.FaultPlan.parse(text)


def test_one_in_n_is_seeded_and_counted():
    def draws(seed: int) -> list[bool]:
        f = faults.Faults(faults.FaultPlan(reply_drop=4, seed=seed))
        return [f.drop_reply() for _ in range(400)]

    assert draws(1) == draws(1) != draws(2)
    hits = sum(draws(1))
    assert 60 < hits < 140  # about 1 in 4


def test_wrapped_write_fails_one_in_n_and_otherwise_writes():
    f = faults.Faults(faults.FaultPlan(write_fail=3, seed=0))
    calls: list[int] = []
    write = f.wrap_write(lambda x: calls.append(x) or x)
    results = []
    for i in range(60):
        try:
            results.append(write(i))
        except TransferError as exc:
            assert "injected" in str(exc)
    assert f.injected["write_fail"] == 60 - len(calls) > 5
    assert results == calls
