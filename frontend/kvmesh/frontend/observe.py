"""One request at a door, observed once for every door (OpenAI and KServe v2, REST and gRPC):
its server span, its count in the gateway's metrics, and the log context of its task.

The server span follows the HTTP semantic conventions (REST doors: `http.request.method`,
`http.route`, `url.path`, `http.response.status_code`) or the RPC ones (gRPC door:
`rpc.system`, `rpc.service`, `rpc.method`, `rpc.grpc.status_code`), and the OpenTelemetry GenAI
ones (`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.request.max_tokens` /
`temperature` / `top_p`, `gen_ai.response.id`, `gen_ai.response.finish_reasons`,
`gen_ai.usage.input_tokens` / `output_tokens`), plus `kvmesh.request_id` (the client's
`x-request-id`). Its context is what the service and the backend get: the preprocess and route
spans and every worker's spans descend from it. With tracing off the span records nothing and
costs a context; the metrics are kept either way.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvmesh.frontend.dataplane import CompletionResult, GenerationOptions
from kvmesh.frontend.metrics import UNKNOWN_MODEL, FrontendMetrics, error_type
from kvmesh.frontend.service import CompletionStream, OpenAIService
from kvmesh.runtime.telemetry import LOG_CONTEXT, LogContext, SpanKind, tracer
from kvmesh.runtime.tracing import TraceContext

__all__ = ["X_REQUEST_ID", "Observed", "observe_grpc", "observe_http"]

X_REQUEST_ID = "x-request-id"
"""The client's request id: honoured (recorded on the spans and in the logs) and returned."""


class Observed:
    """The observation of one request (see the module docstring). Call `request()` once the
    request is decoded, `result()` / `streamed()` with what it produced, and `done()` exactly
    once at the end (or `failed()`, which ends it too)."""

    __slots__ = (
        "_attributes",
        "_done",
        "_http",
        "_service",
        "endpoint",
        "metrics",
        "model",
        "request_id",
        "request_type",
        "span",
    )

    def __init__(
        self,
        service: OpenAIService,
        endpoint: str,
        span_name: str,
        parent: TraceContext | None,
        attributes: dict[str, Any],
        request_id: str = "",
    ) -> None:
        """`endpoint`: the metrics' endpoint label; `parent`: the caller's trace context (None:
        a new trace); `attributes`: the transport's span attributes (kept, not copied);
        `request_id`: the client's x-request-id ("" if none)."""
        self.metrics: FrontendMetrics = service.metrics
        self.endpoint = endpoint
        self.request_type = "unary"
        self.model = UNKNOWN_MODEL
        self.request_id = request_id
        if request_id:
            attributes["kvmesh.request_id"] = request_id
        self.span = span = tracer().start(
            span_name, parent, kind=SpanKind.SERVER, remote=True, attributes=attributes
        )
        self._attributes = attributes if span.recording else None
        """The server span's attributes while it records (set here directly: one dict, no
        calls)."""
        self._done = False
        self._http = "rpc.system" not in attributes
        ctx = span.context
        LOG_CONTEXT.set(LogContext(ctx.trace_id, ctx.span_id, request_id))
        self._service = service

    @property
    def context(self) -> TraceContext:
        """The server span's context: the parent of everything the request does next."""
        return self.span.context

    def request(
        self, model: str, options: GenerationOptions | None, operation: str, *, stream: bool
    ) -> None:
        """The decoded request: its model (the label, `unknown_model` if not served), options
        and GenAI operation ("chat", "text_completion", "embeddings")."""
        self.model = model if self._service.model_info(model) is not None else UNKNOWN_MODEL
        self.request_type = "stream" if stream else "unary"
        self.metrics.started(self.model, self.endpoint, self.request_type)
        a = self._attributes
        if a is None:
            return
        a["gen_ai.operation.name"] = operation
        a["gen_ai.request.model"] = model
        if options is None:
            return
        a["gen_ai.request.temperature"] = options.temperature
        a["gen_ai.request.top_p"] = options.top_p
        if options.max_tokens is not None:
            a["gen_ai.request.max_tokens"] = options.max_tokens
        if options.seed is not None:
            a["gen_ai.request.seed"] = options.seed
        if options.n != 1:
            a["gen_ai.request.choice.count"] = options.n

    def result(self, result: CompletionResult) -> None:
        """A unary result."""
        a = self._attributes
        if a is not None:
            a["gen_ai.response.id"] = result.id
            a["gen_ai.response.model"] = result.model
            a["gen_ai.usage.input_tokens"] = result.usage.prompt_tokens
            a["gen_ai.usage.output_tokens"] = result.usage.completion_tokens
            a["gen_ai.response.finish_reasons"] = tuple(c.finish_reason for c in result.choices)

    def streamed(self, stream: CompletionStream, finish_reasons: list[str]) -> None:
        """A stream that ended (usage is final), and its choices' finish reasons."""
        a = self._attributes
        if a is not None:
            usage = stream.usage
            a["gen_ai.response.id"] = stream.id
            a["gen_ai.response.model"] = stream.model
            a["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            a["gen_ai.usage.output_tokens"] = usage.completion_tokens
            a["gen_ai.response.finish_reasons"] = tuple(finish_reasons)

    def done(self, status: int, *, error: str | None = None, grpc_code: int = 0) -> None:
        """End: count the request and end the span. `status`: the HTTP status (the REST doors'
        `http.response.status_code`; the gRPC door passes the HTTP equivalent of its code and
        `grpc_code`, its `rpc.grpc.status_code`); `error`: the error_type label (default: from
        `status`)."""
        if self._done:
            return
        self._done = True
        kind = error_type(status) if error is None else error
        self.metrics.finished(self.model, self.endpoint, self.request_type, kind)
        span = self.span
        a = self._attributes
        if a is not None:
            if self._http:
                a["http.response.status_code"] = status
            else:
                a["rpc.grpc.status_code"] = grpc_code
            if kind:
                span.error(kind)
            self._attributes = None  # ended: queued for export, no longer written
        span.end()


def observe_http(service: OpenAIService, request: web.Request, endpoint: str) -> Observed:
    """The observation of a REST request: its server span `<METHOD> <route>` (a child of the
    client's `traceparent`), counted under `endpoint`, with the client's x-request-id."""
    headers = request.headers
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    traceparent = headers.get("traceparent")
    parent = (
        TraceContext.from_headers(traceparent, headers.get("tracestate")) if traceparent else None
    )
    attributes: dict[str, Any] = {
        "http.request.method": request.method,
        "http.route": route,
        "url.path": request.path,
    }
    return Observed(
        service,
        endpoint,
        f"{request.method} {route}",
        parent,
        attributes,
        headers.get(X_REQUEST_ID, ""),
    )


def observe_grpc(
    service: OpenAIService,
    metadata: Any,
    rpc_service: str,
    method: str,
    endpoint: str,
) -> Observed:
    """The observation of a gRPC request (`metadata`: the call's invocation metadata): its
    server span `<service>/<method>` (a child of the `traceparent` in the metadata), counted
    under `endpoint`, with the x-request-id of the metadata."""
    request_id = ""
    for key, value in metadata or ():
        if key == X_REQUEST_ID:
            request_id = value if isinstance(value, str) else value.decode()
    attributes: dict[str, Any] = {
        "rpc.system": "grpc",
        "rpc.service": rpc_service,
        "rpc.method": method,
    }
    return Observed(
        service,
        endpoint,
        f"{rpc_service}/{method}",
        TraceContext.from_grpc_metadata(metadata),
        attributes,
        request_id,
    )
