"""KServe v2 REST transport (Open Inference Protocol over HTTP), on the gateway's HTTP port.

Routes (`KSERVE_ROUTES`; each model route also under /v2/models/{name}/versions/{version}/...):

- GET  /v2/health/live, /v2/health/ready       server liveness / readiness (200, else 503)
- GET  /v2                                      server metadata
- GET  /v2/models/{name}                        model metadata
- GET  /v2/models/{name}/ready                  model readiness (200, 503, 404 if unknown)
- GET  /v2/models/{name}/config                 Triton model configuration (decoupled)
- POST /v2/models/{name}/infer                  inference: JSON, or Triton's binary tensor
                                                extension (Inference-Header-Content-Length)
- POST /v2/models/{name}/generate               Triton generate extension (JSON in and out)
- POST /v2/models/{name}/generate_stream        the same, streamed as Server-Sent Events
- POST /v2/repository/index                     the models served (Triton)

Thin like the other transports: decode into kvmesh.frontend.kserve's typed messages, call
`OpenAIService.completion` (or ready / model_info), encode. Infer bodies are declared as msgspec
Structs (`InferenceRequest`, ...) and decoded by kvmesh.frontend.decoding, like the OpenAI
bodies; the generate extension's body is one key per input tensor (`GenerateRequest` is built
from kvmesh.frontend.kserve.INPUT_TYPES). Errors are the protocol's `{"error": "<message>"}`
with the HTTP status of the domain exception.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from kvmesh.frontend import kserve
from kvmesh.frontend.dataplane import CompletionResult
from kvmesh.frontend.decoding import Refusals, decode, load_object
from kvmesh.frontend.kserve import InferRequest, InferResponse, ParamValue, Tensor
from kvmesh.frontend.metrics import error_type
from kvmesh.frontend.observe import X_REQUEST_ID, Observed, observe_http
from kvmesh.frontend.openapi import JSON, SSE, Reply, Route
from kvmesh.frontend.service import CompletionStream, OpenAIService
from kvmesh.runtime.errors import InvalidRequest, KvmeshError, NotFound, retry_after_header

__all__ = ["KSERVE_ROUTES", "KServeRoutes"]

_log = logging.getLogger("kvmesh.frontend.kserve")
HEADER_LENGTH = "Inference-Header-Content-Length"
_SSE_HEADERS = {"Content-Type": SSE, "Cache-Control": "no-cache"}
_encode = msgspec.json.encode

# --------------------------------------------------------------------------------------------
# Schemas

Parameters = dict[str, ParamValue | None]
"""Request parameters (null values are dropped)."""


class RequestInput(Struct):
    """An input tensor. Its elements are `data` (nested or flat, row-major), or follow the JSON
    header in binary when `parameters.binary_data_size` is set."""

    name: str
    datatype: Annotated[str, Meta(extra_json_schema={"enum": sorted(kserve.DATATYPES)})]
    shape: list[int]
    parameters: Parameters | None = None
    data: Any = None


class RequestOutput(Struct):
    """A requested output (`parameters.binary_data`: return it in binary)."""

    name: str
    parameters: Parameters | None = None


class InferenceRequest(Struct, kw_only=True):
    """POST /v2/models/{model}/infer."""

    id: str = ""
    parameters: Parameters | None = None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(Struct, omit_defaults=True):
    """An output tensor: `data`, or `parameters.binary_data_size` bytes after the JSON."""

    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, ParamValue] | None = None
    data: list[Any] | None = None


class InferenceResponse(Struct, kw_only=True, omit_defaults=True):
    """The outputs of an inference."""

    model_name: str
    model_version: str
    id: str = ""
    parameters: dict[str, ParamValue] | None = None
    outputs: list[ResponseOutput]


class InferenceErrorResponse(Struct):
    """The body of every KServe error."""

    error: str


class Live(Struct):
    """Server liveness."""

    live: bool


class Ready(Struct):
    """Server readiness."""

    ready: bool


class ModelReady(Struct):
    """Model readiness."""

    name: str
    ready: bool


class RepositoryModel(Struct):
    """A model of the repository index."""

    name: str
    version: str
    state: str


GenerateRequest = msgspec.defstruct(
    "GenerateRequest",
    [
        ("id", str, ""),
        ("parameters", Parameters | None, None),
        *((name, tp | None, None) for name, tp in kserve.INPUT_TYPES.items()),
    ],
    kw_only=True,
)
"""Triton generate extension: one key per input tensor (text_input or input_ids required)."""
GenerateResponse = msgspec.defstruct(
    "GenerateResponse",
    [
        ("model_name", str),
        ("model_version", str),
        ("id", str, ""),
        *((name, tp | None, None) for name, tp in kserve.OUTPUT_TYPES.items()),
        ("parameters", dict[str, ParamValue] | None, None),
    ],
    kw_only=True,
)
"""Triton generate extension: one key per output tensor (a scalar when it has one element)."""

# --------------------------------------------------------------------------------------------
# JSON <-> typed messages


def _error(exc: BaseException) -> tuple[int, InferenceErrorResponse]:
    if isinstance(exc, KvmeshError):
        return exc.http_status, InferenceErrorResponse(exc.message)
    _log.error("internal error in a KServe REST request", exc_info=exc)
    return 500, InferenceErrorResponse("internal error")


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=_encode(body), content_type=JSON, headers=headers)


def _flatten(data: Any, out: list[Any]) -> None:
    if isinstance(data, list):
        for item in data:
            _flatten(item, out)
    else:
        out.append(data)


def _check_elements(name: str, datatype: str, data: list[Any]) -> list[Any]:
    """JSON tensor elements as the datatype expects (BYTES as bytes)."""
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in data):
            raise InvalidRequest(f"input '{name}' (BYTES) must hold strings")
        return [v.encode() for v in data]
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in data):
            raise InvalidRequest(f"input '{name}' (BOOL) must hold booleans")
        return data
    if datatype in ("FP16", "FP32", "FP64", "BF16"):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in data):
            raise InvalidRequest(f"input '{name}' ({datatype}) must hold numbers")
        return data
    if datatype in kserve.DATATYPES:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in data):
            raise InvalidRequest(f"input '{name}' ({datatype}) must hold integers")
        return data
    raise InvalidRequest(f"input '{name}' has unknown datatype {datatype!r}")


def _params(raw: Any, where: str) -> dict[str, ParamValue]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} 'parameters' must be an object")
    out: dict[str, ParamValue] = {}
    for key, value in raw.items():
        if isinstance(value, (bool, int, float, str)):
            out[key] = value
        elif value is not None:
            raise InvalidRequest(f"parameter '{key}' must be a boolean, number or string")
    return out


def _inputs_error(value: Any) -> None:
    """The first problem of an `inputs` list msgspec refused."""
    if not isinstance(value, list) or not all(isinstance(i, dict) for i in value):
        raise InvalidRequest("'inputs' must be a list of tensor objects")
    for item in value:
        name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise InvalidRequest("every input needs a string 'name' and 'datatype'")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise InvalidRequest(f"input '{name}' needs a 'shape' list of integers")
        _params(item.get("parameters"), f"input '{name}'")


def _outputs_error(value: Any) -> None:
    """The first problem of an `outputs` list msgspec refused."""
    if not isinstance(value, list) or not all(isinstance(o, dict) for o in value):
        raise InvalidRequest("'outputs' must be a list of objects")
    for out in value:
        name = out.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("every requested output needs a string 'name'")
        _params(out.get("parameters"), f"output '{name}'")


def _id_error(value: Any) -> None:
    raise InvalidRequest("'id' must be a string")


_REFUSALS: Refusals = {
    "inputs": _inputs_error,
    "id": _id_error,
    "parameters": lambda v: _params(v, "request"),
    "outputs": _outputs_error,
}


def _infer(
    b: InferenceRequest, binary: bytes, model: str, version: str
) -> tuple[InferRequest, bool, set[str]]:
    raw_inputs = b.inputs
    request_id = b.id
    inputs: list[Tensor] = []
    offset = 0
    for item in raw_inputs:
        name, datatype, shape = item.name, item.datatype, item.shape
        raw_size = _params(item.parameters, f"input '{name}'").get("binary_data_size")
        if raw_size is not None:
            if isinstance(raw_size, bool) or not isinstance(raw_size, int) or raw_size < 0:
                raise InvalidRequest(f"input '{name}' has an invalid binary_data_size")
            if offset + raw_size > len(binary):
                raise InvalidRequest(f"binary data of input '{name}' is missing")
            elements = kserve.decode_raw(datatype, binary[offset : offset + raw_size], shape, name)
            offset += raw_size
        else:
            flat: list[Any] = []
            _flatten(item.data, flat)
            count = kserve.element_count(shape, name)
            if len(flat) != count:
                raise InvalidRequest(
                    f"input '{name}' has {len(flat)} elements but its shape {shape} needs {count}"
                )
            elements = _check_elements(name, datatype, flat)
        inputs.append(Tensor(name, datatype, shape, elements))
    request_params = _params(b.parameters, "request")
    outputs: list[str] = []
    binary_outputs: set[str] = set()
    for out in b.outputs or ():
        outputs.append(out.name)
        if _params(out.parameters, f"output '{out.name}'").get("binary_data") is True:
            binary_outputs.add(out.name)
    return (
        InferRequest(model, version, request_id, request_params, inputs, outputs),
        request_params.get("binary_data_output") is True,
        binary_outputs,
    )


def decode_infer(
    body: bytes, header_length: str | None, model: str, version: str
) -> tuple[InferRequest, bool, set[str]]:
    """(request, binary output for all, outputs wanting binary) of a REST infer body."""
    binary = b""
    if header_length is not None:
        try:
            size = int(header_length)
        except ValueError:
            raise InvalidRequest(f"{HEADER_LENGTH} is not a number") from None
        if not 0 <= size <= len(body):
            raise InvalidRequest(f"{HEADER_LENGTH} is out of range")
        body, binary = body[:size], body[size:]
    return decode(
        InferenceRequest,
        load_object(body),
        lambda b: _infer(b, binary, model, version),
        _REFUSALS,
    )


def _json_data(tensor: Tensor) -> list[Any]:
    if tensor.datatype == "BYTES":
        return [b.decode("utf-8", "replace") for b in tensor.data]
    return list(tensor.data)


def encode_infer(
    resp: InferResponse, binary_all: bool, binary_outputs: set[str]
) -> tuple[bytes, int | None]:
    """(body, JSON header length or None) of a REST infer response."""
    outputs: list[ResponseOutput] = []
    tail: list[bytes] = []
    for tensor in resp.outputs:
        out = ResponseOutput(tensor.name, tensor.datatype, tensor.shape)
        if binary_all or tensor.name in binary_outputs:
            raw = kserve.encode_raw(tensor)
            out.parameters = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            out.data = _json_data(tensor)
        outputs.append(out)
    header = _encode(
        InferenceResponse(
            model_name=resp.model,
            model_version=resp.version,
            id=resp.id,
            parameters=resp.parameters or None,
            outputs=outputs,
        )
    )
    if not tail:
        return header, None
    return header + b"".join(tail), len(header)


def decode_generate(body: bytes, model: str, version: str) -> InferRequest:
    """A Triton generate-extension body: every key but `id` / `parameters` is an input."""
    data = load_object(body)
    request_id = data.get("id", "")
    if not isinstance(request_id, str):
        _id_error(request_id)
    inputs: list[Tensor] = []
    for name, value in data.items():
        if name in ("id", "parameters"):
            continue
        inputs.append(_generate_input(name, value))
    return InferRequest(
        model, version, request_id, _params(data.get("parameters"), "request"), inputs
    )


def _generate_input(name: str, value: Any) -> Tensor:
    if isinstance(value, str):
        return Tensor(name, "BYTES", [1], [value.encode()])
    if isinstance(value, bool):
        return Tensor(name, "BOOL", [1], [value])
    if isinstance(value, int):
        return Tensor(name, "INT64", [1], [value])
    if isinstance(value, float):
        return Tensor(name, "FP64", [1], [value])
    if isinstance(value, list):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return Tensor(name, "INT64", [len(value)], list(value))
        if all(isinstance(v, str) for v in value):
            return Tensor(name, "BYTES", [len(value)], [v.encode() for v in value])
    raise InvalidRequest(f"'{name}' must be a string, number, boolean or a list of them")


def encode_generate(resp: InferResponse) -> dict[str, Any]:
    """Triton generate-extension JSON: one key per output (a scalar when it has one element)."""
    body: dict[str, Any] = {"model_name": resp.model, "model_version": resp.version}
    if resp.id:
        body["id"] = resp.id
    for tensor in resp.outputs:
        values = _json_data(tensor)
        body[tensor.name] = (
            values[0] if len(values) == 1 and tensor.name != "output_ids" else values
        )
    if resp.parameters:
        body["parameters"] = resp.parameters
    return body


# --------------------------------------------------------------------------------------------
# Routes


class KServeRoutes:
    """Route handlers of the KServe v2 REST API over one OpenAIService."""

    def __init__(self, service: OpenAIService) -> None:
        self.service = service
        self.metrics = service.metrics

    # -- health and metadata ---------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        return _json(200, Live(True))

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.service.ready()
        return _json(200 if ready else 503, Ready(ready))

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json(200, kserve.SERVER_METADATA)

    async def repository_index(self, request: web.Request) -> web.Response:
        models = [
            RepositoryModel(m.served_model_name, kserve.MODEL_VERSION, "READY")
            for m in self.service.models()
        ]
        return _json(200, models)

    def _model(self, request: web.Request) -> tuple[str, Any]:
        name = request.match_info["model"]
        version = request.match_info.get("version", "")
        info = self.service.model_info(name)
        if info is None:
            raise NotFound(f"model {name!r} does not exist", param="model")
        kserve.check_version(name, version)
        return name, info

    async def model_metadata(self, request: web.Request) -> web.Response:
        try:
            name, info = self._model(request)
        except KvmeshError as exc:
            return _json(*_error(exc))
        return _json(200, kserve.model_metadata(info, name))

    async def model_config(self, request: web.Request) -> web.Response:
        try:
            name, info = self._model(request)
        except KvmeshError as exc:
            return _json(*_error(exc))
        return _json(200, kserve.model_config(info, name))

    async def model_ready(self, request: web.Request) -> web.Response:
        try:
            name, _ = self._model(request)
        except KvmeshError as exc:
            return _json(*_error(exc))
        ready = self.service.model_ready(name)
        return _json(200 if ready else 503, ModelReady(name, ready))

    # -- inference -------------------------------------------------------------------------

    def _names(self, request: web.Request) -> tuple[str, str]:
        return request.match_info["model"], request.match_info.get("version", "")

    async def _complete(
        self, obs: Observed, infer: InferRequest, *, stream: bool
    ) -> tuple[kserve.GenerationCall, CompletionStream | CompletionResult]:
        call = kserve.to_generation(infer, allow_stream=stream)
        if stream:
            call.request.stream = call.stream = True
        request = call.request
        obs.request(request.model, request.options, "text_completion", stream=stream)
        return call, await self.service.completion(request, obs.context)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        obs = observe_http(self.service, request, "kserve_infer")
        try:
            model, version = self._names(request)
            infer, binary_all, binary_outputs = decode_infer(
                await request.read(), request.headers.get(HEADER_LENGTH), model, version
            )
            if kserve.wants_embedding(infer):
                embedding = kserve.to_embedding(infer)
                obs.request(embedding.model, None, "embeddings", stream=False)
                embedded = await self.service.embeddings(embedding, obs.context)
                resp = kserve.embedding_response(embedded, model, infer.id)
            else:
                call, result = await self._complete(obs, infer, stream=False)
                assert isinstance(result, CompletionResult)
                obs.result(result)
                resp = kserve.InferEncoder(call, model, infer.id).result(result)
            body, header_length = encode_infer(resp, binary_all, binary_outputs)
        except web.HTTPException as exc:
            return self._http_fail(obs, exc)
        except Exception as exc:
            return self._fail(obs, exc)
        except asyncio.CancelledError:
            obs.done(499)
            raise
        obs.done(200)
        headers = _request_id(obs)
        if header_length is None:
            return web.Response(status=200, body=body, content_type=JSON, headers=headers)
        headers["Content-Type"] = "application/octet-stream"
        headers[HEADER_LENGTH] = str(header_length)
        return web.Response(status=200, body=body, headers=headers)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        obs = observe_http(self.service, request, "kserve_generate")
        try:
            model, version = self._names(request)
            infer = decode_generate(await request.read(), model, version)
            call, result = await self._complete(obs, infer, stream=False)
            assert isinstance(result, CompletionResult)
            resp = kserve.InferEncoder(call, model, infer.id).result(result)
        except web.HTTPException as exc:
            return self._http_fail(obs, exc)
        except Exception as exc:
            return self._fail(obs, exc)
        except asyncio.CancelledError:
            obs.done(499)
            raise
        obs.result(result)
        obs.done(200)
        return _json(200, encode_generate(resp), _request_id(obs))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        obs = observe_http(self.service, request, "kserve_generate_stream")
        try:
            model, version = self._names(request)
            infer = decode_generate(await request.read(), model, version)
            call, result = await self._complete(obs, infer, stream=True)
        except web.HTTPException as exc:
            return self._http_fail(obs, exc)
        except Exception as exc:
            return self._fail(obs, exc)
        except asyncio.CancelledError:
            obs.done(499)
            raise
        assert isinstance(result, CompletionStream)
        encoder = kserve.InferEncoder(call, model, infer.id)
        resp = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **_request_id(obs)})
        status = 200
        error: str | None = None
        finish_reasons: list[str] = []
        try:
            await resp.prepare(request)
            async for delta in result:
                if delta.finish_reason is not None:
                    finish_reasons.append(delta.finish_reason)
                event = encoder.delta(delta, result.prompt_tokens(0), result.completion_tokens(0))
                await resp.write(b"data: " + _encode(encode_generate(event)) + b"\n\n")
            if call.empty_final:
                final = encode_generate(encoder.final())
                await resp.write(b"data: " + _encode(final) + b"\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            status = 499
        except Exception as exc:
            failed, payload = _error(exc)
            error = error_type(failed)
            try:
                await resp.write_eof(b"data: " + _encode(payload) + b"\n\n")
            except ConnectionResetError:
                status = 499
        except asyncio.CancelledError:
            obs.done(499)
            raise
        finally:
            await result.aclose()
        obs.streamed(result, finish_reasons)
        obs.done(status, error=error if status == 200 else None)
        return resp

    def _http_fail(self, obs: Observed, exc: web.HTTPException) -> web.Response:
        obs.done(exc.status)
        message = "request body too large" if exc.status == 413 else exc.reason
        return _json(exc.status, InferenceErrorResponse(message), _request_id(obs))

    def _fail(self, obs: Observed, exc: BaseException) -> web.Response:
        status, payload = _error(exc)
        obs.done(status)
        headers = _request_id(obs)
        headers.update(retry_after_header(status, exc) or {})
        return _json(status, payload, headers)


def _request_id(obs: Observed) -> dict[str, str]:
    """The x-request-id response header (the client's), if it sent one."""
    return {X_REQUEST_ID: obs.request_id} if obs.request_id else {}


# -- the route table ---------------------------------------------------------------------------

_ERRORS = {
    400: "Invalid inference request, or prompt (plus max_tokens) over the context window",
    404: "Unknown model or version",
    413: "Request body too large",
    429: "Overloaded",
    503: "No worker available, or draining",
}


def _replies(*replies: tuple[int, Reply], errors: tuple[int, ...] = ()) -> dict[int, Reply]:
    return {**dict(replies), **{s: Reply(InferenceErrorResponse, _ERRORS[s]) for s in errors}}


def _model_routes() -> list[Route]:
    """The /v2/models/{model}[/versions/{version}]/... routes. Model names may contain "/": the
    routes with a suffix come first (aiohttp tries dynamic routes in registration order)."""
    generation = (400, 404, 413, 429, 503)
    suffixes = [
        (
            "/ready",
            "GET",
            KServeRoutes.model_ready,
            "Model readiness",
            _replies((200, Reply(ModelReady, "Ready")), (503, Reply(ModelReady, "Not ready")),
                     errors=(404,)),
            None,
        ),
        (
            "/config",
            "GET",
            KServeRoutes.model_config,
            "Triton model configuration",
            _replies((200, Reply(dict[str, Any], "Configuration")), errors=(404,)),
            None,
        ),
        (
            "/infer",
            "POST",
            KServeRoutes.infer,
            "Inference (JSON; Triton's binary tensor extension is also accepted)",
            _replies(
                (200, Reply(InferenceResponse, "Outputs", (JSON, "application/octet-stream"))),
                errors=generation,
            ),
            InferenceRequest,
        ),
        (
            "/generate",
            "POST",
            KServeRoutes.generate,
            "Triton generate extension",
            _replies((200, Reply(GenerateResponse, "Generated text")), errors=generation),
            GenerateRequest,
        ),
        (
            "/generate_stream",
            "POST",
            KServeRoutes.generate_stream,
            "Triton generate extension, streamed as Server-Sent Events",
            _replies(
                (200, Reply(GenerateResponse, "data: {generate response} events", (SSE,))),
                errors=generation,
            ),
            GenerateRequest,
        ),
        (
            "",
            "GET",
            KServeRoutes.model_metadata,
            "Model metadata",
            _replies((200, Reply(kserve.ModelMetadataResponse, "Metadata")), errors=(404,)),
            None,
        ),
    ]  # fmt: skip
    model, version = r"/v2/models/{model:[\s\S]+}", "/versions/{version:[^/]+}"
    routes: list[Route] = []
    for suffix, method, handler, summary, replies, body in suffixes:
        for prefix in (model + version, model):
            routes.append(Route(prefix + suffix, method, handler, summary, replies, body))
    return routes


KSERVE_ROUTES: tuple[Route, ...] = (
    Route("/v2/health/live", "GET", KServeRoutes.live, "KServe server liveness",
          {200: Reply(Live, "Alive")}),
    Route("/v2/health/ready", "GET", KServeRoutes.ready, "KServe server readiness",
          {200: Reply(Ready, "Ready"), 503: Reply(Ready, "Not ready")}),
    Route("/v2", "GET", KServeRoutes.server_metadata, "KServe server metadata",
          {200: Reply(kserve.ServerMetadataResponse, "Metadata")}),
    Route("/v2/repository/index", "POST", KServeRoutes.repository_index,
          "Models served (Triton repository index)",
          {200: Reply(list[RepositoryModel], "Models")}),
    *_model_routes(),
)  # fmt: skip
"""The KServe v2 REST routes, in registration order (kvmesh.frontend.app adds them)."""
