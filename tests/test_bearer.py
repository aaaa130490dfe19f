"""The one bearer-token check and the host:port names every service shares."""

from __future__ import annotations

from appliance import bearer
from appliance.netaddr import host_port, url_host


def test_keys_admit_only_a_bearer_with_one_of_them() -> None:
    keys = bearer.Keys(["k1", "k2", None, ""])
    assert keys and keys.admit("Bearer k2") and keys.admit("bearer  k1 ")
    assert not keys.admit("Bearer k3") and not keys.admit("Basic k1") and not keys.admit("")
    assert not keys.admit("Bearer k1k2") and not keys.admit("Bearer ")


def test_no_keys_is_falsy_and_admits_nobody_by_itself() -> None:
    keys = bearer.Keys([None])
    assert not keys and not keys.admit("Bearer anything")


def test_ipv6_hosts_are_bracketed_once() -> None:
    assert host_port("10.0.0.1", 80) == "10.0.0.1:80"
    assert host_port("fd00::2", 8998) == "[fd00::2]:8998"
    assert url_host("[fd00::2]") == "[fd00::2]"
