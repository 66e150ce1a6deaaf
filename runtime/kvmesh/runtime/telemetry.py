"""OpenTelemetry tracing for every kvmesh process: setup from the standard variables (or flags),
cheap spans on the request path, export through the SDK's batch processor and OTLP exporters.

Setup: each process's `main` calls `setup_tracing(config, service, ...)` once and
`shutdown_tracing()` when it stops (flushes what is still queued). Tracing is on when
`--otel-endpoint` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` is set
(and `OTEL_SDK_DISABLED` is not true); the protocol is `--otel-protocol` or
`OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` (`grpc` or `http/protobuf`, the specification's default);
the sampler `--otel-sampler-ratio` (parent-based ratio) or `OTEL_TRACES_SAMPLER[_ARG]` (default
`parentbased_always_on`); the resource `OTEL_RESOURCE_ATTRIBUTES` plus `service.name` (`--otel-
service-name`, else `OTEL_SERVICE_NAME`, else `kvmesh-<process>`), a unique
`service.instance.id`, and `kvmesh.role` / `kvmesh.worker_id` where the process has them. Every
other `OTEL_EXPORTER_OTLP_*` variable (headers, timeout, compression, certificates, insecure)
is read by the SDK's exporters themselves.

Spans: `tracer().start(name, parent)` returns a `Span`; `end()` hands the span itself to the
SDK's `BatchSpanProcessor` (a queue append, no copy; encoding and export run on the processor's
thread, never on the event loop; kvmesh.runtime.otlp). Span ids are the W3C ids of
`kvmesh.runtime.tracing.TraceContext`, which travels hop to hop as before: `span.context` is
what the next hop gets as its parent.
Steps the caller timed itself (start and end known together: preprocessing, routing, an
engine's queue, prefill and decode) are `tracer().record(parent, [Step(name, start_ns, end_ns,
attributes), ...])`: one call, a tuple per span, one queued item.
Attribute values are strings, bools, ints, floats or tuples of strings (a list works too, at a
cost to the encoder).
A span records only when tracing is on and its trace is sampled; otherwise `start` returns a
non-recording span whose context still carries the trace on (so the ids stay consistent
across processes whatever each one samples). No SDK span object, lock or context
variable is created on the request path: a recording span costs a few microseconds. No span
is ever created per token.

Logs: `LogContext` (a context variable set per request: trace id, span id, request id) is what
the JSON log format of kvmesh.runtime.process writes on every line of a request.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvmesh.runtime import __version__
from kvmesh.runtime.config import ConfigError, opt
from kvmesh.runtime.otlp import (
    COMPILED,
    ENCODER,
    EndedSpan,
    FinishedSpan,
    SpanGroup,
    grpc_exporter,
    http_exporter,
)
from kvmesh.runtime.tracing import TraceContext, new_span_id

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import Sampler

__all__ = [
    "LOG_CONTEXT",
    "AttributeValue",
    "LogContext",
    "Protocol",
    "Span",
    "SpanKind",
    "Step",
    "Tracer",
    "TracingConfig",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
    "wall_ns",
]

log = logging.getLogger(__name__)

AttributeValue = str | bool | int | float | tuple[str, ...] | list[str]
"""A span attribute's value (sequences: tuples, which the encoder caches; lists cost it more)."""

SCOPE = "kvmesh"
"""The instrumentation scope of every kvmesh span."""


class Protocol(enum.Enum):
    """OTLP transports for traces."""

    DEFAULT = ""
    """OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else http/protobuf (the specification's default)."""
    GRPC = "grpc"
    HTTP_PROTOBUF = "http/protobuf"


@dataclass
class TracingConfig:
    """OpenTelemetry tracing (OTLP export). Every flag defaults to the standard OTEL_* variable;
    `kvmesh up` passes both the flags and the variables to the processes it starts."""

    otel_endpoint: str = opt(
        "",
        "OTLP endpoint to export traces to (grpc: http://host:4317; http/protobuf: the base URL, "
        "/v1/traces is appended); empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT; tracing is off when none is set",
    )
    otel_protocol: Protocol = opt(
        Protocol.DEFAULT,
        "OTLP protocol (grpc, http/protobuf); empty: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else "
        "http/protobuf",
    )
    otel_sampler_ratio: float = opt(
        -1.0,
        "fraction of new traces to sample, parent-based (a sampled parent is always followed); "
        "-1: OTEL_TRACES_SAMPLER[_ARG] (default parentbased_always_on)",
    )
    otel_service_name: str = opt(
        "", "service.name of this process; empty: OTEL_SERVICE_NAME, else kvmesh-<process>"
    )

    def __post_init__(self) -> None:
        if self.otel_sampler_ratio != -1.0 and not 0.0 <= self.otel_sampler_ratio <= 1.0:
            raise ValueError("--otel-sampler-ratio must be in [0, 1] (or -1: the environment)")


class SpanKind(enum.IntEnum):
    """OpenTelemetry span kinds (values of opentelemetry.trace.SpanKind)."""

    INTERNAL = 0
    SERVER = 1
    CLIENT = 2


# --- log context -------------------------------------------------------------------------------


class LogContext(NamedTuple):
    """What the JSON log format writes on each line logged while handling a request (a named
    tuple: one is made for every request in every process, and a tuple is the cheapest to
    make, a third of a frozen dataclass's instructions)."""

    trace_id: str = ""
    span_id: str = ""
    request_id: str = ""


LOG_CONTEXT: contextvars.ContextVar[LogContext | None] = contextvars.ContextVar(
    "kvmesh_log_context", default=None
)
"""The request being handled by the current task (set by the request handlers; tasks they
start inherit it)."""


# --- spans -------------------------------------------------------------------------------------


def wall_ns(monotonic_s: float) -> int:
    """The wall-clock time (ns since the epoch) of a `time.monotonic()` reading."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Span:
    """A span that records nothing (tracing off, or its trace not sampled); the base of the
    recording one. `context` is what the next hop gets as its parent."""

    __slots__ = ("context",)

    recording = False

    def __init__(self, context: TraceContext) -> None:
        self.context = context

    def set(self, key: str, value: AttributeValue) -> None:
        """Set an attribute."""

    def update(self, attributes: Mapping[str, AttributeValue]) -> None:
        """Set several attributes."""

    def error(self, error_type: str, message: str = "") -> None:
        """Mark the span failed: status ERROR and the `error.type` attribute."""

    def end(self, end_ns: int | None = None) -> None:
        """End the span (at `end_ns`, ns since the epoch; default now). Idempotent."""


class _RecordingSpan(Span):
    """A sampled span; once ended, the batch processor queues it as it is (it is a
    kvmesh.runtime.otlp.EndedSpan) and nothing changes it any more."""

    __slots__ = (
        "_tracer",
        "attributes",
        "children",
        "end_ns",
        "error_message",
        "kind",
        "name",
        "parent",
        "remote_parent",
        "start_ns",
    )

    recording = True

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        context: TraceContext,
        parent: TraceContext | None,
        remote_parent: bool,
        kind: SpanKind,
        attributes: dict[str, Any],
        start_ns: int,
    ) -> None:
        self.context = context
        self._tracer = tracer
        self.name = name
        self.parent = parent
        self.remote_parent = remote_parent
        self.kind = kind
        self.attributes = attributes
        self.start_ns = start_ns
        self.end_ns = 0
        """0 until the span ends."""
        self.error_message: str | None = None
        self.children: list[EndedSpan] | None = None
        """A server span's children that ended before it (queued with it)."""

    def set(self, key: str, value: AttributeValue) -> None:
        if not self.end_ns:
            self.attributes[key] = value

    def update(self, attributes: Mapping[str, AttributeValue]) -> None:
        if not self.end_ns:
            self.attributes.update(attributes)

    def error(self, error_type: str, message: str = "") -> None:
        if not self.end_ns:
            self.attributes["error.type"] = error_type
            self.error_message = message or error_type

    def end(self, end_ns: int | None = None) -> None:
        if self.end_ns:
            return
        self.end_ns = time.time_ns() if end_ns is None else end_ns
        self._tracer._ended(self)


_record_spans = COMPILED.record_spans if COMPILED is not None else None
"""`Tracer.record`'s spans built in C, where kvmesh.runtime._otlpc is used (else its loop)."""

_tuple_new = tuple.__new__
"""Makes a FinishedSpan (or a TraceContext) from a tuple of its fields without the NamedTuple's
Python-level __new__ (on every recorded span)."""


class Step(NamedTuple):
    """A step of a request timed by its caller, recorded as a span by `Tracer.record`."""

    name: str
    start_ns: int
    end_ns: int
    """ns since the epoch (`wall_ns` converts a monotonic reading)."""
    attributes: dict[str, Any]
    """Kept, not copied."""
    error: tuple[str, str] | None = None
    """(error.type, status message) of a failed step."""


class Tracer:
    """Starts spans; exports the ended ones through the SDK (see the module docstring).

    A Tracer built without `provider` is off: every span is non-recording.
    """

    def __init__(
        self,
        provider: TracerProvider | None = None,
        processor: BatchSpanProcessor | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        self.enabled = provider is not None and processor is not None
        """Whether spans can record (tracing was set up)."""
        self.provider = provider
        self._processor = processor
        self._servers: dict[str, _RecordingSpan] = {}
        """Open server spans by span id: the local children that end before one of them are
        queued with it (one `on_end` per request and process; kvmesh.runtime.otlp.SpanGroup)."""
        self._sampler = sampler
        self._parent_based = True
        """A remote parent's sampled flag decides (the sampler need not be asked)."""
        self._roots_sampled = True
        """Every new trace is sampled (the sampler need not be asked: the default,
        `parentbased_always_on`, and `always_on`)."""
        if self.enabled and sampler is not None:
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

            self._parent_based = isinstance(sampler, ParentBased)
            description = sampler.get_description()
            self._roots_sampled = description == ALWAYS_ON.get_description() or (
                self._parent_based
                and description.startswith(f"ParentBased{{root:{ALWAYS_ON.get_description()},")
            )

    def start(
        self,
        name: str,
        parent: TraceContext | None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        remote: bool = False,
        attributes: dict[str, Any] | None = None,
        start_ns: int | None = None,
    ) -> Span:
        """Start span `name`, a child of `parent` (None: a new trace).

        `remote`: `parent` came from another process (or a client). A new trace is sampled by
        the configured sampler; a child follows its parent's sampled flag, but for a remote
        parent under a sampler that is not parent-based (`always_on`, `traceidratio`, ...),
        which decides again. `attributes` is kept (not copied).
        """
        if parent is None:
            context = TraceContext.new()
            if (
                self.enabled
                and not self._roots_sampled
                and not self._sample(None, context.trace_id, name, kind)
            ):
                context = TraceContext(context.trace_id, context.span_id, 0)
        else:
            context = parent.child()
            if self.enabled and remote and not self._parent_based:
                sampled = self._sample(parent, parent.trace_id, name, kind)
                if sampled != parent.sampled:
                    flags = (parent.flags | 1) if sampled else (parent.flags & ~1)
                    context = TraceContext(
                        context.trace_id, context.span_id, flags, parent.tracestate
                    )
        if not self.enabled or not context.sampled:
            return Span(context)
        span = _RecordingSpan(
            self,
            name,
            context,
            parent,
            remote,
            kind,
            attributes if attributes is not None else {},
            time.time_ns() if start_ns is None else start_ns,
        )
        if kind is SpanKind.SERVER:
            servers = self._servers
            if len(servers) >= _MAX_OPEN_SERVERS:  # never ended (a bug): stop holding the oldest
                self._queue(servers.pop(next(iter(servers))).children or [])
            servers[context.span_id] = span
        return span

    def record(
        self,
        parent: TraceContext | None,
        steps: Sequence[Step],
        *,
        remote: bool = False,
    ) -> None:
        """Record `steps` of one request, each a span that is a child of `parent` and ran from
        its start to its end (ns since the epoch), timed by the caller: one call, one tuple per
        span, one queued item (or, for a local parent, the item of its open server span).
        `remote`: `parent` came from another process (sampled as `start` samples: a sampler
        that is not parent-based decides again). Nothing when tracing is off or the trace is
        not sampled. Attribute dicts are kept, not copied."""
        if parent is None or not self.enabled or not steps:
            return
        trace_id, parent_id, flags, tracestate = parent
        if remote and not self._parent_based:
            sampled = self._sample(parent, trace_id, steps[0].name, SpanKind.INTERNAL)
            flags = (flags | 1) if sampled else (flags & ~1)  # sampled here, not by the parent
        if not flags & 1:
            return
        if _record_spans is not None:  # the same spans, built in C (kvmesh.runtime._otlpc)
            spans: list[EndedSpan] = _record_spans(
                TraceContext, FinishedSpan, parent, steps, flags, remote
            )
        else:
            spans = []
            for name, start_ns, end_ns, attributes, error in steps:
                message = None
                if error is not None:
                    attributes["error.type"] = error[0]
                    message = error[1] or error[0]
                # a child context (parent.child(), with the flags above)
                context = _tuple_new(TraceContext, (trace_id, new_span_id(), flags, tracestate))
                spans.append(
                    _tuple_new(
                        FinishedSpan,
                        (name, context, parent, remote, 0, start_ns, end_ns, attributes, message),
                    )
                )
        server = None if remote else self._servers.get(parent_id)
        if server is None:
            self._queue(spans)
        elif server.children is None:
            server.children = spans
        else:
            server.children += spans

    def _ended(self, span: _RecordingSpan) -> None:
        """Queue an ended span: a server span with the children it holds; a child of an open
        server span in this process is held by it until it ends."""
        if span.kind is SpanKind.SERVER:
            self._servers.pop(span.context.span_id, None)
            children = span.children
            if children:
                span.children = None
                self._queue([span, *children])
                return
        else:
            parent = span.parent
            if parent is not None and not span.remote_parent:
                server = self._servers.get(parent.span_id)
                if server is not None:
                    if server.children is None:
                        server.children = [span]
                    else:
                        server.children.append(span)
                    return
        processor = self._processor
        if processor is not None:
            processor.on_end(span)  # type: ignore[arg-type]  # an EndedSpan: it only queues it

    def _queue(self, spans: Sequence[EndedSpan]) -> None:
        processor = self._processor
        if processor is not None and spans:
            item = spans[0] if len(spans) == 1 else SpanGroup(spans)
            processor.on_end(item)  # type: ignore[arg-type]  # it only queues it

    def _sample(
        self, parent: TraceContext | None, trace_id: str, name: str, kind: SpanKind
    ) -> bool:
        sampler = self._sampler
        if sampler is None:
            return True
        from opentelemetry import trace as otel_trace
        from opentelemetry.sdk.trace.sampling import Decision

        context = None
        if parent is not None:
            context = otel_trace.set_span_in_context(
                otel_trace.NonRecordingSpan(_span_context(parent, remote=True))
            )
        result = sampler.should_sample(
            context, int(trace_id, 16), name, otel_trace.SpanKind(int(kind))
        )
        return result.decision is Decision.RECORD_AND_SAMPLE

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued now; False if that did not finish in time."""
        if self.provider is None:
            return True
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Flush and stop the exporter (the tracer is off afterwards)."""
        provider, self.provider = self.provider, None
        self.enabled = False
        if provider is not None:
            provider.shutdown()


def _span_context(ctx: TraceContext, *, remote: bool) -> Any:
    from opentelemetry.trace import SpanContext, TraceFlags, TraceState

    state = TraceState.from_header([ctx.tracestate]) if ctx.tracestate else None
    return SpanContext(
        int(ctx.trace_id, 16), int(ctx.span_id, 16), remote, TraceFlags(ctx.flags), state
    )


_MAX_OPEN_SERVERS = 65536
"""Server spans open at once per process, at most (more means spans that are never ended)."""


# --- setup -------------------------------------------------------------------------------------

_TRACER = Tracer()


def tracer() -> Tracer:
    """This process's tracer (off until setup_tracing)."""
    return _TRACER


def _env(*names: str) -> str:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return ""


def setup_tracing(
    config: TracingConfig,
    process: str,
    *,
    role: str = "",
    worker_id: str = "",
) -> Tracer:
    """Configure this process's tracer (see the module docstring); returns it. `process`
    names the default service (`kvmesh-<process>`). Off (and free) when no endpoint is set."""
    global _TRACER
    endpoint = config.otel_endpoint or _env(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    disabled = (
        _env("OTEL_SDK_DISABLED").lower() == "true"
        or _env("OTEL_TRACES_EXPORTER").lower() == "none"
    )
    if not endpoint or disabled:
        _TRACER = Tracer()
        return _TRACER
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    protocol = config.otel_protocol.value or _env(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    protocol = protocol or Protocol.HTTP_PROTOBUF.value
    if protocol not in (Protocol.GRPC.value, Protocol.HTTP_PROTOBUF.value):
        raise ConfigError(
            f"unsupported OTLP protocol {protocol!r} (kvmesh exports grpc or http/protobuf)"
        )
    attributes: dict[str, str] = {"service.instance.id": uuid.uuid4().hex}
    named = config.otel_service_name or _env("OTEL_SERVICE_NAME")
    if config.otel_service_name or not (
        named or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    ):
        attributes["service.name"] = config.otel_service_name or f"kvmesh-{process}"
    attributes["service.version"] = __version__
    attributes["kvmesh.process"] = process
    if role:
        attributes["kvmesh.role"] = role
    if worker_id:
        attributes["kvmesh.worker_id"] = worker_id
    sampler = (
        ParentBased(TraceIdRatioBased(config.otel_sampler_ratio))
        if config.otel_sampler_ratio >= 0
        else None
    )
    resource = Resource.create(attributes)
    if protocol == Protocol.GRPC.value:
        exporter = grpc_exporter(config.otel_endpoint or None, resource, SCOPE, __version__)
    else:
        url = config.otel_endpoint.rstrip("/") + "/v1/traces" if config.otel_endpoint else None
        exporter = http_exporter(url, resource, SCOPE, __version__)
    provider = TracerProvider(sampler=sampler, resource=resource)
    processor = BatchSpanProcessor(exporter)
    provider.add_span_processor(processor)
    _TRACER = Tracer(provider, processor, provider.sampler)
    log.info(
        "tracing: exporting to %s over %s as %s (span encoder: %s)",
        endpoint,
        protocol,
        provider.resource.attributes.get("service.name"),
        ENCODER,
    )
    return _TRACER


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush queued spans and stop exporting (graceful shutdown)."""
    t = _TRACER
    if t.enabled:
        t.flush(timeout_s)
        t.shutdown()
