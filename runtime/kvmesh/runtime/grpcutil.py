"""gRPC plumbing shared by every server and client: status mapping, options, servers.

Domain exceptions (kvmesh.runtime.errors) are mapped to gRPC statuses here, once: servers install
`ErrorInterceptor` (or call `status_of` for errors sent in-band), clients call `error_from_rpc`
(or `error_from_status`). Every error carries, besides its status code and message, a
`google.rpc.Status` in the `grpc-status-details-bin` trailer with a `google.rpc.ErrorInfo`
(domain ERROR_DOMAIN, reason = the exception's `reason`, metadata `param`), so the exact
exception class and its parameter survive every hop (worker -> router -> gateway); a client that
reads only the code and message still gets both.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, cast

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc.error_details_pb2 import ErrorInfo
from google.rpc.status_pb2 import Status
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from kvmesh.runtime import errors

log = logging.getLogger(__name__)

ERROR_DOMAIN = "kvmesh.api"
"""`google.rpc.ErrorInfo.domain` of kvmesh errors (reasons: kvmesh.api.common.v1.ErrorReason)."""

# Most specific class first: the first match wins.
_TO_STATUS: list[tuple[type[errors.KvmeshError], grpc.StatusCode]] = [
    (errors.RequestTooLarge, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
]

_FROM_STATUS: dict[grpc.StatusCode, type[errors.KvmeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidRequest,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: errors.Unimplemented,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
}

# reason -> (class, the status code it travels with). A reason is trusted only with its code.
_BY_REASON: dict[str, tuple[type[errors.KvmeshError], grpc.StatusCode]] = {
    cls.reason: (cls, code) for cls, code in _TO_STATUS
}

# Large enough for KV snapshot chunks and long prompts; keepalive so dead peers are noticed.
CHANNEL_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
)
SERVER_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_concurrent_streams", 10_000),
)


def status_for(exc: errors.KvmeshError) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details (the exception's message) for a domain exception."""
    for cls, code in _TO_STATUS:
        if isinstance(exc, cls):
            return code, exc.message
    return grpc.StatusCode.INTERNAL, exc.message


def status_of(exc: BaseException) -> Status:
    """The google.rpc.Status of any exception: a domain exception's code, message and ErrorInfo;
    anything else is INTERNAL and names only the exception type (callers log the details)."""
    if isinstance(exc, errors.KvmeshError):
        code, message = status_for(exc)
        reason = exc.reason
        metadata = {"param": exc.param} if exc.param else {}
    else:
        code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
        reason, metadata = errors.KvmeshError.reason, {}
    detail = any_pb2.Any()
    detail.Pack(ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata))
    return Status(code=code.value[0], message=message, details=[detail])


def error_from_rpc(err: grpc.aio.AioRpcError) -> errors.KvmeshError:
    """The domain exception for a failed call (INTERNAL and unknown codes -> KvmeshError), from
    its status code, message and status details."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]  # an AioRpcError is a Call
    except ValueError:  # details that contradict the code or message: not ours, ignore them
        status = None
    return _decode(err.code(), err.details() or "", status)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def error_from_status(
    code: grpc.StatusCode | int, details: str, status_details: bytes = b""
) -> errors.KvmeshError:
    """The domain exception for a status code (enum or its number), its details and, if any, the
    serialized google.rpc.Status that came with it (StreamedGenerateOutput.error_status)."""
    if isinstance(code, int):
        code = _CODES.get(code, grpc.StatusCode.UNKNOWN)
    status = None
    if status_details:
        try:
            status = Status.FromString(status_details)
        except DecodeError:  # garbage from a foreign server is just no details
            pass
    return _decode(code, details, status)


def _decode(code: grpc.StatusCode, details: str, status: Status | None) -> errors.KvmeshError:
    """The one decoder: the code picks the class, unless the status carries a kvmesh ErrorInfo
    whose reason goes with that code (then the reason picks it); its metadata gives the param."""
    cls = _FROM_STATUS.get(code, errors.KvmeshError)
    param = None
    info = _error_info(status) if status is not None else None
    if info is not None:
        by_reason = _BY_REASON.get(info.reason)
        if by_reason is not None and by_reason[1] is code:
            cls = by_reason[0]
        param = info.metadata.get("param") or None
    return cls(details or code.name, param=param)


def _error_info(status: Status) -> ErrorInfo | None:
    """The kvmesh ErrorInfo among a google.rpc.Status's details, if there is one."""
    for detail in status.details:
        if detail.Is(ErrorInfo.DESCRIPTOR):
            info = ErrorInfo()
            detail.Unpack(info)
            if info.domain == ERROR_DOMAIN:
                return info
    return None


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> None:
    if not isinstance(exc, errors.KvmeshError):
        log.exception("unhandled error in gRPC handler", exc_info=exc)
    status = rpc_status.to_status(status_of(exc))
    await context.abort(status.code, status.details, status.trailing_metadata)


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await fn(request, context)
        except (errors.KvmeshError, ValueError, TypeError, KeyError, RuntimeError) as exc:
            await _abort(context, exc)

    return call


def _wrap_stream(fn: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
    # `fn` is an async generator method of a grpc.aio servicer (grpc's stubs type handlers as
    # the sync API's iterators).
    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, context):
                yield item
        except (errors.KvmeshError, ValueError, TypeError, KeyError, RuntimeError) as exc:
            await _abort(context, exc)

    return call


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns domain exceptions raised by servicers into gRPC status codes.

    Unexpected exceptions become INTERNAL with the exception type only (details are logged,
    never sent to the client).
    """

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # the method is not served
            return None
        if handler.unary_unary is not None:
            return _replaced(handler, unary_unary=_wrap_unary(handler.unary_unary))
        if handler.unary_stream is not None:
            return _replaced(handler, unary_stream=_wrap_stream(handler.unary_stream))
        if handler.stream_unary is not None:
            return _replaced(handler, stream_unary=_wrap_unary(handler.stream_unary))
        if handler.stream_stream is not None:
            return _replaced(handler, stream_stream=_wrap_stream(handler.stream_stream))
        return handler


def _replaced(
    handler: grpc.RpcMethodHandler[Any, Any], **fns: Any
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` with some behaviours swapped (grpc's handlers are namedtuples)."""
    return cast("grpc.RpcMethodHandler[Any, Any]", cast(Any, handler)._replace(**fns))


class GrpcServer:
    """A grpc.aio server with health and reflection, bound to host:port (port 0 = any).

    `add(register_fn, servicer, service_name)` for each service, then `await start()`;
    `port` is the bound port. `set_serving(bool)` flips the health status of every service.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=SERVER_OPTIONS)
        self._health = health.aio.HealthServicer()  # pyright: ignore[reportAttributeAccessIssue]
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._names: list[str] = []
        self._host = host
        self.port = self._server.add_insecure_port(f"{_bind_host(host)}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {host}:{port}")

    @property
    def address(self) -> str:
        """host:port clients should dial."""
        host = self._host if self._host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"{host}:{self.port}"

    def add(self, register: Callable[[Any, Any], None], servicer: Any, service_name: str) -> None:
        """Register a servicer (e.g. add_WorkerServiceServicer_to_server) under its full name."""
        register(servicer, self._server)
        self._names.append(service_name)

    async def start(self) -> None:
        """Start serving; health is SERVING for every registered service."""
        reflection.enable_server_reflection(
            [*self._names, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server
        )
        await self._server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        """Set the health status of the server and every service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._names]:
            await self._health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting calls, give in-flight calls `grace_s`, then cancel them."""
        await self._server.stop(grace_s)

    async def wait(self) -> None:
        """Wait until the server stops."""
        await self._server.wait_for_termination()


def _bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def insecure_channel(address: str) -> grpc.aio.Channel:
    """A client channel with kvmesh's standard options."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
