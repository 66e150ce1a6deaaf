"""Schemathesis against the gateway's own /openapi.json: no request shape gets a 5xx, and every
answer has a documented status, content type and body shape.

The gateway is a real process (tests.fake_gateway) over a scripted in-process backend. Most
generated requests name a served model (schemathesis would otherwise mostly produce unknown
model names, i.e. 404s), the rest keep whatever was generated. The fast smoke runs by default;
`-m slow` runs many more examples.
"""

from __future__ import annotations

import zlib

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from kvmesh.frontend.app import ROUTES
from kvmesh.frontend.openapi import openapi_document
from tests.fake_gateway import RunningGateway

pytestmark = pytest.mark.integration

schema = schemathesis.openapi.from_dict(openapi_document(ROUTES))
smoke_schema = schemathesis.openapi.from_dict(openapi_document(ROUTES))
smoke_schema.config.phases.coverage.enabled = False  # boundary cases: the thorough run's job
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
MODELS = ("tiny", "tiny-guided")
SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": list(HealthCheck),
}


def _steer(case: schemathesis.Case) -> None:
    """Point two thirds of the requests at a served model (deterministically)."""
    seed = zlib.crc32(repr((case.path, case.body, case.path_parameters)).encode())
    if seed % 3 == 0:
        return
    model = MODELS[seed % 2]
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = model
    if case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = model


def _run(case: schemathesis.Case, gateway: RunningGateway) -> None:
    _steer(case)
    case.call_and_validate(base_url=gateway.http, checks=CHECKS, timeout=30)
    assert gateway.proc.poll() is None, "the gateway died"


@smoke_schema.parametrize()
@settings(max_examples=5, **SETTINGS)  # type: ignore[arg-type]
def test_api_smoke(case: schemathesis.Case, gateway: RunningGateway) -> None:
    _run(case, gateway)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=150, **SETTINGS)  # type: ignore[arg-type]
def test_api_thorough(case: schemathesis.Case, gateway: RunningGateway) -> None:
    _run(case, gateway)
