"""kvmesh.runtime.telemetry: tracing set up from flags and the OTEL_* variables, spans exported
through the SDK to real OTLP receivers (gRPC and http/protobuf), sampling, the JSON log format."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvmesh.runtime import telemetry
from kvmesh.runtime.otlp import SpanGroup, encode_request, spans_of
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.process import GlobalConfig, JsonFormatter, LogFormat
from kvmesh.runtime.telemetry import (
    LOG_CONTEXT,
    LogContext,
    Protocol,
    SpanKind,
    Step,
    Tracer,
    TracingConfig,
    setup_tracing,
    shutdown_tracing,
    tracer,
)
from kvmesh.runtime.tracing import TraceContext
from tests.otlp_receiver import OtlpHttpReceiver, OtlpReceiver

pytestmark = pytest.mark.unit

CLIENT = TraceContext.parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")

OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_SDK_DISABLED",
)


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    shutdown_tracing()
    monkeypatch.undo()
    setup_tracing(TracingConfig(), "test")  # back to off


@pytest.fixture
def grpc_receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def test_off_without_an_endpoint_spans_record_nothing_but_carry_the_trace() -> None:
    t = setup_tracing(TracingConfig(), "frontend")
    assert not t.enabled and tracer() is t
    assert CLIENT is not None
    span = t.start("POST /v1/chat/completions", CLIENT, kind=SpanKind.SERVER, remote=True)
    assert not span.recording
    assert span.context.trace_id == CLIENT.trace_id and span.context.span_id != CLIENT.span_id
    span.set("k", 1)
    span.end()
    root = t.start("root", None)
    assert not root.recording and root.context.sampled


def test_spans_reach_a_grpc_receiver_with_parents_resource_and_status(
    grpc_receiver: OtlpReceiver,
) -> None:
    config = TracingConfig(otel_endpoint=grpc_receiver.endpoint, otel_protocol=Protocol.GRPC)
    t = setup_tracing(config, "worker", role="decode", worker_id="w-1")
    assert t.enabled and CLIENT is not None
    server = t.start("POST /v1/chat/completions", CLIENT, kind=SpanKind.SERVER, remote=True)
    server.set("gen_ai.request.model", "tiny")
    child = t.start("route", server.context, attributes={"kvmesh.route.worker_id": "w-1"})
    child.error("Unavailable", "no worker")
    child.end()
    server.set("gen_ai.response.finish_reasons", ["stop"])
    server.end()
    assert t.flush()
    spans = {s.name: s for s in grpc_receiver.wait_for(CLIENT.trace_id, {"route"})}
    top, route = spans["POST /v1/chat/completions"], spans["route"]
    assert top.parent_span_id == CLIENT.span_id and top.span_id == server.context.span_id
    assert route.parent_span_id == top.span_id
    assert top.kind == 2  # SPAN_KIND_SERVER in OTLP
    assert top.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert route.attributes["error.type"] == "Unavailable" and route.status_code == 2
    assert top.end_ns >= route.end_ns > route.start_ns >= top.start_ns
    res = top.resource
    assert res["service.name"] == "kvmesh-worker"
    assert res["kvmesh.role"] == "decode" and res["kvmesh.worker_id"] == "w-1"
    assert len(res["service.instance.id"]) == 32


def test_spans_queued_while_the_collector_is_down_reach_it_once_it_is_up() -> None:
    # The exporter sends kvmesh's own encoding through its own stub; the SDK rebuilds the
    # client after UNAVAILABLE, and the rebuilt one must still be that stub.
    port = free_port()
    config = TracingConfig(otel_endpoint=f"http://127.0.0.1:{port}", otel_protocol=Protocol.GRPC)
    t = setup_tracing(config, "frontend")
    assert CLIENT is not None
    t.start("route", CLIENT, remote=True, attributes={"kvmesh.route.worker_id": "w-1"}).end()
    flushing = threading.Thread(target=t.flush, kwargs={"timeout_s": 20.0})
    flushing.start()
    threading.Event().wait(0.3)  # the first export attempt fails: nothing listens yet
    receiver = OtlpReceiver(port=port).start()
    try:
        (span,) = receiver.wait_for(CLIENT.trace_id, {"route"})
        assert span.attributes == {"kvmesh.route.worker_id": "w-1"}
    finally:
        flushing.join()
        receiver.stop()


def test_http_protobuf_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = OtlpHttpReceiver().start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "my-gateway")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        t = setup_tracing(TracingConfig(), "frontend")
        span = t.start("decode", None)
        span.end()
        assert t.flush()
        (got,) = receiver.wait_for(span.context.trace_id, {"decode"})
        assert got.parent_span_id == ""
        assert got.service == "my-gateway"
        assert got.resource["deployment.environment"] == "test"
    finally:
        receiver.stop()


def test_sampling_ratio_zero_samples_no_new_trace_but_follows_sampled_parents(
    grpc_receiver: OtlpReceiver,
) -> None:
    config = TracingConfig(
        otel_endpoint=grpc_receiver.endpoint, otel_protocol=Protocol.GRPC, otel_sampler_ratio=0.0
    )
    t = setup_tracing(config, "frontend")
    root = t.start("root", None)
    assert not root.recording and not root.context.sampled
    child = t.start("child", root.context)
    assert not child.recording and not child.context.sampled  # the decision travels on
    assert CLIENT is not None
    followed = t.start("server", CLIENT, remote=True)
    assert followed.recording  # parent-based: a sampled caller is followed
    followed.end()
    root.end()
    child.end()
    assert t.flush()
    grpc_receiver.wait_for(CLIENT.trace_id, {"server"})
    assert grpc_receiver.spans(root.context.trace_id) == []


def test_an_always_off_sampler_from_the_environment_records_nothing(
    monkeypatch: pytest.MonkeyPatch, grpc_receiver: OtlpReceiver
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", grpc_receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    t = setup_tracing(TracingConfig(), "worker")
    assert t.enabled and CLIENT is not None
    span = t.start("PrefillRemote", CLIENT, remote=True)  # always_off is not parent-based
    assert not span.recording and not span.context.sampled


def test_bad_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="sampler-ratio"):
        TracingConfig(otel_sampler_ratio=2.0)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        setup_tracing(TracingConfig(), "worker")


def test_json_logs_carry_the_request_context() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("kvmesh.test.json")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        logger.info("outside")
        token = LOG_CONTEXT.set(LogContext("a" * 32, "b" * 16, "req-1"))
        try:
            logger.warning("inside %d", 7)
        finally:
            LOG_CONTEXT.reset(token)
    finally:
        logger.removeHandler(handler)
    outside, inside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert outside["message"] == "outside" and "trace_id" not in outside
    assert inside["message"] == "inside 7" and inside["level"] == "WARNING"
    assert (inside["trace_id"], inside["span_id"], inside["request_id"]) == (
        "a" * 32,
        "b" * 16,
        "req-1",
    )
    assert GlobalConfig().log_format is LogFormat.TEXT and not GlobalConfig().log_content


class CapturingProcessor:
    """A batch processor stand-in that keeps what the tracer queues."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def on_end(self, item: Any) -> None:
        self.items.append(item)


def recording_tracer() -> tuple[Tracer, CapturingProcessor]:
    from opentelemetry.sdk.trace import TracerProvider

    processor = CapturingProcessor()
    return Tracer(TracerProvider(), processor), processor  # type: ignore[arg-type]


def test_a_requests_spans_in_one_process_are_queued_as_one_item() -> None:
    t, processor = recording_tracer()
    assert CLIENT is not None
    server = t.start("POST /v1/chat/completions", CLIENT, kind=SpanKind.SERVER, remote=True)
    for name in ("preprocess", "route"):
        t.start(name, server.context).end()
    assert processor.items == []  # held by the open server span
    server.end()
    (item,) = processor.items
    assert isinstance(item, SpanGroup) and item.context.trace_flags.sampled
    assert [s.name for s in item] == ["POST /v1/chat/completions", "preprocess", "route"]
    # After its server span, a child goes alone; so does a span whose parent is remote.
    t.start("late", server.context).end()
    t.start("queue", CLIENT, remote=True).end()
    assert [getattr(i, "name", None) for i in processor.items[1:]] == ["late", "queue"]
    # Steps recorded together (an engine's, its parent remote): one item, each at its times.
    t.record(CLIENT, [Step("queue", 1, 3, {}), Step("decode", 2, 4, {})], remote=True)
    group = processor.items[-1]
    assert isinstance(group, SpanGroup) and [(s.name, s.start_ns, s.end_ns) for s in group] == [
        ("queue", 1, 3),
        ("decode", 2, 4),
    ]
    assert all(s.remote_parent and s.parent == CLIENT for s in group)
    spans = list(spans_of(processor.items))
    assert len(spans) == 7
    assert encode_request(b"", b"", processor.items) == encode_request(b"", b"", spans)


def test_server_spans_never_ended_are_not_held_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "_MAX_OPEN_SERVERS", 2)
    t, processor = recording_tracer()
    assert CLIENT is not None
    first = t.start("GET /a", CLIENT, kind=SpanKind.SERVER, remote=True)
    t.start("route", first.context).end()
    t.start("GET /b", CLIENT, kind=SpanKind.SERVER, remote=True)
    assert processor.items == []
    t.start("GET /c", CLIENT, kind=SpanKind.SERVER, remote=True)  # /a is let go: its child is sent
    assert [s.name for s in spans_of(processor.items)] == ["route"]
    assert len(t._servers) == 2


def test_a_step_timed_by_its_caller_is_recorded_in_one_call() -> None:
    """`record`: a finished child span (times, attributes, error) joins its open server span's
    item; nothing is recorded off, unsampled or without a parent."""
    t, processor = recording_tracer()
    assert CLIENT is not None
    server = t.start("POST /v1/completions", CLIENT, kind=SpanKind.SERVER, remote=True)
    t.record(server.context, [Step("preprocess", 10, 20, {"gen_ai.usage.input_tokens": 7})])
    t.record(server.context, [Step("route", 21, 30, {}, ("Unavailable", "no worker"))])
    unsampled = TraceContext(CLIENT.trace_id, server.context.span_id, 0)
    t.record(unsampled, [Step("route", 1, 2, {})])
    t.record(None, [Step("route", 1, 2, {})])
    Tracer().record(server.context, [Step("route", 1, 2, {})])
    assert processor.items == []
    server.end()
    (group,) = processor.items
    top, pre, route = group
    assert top is server
    assert [(s.name, s.start_ns, s.end_ns) for s in (pre, route)] == [
        ("preprocess", 10, 20),
        ("route", 21, 30),
    ]
    for child in (pre, route):
        assert child.parent == server.context and not child.remote_parent
        assert child.context.trace_id == CLIENT.trace_id
        assert child.context.span_id not in (server.context.span_id, CLIENT.span_id)
    assert pre.context.span_id != route.context.span_id
    assert pre.attributes == {"gen_ai.usage.input_tokens": 7} and pre.error_message is None
    assert route.attributes == {"error.type": "Unavailable"}
    assert route.error_message == "no worker"
    # with no open server span (its parent from another process), it is queued alone
    t.record(CLIENT, [Step("route", 1, 2, {})])
    assert processor.items[-1].name == "route"
    received = ExportTraceServiceRequest.FromString(encode_request(b"", b"", processor.items))
    spans = received.resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans] == ["POST /v1/completions", "preprocess", "route", "route"]
    assert spans[2].status.code == 2 and spans[2].status.message == "no worker"


def test_recorded_steps_under_a_remote_parent_are_sampled_as_started_spans_are() -> None:
    """A sampler that is not parent-based decides again for a remote parent, for `record` as
    for `start`: always_on records under an unsampled caller (its spans say sampled), a ratio
    of 0 records nothing under a sampled one; parent-based follows the caller."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

    assert CLIENT is not None
    unsampled = TraceContext(CLIENT.trace_id, CLIENT.span_id, 0)
    for sampler, parent, recorded in (
        (ALWAYS_ON, unsampled, True),
        (TraceIdRatioBased(0.0), CLIENT, False),
        (ParentBased(TraceIdRatioBased(0.0)), CLIENT, True),
        (ParentBased(ALWAYS_ON), unsampled, False),
    ):
        processor = CapturingProcessor()
        t = Tracer(TracerProvider(sampler=sampler), processor, sampler)  # type: ignore[arg-type]
        t.record(parent, [Step("queue", 1, 2, {}), Step("decode", 2, 3, {})], remote=True)
        started = t.start("prefill", parent, remote=True)
        assert started.recording is recorded, sampler
        spans = list(spans_of(processor.items))
        assert [s.name for s in spans] == (["queue", "decode"] if recorded else []), sampler
        assert all(s.context.sampled and s.parent == parent for s in spans)
