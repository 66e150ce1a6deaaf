"""kvmesh.runtime.otlp writes the same ExportTraceServiceRequest as the OpenTelemetry SDK's own
encoder (given the same spans as SDK ReadableSpans, which is also how older SDKs' HTTP exporter
gets them): every field of every span (ids, parent and its remoteness, trace state, kind, times,
attributes of every type, status), the resource and the scope."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from kvmesh.runtime import otlp
from kvmesh.runtime.otlp import (
    FinishedSpan,
    encode_request,
    encode_resource,
    encode_scope,
    readable_span,
)
from kvmesh.runtime.tracing import TraceContext

pytestmark = pytest.mark.unit

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
ATTRS = {
    "http.request.method": "POST",
    "gen_ai.usage.input_tokens": 1234567,
    "negative": -5,
    "gen_ai.usage.output_tokens": 8,
    "zero": 0,
    "edge": 0x3FFF,
    "over": 0x4000,
    "big": 2**62,
    "ratio": 0.125,
    "ok": True,
    "no": False,
    "gen_ai.response.finish_reasons": ["stop", "length"],
    "empty": "",
    "unicode": "prompt \u00e9\u4e2d",
    "long": "x" * 20000,
    "just_cached": "y" * 96,
    "not_cached": "y" * 97,
}


def records() -> list[FinishedSpan]:
    def ctx(span_id: str, state: str = "") -> TraceContext:
        return TraceContext(TRACE, span_id, 1, state)

    return [
        FinishedSpan("POST /v1/chat/completions", ctx("00f067aa0ba902b7", "vendor=value"),
              ctx("a0b1c2d3e4f5a6b7"), True, 1, 1_700_000_000_000_000_000,
              1_700_000_000_500_000_000, ATTRS, None),
        FinishedSpan("route", ctx("1111111111111111"), ctx("00f067aa0ba902b7"), False, 0,
              1_700_000_000_100_000_000, 1_700_000_000_100_050_000, {}, "no worker"),
        FinishedSpan("kv_transfer", ctx("2222222222222222"), None, False, 2, 5, 6,
              {"kvmesh.kv_transfer.bytes": 8388608}, ""),
    ]  # fmt: skip


def test_the_encoding_is_the_sdks_field_for_field() -> None:
    resource = Resource.create({"service.name": "kvmesh-worker", "kvmesh.role": "decode"})
    scope = InstrumentationScope("kvmesh", "0.1.0")
    first, again = (
        encode_request(
            encode_resource(resource.attributes), encode_scope("kvmesh", "0.1.0"), records()
        )
        for _ in range(2)  # the second from the encoder's caches of names and short strings
    )
    assert first == again
    ours = ExportTraceServiceRequest.FromString(first)
    sdk = encode_spans([readable_span(r, resource, scope) for r in records()])
    assert ours == sdk
    spans = ours.resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans] == ["POST /v1/chat/completions", "route", "kv_transfer"]
    assert spans[0].flags == 0x300 and spans[1].flags == 0x100  # parent remote / local
    assert spans[1].status.code == 2 and spans[1].status.message == "no worker"


def test_an_empty_batch_is_a_valid_request() -> None:
    msg = ExportTraceServiceRequest.FromString(encode_request(b"", encode_scope("k", "1"), []))
    assert len(msg.resource_spans) == 1 and not msg.resource_spans[0].scope_spans[0].spans


def test_values_equal_across_types_keep_their_own_types() -> None:
    """The cache of encoded attributes answers `1` for the key it saw `1` under; `True` and
    `1.0` are equal to it (and hash alike) but are a bool and a double on the wire."""
    resource = Resource.create({"service.name": "kvmesh-frontend"})
    scope = InstrumentationScope("kvmesh", "0.1.0")
    ctx = TraceContext(TRACE, "3333333333333333", 1)
    spans = [
        FinishedSpan("a", ctx, None, False, 0, 1, 2, {"k": value, "s": "1"}, None)
        for value in (1, True, 1.0, 0, False, 0.0)
    ]
    ours = ExportTraceServiceRequest.FromString(
        encode_request(encode_resource(resource.attributes), encode_scope("kvmesh", "0.1.0"), spans)
    )
    assert ours == encode_spans([readable_span(r, resource, scope) for r in spans])
    kinds = [
        s.attributes[0].value.WhichOneof("value")
        for s in ours.resource_spans[0].scope_spans[0].spans
    ]
    assert kinds == ["int_value", "bool_value", "double_value"] * 2


def test_ids_are_not_cached_and_sequences_encode_as_lists_or_tuples() -> None:
    """A key whose values never repeat (request ids) stops being cached after a few hundred, so
    it does not push the repeating values out (a span after one with the same id reuses its
    field); tuples and lists are the same array."""
    resource = Resource.create({"service.name": "kvmesh-frontend"})
    scope = InstrumentationScope("kvmesh", "0.1.0")
    spans = [
        FinishedSpan(
            "route", TraceContext(TRACE, f"{i + 1:016x}", 1), None, False, 0, 1, 2,
            {"kvmesh.request_id": f"req-{i // 2}", "kvmesh.route.policy": "kv",
             "reasons": ("stop",) if i % 2 else ["stop"]},
            None,
        )
        for i in range(4 * otlp._PER_KEY_MAX)
    ]  # fmt: skip
    ours = ExportTraceServiceRequest.FromString(
        encode_request(encode_resource(resource.attributes), encode_scope("kvmesh", "0.1.0"), spans)
    )
    assert ours == encode_spans([readable_span(r, resource, scope) for r in spans])
    assert "kvmesh.request_id" in otlp._UNCACHED
    assert not any(key == "kvmesh.request_id" for key, _ in otlp._FIELDS)
    assert ("kvmesh.route.policy", "kv") in otlp._FIELDS
