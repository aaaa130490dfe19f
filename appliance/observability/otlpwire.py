"""OTLP trace spans as protobuf bytes, written directly (pure functions).

The proxy makes three spans per request on one core that is also its whole data path; the
OpenTelemetry SDK's span objects and its exporter's encoder cost about 0.3 ms of that core
per request, which halved the proxy's rate at concurrency 64 (`bench/proxy_overhead.py
--tracing`). A span here is the bytes of one `Span` message, appended as it ends; a batch
is those bytes framed as an `ExportTraceServiceRequest`. Only the fields the proxy sets
are written. Field numbers are opentelemetry-proto's (trace/v1/trace.proto,
common/v1/common.proto); the tests decode what this writes with opentelemetry-proto itself.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

# Wire tags: field number << 3 | wire type (0 varint, 1 fixed64, 2 length-delimited).
_SPAN_TRACE_ID = b"\x0a\x10"  # 1: bytes, always 16 long
_SPAN_ID = b"\x12\x08"  # 2: bytes, 8 long
_SPAN_PARENT = b"\x22\x08"  # 4: bytes, 8 long
_SPAN_NAME = 0x2A  # 5: string
_SPAN_KIND = 0x30  # 6: enum
_SPAN_ATTRIBUTE = 0x4A  # 9: KeyValue
_SPAN_STATUS = 0x7A  # 15: Status
# 7 and 8: start and end, fixed64 nanoseconds (tags 0x39, 0x41): in the heads below
_KV_KEY, _KV_VALUE = 0x0A, 0x12
_ANY_STRING, _ANY_INT = 0x0A, 0x18
_STATUS_MESSAGE, _STATUS_CODE_ERROR = 0x12, b"\x18\x02"
_SCOPE_SPANS_SCOPE, _SCOPE_SPANS_SPAN = 0x0A, 0x12
_RESOURCE_SPANS_RESOURCE, _RESOURCE_SPANS_SCOPE_SPANS = 0x0A, 0x12
_RESOURCE_ATTRIBUTE = 0x0A
_SCOPE_NAME = 0x0A
_REQUEST_RESOURCE_SPANS = 0x0A

KIND_SERVER, KIND_CLIENT = 2, 3


def varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    if n < 0x4000:  # a span's length
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    n = len(payload)
    return b"".join((_SMALL[tag], _SMALL[n] if n < 0x80 else varint(n), payload))


def key_value(key: str, value: str | int | bool) -> bytes:
    """A KeyValue message's bytes (unframed)."""
    if isinstance(value, bool):
        any_value = b"\x10\x01" if value else b"\x10\x00"
    elif isinstance(value, int):
        any_value = _SMALL[_ANY_INT] + varint(value if value >= 0 else value + (1 << 64))
    else:
        any_value = field(_ANY_STRING, value.encode())
    return field(_KV_KEY, key.encode()) + field(_KV_VALUE, any_value)


def attr(key: str, value: str | int | bool) -> bytes:
    """One span attribute (a KeyValue field of the span)."""
    return field(_SPAN_ATTRIBUTE, key_value(key, value))


class Key:
    """An attribute key written once, for the values written per span (the hot path:
    fewer calls than attr())."""

    __slots__ = ("_head", "_heads")

    def __init__(self, key: str) -> None:
        self._head = field(_KV_KEY, key.encode()) + _SMALL[_KV_VALUE]
        self._heads: dict[int, bytes] = {}  # a string value's length: what goes before it

    def str(self, value: str) -> bytes:
        v = value.encode()
        head = self._heads.get(len(v))
        if head is None:
            head = self._string_head(len(v))
        return head + v

    def _string_head(self, n: int) -> bytes:
        """The attribute's bytes before a string value `n` bytes long (its frames' lengths
        are the value's plus constants, so one head serves every value of that length)."""
        any_head = _SMALL[_ANY_STRING] + varint(n)
        kv_head = self._head + varint(len(any_head) + n)
        head = _SMALL[_SPAN_ATTRIBUTE] + varint(len(kv_head) + len(any_head) + n) + kv_head \
            + any_head
        if len(self._heads) < 1024:  # ids of a few lengths; any other is written each time
            self._heads[n] = head
        return head

    def int(self, value: int) -> bytes:
        any_value = _SMALL[_ANY_INT] + varint(value if value >= 0 else value + (1 << 64))
        kv = self._head + _SMALL[len(any_value)] + any_value
        n = len(kv)
        return _SMALL[_SPAN_ATTRIBUTE] + (_SMALL[n] if n < 0x80 else varint(n)) + kv


def name_kind(name: str, kind: int) -> bytes:
    """A span's name and kind, written once per kind of span."""
    return field(_SPAN_NAME, name.encode()) + bytes((_SPAN_KIND, kind))


# A span's ids and times in one pack (fields 1, 2, 4, 7, 8; protobuf takes fields in any
# order, so the rest of a span may follow), packed with the tags below: a child's, its span
# id as a 7-byte stem and a last byte (a request's calls share the stem), and a root's.
CHILD_HEAD = struct.Struct("<2s16s2s7sB2s8sBQBQ")
ROOT_HEAD = struct.Struct("<2s16s2s8sBQBQ")
TRACE_ID_TAG, SPAN_ID_TAG, PARENT_TAG = _SPAN_TRACE_ID, _SPAN_ID, _SPAN_PARENT
START_TAG, END_TAG = 0x39, 0x41


def child_head(trace_id: bytes, span_id: bytes, parent_id: bytes, start_ns: int,
               end_ns: int) -> bytes:
    return CHILD_HEAD.pack(TRACE_ID_TAG, trace_id, SPAN_ID_TAG, span_id[:7], span_id[7],
                           PARENT_TAG, parent_id, START_TAG, start_ns, END_TAG, end_ns)


def root_head(trace_id: bytes, span_id: bytes, start_ns: int, end_ns: int) -> bytes:
    return ROOT_HEAD.pack(TRACE_ID_TAG, trace_id, SPAN_ID_TAG, span_id, START_TAG, start_ns,
                          END_TAG, end_ns)


def error_status(message: str) -> bytes:
    """A failed span's status field."""
    return field(_SPAN_STATUS, field(_STATUS_MESSAGE, message.encode()) + _STATUS_CODE_ERROR)


def span_frame(n: int) -> bytes:
    """What goes before a span's `n` bytes of fields to make it an entry of
    ScopeSpans.spans."""
    return _SMALL[_SCOPE_SPANS_SPAN] + varint(n)


def framed(body: bytes) -> bytes:
    """A span's fields (a head, then name_kind(), attributes...) as an entry of
    ScopeSpans.spans."""
    return span_frame(len(body)) + body


def span(trace_id: bytes, span_id: bytes, parent_id: bytes | None, named: bytes,
         start_ns: int, end_ns: int, attributes: bytes, error: str | None = None) -> bytes:
    """One span, framed as an entry of ScopeSpans.spans. `named`: name_kind(...);
    `attributes`: attr(...) fields joined; `error`: the status message of a failed span."""
    head = (root_head(trace_id, span_id, start_ns, end_ns) if parent_id is None
            else child_head(trace_id, span_id, parent_id, start_ns, end_ns))
    return framed(b"".join((head, named, attributes,
                            b"" if error is None else error_status(error))))


def request(resource: Mapping[str, str | int], scope: str, spans: Iterable[bytes]) -> bytes:
    """An ExportTraceServiceRequest of `spans` (each from span()), all from one resource
    and one instrumentation scope."""
    scope_spans = field(_SCOPE_SPANS_SCOPE, field(_SCOPE_NAME, scope.encode())) + b"".join(spans)
    res = b"".join(field(_RESOURCE_ATTRIBUTE, key_value(k, v)) for k, v in resource.items())
    body = (field(_RESOURCE_SPANS_RESOURCE, res)
            + field(_RESOURCE_SPANS_SCOPE_SPANS, scope_spans))
    return field(_REQUEST_RESOURCE_SPANS, body)
