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

The same encoder is compiled (`kvmesh.runtime._otlpc`, from `_otlpc.c`, built by hatch_build.py
when kvmesh is installed): `encode_request` is that one when it is built from this tree's
source, the Python one (`encode_request_python`) otherwise, or when `KVMESH_OTLP_ENCODER=python`.
Same bytes (tests/unit/test_otlp.py compares them); the compiled one takes well under a tenth
of the Python one's CPU, which was most of what tracing cost a serving process. The same module
builds the spans of `Tracer.record` on the request path (`record_spans`: the spans its Python
loop builds; a one-step record 16.6 k -> 11.9 k instructions), under the same conditions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple, Protocol

from kvmesh.runtime.tracing import TraceContext

log = logging.getLogger(__name__)

__all__ = [
    "COMPILED",
    "ENCODER",
    "Encoder",
    "EndedSpan",
    "FinishedSpan",
    "SpanGroup",
    "encode_request",
    "encode_request_python",
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


class FinishedSpan(NamedTuple):
    """An EndedSpan as a tuple, made in one step when a span is recorded at its end
    (kvmesh.runtime.telemetry's `Tracer.record`)."""

    name: str
    context: TraceContext
    parent: TraceContext | None
    remote_parent: bool
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error_message: str | None


class SpanGroup(list[EndedSpan]):
    """Ended spans queued as one item of the SDK's batch processor: a request's spans in one
    process (a server span and the children that ended before it, or spans that end together)
    cost one `on_end` and its bookkeeping instead of one each. The exporters take spans and
    groups alike (`spans_of`); the processor's batch and queue sizes count items."""

    __slots__ = ()

    context = SimpleNamespace(trace_flags=SimpleNamespace(sampled=True))
    """What the batch processor reads of an item before it queues it
    (`item.context.trace_flags.sampled`), as plain attributes, no call: every span of a group is
    sampled. Its spans' own contexts are theirs."""


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


def _key(key: str) -> bytes:
    """A KeyValue's key field (encoded once per key)."""
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = _KEYS[key] = _field(_KV_KEY, key.encode())
    return encoded


def _attribute(key: str, value: Any) -> bytes:
    """A KeyValue."""
    return _key(key) + _field(_KV_VALUE, _any(value))


# Span attributes: most values repeat from span to span (methods, routes, models, worker ids,
# token counts, finish reasons), so their encoded fields are kept, looked up by the (key, value)
# pair the attribute dict yields. `_FIELDS` holds strings and tuples of strings only: no value of
# another type equals one, so a hit there needs no type test (True == 1 == 1.0, hence ints in
# `_INTS`, looked up once the value is known to be an int). Floats take a per-key prefix.
_FIELDS: dict[tuple[str, Any], bytes] = {}
"""(key, short string or tuple of strings) -> the attribute's field."""
_INTS: dict[tuple[str, int], bytes] = {}
"""(key, int) -> the attribute's field."""
_FLOAT_PREFIXES: dict[str, bytes] = {}
"""Per key, the bytes of a float attribute's field before the value (bounded by the keys in
use, a few dozen)."""
_DISTINCT: dict[str, int] = {}
"""Per key, the values `_FIELDS` took so far; a key with more than _PER_KEY_MAX (ids: request,
response) is no longer cached (`_UNCACHED`): its values would only push the others out."""
_UNCACHED: set[str] = set()
_LAST: dict[str, tuple[Any, bytes]] = {}
"""Per uncached key, its last value and field: a request's spans in one batch carry the same
request id one after another."""
_CACHE_MAX = 4096
_PER_KEY_MAX = 256
_FIELDS_VALUE_MAX = 96
"""Longer strings are encoded every time."""


def _float_prefix(key: str) -> bytes:
    """A float attribute's field before its 8 bytes (kept per key)."""
    kv_key = _key(key)  # KeyValue: the key field, then the value field: tag, length 9, double
    prefix = _SPAN_ATTRIBUTE + _len(len(kv_key) + 11) + kv_key + _KV_VALUE + b"\x09" + _ANY_DOUBLE
    _FLOAT_PREFIXES[key] = prefix
    return prefix


def _other(key: str, value: Any) -> bytes:
    """The field of an attribute not cached yet (or never), caching it where it may repeat."""
    kind = type(value)
    if kind is str:  # (ids come here every time: one join, or the field of the span before)
        last = _LAST.get(key)
        if last is not None and last[0] == value:
            return last[1]
        data = value.encode()
        n = len(data)
        key_field = _KEYS.get(key) or _key(key)
        value_len = 1 + len(_len(n)) + n  # AnyValue: tag, length, the string
        kv_len = len(key_field) + 1 + len(_len(value_len)) + value_len
        field = b"".join(
            (
                _SPAN_ATTRIBUTE,
                _len(kv_len),
                key_field,
                _KV_VALUE,
                _len(value_len),
                _ANY_STRING,
                _len(n),
                data,
            )
        )
    else:
        field = _field(_SPAN_ATTRIBUTE, _attribute(key, value))
    if kind is int:
        if len(_INTS) >= _CACHE_MAX:
            _INTS.clear()
        _INTS[(key, value)] = field
        return field
    if kind is list or kind is tuple:
        if len(value) > 4 or any(type(v) is not str for v in value):
            return field
        value = tuple(value)  # e.g. finish reasons
    elif kind is not str or len(value) > _FIELDS_VALUE_MAX:
        return field
    if key in _UNCACHED:
        _LAST[key] = (value, field)
    else:
        seen = _DISTINCT.get(key, 0) + 1
        if seen > _PER_KEY_MAX:  # an id: stop caching this key's values
            _UNCACHED.add(key)
            for memo in [m for m in _FIELDS if m[0] == key]:
                del _FIELDS[memo]
        else:
            if len(_FIELDS) >= _CACHE_MAX:
                _FIELDS.clear()
                _DISTINCT.clear()
                seen = 1
            _DISTINCT[key] = seen
            _FIELDS[(key, value)] = field
    return field


def _span(r: EndedSpan) -> bytes:
    """A Span message (the ScopeSpans field around it is the caller's). Few parts, each made in
    one step: every part costs the join a copy."""
    ctx = r.context
    parent = r.parent
    # the ids after their tags (_SPAN_TRACE_ID, _SPAN_SPAN_ID, _SPAN_PARENT): one fromhex
    if parent is None:
        ids = _fromhex(f"0a10{ctx.trace_id}1208{ctx.span_id}")
        flags = _LOCAL_FLAGS  # as the SDK's encoder: no trace flag bits
    else:
        ids = _fromhex(f"0a10{ctx.trace_id}1208{ctx.span_id}2208{parent.span_id}")
        flags = _REMOTE_FLAGS if r.remote_parent else _LOCAL_FLAGS
    named = _NAMES.get(r.name) or _name(r.name)
    parts = [ids, named[r.kind], _PACK_TIMES(_START_TAG, r.start_ns, _END_TAG, r.end_ns)]
    if ctx.tracestate:
        parts.append(_field(_SPAN_TRACE_STATE, ctx.tracestate.encode()))
    # The attributes, inline: one lookup for a cached string or int, a prefix for a float.
    fields, ints, floats = _FIELDS.get, _INTS.get, _FLOAT_PREFIXES.get
    for kv in r.attributes.items():
        try:
            field = fields(kv)
        except TypeError:  # a list value (unhashable); kvmesh's spans record tuples
            field = None
        if field is None:
            key, value = kv
            kind = type(value)
            if kind is float:
                field = (floats(key) or _float_prefix(key)) + _PACK_d(value)
            else:
                field = (ints(kv) if kind is int else None) or _other(key, value)
        parts.append(field)
    error = r.error_message
    if error is None:
        parts.append(_UNSET[flags])
    else:
        status = _field(_STATUS_MESSAGE, error.encode()) if error else b""
        parts += (_field(_SPAN_STATUS, status + _STATUS_ERROR), flags)
    return b"".join(parts)


_fromhex = bytes.fromhex
assert (_SPAN_TRACE_ID + _SPAN_SPAN_ID + _SPAN_PARENT).hex() == "0a1012082208"  # as in _span
_LOCAL_FLAGS = _SPAN_FLAGS + _PACK_I(_HAS_IS_REMOTE)
_REMOTE_FLAGS = _SPAN_FLAGS + _PACK_I(_HAS_IS_REMOTE | _IS_REMOTE)
_UNSET = {flags: _STATUS_UNSET + flags for flags in (_LOCAL_FLAGS, _REMOTE_FLAGS)}
"""A span's last bytes when its status is unset: the empty status and its flags."""
_PACK_TIMES = struct.Struct("<BQBQ").pack
_START_TAG, _END_TAG = _SPAN_START[0], _SPAN_END[0]


_NAMES: dict[str, tuple[bytes, bytes, bytes]] = {}
"""Per span name, its name field with each kind's field after it, encoded once (a handful of
names; bounded like the attribute caches)."""
_KINDS = [_SPAN_KIND + _SMALL[k + 1] for k in range(3)]  # the proto's kinds start at UNSPECIFIED


def _name(name: str) -> tuple[bytes, bytes, bytes]:
    if len(_NAMES) >= _CACHE_MAX:
        _NAMES.clear()
    field = _field(_SPAN_NAME, name.encode())
    named = _NAMES[name] = (field + _KINDS[0], field + _KINDS[1], field + _KINDS[2])
    return named


def encode_resource(attributes: Mapping[str, Any]) -> bytes:
    """A Resource message."""
    return b"".join(_field(_RESOURCE_ATTRIBUTE, _attribute(k, v)) for k, v in attributes.items())


def encode_scope(name: str, version: str) -> bytes:
    """An InstrumentationScope message."""
    return _field(_SCOPE_NAME, name.encode()) + _field(_SCOPE_VERSION, version.encode())


def encode_request_python(
    resource: bytes, scope: bytes, records: Sequence[EndedSpan | SpanGroup]
) -> bytes:
    """An ExportTraceServiceRequest of `records` (one resource, one scope), in one join: the
    enclosing messages' lengths are summed, not measured on copies."""
    scope_field = _field(_SCOPE_SPANS_SCOPE, scope)
    resource_field = _field(_RESOURCE_SPANS_RESOURCE, resource)
    parts = [b"", resource_field, b"", scope_field]  # the two heads are filled in at the end
    size = len(scope_field)  # of the ScopeSpans
    for r in spans_of(records):
        span = _span(r)
        n = len(span)
        length = _SMALL[n] if n < 0x4000 else _varint(n)
        parts += (_SCOPE_SPANS_SPAN, length, span)
        size += 1 + len(length) + n
    parts[2] = scope_head = _RESOURCE_SPANS_SCOPE_SPANS + _len(size)
    parts[0] = _REQUEST_RESOURCE_SPANS + _len(len(resource_field) + len(scope_head) + size)
    return b"".join(parts)


Encoder = Callable[[bytes, bytes, Sequence[EndedSpan | SpanGroup]], bytes]
"""`encode_request`'s signature: (resource, scope, records) -> the request's bytes."""


def _compiled() -> Any:
    """`kvmesh.runtime._otlpc`, if it is built, from this tree's `_otlpc.c`, and not refused by
    KVMESH_OTLP_ENCODER=python; else None."""
    choice = os.environ.get("KVMESH_OTLP_ENCODER", "").strip().lower()
    if choice == "python":
        return None
    if choice not in ("", "c"):
        log.warning("KVMESH_OTLP_ENCODER=%r: expected c or python; using the default", choice)
    try:
        from kvmesh.runtime import _otlpc
    except ImportError:
        log.debug("no compiled OTLP encoder (kvmesh.runtime._otlpc): encoding spans in Python")
        return None
    source = Path(__file__).with_name("_otlpc.c")
    if source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != _otlpc.SOURCE:
        log.warning(
            "kvmesh.runtime._otlpc was built from another version of %s (reinstall kvmesh: "
            "pip install -e .); encoding spans in Python",
            source,
        )
        return None
    return _otlpc


def _seed() -> None:
    COMPILED.seed(os.urandom(32))


COMPILED: Any = _compiled()
"""`kvmesh.runtime._otlpc` when it is used (see the module docstring), else None: its
`encode_request`, and the span building of `Tracer.record` (`record_spans`, with span ids from
its own generator, seeded from os.urandom here and in a forked child)."""
encode_request: Encoder = COMPILED.encode_request if COMPILED is not None else encode_request_python
"""An ExportTraceServiceRequest of `records` (one resource, one scope): the compiled encoder
when there is one (see the module docstring), else `encode_request_python`."""
ENCODER = "c" if COMPILED is not None else "python"
"""Which encoder `encode_request` is (and whether `Tracer.record` builds its spans in C)."""
if COMPILED is not None:
    _seed()
    os.register_at_fork(after_in_child=_seed)  # a forked child must not draw the same span ids


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
