"""Who must free P's KV for a transfer: the states and the only changes allowed."""

from __future__ import annotations

import pytest

from appliance.proxy.nodes.backends import PrefillBackend
from appliance.proxy.ownership.kv import Holder, OwnershipError, PrefillKV


def _kv() -> PrefillKV:
    p = PrefillBackend("prefill", "http://p", side_channels={0: ["tcp://p:1"], 1: ["tcp://p:2"]})
    return PrefillKV(p, 1, "x1")


def test_the_proxy_owes_it_until_d_answers() -> None:
    kv = _kv()
    assert kv.holder is Holder.PROXY and kv.owed
    assert kv.side_channels == ("tcp://p:2",)  # the workers of the rank asked, as of then
    kv.move(Holder.ASKED, "D asked")
    assert kv.owed  # D may never get it (refused before its engine, unreachable)
    kv.decode_answered()
    assert kv.holder is Holder.DECODE and not kv.owed


def test_a_request_given_up_goes_back_to_the_proxy() -> None:
    kv = _kv()
    kv.move(Holder.ASKED, "D asked")
    kv.given_up("D asked alone")
    assert kv.holder is Holder.PROXY and kv.owed
    kv.decode_answered()  # the answer of a D asked alone says nothing about this KV
    assert kv.holder is Holder.PROXY


@pytest.mark.parametrize("end", [Holder.DECODE, Holder.NONE])
def test_no_way_back_once_it_is_someone_elses(end: Holder) -> None:
    kv = _kv()
    kv.move(Holder.ASKED, "D asked")
    kv.move(end, "end")
    for to in Holder:
        if to is not end:
            with pytest.raises(OwnershipError, match="x1"):
                kv.move(to, "again")


def test_decode_cannot_own_what_it_was_never_asked_for() -> None:
    with pytest.raises(OwnershipError):
        _kv().move(Holder.DECODE, "D answered")


class _Call:
    """What Pulls reads of D's call: whether it ended, and its abort."""

    def __init__(self) -> None:
        self.done = False
        self.aborted: Exception | None = None

    def abort(self, exc: Exception) -> None:
        self.aborted = exc


def test_p_down_fails_over_only_the_pulls_d_has_not_landed() -> None:
    """A whole answer's D call stays ASKED for its whole decode; once D's KV events show it
    holds the blocks it pulled, P's failure must not rerun it on D alone."""
    from appliance.proxy.ownership.pulls import Pulls

    landed = {"x-landed"}
    pulls = Pulls(lambda kv: kv.transfer_id in landed)
    p = PrefillBackend("prefill", "http://p")
    calls = {}
    for xfer in ("x-landed", "x-waiting"):
        kv = PrefillKV(p, 0, xfer, d_url="http://d", lands=(1, 2))
        kv.move(Holder.ASKED, "D asked")
        calls[xfer] = _Call()
        pulls.waiting(kv, calls[xfer])  # type: ignore[arg-type]
    failed, kept = pulls.fail_over("http://p", "P is down")
    assert (failed, kept) == (["x-waiting"], ["x-landed"])
    assert calls["x-waiting"].aborted is not None and calls["x-landed"].aborted is None


def test_a_kept_call_is_failed_over_when_d_still_loads_kv() -> None:
    """D's KV events cannot tell requests apart: another request with the same blocks makes
    a call still waiting on the dead P look landed. D's own count of unfinished KV loads,
    beyond this proxy's calls on live Ps, says some kept call still waits."""
    from appliance.proxy.ownership.pulls import Pulls

    pulls = Pulls(lambda kv: kv.transfer_id != "x-other")
    dead, live = PrefillBackend("prefill", "http://p"), PrefillBackend("prefill", "http://p2")
    calls = {}
    for xfer, p in (("x-kept", dead), ("x-other", live)):
        kv = PrefillKV(p, 0, xfer, d_url="http://d", lands=(1, 2))
        kv.move(Holder.ASKED, "D asked")
        calls[xfer] = _Call()
        pulls.waiting(kv, calls[xfer])  # type: ignore[arg-type]
    assert pulls.fail_over("http://p", "P is down") == ([], ["x-kept"])
    assert list(pulls.kept("http://p")) == ["http://d"]
    assert pulls.waiting_elsewhere("http://d", "http://p") == 1
    # One load unfinished on D: the live P's call, not the kept one.
    assert pulls.recheck("http://p", "http://d", 1, "P is down") == []
    assert pulls.recheck("http://p", "http://d", 0, "P is down") == []
    assert calls["x-kept"].aborted is None
    # Two: the kept call is one of them (or D's count is unknown): D alone.
    assert pulls.recheck("http://p", "http://d", 2, "P is down") == ["x-kept"]
    assert calls["x-kept"].aborted is not None and calls["x-other"].aborted is None
    calls["x-kept"].aborted = None
    assert pulls.recheck("http://p", "http://d", None, "P is down") == ["x-kept"]
