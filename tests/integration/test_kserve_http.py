"""KServe v2 REST on the gateway's HTTP port: the real `tritonclient.http` (binary tensor
extension and JSON), plain HTTP for the Triton generate extension and error bodies."""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from kvmesh.frontend.testing import DEFAULT_TEXT
from tests.fake_gateway import RunningGateway, running

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway(tiny_model: Path) -> Iterator[RunningGateway]:
    with running(tiny_model) as gw:
        yield gw


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


@pytest.fixture
def client(gateway: RunningGateway) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(gateway.http.removeprefix("http://"))
    yield c
    c.close()


def expected(tok: Tokenizer, n: int) -> str:
    return str(tok.decode(tok.encode(DEFAULT_TEXT, add_special_tokens=False).ids[:n]))


def http(
    gw: RunningGateway,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, Any]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(gw.http + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers


def inputs(prompt: str = "Hello", max_tokens: int = 5, binary: bool = True) -> list[Any]:
    t = httpclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=object), binary_data=binary)
    m = httpclient.InferInput("max_tokens", [1], "INT32")
    m.set_data_from_numpy(np.array([max_tokens], dtype=np.int32), binary_data=binary)
    return [t, m]


def test_health_metadata_config(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready("tiny", "7")
    assert client.get_server_metadata()["name"] == "kvmesh"
    meta = client.get_model_metadata("tiny")
    assert meta["versions"] == ["1"] and meta["inputs"][0]["name"] == "text_input"
    assert client.get_model_config("tiny")["model_transaction_policy"] == {"decoupled": True}
    assert [m["name"] for m in client.get_model_repository_index()] == ["tiny", "tiny-guided"]
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "404"


def test_infer_binary_and_json(client: httpclient.InferenceServerClient, tok: Tokenizer) -> None:
    result = client.infer("tiny", inputs(max_tokens=5), request_id="h-1")  # binary both ways
    assert result.get_response()["id"] == "h-1"
    assert result.as_numpy("text_output")[0].decode() == expected(tok, 5)
    assert result.as_numpy("finish_reason")[0] == b"length"
    assert result.as_numpy("num_output_tokens")[0] == 5
    result = client.infer(
        "tiny",
        inputs(max_tokens=4, binary=False),
        model_version="1",
        outputs=[httpclient.InferRequestedOutput("text_output", binary_data=False)],
        parameters={"temperature": 0.0},
    )
    response = result.get_response()
    assert [o["name"] for o in response["outputs"]] == ["text_output"]
    assert response["outputs"][0]["data"] == [expected(tok, 4)]


def test_token_ids(client: httpclient.InferenceServerClient, tok: Tokenizer) -> None:
    ids = np.array(tok.encode("Hi there").ids, dtype=np.int32)
    t = httpclient.InferInput("input_ids", [len(ids)], "INT32")
    t.set_data_from_numpy(ids)
    result = client.infer("tiny", [t])
    out = result.as_numpy("output_ids")
    assert out.dtype == np.int32 and len(out) == 16


@pytest.mark.parametrize(
    ("prompt", "model", "max_tokens", "status"),
    [
        ("Hi", "nope", 5, "404"),
        ("Hi", "tiny", 0, "400"),
        ("Hi", "tiny", 600, "400"),  # over the context length: 400, as OpenAI and vLLM
        ("@error:exhausted@", "tiny", 5, "429"),
        ("@error:unavailable@", "tiny", 5, "503"),
    ],
)
def test_errors(
    client: httpclient.InferenceServerClient, prompt: str, model: str, max_tokens: int, status: str
) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs(prompt, max_tokens))
    assert info.value.status() == status and info.value.message()


def test_error_bodies_and_routes(gateway: RunningGateway) -> None:
    status, body, _ = http(gateway, "POST", "/v2/models/tiny/infer", b"{not json")
    assert status == 400 and set(json.loads(body)) == {"error"}
    status, body, _ = http(
        gateway,
        "POST",
        "/v2/models/tiny/infer",
        {
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
            "parameters": {"stream": True},
        },
    )
    assert status == 400 and "ModelStreamInfer" in json.loads(body)["error"]
    status, body, _ = http(gateway, "POST", "/v2/models/tiny/infer", {"inputs": []})
    assert status == 400 and "text_input" in json.loads(body)["error"]
    status, _, headers = http(gateway, "GET", "/v2/models/tiny/infer")
    assert status == 405 and "POST" in headers["Allow"]
    status, body, _ = http(gateway, "GET", "/v2/models/tiny/versions/1/ready")
    assert status == 200 and json.loads(body) == {"name": "tiny", "ready": True}
    status, body, _ = http(gateway, "GET", "/v2/models/nope/ready")
    assert status == 404
    big = {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["x" * 300_000]}
        ]
    }
    status, body, _ = http(gateway, "POST", "/v2/models/tiny/infer", big)
    assert status == 413 and "too large" in json.loads(body)["error"]


def test_binary_request_by_hand(gateway: RunningGateway, tok: Tokenizer) -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text_input",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": 9},
                },
                {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [3]},
            ],
            "outputs": [
                {"name": "text_output", "parameters": {"binary_data": True}},
                {"name": "num_output_tokens"},
            ],
        }
    ).encode()
    body = header + struct.pack("<I", 5) + b"Hello"
    status, data, headers = http(
        gateway,
        "POST",
        "/v2/models/tiny/infer",
        body,
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200
    length = int(headers["Inference-Header-Content-Length"])
    meta = json.loads(data[:length])
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == len(data) - length
    assert meta["outputs"][1]["data"] == [3]
    assert data[length + 4 :].decode() == expected(tok, 3)


def test_generate_and_generate_stream(gateway: RunningGateway, tok: Tokenizer) -> None:
    status, body, _ = http(
        gateway,
        "POST",
        "/v2/models/tiny/generate",
        {"text_input": "Hello", "max_tokens": 6, "parameters": {"temperature": 0}},
    )
    assert status == 200
    result = json.loads(body)
    assert result["text_output"] == expected(tok, 6) and result["finish_reason"] == "length"
    assert result["model_name"] == "tiny" and result["num_output_tokens"] == 6

    status, body, headers = http(
        gateway,
        "POST",
        "/v2/models/tiny/versions/1/generate_stream",
        {
            "text_input": "Hello",
            "max_tokens": 6,
            "parameters": {"triton_enable_empty_final_response": True},
        },
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(e[len(b"data: ") :]) for e in body.split(b"\n\n") if e]
    *data, final = events
    assert "".join(e["text_output"] for e in data) == expected(tok, 6)
    assert final["parameters"]["triton_final_response"] is True
    status, body, _ = http(
        gateway, "POST", "/v2/models/tiny/generate_stream", {"text_input": "@midfail@"}
    )
    last = json.loads(body.strip().split(b"\n\n")[-1][len(b"data: ") :])
    assert status == 200 and "went away" in last["error"]
    status, body, _ = http(gateway, "POST", "/v2/models/nope/generate", {"text_input": "x"})
    assert status == 404 and "error" in json.loads(body)
