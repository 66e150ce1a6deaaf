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

import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
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
from kvmesh.runtime.tasks import TaskSet
from kvmesh.runtime.tls import ReloadingTls, TlsConfig, TlsMaterial

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
    (errors.Aborted, grpc.StatusCode.ABORTED),
    (errors.Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
]

_FROM_STATUS: dict[grpc.StatusCode, type[errors.KvmeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidRequest,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.ABORTED: errors.Aborted,
    grpc.StatusCode.UNIMPLEMENTED: errors.Unimplemented,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
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


# Codes a call gets when it breaks below the service: the peer died or was cut off (UNAVAILABLE,
# "Socket closed"), the channel was closed (CANCELLED), the HTTP/2 stream was reset or ended
# without a status (INTERNAL "Internal error from Core", UNKNOWN), or it hung (DEADLINE_EXCEEDED).
_TRANSPORT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


def transport_failure(err: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call broke below the service (connection lost, peer killed or hung, stream
    reset) rather than ended with an error the peer's servicer returned. Every status a kvmesh
    server sends carries a kvmesh ErrorInfo (`status_of`), so a status in one of the transport's
    codes without one came from the transport, whatever its message says."""
    if err.code() not in _TRANSPORT_CODES:
        return False
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]  # an AioRpcError is a Call
    except ValueError:
        return True
    return status is None or _error_info(status) is None


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


Authorize = Callable[["grpc.aio.ServicerContext[Any, Any]"], None]
"""Checks a call's credentials before its handler runs: returns, or raises Unauthenticated /
PermissionDenied (ServerSecurity.authorize)."""


def _wrap_unary(
    fn: Callable[..., Awaitable[Any]], authorize: Authorize | None
) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            if authorize is not None:
                authorize(context)
            return await fn(request, context)
        except (errors.KvmeshError, ValueError, TypeError, KeyError, RuntimeError) as exc:
            await _abort(context, exc)

    return call


def _wrap_stream(fn: Callable[..., Any], authorize: Authorize | None) -> Callable[..., Any]:
    # `fn` is an async generator method of a grpc.aio servicer (grpc's stubs type handlers as
    # the sync API's iterators), or a coroutine that writes with context.write (grpc's own
    # Health.Watch), wrapped as a unary handler is.
    if not inspect.isasyncgenfunction(fn):
        return _wrap_unary(fn, authorize)

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            if authorize is not None:
                authorize(context)
            async for item in fn(request, context):
                yield item
        except (errors.KvmeshError, ValueError, TypeError, KeyError, RuntimeError) as exc:
            await _abort(context, exc)

    return call


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns domain exceptions raised by servicers into gRPC status codes, and runs
    `authorize` (if any) before every handler but those of `open_methods` (full method names,
    or prefixes ending in "/": a whole service).

    Unexpected exceptions become INTERNAL with the exception type only (details are logged,
    never sent to the client).
    """

    def __init__(
        self, authorize: Authorize | None = None, open_methods: Collection[str] = ()
    ) -> None:
        self._authorize = authorize
        self._open = tuple(open_methods)

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
        auth = self._authorize
        if auth is not None and handler_call_details.method.startswith(self._open):
            auth = None
        if handler.unary_unary is not None:
            return _replaced(handler, unary_unary=_wrap_unary(handler.unary_unary, auth))
        if handler.unary_stream is not None:
            return _replaced(handler, unary_stream=_wrap_stream(handler.unary_stream, auth))
        if handler.stream_unary is not None:
            return _replaced(handler, stream_unary=_wrap_unary(handler.stream_unary, auth))
        if handler.stream_stream is not None:
            return _replaced(handler, stream_stream=_wrap_stream(handler.stream_stream, auth))
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
    `security`: TLS credentials and a per-call check (e.g. `MeshSecurity.server()`); None:
    plaintext, every caller accepted. `reuse_port`: bind with SO_REUSEPORT (a port several
    processes serve; off otherwise, so a port in use is an error).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        security: ServerSecurity | None = None,
        reuse_port: bool = False,
    ) -> None:
        security = security or ServerSecurity()
        interceptor = ErrorInterceptor(security.authorize, security.open_methods)
        options = SERVER_OPTIONS
        if reuse_port:  # beside the other processes of a gateway group (--gateway-processes)
            options = (*(o for o in options if o[0] != "grpc.so_reuseport"),)
            options += (("grpc.so_reuseport", 1),)
        self._server = grpc.aio.server(interceptors=[interceptor], options=options)
        self._health = health.aio.HealthServicer()  # pyright: ignore[reportAttributeAccessIssue]
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._names: list[str] = []
        self._host = host
        self.security = security
        target = f"{_bind_host(host)}:{port}"
        if security.credentials is None:
            self.port = self._server.add_insecure_port(target)
        else:
            self.port = self._server.add_secure_port(target, security.credentials)
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
    """A plaintext client channel with kvmesh's standard options (mesh links use
    `mesh_channel`, which is this one when the mesh has no TLS and no token)."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def check_health(channel: grpc.aio.Channel, timeout_s: float) -> bool:
    """The standard grpc.health.v1 Check of the server behind `channel`: True if SERVING, False
    if it answered otherwise (draining). Raises grpc.aio.AioRpcError when it did not answer within
    `timeout_s` (hung, dead)."""
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    resp = await check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


# --- security ---------------------------------------------------------------------------------


async def watch_health(channel: grpc.aio.Channel) -> AsyncIterator[bool]:
    """The standard grpc.health.v1 Watch of the server behind `channel`: whether it is SERVING,
    now and at every change. Ends (or raises AioRpcError) when the server goes away."""
    watch = channel.unary_stream(
        "/grpc.health.v1.Health/Watch",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    async for resp in watch(health_pb2.HealthCheckRequest()):
        yield resp.status == health_pb2.HealthCheckResponse.SERVING


HEALTH_METHODS = f"/{health.SERVICE_NAME}/"
"""Method-name prefix of grpc.health.v1: probes call it without a mesh token."""

MESH_TOKEN_HEADER = "x-kvmesh-mesh-token"
"""Call metadata that carries the shared mesh token (meshes without TLS)."""


@dataclass(frozen=True)
class ServerSecurity:
    """How a GrpcServer authenticates its callers."""

    credentials: grpc.ServerCredentials | None = None
    """TLS server credentials; None: plaintext."""
    authorize: Authorize | None = None
    """Runs before every handler but those of `open_methods`; None: every caller is accepted."""
    open_methods: tuple[str, ...] = ()
    """Full method names, or service prefixes ("/pkg.Service/"), callable without `authorize`."""


class MeshSecurity:
    """How this process's mesh links (worker, router, scaling servers and their clients)
    authenticate, built once from its TlsConfig by `load`:

    * mTLS (--tls-cert/--tls-key/--tls-ca): servers require a client certificate signed by the
      CA, and with --mesh-identities one whose subject CN or SAN is listed (else
      PERMISSION_DENIED); clients present their certificate and verify the server's. The files
      are reloaded when they change: servers use the new certificate from the next handshake
      on, clients for new calls (`mesh_channel`), while calls in flight finish on the
      connections they started on.
    * a shared token (no TLS, --mesh-token-file or $KVMESH_MESH_TOKEN): clients send it in the
      `x-kvmesh-mesh-token` metadata; servers refuse calls without it, or with another one,
      with UNAUTHENTICATED (but grpc.health.v1, for probes).
    * neither: plaintext, every caller accepted (the default, for one machine).

    `server()` is what a mesh GrpcServer takes, `channel(address)` a client channel. The planner
    and tools that call a mesh server get theirs in one call: `mesh_channel(address, security)`.
    """

    def __init__(
        self,
        tls: ReloadingTls | None = None,
        *,
        identities: Collection[str] = (),
        token: bytes | None = None,
        server_name: str = "",
    ) -> None:
        if tls is not None and token is not None:
            raise ValueError("a mesh uses TLS identities or a shared token, not both")
        self.tls = tls
        self.identities = frozenset(identities)
        self.channel_options: Sequence[tuple[str, Any]] = (
            (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", server_name))
            if server_name
            else CHANNEL_OPTIONS
        )
        """Options of client channels (with --tls-server-name: the name servers' certificates
        are checked against)."""
        self._token = token
        self._metadata: tuple[tuple[str, str], ...] = (
            ((MESH_TOKEN_HEADER, token.decode()),) if token is not None else ()
        )
        self._client: tuple[int, grpc.ChannelCredentials] | None = None

    @classmethod
    def load(cls, config: TlsConfig) -> MeshSecurity:
        """The security `config` describes, with its files read and checked now: raises
        TlsError (missing, expired or mismatched certificate, bad token) at start-up."""
        token = config.token()  # also refuses a token next to TLS
        if config.enabled:
            return cls(
                ReloadingTls(config.files()),
                identities=config.mesh_identities,
                server_name=config.tls_server_name,
            )
        return cls(token=token)

    @property
    def mode(self) -> str:
        """ "mtls", "token" or "none"."""
        return "mtls" if self.tls is not None else ("token" if self._token else "none")

    def server(self) -> ServerSecurity:
        """What a mesh server (GrpcServer) takes."""
        if self.tls is not None:
            auth = self._authorize_identity if self.identities else None
            return ServerSecurity(reloading_server_credentials(self.tls), auth)
        if self._token is not None:
            return ServerSecurity(None, self._authorize_token, (HEALTH_METHODS,))
        return ServerSecurity()

    def channel(self, address: str) -> grpc.aio.Channel:
        """A client channel to a mesh server (see `mesh_channel`)."""
        if self.tls is None and self._token is None:
            return insecure_channel(address)
        return _MeshChannel(address, self)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata every mesh call carries (the token, when there is one)."""
        return self._metadata

    def channel_credentials(self) -> tuple[int, grpc.ChannelCredentials | None]:
        """(generation, credentials) for new client connections; the generation changes when
        the certificate files were reloaded."""
        if self.tls is None:
            return 0, None
        generation, material = self.tls.current()
        if self._client is None or self._client[0] != generation:
            creds = grpc.ssl_channel_credentials(material.ca, material.key, material.cert_chain)
            self._client = (generation, creds)
        return self._client

    def _authorize_identity(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        auth = context.auth_context()
        names = [
            n.decode(errors="replace")
            for key in ("x509_common_name", "x509_subject_alternative_name")
            for n in auth.get(key, ())
        ]
        if not names:
            raise errors.Unauthenticated("this mesh server needs a client certificate")
        if self.identities.isdisjoint(names):
            raise errors.PermissionDenied(
                f"the client certificate ({', '.join(names)}) is not one of this mesh's "
                "identities (--mesh-identities)"
            )

    def _authorize_token(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        assert self._token is not None
        for key, value in context.invocation_metadata() or ():
            if key == MESH_TOKEN_HEADER:
                given = value if isinstance(value, bytes) else value.encode()
                if hmac.compare_digest(given, self._token):
                    return
                raise errors.Unauthenticated("wrong mesh token")
        raise errors.Unauthenticated(f"this mesh server needs the mesh token ({MESH_TOKEN_HEADER})")


def mesh_server(host: str, port: int, security: MeshSecurity | None = None) -> GrpcServer:
    """A GrpcServer for a mesh service (worker, router, scaling) at host:port with the process's
    mesh security (plaintext when `security` is None)."""
    return GrpcServer(host, port, security=security.server() if security is not None else None)


def mesh_channel(address: str, security: MeshSecurity | None = None) -> grpc.aio.Channel:
    """A client channel to a mesh server at `address` (host:port) with the process's mesh
    security: plaintext when `security` is None or has neither TLS nor a token. The one call a
    mesh client (router, frontend, worker, planner, a tool) needs:

        security = MeshSecurity.load(tls_config)   # once per process, from its TlsConfig flags
        stub = ScalingServiceStub(mesh_channel("127.0.0.1:7000", security))
    """
    return security.channel(address) if security is not None else insecure_channel(address)


def reloading_server_credentials(
    tls: ReloadingTls, *, require_client_certificate: bool = True
) -> grpc.ServerCredentials:
    """TLS server credentials that pick up reloaded files at the next handshake;
    `require_client_certificate`: mTLS, against the material's CA."""
    served, material = tls.current()
    last = [served]

    def config(m: TlsMaterial) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(m.key, m.cert_chain)], root_certificates=m.ca
        )

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # Called by gRPC before each handshake; None keeps the current configuration.
        try:
            generation, m = tls.current()
            if generation == last[0]:
                return None
            last[0] = generation
            return config(m)
        except Exception:  # never fail a handshake because of a reload
            log.exception("cannot build the reloaded TLS configuration")
            return None

    # grpc documents None as "no change"; its stubs say the fetcher always returns one.
    fetcher = cast("Callable[[], grpc.ServerCertificateConfiguration]", fetch)
    return grpc.dynamic_ssl_server_credentials(
        config(material), fetcher, require_client_authentication=require_client_certificate
    )


class _MeshChannel(grpc.aio.Channel):
    """A client channel that follows a MeshSecurity: every call carries the mesh token (if
    any), and each new call uses the current certificates. When the certificate files were
    reloaded, new calls go to a new underlying channel and the previous one is closed once its
    last call has ended (calls in flight are never cut)."""

    def __init__(self, address: str, security: MeshSecurity) -> None:
        self._address = address
        self._security = security
        self._generation = -1
        self._channel: grpc.aio.Channel | None = None
        self._calls: dict[grpc.aio.Channel, int] = {}
        self._retired: set[grpc.aio.Channel] = set()
        self._closing = TaskSet()

    def current(self) -> grpc.aio.Channel:
        """The underlying channel new calls use."""
        generation, creds = self._security.channel_credentials()
        channel = self._channel
        if channel is None or generation != self._generation:
            if channel is not None:
                self._retire(channel)
            if creds is None:
                channel = grpc.aio.insecure_channel(self._address, options=CHANNEL_OPTIONS)
            else:
                options = self._security.channel_options
                channel = grpc.aio.secure_channel(self._address, creds, options=options)
            self._channel, self._generation = channel, generation
        return channel

    def _started(self, channel: grpc.aio.Channel, call: Any) -> None:
        self._calls[channel] = self._calls.get(channel, 0) + 1
        call.add_done_callback(lambda _call: self._ended(channel))

    def _ended(self, channel: grpc.aio.Channel) -> None:
        left = self._calls.get(channel, 1) - 1
        if left > 0:
            self._calls[channel] = left
            return
        self._calls.pop(channel, None)
        if channel in self._retired:
            self._close_later(channel)

    def _retire(self, channel: grpc.aio.Channel) -> None:
        if self._calls.get(channel):
            self._retired.add(channel)
        else:
            self._close_later(channel)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        self._retired.discard(channel)
        self._closing.spawn(channel.close())

    def unary_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool = False,
    ) -> Any:
        return _MeshCallable(
            self, "unary_unary", (method, request_serializer, response_deserializer)
        )

    def unary_stream(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool = False,
    ) -> Any:
        return _MeshCallable(
            self, "unary_stream", (method, request_serializer, response_deserializer)
        )

    def stream_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool = False,
    ) -> Any:
        return _MeshCallable(
            self, "stream_unary", (method, request_serializer, response_deserializer)
        )

    def stream_stream(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool = False,
    ) -> Any:
        return _MeshCallable(
            self, "stream_stream", (method, request_serializer, response_deserializer)
        )

    async def close(self, grace: float | None = None) -> None:
        channels = [c for c in (self._channel, *self._retired) if c is not None]
        self._channel, self._generation = None, -1
        self._retired.clear()
        for channel in channels:
            await channel.close(grace)
        await self._closing.wait()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def __aenter__(self) -> _MeshChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _MeshCallable:
    """A multi-callable of a _MeshChannel: each call goes to the channel's current underlying
    channel, with the mesh metadata added."""

    __slots__ = ("_args", "_cached", "_kind", "_owner")

    def __init__(self, owner: _MeshChannel, kind: str, args: tuple[Any, ...]) -> None:
        self._owner = owner
        self._kind = kind
        self._args = args
        self._cached: tuple[grpc.aio.Channel, Any] | None = None

    def __call__(self, request: Any = None, **kwargs: Any) -> Any:
        owner = self._owner
        channel = owner.current()
        cached = self._cached
        if cached is None or cached[0] is not channel:
            cached = self._cached = (channel, getattr(channel, self._kind)(*self._args))
        extra = owner._security.call_metadata()
        if extra:
            kwargs["metadata"] = (*(kwargs.get("metadata") or ()), *extra)
        call = cached[1](request, **kwargs)
        owner._started(channel, call)
        return call
