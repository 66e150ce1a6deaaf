"""kvmesh's ended spans (`EndedSpan`) and their way out through the OpenTelemetry SDK's OTLP
exporters.

A span costs the request path one small object, which the SDK's `BatchSpanProcessor` queues as
it is; everything else happens on that processor's thread. There, for OTLP/gRPC,
`encode_request` writes the ExportTraceServiceRequest directly in protobuf's wire format and the
SDK exporter sends those bytes as they are: about an eighth of the CPU of the SDK's own encoder,
which builds a message object per span, attribute and value, in Python (7 vs 58 µs for a span
with nine attributes on this project's 2-core machine; span names, attribute keys and short
string values, which repeat from span to span, are encoded once and kept). OTLP http/protobuf
likewise (its SDK exporter's HTTP client sends the bytes). The SDK exporters do the rest:
endpoint, headers, TLS, compression, timeouts, retries, all from their `OTEL_EXPORTER_OTLP_*`
variables.

Wire format: opentelemetry-proto `collector/trace/v1` and `trace/v1` (field numbers in the
constants below); `tests/unit/test_otlp.py` checks the encoding against the SDK's, field by
field.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from kvmesh.runtime.tracing import TraceContext

__all__ = [
    "EndedSpan",
    "SpanGroup",
    "encode_request",
    "grpc_exporter",
    "http_exporter",
    "readable_span",
    "spans_of",
]


class EndedSpan(Protocol):
    """What the encoder reads of an ended span (kvmesh.runtime.telemetry's recording spans are
    queued as they are: no copy is made when a span ends)."""

    @property
    def name(self) -> str: ...
    @property
    def context(self) -> TraceContext:
        """The span's own ids, flags and trace state."""
        ...

    @property
    def parent(self) -> TraceContext | None:
        """None for a root span."""
        ...

    @property
    def remote_parent(self) -> bool: ...
    @property
    def kind(self) -> int:
        """opentelemetry.trace.SpanKind value (INTERNAL 0, SERVER 1, CLIENT 2)."""
        ...

    @property
    def start_ns(self) -> int: ...
    @property
    def end_ns(self) -> int: ...
    @property
    def attributes(self) -> Mapping[str, Any]: ...
    @property
    def error_message(self) -> str | None:
        """Status message of a failed span; None: status unset."""
        ...


class SpanGroup(list[EndedSpan]):
    """Ended spans queued as one item of the SDK's batch processor: a request's spans in one
    process (a server span and the children that ended before it, or spans that end together)
    cost one `on_end` and its bookkeeping instead of one each. The exporters take spans and
    groups alike (`spans_of`); the processor's batch and queue sizes count items."""

    __slots__ = ()

    @property
    def context(self) -> TraceContext:
        """What the batch processor reads before it queues an item (the first span's flags:
        every span of a group is sampled)."""
        return self[0].context


def spans_of(items: Sequence[EndedSpan | SpanGroup]) -> Iterator[EndedSpan]:
    """The spans of queued items, groups unpacked."""
    for item in items:
        if type(item) is SpanGroup:
            yield from item
        else:
            yield item  # type: ignore[misc]  # not a group: a span


# --- protobuf wire format ------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [_varint(i) for i in range(0x4000)]
_PACK_Q = struct.Struct("<Q").pack
_PACK_d = struct.Struct("<d").pack
_PACK_I = struct.Struct("<I").pack


def _len(n: int) -> bytes:
    return _SMALL[n] if n < 0x4000 else _varint(n)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + _len(len(payload)) + payload


# Tags: (field number << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
_ANY_STRING, _ANY_BOOL, _ANY_INT, _ANY_DOUBLE, _ANY_ARRAY = (
    b"\x0a",
    b"\x10",
    b"\x18",
    b"\x21",
    b"\x2a",
)
_KV_KEY, _KV_VALUE = b"\x0a", b"\x12"
_SPAN_TRACE_ID, _SPAN_SPAN_ID, _SPAN_TRACE_STATE = b"\x0a\x10", b"\x12\x08", b"\x1a"
_SPAN_PARENT, _SPAN_NAME, _SPAN_KIND = b"\x22\x08", b"\x2a", b"\x30"
_SPAN_START, _SPAN_END, _SPAN_ATTRIBUTE = b"\x39", b"\x41", b"\x4a"
_SPAN_STATUS, _SPAN_FLAGS = b"\x7a", b"\x85\x01"
_STATUS_MESSAGE, _STATUS_ERROR = b"\x12", b"\x18\x02"
_STATUS_UNSET = b"\x7a\x00"  # an empty Status, as the SDK's encoder writes it
_SCOPE_SPANS_SCOPE, _SCOPE_SPANS_SPAN = b"\x0a", b"\x12"
_RESOURCE_SPANS_RESOURCE, _RESOURCE_SPANS_SCOPE_SPANS = b"\x0a", b"\x12"
_REQUEST_RESOURCE_SPANS = b"\x0a"
_RESOURCE_ATTRIBUTE = b"\x0a"
_SCOPE_NAME, _SCOPE_VERSION = b"\x0a", b"\x12"
_ARRAY_VALUE = b"\x0a"

# SpanFlags: bits 0-7 the trace flags (the SDK leaves them 0, and so does this encoder); bit 8:
# whether the parent's remoteness is known; bit 9: the parent is remote.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200


def _any(value: Any) -> bytes:
    """An AnyValue."""
    if isinstance(value, str):
        return _field(_ANY_STRING, value.encode())
    if isinstance(value, bool):
        return _ANY_BOOL + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return _ANY_INT + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return _ANY_DOUBLE + _PACK_d(value)
    if isinstance(value, (list, tuple)):
        return _field(_ANY_ARRAY, b"".join(_field(_ARRAY_VALUE, _any(v)) for v in value))
    return _field(_ANY_STRING, str(value).encode())


_KEYS: dict[str, bytes] = {}
_STRINGS: dict[tuple[str, str | int | tuple[str, ...]], bytes] = {}
"""Span attribute fields of short string, integer and short string-list values, encoded once:
most repeat from span to span (method, route, model, backend, worker id, token counts, finish
reasons); bounded (cleared when full)."""
_STRINGS_MAX = 4096
_STRINGS_VALUE_MAX = 96


def _key(key: str) -> bytes:
    """A KeyValue's key field (encoded once per key)."""
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = _KEYS[key] = _field(_KV_KEY, key.encode())
    return encoded


def _attribute(key: str, value: Any) -> bytes:
    """A KeyValue."""
    return _key(key) + _field(_KV_VALUE, _any(value))


def _span_attribute(key: str, value: Any) -> bytes:
    """A span's attribute field (a KeyValue, tagged). Short strings, integers and short lists of
    strings repeat from span to span (methods, models, worker ids, token counts, finish
    reasons): theirs come from a cache; a float's is a per-key prefix and the value."""
    kind = type(value)
    memo: tuple[str, str | int | tuple[str, ...]]
    if kind is int or (kind is str and len(value) <= _STRINGS_VALUE_MAX):
        memo = (key, value)
    elif kind is list and len(value) <= 4 and all(type(v) is str for v in value):
        memo = (key, tuple(value))  # e.g. finish reasons: ["stop"]
    elif kind is float:
        prefix = _FLOAT_PREFIXES.get(key)
        if prefix is None:
            kv_key = _key(key)  # KeyValue: key field, then the value field: tag, length 9, double
            prefix = _SPAN_ATTRIBUTE + _len(len(kv_key) + 11) + kv_key + _KV_VALUE + b"\x09"
            prefix = _FLOAT_PREFIXES[key] = prefix + _ANY_DOUBLE
        return prefix + _PACK_d(value)
    else:
        return _field(_SPAN_ATTRIBUTE, _attribute(key, value))
    cached = _STRINGS.get(memo)
    if cached is None:
        if len(_STRINGS) >= _STRINGS_MAX:
            _STRINGS.clear()
        cached = _STRINGS[memo] = _field(_SPAN_ATTRIBUTE, _attribute(key, value))
    return cached


_FLOAT_PREFIXES: dict[str, bytes] = {}
"""Per attribute key, the bytes of a float attribute's field before the value (bounded by the
keys in use, a few dozen)."""


def _span(r: EndedSpan) -> bytes:
    """A Span message (the ScopeSpans field around it is the caller's)."""
    ctx = r.context
    parent = r.parent
    name = _NAMES.get(r.name)
    if name is None:
        if len(_NAMES) >= _STRINGS_MAX:
            _NAMES.clear()
        name = _NAMES[r.name] = _field(_SPAN_NAME, r.name.encode())
    head = _SPAN_TRACE_ID + _fromhex(ctx.trace_id) + _SPAN_SPAN_ID + _fromhex(ctx.span_id)
    if ctx.tracestate:
        head += _field(_SPAN_TRACE_STATE, ctx.tracestate.encode())
    if parent is not None:
        head += _SPAN_PARENT + _fromhex(parent.span_id)
        flags = _REMOTE_FLAGS if r.remote_parent else _LOCAL_FLAGS
    else:
        flags = _LOCAL_FLAGS  # as the SDK's encoder: no trace flag bits
    # The attributes: most values repeat (see _span_attribute), so the lookup comes first, here,
    # without a call per attribute; floats and misses take the call.
    memo = _STRINGS
    parts = [
        head,
        name,
        _KINDS[r.kind],
        _SPAN_START,
        _PACK_Q(r.start_ns),
        _SPAN_END,
        _PACK_Q(r.end_ns),
    ]
    for k, v in r.attributes.items():
        kind = type(v)
        # (only str and int: a bool or a float equal to a cached int must not match it)
        if kind is str or kind is int:
            parts.append(memo.get((k, v)) or _span_attribute(k, v))
        else:
            parts.append(_span_attribute(k, v))
    error = r.error_message
    if error is None:
        parts.append(_STATUS_UNSET)
    else:
        status = _field(_STATUS_MESSAGE, error.encode()) if error else b""
        parts.append(_field(_SPAN_STATUS, status + _STATUS_ERROR))
    parts.append(flags)
    return b"".join(parts)


_fromhex = bytes.fromhex
_LOCAL_FLAGS = _SPAN_FLAGS + _PACK_I(_HAS_IS_REMOTE)
_REMOTE_FLAGS = _SPAN_FLAGS + _PACK_I(_HAS_IS_REMOTE | _IS_REMOTE)


_NAMES: dict[str, bytes] = {}
"""Span name fields, encoded once (a handful of names; bounded like _STRINGS)."""
_KINDS = [_SPAN_KIND + _SMALL[k + 1] for k in range(3)]  # the proto's kinds start at UNSPECIFIED


def encode_resource(attributes: Mapping[str, Any]) -> bytes:
    """A Resource message."""
    return b"".join(_field(_RESOURCE_ATTRIBUTE, _attribute(k, v)) for k, v in attributes.items())


def encode_scope(name: str, version: str) -> bytes:
    """An InstrumentationScope message."""
    return _field(_SCOPE_NAME, name.encode()) + _field(_SCOPE_VERSION, version.encode())


def encode_request(
    resource: bytes, scope: bytes, records: Sequence[EndedSpan | SpanGroup]
) -> bytes:
    """An ExportTraceServiceRequest of `records` (one resource, one scope)."""
    parts: list[bytes] = []
    for r in spans_of(records):
        span = _span(r)
        parts += (_SCOPE_SPANS_SPAN, _len(len(span)), span)
    spans = b"".join(parts)
    scope_spans = _field(_SCOPE_SPANS_SCOPE, scope) + spans
    resource_spans = _field(_RESOURCE_SPANS_RESOURCE, resource) + _field(
        _RESOURCE_SPANS_SCOPE_SPANS, scope_spans
    )
    return _field(_REQUEST_RESOURCE_SPANS, resource_spans)


# --- exporters ---------------------------------------------------------------------------------


def grpc_exporter(endpoint: str | None, resource: Any, scope_name: str, scope_version: str) -> Any:
    """The SDK's OTLP/gRPC span exporter, taking EndedSpans: `encode_request` writes the
    request and its bytes go on the wire as they are (the exporter's stub is swapped for one
    whose serializer is the identity, so the SDK neither parses nor re-serializes them)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    resource_bytes = encode_resource(resource.attributes)
    scope_bytes = encode_scope(scope_name, scope_version)

    class BytesStub:
        """TraceService's stub, sending an already-encoded ExportTraceServiceRequest."""

        def __init__(self, channel: Any) -> None:
            self.Export = channel.unary_unary(
                "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                request_serializer=None,
                response_deserializer=ExportTraceServiceResponse.FromString,
            )

    class RecordExporter(OTLPSpanExporter):
        def __init__(self, endpoint: str | None) -> None:
            super().__init__(endpoint=endpoint)
            # The SDK builds its client as `self._stub(self._channel)`, at start and again when
            # it reconnects after UNAVAILABLE; tests/unit/test_telemetry.py exports through it.
            self._stub = BytesStub
            self._client = BytesStub(self._channel)  # type: ignore[assignment]  # SDK: None

        def _translate_data(self, data: Sequence[Any]) -> Any:
            return encode_request(resource_bytes, scope_bytes, data)

    return RecordExporter(endpoint)


def readable_span(r: EndedSpan, resource: Any, scope: Any) -> Any:
    """`r` as an SDK `ReadableSpan` of `resource` and InstrumentationScope `scope` (for the
    SDK's own encoder)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState
    from opentelemetry.trace.status import Status, StatusCode

    ctx = r.context
    state = TraceState.from_header([ctx.tracestate]) if ctx.tracestate else None
    flags = TraceFlags(ctx.flags & 0xFF)
    trace_id = int(ctx.trace_id, 16)
    parent = (
        SpanContext(trace_id, int(r.parent.span_id, 16), r.remote_parent, flags, state)
        if r.parent is not None
        else None
    )
    return ReadableSpan(
        name=r.name,
        context=SpanContext(trace_id, int(ctx.span_id, 16), False, flags, state),
        parent=parent,
        resource=resource,
        attributes=r.attributes,
        kind=SpanKind(r.kind),
        instrumentation_scope=scope,
        status=(
            Status(StatusCode.ERROR, r.error_message or None)
            if r.error_message is not None
            else Status()
        ),
        start_time=r.start_ns,
        end_time=r.end_ns,
    )


def http_exporter(endpoint: str | None, resource: Any, scope_name: str, scope_version: str) -> Any:
    """The SDK's OTLP http/protobuf span exporter, taking EndedSpans: `encode_request` writes
    the body and the SDK's HTTP client sends it (compression, retries, timeout, headers: the
    SDK's). SDKs whose exporter has no such client (before 1.45) get `readable_span`s and
    encode them with the SDK's own encoder (about 8x the CPU per span)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    resource_bytes = encode_resource(resource.attributes)
    scope_bytes = encode_scope(scope_name, scope_version)
    scope = InstrumentationScope(scope_name, scope_version)

    class RecordExporter(OTLPSpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            send = getattr(getattr(self, "_client", None), "export", None)
            if send is None:
                return super().export([readable_span(r, resource, scope) for r in spans_of(spans)])
            if self._shutdown:
                return SpanExportResult.FAILURE
            sent = send(encode_request(resource_bytes, scope_bytes, spans))  # logs failures
            return SpanExportResult.SUCCESS if sent.success else SpanExportResult.FAILURE

    return RecordExporter(endpoint=endpoint)
