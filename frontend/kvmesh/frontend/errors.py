"""kvmesh.runtime.errors exceptions -> OpenAI-shaped HTTP errors, in one place.

Body: `{"error": {"message", "type", "param", "code"}}`. `type` is the exception's `code`
class attribute (OpenAI's error type string); `code` is a finer OpenAI code where one exists
("model_not_found", "context_length_exceeded"), else null. Unexpected exceptions become a
500 whose message never contains the exception text or a traceback (those go to the log).
"""

from __future__ import annotations

import logging

import orjson

from kvmesh.runtime.errors import KvmeshError, NotFound, RequestTooLarge

__all__ = ["error_body", "error_from_exception", "error_payload"]

_log = logging.getLogger("kvmesh.frontend")

_STATUS_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_payload(
    message: str, type_: str, *, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    """JSON body of an error with HTTP `status` that did not come from an exception."""
    type_ = _STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return orjson.dumps(error_payload(message, type_, param=param, code=code))


def _openai_code(exc: KvmeshError) -> str | None:
    code: str | None = getattr(exc, "openai_code", None)
    if code is not None:
        return code
    if isinstance(exc, RequestTooLarge):
        return "context_length_exceeded"
    if isinstance(exc, NotFound) and exc.param == "model":
        return "model_not_found"
    return None


def error_from_exception(exc: BaseException) -> tuple[int, dict[str, dict[str, str | None]]]:
    """(HTTP status, error object) for any exception. Logs unexpected ones with traceback."""
    if isinstance(exc, KvmeshError):
        return exc.http_status, error_payload(
            exc.message, exc.code, param=exc.param, code=_openai_code(exc)
        )
    _log.error("internal error while serving a request", exc_info=exc)
    return 500, error_payload("internal server error", "internal_error")
