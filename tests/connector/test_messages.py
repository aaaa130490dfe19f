"""Side-channel messages: round trips, compact encoding, and every malformed case."""

from __future__ import annotations

import msgspec
import pytest

from appliance.connector.planning.plan import Region
from appliance.connector.sidechannel.layout import layout_from_wire, layout_to_wire
from appliance.sidechannel.messages import (
    CancelEntry,
    CancelRequest,
    MessageError,
    RegionMsg,
    ReqEntry,
    Status,
    TransferRequest,
    TransferResponse,
    decode_cancel,
    decode_request,
    decode_response,
    decode_side_channel,
    encode_cancel,
    encode_request,
    encode_response,
)

LAYOUT = [Region(0x7F00_0000_0000 + i * (1 << 26), 65536, 65536, 1024) for i in range(36)]


def request(**kw) -> TransferRequest:
    fields = dict(
        engine_id="d-engine-1",
        host="10.0.0.2",
        rpc_port=15432,
        layout_id=0x5D3_0000_0000_00B1,
        reqs=[ReqEntry("cmpl-d-1", "xfer-3f2a", [list(range(512, 575))])],
    )
    fields.update(kw)
    return TransferRequest(**fields)


def raw(obj) -> bytes:
    """Encode arbitrary (possibly malformed) data as msgpack, bypassing validation."""
    return msgspec.msgpack.encode(obj)


def as_dict(msg) -> dict:
    return msgspec.to_builtins(msg)


# --- round trips --------------------------------------------------------------------------------


def test_request_round_trip_with_layout() -> None:
    msg = request(layout=layout_to_wire(LAYOUT), tp_rank=1, tp_size=2)
    back = decode_request(encode_request(msg))
    assert back == msg
    assert layout_from_wire(back.layout) == LAYOUT
    assert back.session_id == "10.0.0.2:15432"


def test_request_round_trip_without_layout_and_many_requests() -> None:
    reqs = [ReqEntry(f"d{i}", f"xfer-{i}", [[i, i + 1]]) for i in range(100)]
    msg = request(reqs=reqs)
    assert decode_request(encode_request(msg)) == msg


def test_ipv6_session_id() -> None:
    assert request(host="fd00::2").session_id == "[fd00::2]:15432"


def test_response_round_trips() -> None:
    for msg in (
        TransferResponse(Status.FINISH, ok=["a", "b"], failed={"c": "transfer_id unknown"}),
        TransferResponse(Status.ERROR, failed={"a": "x"}, message="bad metadata"),
        TransferResponse(Status.LAYOUT_MISS, layout_id=42),
        TransferResponse(Status.FINISH),
    ):
        assert decode_response(encode_response(msg)) == msg


def test_omitted_defaults_keep_messages_small() -> None:
    with_layout = encode_request(request(layout=layout_to_wire(LAYOUT)))
    without = encode_request(request())
    assert b"layout\xc0" not in without and b"tp_rank" not in without and b"tp_size" not in without
    # 63 block ids (3 B each) dominate a steady-state message; the layout is sent once
    assert len(without) < 300
    assert len(with_layout) - len(without) > 36 * 20
    ok = encode_response(TransferResponse(Status.FINISH, ok=["cmpl-d-1"]))
    assert b"failed" not in ok and b"message" not in ok and len(ok) < 48


def test_layout_helpers_round_trip() -> None:
    assert layout_from_wire(layout_to_wire(LAYOUT)) == LAYOUT
    assert layout_to_wire([]) == []


# --- malformed bytes and types -------------------------------------------------------------------


GOOD = as_dict(request(layout=layout_to_wire(LAYOUT[:2])))


def mutate(**kw) -> bytes:
    data = dict(GOOD)
    for key, value in kw.items():
        if value is ...:
            data.pop(key)
        else:
            data[key] = value
    return raw(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x92\x01",  # truncated array
        b"not msgpack at all",
        raw([1, 2, 3]),
        raw({"type": "xresp", "status": "finish"}),  # a response where a request belongs
        raw({"type": "other"}),
        mutate(engine_id=...),
        mutate(engine_id=""),
        mutate(engine_id=7),
        mutate(host=""),
        mutate(rpc_port=0),
        mutate(rpc_port=70000),
        mutate(rpc_port="15432"),
        mutate(layout_id=-1),
        mutate(layout_id=(1 << 64) - 1),
        mutate(tp_size=0),
        mutate(tp_rank=2, tp_size=2),
        mutate(layout=[]),
        mutate(layout=[[0, 10, 20, 5]]),  # blocks overlap
        mutate(layout=[[0, 10, 0, 5]]),
        mutate(layout=[[0, 10, 10]]),
        mutate(layout=[[-5, 10, 10, 5]]),
        mutate(layout="abc"),
        mutate(reqs=[["d1", "x1", [-1]]]),
        mutate(reqs=[["d1", "x1", [1.5]]]),
        mutate(reqs=[["d1", "x1", "12"]]),
        mutate(reqs=[["d1", "", [1]]]),
        mutate(reqs=[["", "x1", [1]]]),
        mutate(reqs=[["d1", "x1"]]),
        mutate(reqs=[["d1", "x1", [1]], ["d2", "x1", [2]]]),  # duplicate transfer_id
        mutate(reqs=[["d1", "x1", [1]], ["d1", "x2", [2]]]),  # duplicate d_req_id
        mutate(reqs=[["d1", "x1", [1024]]]),  # beyond the layout sent along
        mutate(reqs={"d1": 1}),
    ],
)
def test_malformed_requests_raise_message_error(data: bytes) -> None:
    with pytest.raises(MessageError):
        decode_request(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xff",
        raw({"type": "xresp"}),
        raw({"type": "xresp", "status": "maybe"}),
        raw({"type": "xresp", "status": 1}),
        raw({"type": "xreq", "status": "finish"}),
        raw({"type": "xresp", "status": "finish", "ok": "a"}),
        raw({"type": "xresp", "status": "finish", "ok": [""]}),
        raw({"type": "xresp", "status": "finish", "failed": {"a": 1}}),
        raw({"type": "xresp", "status": "finish", "ok": ["a"], "failed": {"a": "x"}}),
        raw({"type": "xresp", "status": "finish", "ok": ["a", "a"]}),
        raw({"type": "xresp", "status": "error", "ok": ["a"]}),
        raw({"type": "xresp", "status": "finish", "layout_id": -1}),
    ],
)
def test_malformed_responses_raise_message_error(data: bytes) -> None:
    with pytest.raises(MessageError):
        decode_response(data)


def test_message_error_is_a_value_error() -> None:
    assert issubclass(MessageError, ValueError)


# --- validate() on messages built in process --------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        request(reqs=[ReqEntry("d1", "x", [[1]]), ReqEntry("d2", "x", [[2]])]),
        request(reqs=[ReqEntry("d1", "x", [[1]]), ReqEntry("d1", "y", [[2]])]),
        request(reqs=[ReqEntry("d1", "", [[1]])]),
        request(reqs=[ReqEntry("d1", "x", [[-4]])]),
        request(tp_rank=3, tp_size=2),
        request(layout=[]),
        request(layout=[RegionMsg(0, 10, 10, 4)], reqs=[ReqEntry("d1", "x", [[4]])]),
    ],
)
def test_encode_refuses_invalid_requests(msg: TransferRequest) -> None:
    with pytest.raises(MessageError):
        encode_request(msg)


def test_encode_refuses_invalid_responses() -> None:
    with pytest.raises(MessageError):
        encode_response(TransferResponse(Status.LAYOUT_MISS, ok=["a"]))
    with pytest.raises(MessageError):
        encode_response(TransferResponse(Status.FINISH, ok=["a"], failed={"a": "why"}))


def test_empty_request_list_is_valid() -> None:
    msg = request(reqs=[])
    assert decode_request(encode_request(msg)).reqs == []


# --- cancellations and the side channel's union ---------------------------------------------


def test_cancel_round_trip_and_side_channel_union() -> None:
    cancel = CancelRequest("d-engine-1", [CancelEntry("cmpl-d-1", "xfer-1")])
    data = encode_cancel(cancel)
    assert decode_cancel(data) == cancel
    assert decode_side_channel(data) == cancel
    req = request()
    assert decode_side_channel(encode_request(req)) == req


def test_release_entries_say_so() -> None:
    entry = decode_cancel(encode_cancel(CancelRequest("proxy", [CancelEntry.release("x1")]))
                          ).reqs[0]
    assert entry.is_release and entry.transfer_id == "x1"
    assert not CancelEntry("cmpl-d-1", "x1").is_release
    assert not CancelEntry("release-x2", "x1").is_release  # another transfer's name


@pytest.mark.parametrize(
    "data",
    [
        b"\x00",
        raw({"engine_id": "e", "host": "h", "rpc_port": 1, "layout_id": 1}),  # no tag
        raw({"type": "xresp", "status": "finish"}),  # P never receives responses
        raw({"type": "xcancel"}),
        raw({"type": "xcancel", "engine_id": "e", "reqs": [["d1", "x"], ["d2", "x"]]}),
        raw({"type": "xcancel", "engine_id": "e", "reqs": [["d1"]]}),
        raw({**GOOD, "reqs": [["d1", "x1", [-1]]]}),
    ],
)
def test_malformed_side_channel_messages(data: bytes) -> None:
    with pytest.raises(MessageError):
        decode_side_channel(data)


def test_encode_refuses_invalid_cancels() -> None:
    with pytest.raises(MessageError):
        encode_cancel(CancelRequest("e", [CancelEntry("a", "x"), CancelEntry("b", "x")]))
    with pytest.raises(MessageError):
        encode_cancel(CancelRequest("e", [CancelEntry("a", "")]))
