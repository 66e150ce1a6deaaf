"""Domain exceptions, in one place.

Each maps once to a gRPC status (kvmesh.runtime.grpcutil) and once to an OpenAI-style HTTP error
(kvmesh.frontend.errors). Raise these from engines, routers and services; never return
success-shaped error messages.

`reason` names the kind of error on the wire: it travels as the `reason` of a `google.rpc.ErrorInfo`
in the call's status details (kvmesh.runtime.grpcutil), so a subclass that shares its parent's
status code (RequestTooLarge is an INVALID_ARGUMENT) survives every hop. The reasons are the
`ErrorReason` values of kvmesh.api.common.v1 without their prefix.
"""

from __future__ import annotations


class KvmeshError(Exception):
    """Base class. `code` is the OpenAI error type string, `http_status` its HTTP status."""

    http_status = 500
    code = "internal_error"
    reason = "INTERNAL"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(KvmeshError):
    """The request is malformed or violates a limit (gRPC INVALID_ARGUMENT, HTTP 400)."""

    http_status = 400
    code = "invalid_request_error"
    reason = "INVALID_REQUEST"


class RequestTooLarge(InvalidRequest):
    """The prompt (plus requested output) does not fit the context window (gRPC INVALID_ARGUMENT,
    HTTP 400 with OpenAI's code "context_length_exceeded", as OpenAI and vLLM answer)."""

    reason = "CONTEXT_LENGTH_EXCEEDED"


class NotFound(KvmeshError):
    """Unknown model, adapter or transfer (gRPC NOT_FOUND, HTTP 404)."""

    http_status = 404
    code = "not_found_error"
    reason = "NOT_FOUND"


class ResourceExhausted(KvmeshError):
    """Overloaded, or the request can never fit (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""

    http_status = 429
    code = "rate_limit_error"
    reason = "RESOURCE_EXHAUSTED"


class Unavailable(KvmeshError):
    """No worker can take the request now: none registered, all busy, draining
    (gRPC UNAVAILABLE, HTTP 503)."""

    http_status = 503
    code = "service_unavailable"
    reason = "UNAVAILABLE"


class Aborted(KvmeshError):
    """The operation conflicts with another one still in progress; retry once it is done
    (gRPC ABORTED, HTTP 409)."""

    http_status = 409
    code = "conflict"
    reason = "ABORTED"


class Unimplemented(KvmeshError):
    """The engine or component does not support this operation (gRPC UNIMPLEMENTED, HTTP 501)."""

    http_status = 501
    code = "not_implemented"
    reason = "UNIMPLEMENTED"


class Cancelled(KvmeshError):
    """The request was cancelled (gRPC CANCELLED, HTTP 499)."""

    http_status = 499
    code = "cancelled"
    reason = "CANCELLED"


class DeadlineExceeded(KvmeshError):
    """A deadline passed (gRPC DEADLINE_EXCEEDED, HTTP 504)."""

    http_status = 504
    code = "timeout"
    reason = "DEADLINE_EXCEEDED"


class Unauthenticated(KvmeshError):
    """The call carries no valid credentials: no API key or an unknown one, no mesh token or a
    wrong one (gRPC UNAUTHENTICATED, HTTP 401)."""

    http_status = 401
    code = "invalid_request_error"
    reason = "UNAUTHENTICATED"


class PermissionDenied(KvmeshError):
    """The caller is authenticated but may not call this, e.g. a client certificate whose
    identity is not one of the mesh's (gRPC PERMISSION_DENIED, HTTP 403)."""

    http_status = 403
    code = "permission_error"
    reason = "PERMISSION_DENIED"
