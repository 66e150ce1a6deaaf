"""The OpenAPI 3.1 document of the gateway (GET /openapi.json), generated.

Nothing here describes a request or a response by hand. The paths come from the route table
that also registers the handlers (kvmesh.frontend.app.ROUTES: per route its handler, a summary,
the type of its request body and those of its answers); the schemas come from those types by
msgspec.json.schema_components. The types are the msgspec Structs that decode the requests and
encode the responses (kvmesh.frontend.protocol for the OpenAI routes, kvmesh.frontend.kserve
and kserve_http for KServe v2), so the document says what the code does. schemathesis checks
it against a running gateway (tests/fuzz).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from kvmesh.runtime import __version__

__all__ = ["JSON", "SSE", "Reply", "Route", "openapi_document"]

JSON = "application/json"
SSE = "text/event-stream"
Handler = Callable[[Any, web.Request], Awaitable[web.StreamResponse]]


class ServerSentEvent(msgspec.Struct, omit_defaults=True):
    """One Server-Sent Event; `data` is a JSON document (or `[DONE]`)."""

    data: str
    event: str | None = None
    id: str | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """One documented answer of a route."""

    schema: Any
    """The type of its body (a msgspec Struct, or any type msgspec describes)."""
    description: str
    media: tuple[str, ...] = (JSON,)
    """Content types: `schema` is the JSON one's; a `text/event-stream` body is documented as
    ServerSentEvents, any other as a string."""


@dataclass(frozen=True, slots=True)
class Route:
    """A route: what serves it, what it takes and what it answers."""

    path: str
    """aiohttp path; a placeholder may carry a regex (`{model:[\\s\\S]+}`)."""
    method: str
    handler: Handler
    """The routes object's method (unbound) that serves it."""
    summary: str
    replies: Mapping[int, Reply]
    body: Any = None
    """The type of the JSON request body, if any."""


def _body_type(media: str, schema: Any) -> Any:
    return schema if media == JSON else ServerSentEvent if media == SSE else str


def _schemas(routes: Sequence[Route]) -> tuple[dict[Any, Any], dict[str, Any]]:
    """(type -> schema or $ref, components) of every type the routes name."""
    types: list[Any] = [ServerSentEvent, str]
    for route in routes:
        for t in (route.body, *(r.schema for r in route.replies.values())):
            if t is not None and t not in types:
                types.append(t)
    refs, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    return dict(zip(types, refs, strict=True)), components


def openapi_document(routes: Sequence[Route]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes`."""
    schema_of, components = _schemas(routes)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        path = re.sub(r"\{(\w+):[^}]*\}", r"{\1}", route.path)
        responses = {
            str(status): {
                "description": reply.description,
                "content": {
                    media: {"schema": schema_of[_body_type(media, reply.schema)]}
                    for media in reply.media
                },
            }
            for status, reply in route.replies.items()
        }
        operation: dict[str, Any] = {"summary": route.summary, "responses": responses}
        names = re.findall(r"\{(\w+)", path)
        if names:
            operation["parameters"] = [
                {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                for n in names
            ]
        if route.body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {JSON: {"schema": schema_of[route.body]}},
            }
        paths.setdefault(path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvmesh gateway",
            "version": __version__,
            "description": "OpenAI-compatible API and KServe v2 (Open Inference Protocol) REST "
            "API of a kvmesh frontend.",
        },
        "paths": paths,
        "components": {"schemas": components},
    }
