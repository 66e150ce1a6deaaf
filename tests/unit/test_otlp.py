"""kvmesh.runtime.otlp writes the same ExportTraceServiceRequest as the OpenTelemetry SDK's own
encoder (given the same spans as SDK ReadableSpans, which is also how older SDKs' HTTP exporter
gets them): every field of every span (ids, parent and its remoteness, trace state, kind, times,
attributes of every type, status), the resource and the scope. Both of its encoders, the Python
one and the compiled one (kvmesh.runtime._otlpc), and the two byte for byte."""

from __future__ import annotations

import os
import re
import shutil
import sysconfig
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from kvmesh.runtime import otlp, telemetry
from kvmesh.runtime.otlp import (
    Encoder,
    FinishedSpan,
    SpanGroup,
    encode_request_python,
    encode_resource,
    encode_scope,
    readable_span,
    spans_of,
)
from kvmesh.runtime.tracing import TraceContext
from tests.unit.test_telemetry import recording_tracer

pytestmark = pytest.mark.unit


def _module() -> Any:
    """kvmesh.runtime._otlpc; a test of it is skipped only on a machine with no C compiler (where
    `pip install` cannot build it), and fails where one is and the module is missing."""
    try:
        from kvmesh.runtime import _otlpc
    except ImportError:
        cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
        if shutil.which(cc) is None:
            pytest.skip(f"no C compiler ({cc}): kvmesh encodes spans in Python here")
        raise AssertionError("kvmesh.runtime._otlpc is not built: pip install -e .") from None
    return _otlpc


def _compiled() -> Encoder:
    """The compiled encoder (see `_module`)."""
    return _module().encode_request  # type: ignore[no-any-return]


@pytest.fixture(params=["python", "c"])
def encode_request(request: pytest.FixtureRequest) -> Encoder:
    """Each encoder in turn (the compiled one is built by `pip install -e .`: hatch_build.py)."""
    return encode_request_python if request.param == "python" else _compiled()


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


def test_the_encoding_is_the_sdks_field_for_field(encode_request: Encoder) -> None:
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


def test_an_empty_batch_is_a_valid_request(encode_request: Encoder) -> None:
    msg = ExportTraceServiceRequest.FromString(encode_request(b"", encode_scope("k", "1"), []))
    assert len(msg.resource_spans) == 1 and not msg.resource_spans[0].scope_spans[0].spans


def test_values_equal_across_types_keep_their_own_types(encode_request: Encoder) -> None:
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
        encode_request_python(
            encode_resource(resource.attributes), encode_scope("kvmesh", "0.1.0"), spans
        )
    )
    assert ours == encode_spans([readable_span(r, resource, scope) for r in spans])
    assert "kvmesh.request_id" in otlp._UNCACHED
    assert not any(key == "kvmesh.request_id" for key, _ in otlp._FIELDS)
    assert ("kvmesh.route.policy", "kv") in otlp._FIELDS


def _traced_requests(n: int) -> list[object]:
    """What a gateway's tracer queues for `n` requests: a server span (an object, not a tuple)
    with its steps as one group, varied values of every attribute type."""
    t, processor = recording_tracer()
    for i in range(n):
        parent = None if i % 3 else TraceContext(TRACE, f"{i + 1:016x}", 1, "k=v" * (i % 2))
        span = t.start(
            "POST /v1/chat/completions",
            parent,
            kind=telemetry.SpanKind.SERVER,
            remote=True,
            attributes={"http.route": "/v1/chat/completions", "n": i, "neg": -i, "f": i / 7},
        )
        ctx = span.context
        t.record(ctx, [telemetry.Step("preprocess", 10 + i, 20 + i, {"t_ms": 0.1 * i})])
        t.record(ctx, [
            telemetry.Step("route", 20, 30, {"id": f"req-{i}", "ok": i % 2 == 0,
                                             "u": "\u00e9\u4e2d" * (i % 3), "big": 2**70 + i,
                                             "list": ["a", 1, 2.5, True, ["nested"]]}),
            telemetry.Step("queue", 30, 31, {}, ("Timeout", "" if i % 2 else "too long")),
        ])  # fmt: skip
        span.set("gen_ai.response.finish_reasons", ("stop",) * (i % 3))
        if i % 5 == 0:
            span.error("Internal", "boom")
        span.end(1_700_000_000_000_000_000 + i)
        t.record(TraceContext(TRACE, "0000000000000abc", 1), [
            telemetry.Step("kv_transfer", 1, 2, {"kvmesh.kv_transfer.bytes": i * 4096}),
        ], remote=True)  # fmt: skip
    return processor.items


def test_the_compiled_encoder_writes_the_python_encoders_bytes() -> None:
    items = _traced_requests(600)
    assert any(type(item) is SpanGroup for item in items)
    resource = encode_resource(
        Resource.create(
            {"service.name": "kvmesh-frontend", "service.instance.id": "0" * 32}
        ).attributes
    )
    assert len(resource) > 127  # a length of 2 bytes
    scope = encode_scope("kvmesh", "0.1.0")
    compiled = _compiled()
    for start in range(0, len(items), 97):  # batches of several sizes of a warm Python encoder
        batch = items[start : start + 97]
        assert compiled(resource, scope, batch) == encode_request_python(resource, scope, batch)
    big = compiled(resource, scope, items)  # lengths of 2 and 3 bytes (outer messages)
    assert big == encode_request_python(resource, scope, items) and len(big) > 2**14


@pytest.mark.parametrize(
    "span",
    [
        FinishedSpan("a", TraceContext("xyz", "1", 1), None, False, 0, 1, 2, {}, None),
        FinishedSpan("a", TraceContext(TRACE, "zz" * 8, 1), None, False, 0, 1, 2, {}, None),
    ],
    ids=["short-trace-id", "not-hex"],
)
def test_bad_ids_are_refused_by_both_encoders(span: FinishedSpan) -> None:
    for encoder in (encode_request_python, _compiled()):
        with pytest.raises(ValueError):
            encoder(b"", b"", [span])


def test_the_compiled_encoder_is_built_and_used() -> None:
    """`pip install -e .` builds it (a C compiler and Python's headers are on every machine the
    tests run on); kvmesh uses it unless it was built from another _otlpc.c or is refused."""
    compiled = _compiled()
    assert otlp.ENCODER == "c"
    assert otlp.encode_request is compiled


def test_a_stale_or_refused_compiled_encoder_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _otlpc = _module()  # (skips where it cannot be built)
    assert otlp._compiled() is _otlpc
    monkeypatch.setenv("KVMESH_OTLP_ENCODER", "python")
    assert otlp._compiled() is None
    monkeypatch.delenv("KVMESH_OTLP_ENCODER")
    monkeypatch.setattr(_otlpc, "SOURCE", "0" * 64)  # built from another version of the source
    assert otlp._compiled() is None


def test_record_builds_the_same_spans_in_c_as_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Tracer.record` builds its spans in C where kvmesh.runtime._otlpc is used: the spans its
    Python loop builds (names, times, parent, remoteness, kind, the attribute dicts themselves,
    errors and their messages, flags, trace state), but for the new span ids."""
    module = _module()
    assert telemetry._record_spans is module.record_spans
    parent = TraceContext(TRACE, "00f067aa0ba902b7", 1, "k=v")

    def record(built_in: Any, remote: bool) -> list[FinishedSpan]:
        monkeypatch.setattr(telemetry, "_record_spans", built_in)
        t, processor = recording_tracer()
        steps = [
            telemetry.Step("queue", 10, 20, {"kvmesh.request_id": "r"}),
            telemetry.Step("prefill", 20, 35, {"n": 3}, ("Unavailable", "")),  # message: the type
            ("decode", 35, 90, {"x": 1.5}, ("Cancelled", "client went away")),  # plain tuples too
        ]
        t.record(parent, steps, remote=remote)
        (group,) = processor.items
        spans = list(spans_of(group))
        for step, span in zip(steps, spans, strict=True):
            assert span.attributes is step[3]  # kept, not copied
        return spans

    for remote in (True, False):
        python, c = record(None, remote), record(module.record_spans, remote)
        assert [type(s) for s in c] == [FinishedSpan] * 3
        assert [type(s.context) for s in c] == [TraceContext] * 3
        ids = [s.context.span_id for s in python + c]
        assert all(re.fullmatch("[0-9a-f]{16}", i) and i != "0" * 16 for i in ids)
        assert len(set(ids)) == 6
        same = [s._replace(context=s.context._replace(span_id="")) for s in python]
        assert [s._replace(context=s.context._replace(span_id="")) for s in c] == same
        assert [s.error_message for s in c] == [None, "Unavailable", "client went away"]
        assert c[1].attributes["error.type"] == "Unavailable" and c[0].remote_parent is remote


def test_record_spans_refuses_what_is_not_a_step() -> None:
    module = _module()
    parent = TraceContext(TRACE, "00f067aa0ba902b7", 1, "")
    for steps in ([("queue", 1, 2, {})], [None], 5, [("queue", 1, 2, [], ("E", ""))]):
        with pytest.raises(TypeError):
            module.record_spans(TraceContext, FinishedSpan, parent, steps, 1, False)
    with pytest.raises(TypeError):
        module.record_spans(TraceContext, FinishedSpan, ("a", "b"), [], 1, False)
    with pytest.raises(ValueError):
        module.seed(b"short")


def test_a_forked_child_draws_other_span_ids() -> None:
    """The compiled span id generator is seeded again in a forked child (else parent and child
    would give their next spans the same ids)."""
    module = _module()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.write(write, module.span_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert re.fullmatch("[0-9a-f]{16}", child)
    assert child != module.span_id()
