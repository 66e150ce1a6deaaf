"""KServe v2 gRPC transport: `inference.GRPCInferenceService` over the OpenAIService.

Thin: each RPC decodes protobuf into kvmesh.frontend.kserve's typed messages, calls one method
of the same `OpenAIService` the OpenAI routes use (`completion`, `ready`, `model_info`), and
encodes the result. Output tensors always travel in `raw_output_contents` (tritonclient reads
them from there), inputs in either `contents` or `raw_input_contents`.

Errors: unary RPCs end with a gRPC status (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED,
UNAVAILABLE, INTERNAL without details); on ModelStreamInfer a failing request gets one response
with `error_message` (and its id) and the stream stays open. Requests on one stream run
concurrently; their responses interleave and are matched by `id`. Closing the stream (or
cancelling the call) cancels every request still running on it.

Importing this module registers the `inference.*` protobuf symbols, exactly as tritonclient's
generated modules do, so it cannot share a Python process with `tritonclient.grpc` (protobuf
refuses duplicate symbols; KServe and MLServer have the same clash). Only the frontend process
imports it (lazily, in kvmesh.frontend.main); tests run it in a subprocess (tests/fake_gateway.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvmesh.api.kserve.v2 import grpc_predict_v2_pb2 as pb
from kvmesh.api.kserve.v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from kvmesh.frontend import kserve
from kvmesh.frontend.auth import GatewayAuth
from kvmesh.frontend.dataplane import CompletionResult
from kvmesh.frontend.kserve import InferRequest, InferResponse, ParamValue, Tensor
from kvmesh.frontend.observe import Observed, observe_grpc
from kvmesh.frontend.service import CompletionStream, OpenAIService
from kvmesh.runtime.errors import InvalidRequest, KvmeshError, NotFound, RequestTooLarge
from kvmesh.runtime.grpcutil import (
    HEALTH_METHODS,
    GrpcServer,
    ServerSecurity,
    reloading_server_credentials,
    status_for,
)
from kvmesh.runtime.tasks import TaskSet
from kvmesh.runtime.tls import ReloadingTls

__all__ = ["KSERVE_SERVICE", "KServeServicer", "serve_kserve_grpc"]

KSERVE_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
"""Full name of the service ("inference.GRPCInferenceService")."""

_log = logging.getLogger("kvmesh.frontend.kserve")

_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_HTTP_OF = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 499,
}


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """gRPC status and a client-safe message for any exception (unexpected ones are logged)."""
    if isinstance(exc, KvmeshError):
        code, _ = status_for(exc)
        message = exc.message
        if isinstance(exc, RequestTooLarge):
            code = grpc.StatusCode.INVALID_ARGUMENT
        return code, message
    _log.error("internal error in a KServe request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error"


# --------------------------------------------------------------------------------------------
# protobuf <-> typed messages


def _param(value: pb.InferParameter) -> ParamValue | None:
    which = value.WhichOneof("parameter_choice")
    if which is None:
        return None
    result: ParamValue = getattr(value, which)
    return result


def _set_param(target: pb.InferParameter, value: ParamValue) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = value


def decode_request(msg: pb.ModelInferRequest) -> InferRequest:
    """ModelInferRequest -> InferRequest (InvalidRequest for malformed tensors)."""
    params = {k: v for k, v in ((k, _param(p)) for k, p in msg.parameters.items()) if v is not None}
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise InvalidRequest(
            f"raw_input_contents has {len(raw)} entries for {len(msg.inputs)} inputs"
        )
    inputs: list[Tensor] = []
    for i, t in enumerate(msg.inputs):
        shape = list(t.shape)
        if raw:
            if t.HasField("contents"):
                raise InvalidRequest(
                    f"input '{t.name}' sets contents while raw_input_contents is used"
                )
            data = kserve.decode_raw(t.datatype, raw[i], shape, t.name)
        else:
            data = _contents(t, shape)
        inputs.append(Tensor(t.name, t.datatype, shape, data))
    return InferRequest(
        model=msg.model_name,
        version=msg.model_version,
        id=msg.id,
        parameters=params,
        inputs=inputs,
        outputs=[o.name for o in msg.outputs],
    )


def _contents(t: pb.ModelInferRequest.InferInputTensor, shape: list[int]) -> list[Any]:
    count = kserve.element_count(shape, t.name)
    attr = _CONTENTS.get(t.datatype)
    if attr is None:
        known = "FP16 and BF16 travel only in raw_input_contents"
        if t.datatype not in kserve.DATATYPES:
            known = "unknown datatype"
        raise InvalidRequest(f"input '{t.name}' has datatype {t.datatype!r} ({known})")
    data = list(getattr(t.contents, attr))
    if len(data) != count:
        raise InvalidRequest(
            f"input '{t.name}' has {len(data)} elements but its shape {shape} needs {count}"
        )
    return data


def encode_response(resp: InferResponse) -> pb.ModelInferResponse:
    """InferResponse -> ModelInferResponse (outputs as raw contents)."""
    msg = pb.ModelInferResponse(model_name=resp.model, model_version=resp.version, id=resp.id)
    for tensor in resp.outputs:
        msg.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        msg.raw_output_contents.append(kserve.encode_raw(tensor))
    for key, value in resp.parameters.items():
        _set_param(msg.parameters[key], value)
    return msg


def _metadata_pb(meta: kserve.ModelMetadataResponse) -> pb.ModelMetadataResponse:
    tm = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=meta.name,
        versions=meta.versions,
        platform=meta.platform,
        inputs=[tm(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.inputs],
        outputs=[tm(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.outputs],
        properties=meta.properties,
    )


def _config_pb(config: dict[str, Any]) -> pb.ModelConfig:
    return pb.ModelConfig(
        name=config["name"],
        platform=config["platform"],
        backend=config["backend"],
        max_batch_size=config["max_batch_size"],
        input=[
            pb.ModelInput(
                name=t["name"],
                data_type=pb.DataType.Value(t["data_type"]),
                dims=t["dims"],
                optional=t["optional"],
            )
            for t in config["input"]
        ],
        output=[
            pb.ModelOutput(
                name=t["name"], data_type=pb.DataType.Value(t["data_type"]), dims=t["dims"]
            )
            for t in config["output"]
        ],
        model_transaction_policy=pb.ModelTransactionPolicy(
            decoupled=config["model_transaction_policy"]["decoupled"]
        ),
    )


# --------------------------------------------------------------------------------------------
# The servicer


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    """inference.GRPCInferenceService over an OpenAIService (see the module docstring)."""

    def __init__(self, service: OpenAIService) -> None:
        self.service = service
        self.metrics = service.metrics

    # -- health and metadata ---------------------------------------------------------------

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        return pb.ServerReadyResponse(ready=self.service.ready())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        ready = request.version in ("", kserve.MODEL_VERSION) and self.service.model_ready(
            request.name
        )
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        meta = kserve.SERVER_METADATA
        return pb.ServerMetadataResponse(
            name=meta.name, version=meta.version, extensions=meta.extensions
        )

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        info = await self._model(request.name, request.version, context)
        return _metadata_pb(kserve.model_metadata(info, request.name))

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        info = await self._model(request.name, request.version, context)
        return pb.ModelConfigResponse(config=_config_pb(kserve.model_config(info, request.name)))

    async def _model(
        self, name: str, version: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        info = self.service.model_info(name)
        try:
            if info is None:
                raise NotFound(f"model {name!r} does not exist", param="model")
            kserve.check_version(name, version)
        except KvmeshError as exc:
            await context.abort(*_status(exc))
        return info

    # -- inference -------------------------------------------------------------------------

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        obs = observe_grpc(
            self.service,
            context.invocation_metadata(),
            KSERVE_SERVICE,
            "ModelInfer",
            "kserve_grpc_infer",
        )
        try:
            decoded = decode_request(request)
            if kserve.wants_embedding(decoded):
                embedding = kserve.to_embedding(decoded)
                obs.request(embedding.model, None, "embeddings", stream=False)
                embedded = await self.service.embeddings(embedding, obs.context)
                response = encode_response(
                    kserve.embedding_response(embedded, request.model_name, request.id)
                )
            else:
                call = kserve.to_generation(decoded, allow_stream=False)
                generation = call.request
                obs.request(generation.model, generation.options, "text_completion", stream=False)
                result = await self.service.completion(generation, obs.context)
                assert isinstance(result, CompletionResult)
                obs.result(result)
                response = encode_response(
                    kserve.InferEncoder(call, request.model_name, request.id).result(result)
                )
        except asyncio.CancelledError:
            # The client cancelled the call (or its deadline passed).
            _done(obs, grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            code, message = _status(exc)
            _done(obs, code)
            await context.abort(code, message)
        _done(obs, grpc.StatusCode.OK)
        return response

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        queue: asyncio.Queue[pb.ModelStreamInferResponse | BaseException | None] = asyncio.Queue()
        tasks = TaskSet()
        metadata = context.invocation_metadata()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    tasks.spawn(self._stream_one(request, queue, metadata))
                while tasks:
                    await tasks.wait()
                queue.put_nowait(None)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # the transport failed: end the call
                queue.put_nowait(exc)

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            reader.cancel()
            await tasks.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _stream_one(
        self,
        request: pb.ModelInferRequest,
        queue: asyncio.Queue[pb.ModelStreamInferResponse | BaseException | None],
        metadata: Any,
    ) -> None:
        obs = observe_grpc(
            self.service, metadata, KSERVE_SERVICE, "ModelStreamInfer", "kserve_grpc_stream_infer"
        )
        put = queue.put_nowait
        empty_final = False
        stream: CompletionStream | None = None
        finish_reasons: list[str] = []
        try:
            decoded = decode_request(request)
            empty_final = decoded.parameters.get("triton_enable_empty_final_response") is True
            call = kserve.to_generation(decoded, allow_stream=True)
            encoder = kserve.InferEncoder(call, request.model_name, request.id)
            generation = call.request
            obs.request(generation.model, generation.options, "text_completion", stream=call.stream)
            result = await self.service.completion(generation, obs.context)
            if isinstance(result, CompletionResult):
                obs.result(result)
                put(_stream_response(encoder.result(result)))
            else:
                stream = result
                async for delta in stream:
                    if delta.finish_reason is not None:
                        finish_reasons.append(delta.finish_reason)
                    put(
                        _stream_response(
                            encoder.delta(
                                delta, stream.prompt_tokens(0), stream.completion_tokens(0)
                            )
                        )
                    )
            if call.empty_final:
                put(_stream_response(encoder.final()))
            if stream is not None:
                obs.streamed(stream, finish_reasons)
            _done(obs, grpc.StatusCode.OK)
        except asyncio.CancelledError:
            _done(obs, grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            code, message = _status(exc)
            _done(obs, code)
            error = pb.ModelStreamInferResponse(
                error_message=message,
                infer_response=pb.ModelInferResponse(
                    model_name=request.model_name, model_version=request.model_version,
                    id=request.id,
                ),
            )  # fmt: skip
            if empty_final:
                error.infer_response.parameters["triton_final_response"].bool_param = True
            put(error)
        finally:
            if stream is not None:
                await stream.aclose()


def _done(obs: Observed, code: grpc.StatusCode) -> None:
    """End `obs` with gRPC status `code` (counted as its HTTP equivalent)."""
    obs.done(_HTTP_OF.get(code, 500), grpc_code=code.value[0])


def _stream_response(resp: InferResponse) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(infer_response=encode_response(resp))


async def serve_kserve_grpc(
    service: OpenAIService,
    host: str,
    port: int,
    *,
    auth: GatewayAuth | None = None,
    tls: ReloadingTls | None = None,
    reuse_port: bool = False,
) -> GrpcServer:
    """Start `inference.GRPCInferenceService` (plus health and reflection) on host:port
    (0: any free port); stop it with `await server.stop(grace)`.

    `auth`: every call but the probes (ServerLive, ServerReady, grpc.health.v1) needs an API
    key in its `authorization` metadata ("Bearer KEY", as tritonclient's `headers=` sends it),
    else UNAUTHENTICATED; a key over its requests-per-minute limit gets RESOURCE_EXHAUSTED.
    `tls`: TLS with the gateway's certificate (reloaded when its files change). `reuse_port`:
    bind with SO_REUSEPORT, beside the other processes of a gateway group."""
    security = ServerSecurity(
        credentials=(
            reloading_server_credentials(tls, require_client_certificate=False)
            if tls is not None
            else None
        ),
        authorize=_authorizer(auth) if auth is not None else None,
        open_methods=(HEALTH_METHODS, *_PROBES),
    )
    server = GrpcServer(host, port, security=security, reuse_port=reuse_port)
    server.add(
        pb_grpc.add_GRPCInferenceServiceServicer_to_server, KServeServicer(service), KSERVE_SERVICE
    )
    await server.start()
    return server


_PROBES = tuple(f"/{KSERVE_SERVICE}/{m}" for m in ("ServerLive", "ServerReady"))


def _authorizer(auth: GatewayAuth) -> Callable[[grpc.aio.ServicerContext[Any, Any]], None]:
    def authorize(context: grpc.aio.ServicerContext[Any, Any]) -> None:
        given: str | None = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                given = value.decode() if isinstance(value, bytes) else value
        api_key = auth.check(given)
        if auth.limited:
            auth.admit(api_key, 0)

    return authorize
