"""Inputs that fuzzing found to break the gateway, kept as regression tests.

- Sampling values the OpenAI schema allows but the worker contract's protobuf fields cannot
  hold (a negative `seed` for the uint64 seed; `top_k` / `min_tokens` past uint32; `priority`
  past int32) raised ValueError while the mesh backend built the GenerateRequest: HTTP 500 via
  `kvmesh up`. Now: 400, and seeds wrap into uint64.
- A path with a percent-encoded newline missed the catch-all route (`.*` stops at "\\n") and got
  aiohttp's plain-text 404 instead of a JSON error.

The backend here round-trips every request through kvmesh.runtime.wire exactly as the mesh
backend does, so protobuf range errors surface in-process.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvmesh.frontend.app import build_app, serve_http
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.testing import FakeBackend, model_info
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.runtime import wire
from kvmesh.runtime.tinymodel import create_tiny_model
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import EngineOutput, EngineRequest

pytestmark = pytest.mark.unit


class WireBackend(FakeBackend):
    """FakeBackend that first converts each request to protobuf and back, like MeshBackend."""

    def generate(
        self, model: str, request: EngineRequest, trace: TraceContext | None
    ) -> AsyncGenerator[EngineOutput, None]:
        request = wire.request_from_pb(wire.request_to_pb(request), request.request_id)
        return super().generate(model, request, trace)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = create_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")
    return Tokenizer.from_pretrained(path)


@pytest.fixture
async def base(tok: Tokenizer) -> AsyncIterator[tuple[str, WireBackend]]:
    backend = WireBackend([model_info("tiny")], tokens=tok.encode("hello world"))
    runner, port = await serve_http(
        build_app(OpenAIService(backend, {"tiny": tok})), "127.0.0.1", 0
    )
    yield f"http://127.0.0.1:{port}", backend
    await runner.cleanup()


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
CORPUS: list[tuple[str, dict[str, Any], int]] = [
    ("/v1/chat/completions", {**CHAT, "seed": -1}, 200),
    ("/v1/chat/completions", {**CHAT, "seed": 2**63 - 1, "n": 3}, 200),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**33}, 400),
    ("/v1/chat/completions", {**CHAT, "priority": 2**33}, 400),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 2**33, "max_tokens": None}, 400),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [2**32]}, 400),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(2**32): 1}}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": [2**32]}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2**40}, 400),
]


@pytest.mark.parametrize(("path", "body", "status"), CORPUS)
async def test_out_of_range_sampling_values(
    base: tuple[str, WireBackend], path: str, body: dict[str, Any], status: int
) -> None:
    url, backend = base
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as resp:
        payload = await resp.json()
        assert resp.status == status, payload
    if status == 200:
        seeds = [c.request.sampling.seed for c in backend.calls]
        assert all(s is not None and 0 <= s < 2**64 for s in seeds)
    else:
        assert payload["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/v1/x%0Ay", {"error": {"message", "type", "param", "code"}}),
        ("/%0A", {"error": {"message", "type", "param", "code"}}),
        ("/v2/models/a%0Ab", {"error": None}),
        ("/v2/models/a%0Ab/versions/1/ready", {"error": None}),
    ],
)
async def test_paths_with_newlines_get_json_errors(
    base: tuple[str, WireBackend], path: str, shape: dict[str, Any]
) -> None:
    url, _ = base
    async with aiohttp.ClientSession() as http, http.get(url + path) as resp:
        assert resp.status == 404
        assert resp.headers["Content-Type"].startswith("application/json")
        body = json.loads(await resp.read())
    assert set(body) == set(shape)
    if shape["error"] is None:
        assert isinstance(body["error"], str)
    else:
        assert set(body["error"]) == shape["error"]
