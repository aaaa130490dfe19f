"""One deadline policy (appliance.deadlines): D waits longer than the proxy waits for P, and
P writes for any D whose prefill answered within the proxy's wait."""

from __future__ import annotations

import pytest

from appliance.connector.settings import ConnectorSettings
from appliance.deadlines import WRITE_MARGIN_MAX_S, Deadlines, write_by_s


def test_defaults_are_ordered() -> None:
    d = Deadlines()
    assert (d.prefill_s, d.recv_s, d.send_s) == (120, 130, 140)
    assert d.recv_ms() == 130_000 and d.recv_ms(after_prefill=True) == 10_000
    # The connector's own defaults (for callers that send no deadline) are the same.
    c = ConnectorSettings(engine_id="e", role="consumer")
    assert (c.recv_timeout_s, c.send_timeout_s) == (d.recv_s, d.send_s)


@pytest.mark.parametrize("prefill_s", [0.5, 2, 8, 30, 120, 600, 3600])
@pytest.mark.parametrize("transfer_s", [WRITE_MARGIN_MAX_S, 7.5, 10, 60])
def test_a_prefill_answered_within_the_proxys_wait_is_always_written(prefill_s, transfer_s):
    d = Deadlines(prefill_s, transfer_s)
    # D waits longer than the proxy; P's last moment to start the write (counted from D's
    # message, which leaves with the proxy's call or later) is no sooner than the proxy's
    # last moment to accept P's answer; and the write has a margin before D's deadline.
    assert d.recv_s > d.prefill_s
    assert d.prefill_s <= write_by_s(d.recv_s) < d.recv_s
    assert d.send_s > d.recv_s


def test_the_write_margin_is_a_share_of_short_deadlines_and_capped_for_long_ones() -> None:
    assert write_by_s(10) == pytest.approx(8)
    assert write_by_s(130) == pytest.approx(125)  # the old rule (0.8) stopped at 104
