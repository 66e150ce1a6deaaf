"""The OpenAI-compatible HTTP transport (aiohttp).

Each route decodes the request into a typed request of kvmesh.frontend.dataplane (with
kvmesh.frontend.protocol), calls ONE method of OpenAIService, and encodes the result: a JSON
body, or Server-Sent Events for streams. Errors are OpenAI-shaped JSON everywhere, including
unknown paths (404), wrong methods (405) and oversized bodies (413). After a stream has
started, an error is sent as `data: {"error": {...}}` followed by `data: [DONE]`. The KServe v2
REST routes (kvmesh.frontend.kserve_http, under /v2) share the app and the service but answer
with the protocol's own `{"error": "..."}`. `ROUTES` is the route table: it registers the
handlers, and GET /openapi.json is generated from it (kvmesh.frontend.openapi).

Performance notes: no middlewares (each costs a call per request), no access log, pre-encoded
SSE fragments, the last event of a stream coalesced with `[DONE]` and the chunked-encoding
terminator into one write. aiohttp enables TCP_NODELAY on every accepted connection
(BaseProtocol.connection_made), so keep-alive streams do not stall on Nagle + delayed ACK.
Handlers are cancelled when the client disconnects (`handler_cancellation=True`), which closes
the backend iterators and so cancels the requests on the workers.

Slow readers and shutdown: a stream whose client does not read for `stream_write_timeout_s`
(the socket's send buffer stays full) is cut; meanwhile the request is paused on its worker
(kvmesh.router.session flow control), so nothing grows without bound. `abort_streams` (a drain
that timed out, or a forced stop) ends every open stream at once with an error event and
`[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
import orjson
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import StreamWriter

from kvmesh.frontend.anthropic_api import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    CreateMessageRequest,
    MessageResponse,
    MessageStreamEncoder,
    anthropic_error_body,
    encode_count,
    encode_message,
    error_event,
    parse_count_tokens_request,
    parse_message_request,
)
from kvmesh.frontend.auth import GatewayAuth, estimate_tokens
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.dataplane import ChatCompletionRequest, CompletionRequest, CompletionResult
from kvmesh.frontend.errors import error_body, error_from_exception, error_payload
from kvmesh.frontend.kserve_http import KSERVE_ROUTES, KServeRoutes
from kvmesh.frontend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvmesh.frontend.metrics import error_type
from kvmesh.frontend.observe import X_REQUEST_ID, Observed, observe_http
from kvmesh.frontend.openapi import JSON, SSE, Reply, Route, openapi_document
from kvmesh.frontend.protocol import (
    DONE_EVENT,
    ChatChunkEncoder,
    CreateChatCompletionRequest,
    CreateChatCompletionResponse,
    CreateCompletionRequest,
    CreateCompletionResponse,
    CreateEmbeddingRequest,
    CreateEmbeddingResponse,
    ErrorResponse,
    ListModelsResponse,
    LoadLoraAdapterRequest,
    Model,
    ParsedChatChunkEncoder,
    TextChunkEncoder,
    UnloadLoraAdapterRequest,
    encode_embeddings,
    encode_error_event,
    encode_model,
    encode_models,
    encode_result,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
    parse_lora_request,
)
from kvmesh.frontend.service import CompletionStream, OpenAIService
from kvmesh.runtime.errors import KvmeshError, retry_after_header
from kvmesh.runtime.tls import ServerSslContext
from kvmesh.runtime.tracing import TraceContext

__all__ = [
    "CONFIG_KEY",
    "ROUTES",
    "SERVICE_KEY",
    "abort_streams",
    "build_app",
    "guarded",
    "serve_http",
]

SERVICE_KEY = web.AppKey("kvmesh_openai_service", OpenAIService)
"""Where build_app stores the service in the Application."""
CONFIG_KEY = web.AppKey("kvmesh_frontend_config", FrontendConfig)
"""Where build_app stores the config in the Application."""

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
_SSE_HEADERS = {"Content-Type": SSE, "Cache-Control": "no-cache"}
_CLIENT_CLOSED = 499

Req = TypeVar("Req", ChatCompletionRequest, CompletionRequest)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _EventStreamResponse(web.StreamResponse):
    """A StreamResponse whose headers go out with the first event (one write, not two)."""

    _send_headers_immediately = False


class _EventWriter:
    """Writes the SSE events of one response with one syscall per burst, not per event.

    The first event written since the handler last waited goes out at once (no added latency
    for a token that arrived alone); events that follow in the same step of the handler (the
    backend had several outputs ready) are buffered and sent together as soon as the handler
    waits again (a `call_soon` callback), or with the final write (`take()`). Backpressure:
    when more than 64 KiB were written since the last check, `write` waits for the transport
    to drain. Uses aiohttp's StreamWriter.write(drain=False), which never suspends; with any
    other writer it falls back to one awaited resp.write() per event.
    """

    __slots__ = ("_buffer", "_error", "_in_burst", "_loop", "_resp", "_timeout_s", "_writer")

    _DRAIN_BYTES = 0x10000

    def __init__(
        self, resp: web.StreamResponse, writer: AbstractStreamWriter | None, timeout_s: float
    ) -> None:
        self._resp = resp
        self._timeout_s = timeout_s
        self._writer = writer if isinstance(writer, StreamWriter) else None
        self._loop = asyncio.get_running_loop()
        self._buffer: list[bytes] = []
        self._in_burst = False
        self._error: ConnectionResetError | None = None

    async def write(self, data: bytes) -> None:
        """Send `data` now, or with the rest of the current burst."""
        writer = self._writer
        if writer is None:
            await self._resp.write(data)
            return
        if self._error is not None:
            raise self._error
        if self._in_burst:
            self._buffer.append(data)
            return
        self._in_burst = True
        self._loop.call_soon(self._end_burst)
        _write_now(writer, data)
        if writer.buffer_size > self._DRAIN_BYTES:
            writer.buffer_size = 0
            try:
                await asyncio.wait_for(writer.drain(), self._timeout_s or None)
            except TimeoutError:
                transport = writer.transport
                if transport is not None:
                    transport.abort()
                raise ConnectionResetError("the client stopped reading its stream") from None

    def write_final(self, data: bytes) -> None:
        """Send what is buffered and `data` now, without waiting (a stream cut short: the
        connection closes right after)."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                _write_now(self._writer, self.take() + data)

    def take(self) -> bytes:
        """Buffered bytes not yet sent (the caller sends them with its final write)."""
        if not self._buffer:
            return b""
        data = b"".join(self._buffer)
        self._buffer.clear()
        return data

    def _end_burst(self) -> None:
        self._in_burst = False
        if self._buffer and self._writer is not None:
            try:
                _write_now(self._writer, self.take())
            except ConnectionResetError as exc:  # the handler sees it on its next write
                self._error = exc


def _write_now(writer: StreamWriter, data: bytes) -> None:
    """Run StreamWriter.write(data, drain=False), which completes without suspending."""
    step = writer.write(data, drain=False)
    try:
        step.send(None)
    except StopIteration:
        return
    step.close()
    raise RuntimeError("aiohttp StreamWriter.write(drain=False) suspended")


def _json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type=JSON, headers=headers)


class _Routes:
    """Route handlers bound to one service (no per-request app lookups)."""

    def __init__(self, service: OpenAIService) -> None:
        self.service = service
        self.metrics = service.metrics
        self._openapi: bytes | None = None
        self.streams: set[asyncio.Task[Any]] = set()
        """Handlers streaming a response now (abort_streams)."""
        self.aborting: dict[str, dict[str, str | None]] | None = None
        """Set by abort_streams: the error event the cut streams end with."""

    # -- generation ------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(
            request,
            CHAT_PATH,
            parse_chat_request,
            self.service.chat_completion,
            ChatChunkEncoder,
            "chat",
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(
            request,
            COMPLETIONS_PATH,
            parse_completion_request,
            self.service.completion,
            TextChunkEncoder,
            "text_completion",
        )

    def _observed(self, request: web.Request, route: str) -> Observed:
        return observe_http(self.service, request, _ENDPOINTS[route])

    async def _generate(
        self,
        request: web.Request,
        endpoint: str,
        parse: Callable[[bytes], Req],
        call: Callable[[Req, TraceContext | None], Awaitable[CompletionStream | CompletionResult]],
        encoder_cls: type[ChatChunkEncoder] | type[TextChunkEncoder],
        operation: str,
    ) -> web.StreamResponse:
        obs = self._observed(request, endpoint)
        try:
            parsed = parse(await request.read())
            obs.request(parsed.model, parsed.options, operation, stream=parsed.stream)
            result = await call(parsed, obs.context)
        except web.HTTPException as exc:
            return self._http_error(obs, exc)
        except Exception as exc:
            return self._error(obs, exc)
        except asyncio.CancelledError:
            obs.done(_CLIENT_CLOSED)
            raise
        if isinstance(result, CompletionResult):
            obs.result(result)
            obs.done(200)
            return _json_response(200, encode_result(result), _request_id(obs))
        if result.parsed and encoder_cls is ChatChunkEncoder:
            encoder_cls = ParsedChatChunkEncoder
        encoder = encoder_cls(
            result.id,
            result.created,
            result.model,
            include_usage=parsed.include_usage,
            system_fingerprint=result.system_fingerprint,
        )
        return await self._stream(request, obs, result, encoder, parsed.include_usage)

    async def _stream(
        self,
        request: web.Request,
        obs: Observed,
        stream: CompletionStream,
        encoder: ChatChunkEncoder | TextChunkEncoder,
        include_usage: bool,
    ) -> web.StreamResponse:
        async def body(events: _EventWriter, finish_reasons: list[str]) -> bytes:
            write = events.write
            encode = encoder.delta
            remaining = stream.num_choices
            tail = b""
            async for delta in stream:
                data = encode(delta)
                if delta.finish_reason is not None:
                    finish_reasons.append(delta.finish_reason)
                    remaining -= 1
                    if remaining == 0:
                        tail = data  # coalesced with [DONE] below
                        break
                await write(data)
            if include_usage:
                tail += encoder.usage(stream.usage)
            return tail + DONE_EVENT

        return await self._event_stream(
            request, obs, stream, body, lambda _status, payload: encode_error_event(payload)
        )

    async def _event_stream(
        self,
        request: web.Request,
        obs: Observed,
        stream: CompletionStream,
        body: Callable[[_EventWriter, list[str]], Awaitable[bytes]],
        error_frame: Callable[[int, dict[str, Any]], bytes],
    ) -> web.StreamResponse:
        """Serve `stream` as server-sent events (either door's format): `body` writes the events,
        appends the choices' finish reasons to its list and returns the last bytes, written with
        the end of the response; a failure ends the stream with `error_frame(status, payload)`;
        `obs` counts the request and ends its span."""
        resp = _EventStreamResponse(status=200, headers=_SSE_HEADERS)
        if obs.request_id:
            resp.headers[X_REQUEST_ID] = obs.request_id
        status = 200
        error: str | None = None
        finish_reasons: list[str] = []
        events: _EventWriter | None = None
        task = asyncio.current_task()
        if task is not None:
            self.streams.add(task)  # abort_streams ends it on a forced stop
        try:
            writer = await resp.prepare(request)
            events = _EventWriter(resp, writer, self.service.config.stream_write_timeout_s)
            tail = await body(events, finish_reasons)
            await resp.write_eof(events.take() + tail)
        except ConnectionResetError:
            status = _CLIENT_CLOSED
        except Exception as exc:
            failed, payload = error_from_exception(exc)
            error = error_type(failed)
            pending = events.take() if events is not None else b""
            try:
                await resp.write_eof(pending + error_frame(failed, payload))
            except ConnectionResetError:
                status = _CLIENT_CLOSED
        except asyncio.CancelledError:
            aborting = self.aborting
            if aborting is not None and events is not None:  # cut by abort_streams
                events.write_final(error_frame(503, aborting))
            obs.done(503 if aborting is not None else _CLIENT_CLOSED)
            raise
        finally:
            if task is not None:
                self.streams.discard(task)
            await stream.aclose()
        obs.streamed(stream, finish_reasons)
        obs.done(status, error=error if status == 200 else None)
        return resp

    # -- the Anthropic Messages API -----------------------------------------------------------

    async def messages(self, request: web.Request) -> web.StreamResponse:
        obs = self._observed(request, MESSAGES_PATH)
        try:
            parsed = parse_message_request(await request.read())
            obs.request(parsed.model, parsed.options, "chat", stream=parsed.stream)
            result = await self.service.chat_completion(parsed, obs.context)
        except Exception as exc:
            return self._anthropic_failure(obs, exc)
        except asyncio.CancelledError:
            obs.done(_CLIENT_CLOSED)
            raise
        if isinstance(result, CompletionResult):
            obs.result(result)
            obs.done(200)
            return _json_response(200, encode_message(result), _request_id(obs))
        return await self._message_stream(request, obs, result)

    async def _message_stream(
        self, request: web.Request, obs: Observed, stream: CompletionStream
    ) -> web.StreamResponse:
        encoder = MessageStreamEncoder()

        async def body(events: _EventWriter, finish_reasons: list[str]) -> bytes:
            await events.write(encoder.start(stream.id, stream.model, stream.prompt_tokens(0)))
            async for delta in stream:
                data = encoder.delta(delta)
                if delta.finish_reason is not None:
                    finish_reasons.append(delta.finish_reason)
                    return data + encoder.finish(
                        delta.finish_reason, delta.stop_sequence, stream.completion_tokens(0)
                    )
                if data:
                    await events.write(data)
            return b""

        return await self._event_stream(
            request,
            obs,
            stream,
            body,
            lambda status, payload: error_event(status, str(payload["error"]["message"])),
        )

    async def count_tokens(self, request: web.Request) -> web.Response:
        obs = self._observed(request, COUNT_TOKENS_PATH)
        try:
            parsed = parse_count_tokens_request(await request.read())
            obs.request(parsed.model, None, "chat", stream=False)
            tokens = await self.service.count_chat_tokens(parsed)
        except Exception as exc:
            return self._anthropic_failure(obs, exc)
        except asyncio.CancelledError:
            obs.done(_CLIENT_CLOSED)
            raise
        obs.done(200)
        return _json_response(200, encode_count(tokens), _request_id(obs))

    def _anthropic_failure(self, obs: Observed, exc: Exception) -> web.Response:
        if isinstance(exc, web.HTTPException):
            status, message = exc.status, self._reason(exc)
        else:
            status, payload = error_from_exception(exc)
            message = str(payload["error"]["message"])
        obs.done(status)
        headers = _request_id(obs) or {}
        if status in (429, 503):
            headers["Retry-After"] = "1"
        return _json_response(status, anthropic_error_body(status, message), headers or None)

    async def embeddings(self, request: web.Request) -> web.Response:
        obs = self._observed(request, EMBEDDINGS_PATH)
        try:
            parsed = parse_embedding_request(await request.read())
            obs.request(parsed.model, None, "embeddings", stream=False)
            result = await self.service.embeddings(parsed, obs.context)
        except web.HTTPException as exc:
            return self._http_error(obs, exc)
        except Exception as exc:
            return self._error(obs, exc)
        except asyncio.CancelledError:
            obs.done(_CLIENT_CLOSED)
            raise
        obs.done(200)
        body = encode_embeddings(result, parsed.encoding_format)
        return _json_response(200, body, _request_id(obs))

    # -- LoRA adapters (vLLM's runtime loading API) ----------------------------------------

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        async def load(body: bytes) -> str:
            parsed = parse_lora_request(LoadLoraAdapterRequest, body)
            await self.service.load_lora_adapter(parsed.lora_name, parsed.lora_path, parsed.model)
            return f"Success: LoRA adapter '{parsed.lora_name}' added successfully."

        return await self._lora(request, LOAD_LORA_PATH, load)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        async def unload(body: bytes) -> str:
            parsed = parse_lora_request(UnloadLoraAdapterRequest, body)
            await self.service.unload_lora_adapter(parsed.lora_name)
            return f"Success: LoRA adapter '{parsed.lora_name}' removed successfully."

        return await self._lora(request, UNLOAD_LORA_PATH, unload)

    async def _lora(
        self, request: web.Request, path: str, act: Callable[[bytes], Awaitable[str]]
    ) -> web.Response:
        """Run a load/unload on the request body; vLLM's plain-text answer on success."""
        obs = self._observed(request, path)
        try:
            text = await act(await request.read())
        except web.HTTPException as exc:
            return self._http_error(obs, exc)
        except Exception as exc:
            return self._error(obs, exc)
        except asyncio.CancelledError:
            obs.done(_CLIENT_CLOSED)
            raise
        obs.done(200)
        return web.Response(text=text, content_type="text/plain")

    # -- errors ----------------------------------------------------------------------------

    def _error(self, obs: Observed, exc: Exception) -> web.Response:
        status, payload = error_from_exception(exc)
        obs.done(status)
        headers = _request_id(obs) or {}
        headers.update(retry_after_header(status, exc) or {})
        return _json_response(status, orjson.dumps(payload), headers or None)

    def _http_error(self, obs: Observed, exc: web.HTTPException) -> web.Response:
        status = exc.status
        obs.done(status)
        return _json_response(status, error_body(status, self._reason(exc)), _request_id(obs))

    def _reason(self, exc: web.HTTPException) -> str:
        if exc.status == 413:
            return f"request body too large (limit {self._max_bytes()} bytes)"
        return exc.reason

    def _max_bytes(self) -> int:
        return self.service.config.max_request_bytes

    # -- other endpoints -------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        body = encode_models(self.service.models(), int(time.time()))
        return _json_response(200, body)

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        body = encode_model(self.service.models(), name, int(time.time()))
        if body is not None:
            return _json_response(200, body)
        return _json_response(
            404,
            error_body(404, f"The model `{name}` does not exist.", param="model",
                       code="model_not_found"),
        )  # fmt: skip

    async def health(self, request: web.Request) -> web.Response:
        service = self.service
        if service.ready():
            return _json_response(200, _OK)
        state = "draining" if service.draining else "no ready worker"
        return _json_response(503, msgspec.json.encode(Health(state)))

    async def live(self, request: web.Request) -> web.Response:
        return _json_response(200, _ALIVE)

    async def openapi(self, request: web.Request) -> web.Response:
        if self._openapi is None:
            self._openapi = orjson.dumps(openapi_document(ROUTES))
        return _json_response(200, self._openapi)

    async def metrics_text(self, request: web.Request) -> web.Response:
        resp = web.Response(status=200, body=await self.metrics.exposition())
        resp.headers["Content-Type"] = METRICS_CONTENT_TYPE
        return resp

    async def method_not_allowed(self, request: web.Request) -> web.Response:
        return _json_response(
            405,
            error_body(405, f"method {request.method} is not allowed on {request.path}"),
            {"Allow": ", ".join(_allowed_methods(request))},
        )

    async def not_found(self, request: web.Request) -> web.Response:
        return _json_response(404, error_body(404, f"no route for {request.path}"))


_ENDPOINTS = {
    CHAT_PATH: "chat_completions",
    COMPLETIONS_PATH: "completions",
    EMBEDDINGS_PATH: "embeddings",
    MESSAGES_PATH: "messages",
    COUNT_TOKENS_PATH: "count_tokens",
    LOAD_LORA_PATH: "load_lora_adapter",
    UNLOAD_LORA_PATH: "unload_lora_adapter",
}
"""The metrics' endpoint label of each OpenAI route (Dynamo's values)."""


def _request_id(obs: Observed) -> dict[str, str] | None:
    """The x-request-id response header (the client's), if it sent one."""
    return {X_REQUEST_ID: obs.request_id} if obs.request_id else None


def _allowed_methods(request: web.Request) -> list[str]:
    resource = request.match_info.route.resource
    if resource is None:
        return []
    return sorted(r.method for r in resource if r.method != "*")


class Health(msgspec.Struct):
    """Gateway health: "ok" / "alive", or why it is not ready."""

    status: str


_OK = msgspec.json.encode(Health("ok"))
_ALIVE = msgspec.json.encode(Health("alive"))
_ERRORS = {
    400: "Invalid request, or prompt (plus max_tokens) over the context window",
    404: "Unknown model or route",
    413: "Request body too large",
    429: "Overloaded",
    501: "Not implemented by the backend",
    503: "No worker available, or draining",
}


def _replies(ok: Reply, *errors: int) -> dict[int, Reply]:
    return {200: ok, **{s: Reply(ErrorResponse, _ERRORS[s]) for s in errors}}


def _anthropic_replies(ok: Reply, *errors: int) -> dict[int, Reply]:
    return {200: ok, **{s: Reply(AnthropicErrorResponse, _ERRORS[s]) for s in errors}}


_GENERATION_ERRORS = (400, 404, 413, 429, 503)
_CHAT = Reply(
    CreateChatCompletionResponse, "A chat.completion, or chat.completion.chunk events", (JSON, SSE)
)
_TEXT = Reply(CreateCompletionResponse, "A text_completion, or text_completion events", (JSON, SSE))
_HEALTH = {200: Reply(Health, "Ready"), 503: Reply(Health, "Not ready")}
OPENAI_ROUTES: tuple[Route, ...] = (
    Route(CHAT_PATH, "POST", _Routes.chat, "Chat completion (stream: Server-Sent Events)",
          _replies(_CHAT, *_GENERATION_ERRORS), CreateChatCompletionRequest),
    Route(COMPLETIONS_PATH, "POST", _Routes.completions,
          "Text completion (stream: Server-Sent Events)",
          _replies(_TEXT, *_GENERATION_ERRORS), CreateCompletionRequest),
    Route(EMBEDDINGS_PATH, "POST", _Routes.embeddings,
          "Embeddings (engines with the EMBEDDINGS capability)",
          _replies(Reply(CreateEmbeddingResponse, "One vector per input"), *_GENERATION_ERRORS,
                   501),
          CreateEmbeddingRequest),
    Route(MESSAGES_PATH, "POST", _Routes.messages,
          "Anthropic Messages API (stream: Server-Sent Events); Anthropic-shaped errors",
          _anthropic_replies(Reply(MessageResponse, "A message, or its events", (JSON, SSE)),
                             *_GENERATION_ERRORS),
          CreateMessageRequest),
    Route(COUNT_TOKENS_PATH, "POST", _Routes.count_tokens,
          "Anthropic Messages API: prompt tokens of a request",
          _anthropic_replies(Reply(CountTokensResponse, "The count"), 400, 404, 413),
          CountTokensRequest),
    Route("/v1/models", "GET", _Routes.models, "Models served now",
          _replies(Reply(ListModelsResponse, "Model list"))),
    Route("/v1/models/{model}", "GET", _Routes.model, "One model",
          _replies(Reply(Model, "The model"), 404)),
    Route(LOAD_LORA_PATH, "POST", _Routes.load_lora_adapter,
          "Load a LoRA adapter on the workers of its base model (vLLM's API)",
          _replies(Reply(str, "Loaded", ("text/plain",)), 400, 404, 413, 501, 503),
          LoadLoraAdapterRequest),
    Route(UNLOAD_LORA_PATH, "POST", _Routes.unload_lora_adapter,
          "Unload a LoRA adapter from every worker (vLLM's API)",
          _replies(Reply(str, "Unloaded", ("text/plain",)), 400, 404, 413, 501, 503),
          UnloadLoraAdapterRequest),
    Route("/health", "GET", _Routes.health, "Readiness", _HEALTH),
    Route("/live", "GET", _Routes.live, "Liveness", {200: Reply(Health, "Alive")}),
    Route("/metrics", "GET", _Routes.metrics_text, "Prometheus metrics",
          {200: Reply(str, "Text exposition", ("text/plain",))}),
    Route("/openapi.json", "GET", _Routes.openapi, "This document",
          {200: Reply(dict[str, Any], "OpenAPI 3.1")}),
)  # fmt: skip
ROUTES: tuple[Route, ...] = (*OPENAI_ROUTES, *KSERVE_ROUTES)
"""Every route of the gateway, in registration order (see build_app)."""


def _bound(routes: Sequence[Route], owner: object) -> list[tuple[Route, Handler]]:
    return [(r, functools.partial(r.handler, owner)) for r in routes]


ROUTES_KEY = web.AppKey("kvmesh_openai_routes", _Routes)


def abort_streams(app: web.Application, message: str) -> int:
    """End every event stream `app` is sending now (OpenAI or Anthropic) with an error event
    in its door's format (503, `message`); returns how many. For a drain that timed out or a
    forced stop, before the runner's cleanup closes the connections."""
    routes = app[ROUTES_KEY]
    routes.aborting = error_payload(message, "service_unavailable")
    streams = list(routes.streams)
    for task in streams:
        task.cancel()
    return len(streams)


def build_app(
    service: OpenAIService,
    config: FrontendConfig | None = None,
    auth: GatewayAuth | None = None,
) -> web.Application:
    """The aiohttp Application serving `service` (config defaults to `service.config`).

    `auth` (API keys, rate limits; see `guarded`) guards every /v1 and /v2 route but the
    KServe health probes, and /metrics with --protect-metrics; None: open doors."""
    config = config if config is not None else service.config
    app = web.Application(client_max_size=config.max_request_bytes)
    app[SERVICE_KEY] = service
    app[CONFIG_KEY] = config
    routes = _Routes(service)
    app[ROUTES_KEY] = routes
    table = _bound(OPENAI_ROUTES, routes) + _bound(KSERVE_ROUTES, KServeRoutes(service))
    for route, handler in table:
        if auth is not None and _protected(route.path, auth):
            handler = guarded(handler, auth, route.path, service)
        resource = app.router.add_resource(route.path)
        resource.add_route(route.method, handler)
        if route.method == "GET":
            resource.add_route("HEAD", handler)
        resource.add_route("*", routes.method_not_allowed)
    # [\s\S]: also paths with a (percent-encoded) newline, which "." does not match.
    app.router.add_route("*", r"/{tail:[\s\S]*}", routes.not_found)
    if auth is not None and auth.limited:
        app.on_response_prepare.append(_add_rate_limit_headers)
    return app


_RATE_HEADERS = web.RequestKey("kvmesh_rate_limit_headers", dict)


def _protected(path: str, auth: GatewayAuth) -> bool:
    if path.startswith("/v2/health/"):
        return False  # KServe's probes, like /health and /live
    return path.startswith(("/v1/", "/v2")) or (path == "/metrics" and auth.protect_metrics)


def guarded(handler: Handler, auth: GatewayAuth, endpoint: str, service: OpenAIService) -> Handler:
    """`handler` behind the gateway's API keys: a missing or unknown `Authorization: Bearer`
    key gets an OpenAI-shaped 401, a key over its rate limit a 429 (with x-ratelimit-*
    headers, which every answer to a limited key carries). The Anthropic routes (/v1/messages)
    also take the key from `x-api-key` and answer Anthropic-shaped errors."""

    anthropic = endpoint.startswith(MESSAGES_PATH)

    async def guard(request: web.Request) -> web.StreamResponse:
        try:
            headers = request.headers
            authorization = headers.get("Authorization")
            if anthropic and not authorization and headers.get("x-api-key"):
                authorization = "Bearer " + headers["x-api-key"]  # Anthropic clients' header
            key = auth.check(authorization)
            if auth.limited:
                tokens = 0
                if auth.tpm and request.method == "POST":
                    try:
                        tokens = estimate_tokens(await request.read())
                    except web.HTTPException:
                        tokens = 0  # too large: the handler answers 413
                request[_RATE_HEADERS] = auth.admit(key, tokens)
        except KvmeshError as exc:
            status, payload = error_from_exception(exc)
            observe_http(service, request, endpoint).done(status)  # counted and traced
            reply_headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            if status == 429:
                reply_headers = {**getattr(exc, "headers", {}), "Retry-After": "1"}
            body = anthropic_error_body(status, exc.message) if anthropic else orjson.dumps(payload)
            return _json_response(status, body, reply_headers)
        return await handler(request)

    return guard


async def _add_rate_limit_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
    headers = request.get(_RATE_HEADERS) if isinstance(request, web.Request) else None
    if headers:
        response.headers.update(headers)


async def serve_http(
    app: web.Application,
    host: str,
    port: int,
    *,
    tls: ServerSslContext | None = None,
    reuse_port: bool = False,
    **runner_kwargs: Any,
) -> tuple[web.AppRunner, int]:
    """Start serving `app` on host:port (0 = any free port); return (runner, bound port).

    Stop with `await runner.cleanup()`. Backlog and keep-alive come from the app's
    FrontendConfig. `tls`: serve HTTPS (certificates reloaded when their files change).
    `reuse_port`: bind with SO_REUSEPORT, beside the other processes of a gateway group.
    `runner_kwargs` go to web.AppRunner.
    """
    config = app.get(CONFIG_KEY) or FrontendConfig()
    kwargs: dict[str, Any] = {
        "access_log": None,
        "handler_cancellation": True,
        "keepalive_timeout": config.keepalive_timeout_s,
    }
    kwargs.update(runner_kwargs)
    runner = web.AppRunner(app, **kwargs)
    await runner.setup()
    ssl_context = tls.context if tls is not None else None
    site = web.TCPSite(
        runner,
        host,
        port,
        backlog=config.backlog,
        ssl_context=ssl_context,
        reuse_port=reuse_port or None,
    )
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    if config.send_buffer_bytes:
        # Accepted connections inherit the listening socket's fixed send buffer (Linux), at no
        # cost per request. aiohttp keeps the asyncio Server in the site's `_server`.
        server = getattr(site, "_server", None)
        for sock in getattr(server, "sockets", None) or ():
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.send_buffer_bytes)
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, int(bound)
