"""The KV transfer inside its request's trace (appliance.connector.spans): real Sender and
Receiver over Mooncake TCP, exporting to a real OTLP/HTTP receiver: P's write and D's pull
are spans under the traceparent each request came with, with bytes, descriptors, time and
GB/s; without one, nothing is recorded."""

from __future__ import annotations

import pytest

from appliance.observability.tracing import ENDPOINT_ENV, PROTOCOL_ENV
from tests.connector.test_side_channel import Pair
from tests.otlp import Collector

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
P_CALL, D_CALL = "00f067aa0ba902b7", "b7ad6b7169203331"


def parent(span_id: str) -> str:
    return f"00-{TRACE}-{span_id}-01"


@pytest.fixture
def collector(monkeypatch):
    with Collector() as c:
        monkeypatch.setenv(ENDPOINT_ENV, c.url)
        monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield c


async def test_write_and_pull_are_spans_of_their_calls(bootstrap_url, collector):
    pair = Pair(bootstrap_url)
    await pair.start()
    try:
        assert pair.receiver is not None and pair.sender.spans.on
        pair.sender.spans.parents({"x1": parent(P_CALL)})
        pair.receiver.spans.parents({"x1": parent(D_CALL)})
        pair.sender.on_ready("p1", "x1", [[1, 2, 3]], None)
        pair.receiver.on_recv("d1", pair.spec("x1", [7, 8, 9]))
        assert await pair.results() == ({"d1"}, set())
        pair.receiver.on_recv("d2", pair.spec("x2", [4]))  # no trace context: no span
        pair.sender.on_ready("p2", "x2", [[5]], None)
        assert await pair.results() == ({"d2"}, set())
        spans = {s.name: s for s in collector.wait(TRACE, {"pd.kv_write", "pd.kv_pull"})}
    finally:
        await pair.close()
    write, pull = spans["pd.kv_write"], spans["pd.kv_pull"]
    assert (write.parent_id, pull.parent_id) == (P_CALL, D_CALL)
    assert (write.service, pull.service) == ("pd-connector-prefill", "pd-connector-decode")
    assert write.attributes["pd.transfer_id"] == pull.attributes["pd.transfer_id"] == "x1"
    assert write.attributes["pd.p_req"] == "p1" and pull.attributes["pd.d_req"] == "d1"
    assert write.attributes["pd.bytes"] == pull.attributes["pd.bytes"] > 0
    assert write.attributes["pd.blocks"] == pull.attributes["pd.blocks"] == 3
    assert write.attributes["pd.descriptors"] >= 1 and write.attributes["pd.gbps"] > 0
    assert pull.start_ns <= write.start_ns and write.end_ns <= pull.end_ns  # D waits for P
    assert not write.error and not pull.error
    assert {s.attributes["pd.transfer_id"] for s in collector.spans} == {"x1"}


async def test_off_without_an_endpoint(bootstrap_url, monkeypatch):
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    pair = Pair(bootstrap_url)
    await pair.start()
    try:
        assert not pair.sender.spans.on
        pair.sender.spans.parents({"x1": parent(P_CALL)})  # ignored
        pair.sender.on_ready("p1", "x1", [[1]], None)
        assert pair.receiver is not None
        pair.receiver.on_recv("d1", pair.spec("x1", [7]))
        assert await pair.results() == ({"d1"}, set())
    finally:
        await pair.close()
