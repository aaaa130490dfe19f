"""A request's accounts (appliance.proxy.flight): each count given back once, however the
request ends, and P's KV released by the proxy only when nobody else will free it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from appliance.proxy.access import AccessRecord
from appliance.proxy.flight import Flight
from appliance.proxy.nodes.backends import Backend, PrefillBackend
from appliance.proxy.ownership.kv import Holder, PrefillKV
from appliance.proxy.ownership.pulls import Pulls


class Releaser:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, kv: PrefillKV) -> None:
        self.released.append(kv.transfer_id)


def _flight() -> tuple[Flight, Releaser, Pulls]:
    releaser, pulls = Releaser(), Pulls()
    flight = Flight(AccessRecord("/v1/completions", "r1", 0.0), None, pulls,
                    releaser, None)  # type: ignore[arg-type]
    return flight, releaser, pulls


def _counts(*nodes: Any) -> list[tuple[int, ...]]:
    return [(n.in_flight, n.decodes, getattr(n, "transfers", 0)) for n in nodes]


def test_a_lease_gives_its_count_back_once_and_then_wakes_the_next() -> None:
    flight, _, _ = _flight()
    d = Backend("decode", "http://d")
    woken: list[int] = []
    lease = flight.hold(d, "in_flight", then=lambda: woken.append(d.in_flight))
    assert d.in_flight == 1
    lease.release()
    lease.release()
    flight.end()
    assert d.in_flight == 0 and woken == [0]


def test_the_end_gives_back_every_count_the_request_took() -> None:
    flight, releaser, _ = _flight()
    proxy = SimpleNamespace(in_flight=0)
    p, d = PrefillBackend("prefill", "http://p"), Backend("decode", "http://d")
    flight.hold(proxy, "in_flight")
    flight.hold(d, "in_flight")  # its admission slot
    flight.serve_on(p, holds_node=True)  # P serves it whole
    flight.take_kv(PrefillKV(p, 0, "xfer-1"))
    p_leg = flight.hold(p, "in_flight")
    assert _counts(p, d) == [(2, 1, 1), (1, 0, 0)] and proxy.in_flight == 1
    p_leg.release()
    flight.end()
    flight.end()  # a second end changes nothing
    assert _counts(p, d) == [(0, 0, 0), (0, 0, 0)] and proxy.in_flight == 0
    assert releaser.released == ["xfer-1"]  # nobody pulled it: the proxy frees it, once


def test_the_serving_nodes_counts_go_back_when_it_stops_serving() -> None:
    """A D found down before the first byte: its counts go back at once, another D takes
    the request on, and the batch is the mean of the requests D held at start and end."""
    flight, _, _ = _flight()
    d, other = Backend("decode", "http://d"), Backend("decode", "http://e")
    d.decodes = 3
    flight.serve_on(d, holds_node=False)
    assert flight.rec.batch == 4
    d.decodes -= 2  # two others ended meanwhile
    flight.stop_serving()
    assert d.decodes == 1 and flight.rec.batch == 3
    flight.serve_on(other, holds_node=True)
    flight.end()
    assert _counts(d, other) == [(0, 1, 0), (0, 0, 0)]


def test_kv_that_d_took_over_is_not_released_by_the_proxy() -> None:
    flight, releaser, pulls = _flight()
    p = PrefillBackend("prefill", "http://p")
    kv = flight.take_kv(PrefillKV(p, 0, "xfer-2"))
    kv.move(Holder.ASKED, "D asked")
    kv.decode_answered()
    flight.end()
    assert releaser.released == [] and kv.holder is Holder.DECODE and p.transfers == 0
