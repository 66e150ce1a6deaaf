"""`kvmesh up` (frontend + 2 mocker workers as real processes) through its KServe v2 front doors,
with the real `tritonclient.grpc` (unary and streaming) and `tritonclient.http`, plus the new
OpenAI features where they depend on real worker model cards and the real wire."""

from __future__ import annotations

import queue
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.integration.test_up_openai import MODEL, Mesh, start_mesh, stop_mesh

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("up-kserve"))
    yield m
    assert stop_mesh(m) == 0, m.log.read_text()


def kserve_grpc_address(mesh: Mesh) -> str:
    """The KServe gRPC address `kvmesh up` picked and printed in its banner."""
    deadline = time.monotonic() + 10
    while True:
        found = re.search(
            r"grpc (127\.0\.0\.1:\d+) \(inference\.GRPCInferenceService\)", mesh.log.read_text()
        )
        if found:
            return found.group(1)
        assert time.monotonic() < deadline, mesh.log.read_text()
        time.sleep(0.1)


@pytest.fixture(scope="module")
def grpc_address(mesh: Mesh) -> str:
    return kserve_grpc_address(mesh)


def _inputs(mod: Any, prompt: str, max_tokens: int, stream: bool | None = None) -> list[Any]:
    text = mod.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    limit = mod.InferInput("max_tokens", [1], "INT32")
    limit.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    temp = mod.InferInput("temperature", [1], "FP32")
    temp.set_data_from_numpy(np.array([0.0], dtype=np.float32))
    out = [text, limit, temp]
    if stream is not None:
        flag = mod.InferInput("stream", [1], "BOOL")
        flag.set_data_from_numpy(np.array([stream]))
        out.append(flag)
    return out


def test_grpc_unary_and_streaming(grpc_address: str) -> None:
    client = grpcclient.InferenceServerClient(grpc_address)
    try:
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        assert client.get_model_config(MODEL).config.model_transaction_policy.decoupled
        unary = client.infer(MODEL, _inputs(grpcclient, "The quick brown fox", 10))
        text = unary.as_numpy("text_output")[0].decode()
        assert unary.as_numpy("num_output_tokens")[0] == 10
        assert unary.as_numpy("finish_reason")[0] == b"length"

        q: queue.Queue[Any] = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        client.async_stream_infer(
            MODEL,
            _inputs(grpcclient, "The quick brown fox", 10, stream=True),
            request_id="up-1",
            enable_empty_final_response=True,
        )
        pieces = []
        while True:
            result, error = q.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            assert response.id == "up-1"
            if response.parameters["triton_final_response"].bool_param:
                break
            pieces.append(result.as_numpy("text_output")[0].decode())
        client.stop_stream()
        assert "".join(pieces) == text  # greedy: the same text, streamed
        with pytest.raises(InferenceServerException) as info:
            client.infer("nope", _inputs(grpcclient, "x", 2))
        assert info.value.status() == "StatusCode.NOT_FOUND"
    finally:
        client.close()


def test_http(mesh: Mesh) -> None:
    client = httpclient.InferenceServerClient(mesh.base.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_model_ready(MODEL)
        result = client.infer(MODEL, _inputs(httpclient, "Hello there", 7))
        assert result.as_numpy("num_output_tokens")[0] == 7
        assert result.as_numpy("text_output")[0]
    finally:
        client.close()


def test_openai_features_over_the_mesh(mesh: Mesh) -> None:
    client = mesh.client()
    messages: Any = [{"role": "user", "content": "Weather in Paris?"}]
    # the mocker's card has no GUIDED_DECODING / EMBEDDINGS: clear 400s, not silent ignoring
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=messages, response_format={"type": "json_object"}
        )
    assert "GUIDED_DECODING" in info.value.message and "'mocker'" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="hello")
    assert "EMBEDDINGS" in info.value.message
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=8, seed=-1, temperature=0.5
    )
    assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert resp.system_fingerprint and resp.system_fingerprint.startswith("fp_")
