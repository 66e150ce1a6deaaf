"""The generated OpenAPI document against what the app serves and what the code sends.

(The fuzzers in tests/fuzz check the document against a running gateway with schemathesis.)
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import msgspec
import pytest

from kvmesh.frontend.app import ROUTES, build_app
from kvmesh.frontend.errors import error_body, error_from_exception
from kvmesh.frontend.openapi import openapi_document
from kvmesh.frontend.protocol import ErrorResponse
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.testing import FakeBackend, model_info
from kvmesh.runtime.errors import InvalidRequest, NotFound, RequestTooLarge

pytestmark = pytest.mark.unit

DOC = openapi_document(ROUTES)


def _schema(name: str) -> dict[str, Any]:
    """A component schema that validates on its own (refs resolved against the document)."""
    return {**DOC["components"]["schemas"][name], "components": DOC["components"]}


def test_every_served_route_is_documented() -> None:
    app = build_app(OpenAIService(FakeBackend([model_info("m")]), {}))
    served = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method not in ("*", "HEAD") and "{tail" not in path:
            served.add((re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path), route.method.lower()))
    documented = {(p, m) for p, ops in DOC["paths"].items() for m in ops}
    assert served == documented


@pytest.mark.parametrize(
    ("body", "valid"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 2}, True),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, False),
        ({"model": "m", "messages": [{"role": "bot", "content": "hi"}]}, False),
        ({"model": "m", "messages": []}, False),
        ({"messages": [{"role": "user", "content": "hi"}]}, False),
    ],
)
def test_request_schema_says_what_the_parser_checks(body: dict[str, Any], valid: bool) -> None:
    schema = _schema("CreateChatCompletionRequest")
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(body))
    assert (not errors) is valid, errors


@pytest.mark.parametrize(
    "exc",
    [InvalidRequest("bad", param="n"), NotFound("gone", param="model"), RequestTooLarge("big")],
)
def test_error_bodies_match_the_documented_error(exc: Exception) -> None:
    _, payload = error_from_exception(exc)
    msgspec.convert(payload, ErrorResponse)
    msgspec.json.decode(error_body(404, "no route for /x"), type=ErrorResponse)
    jsonschema.validate(json.loads(json.dumps(payload)), _schema("ErrorResponse"))
