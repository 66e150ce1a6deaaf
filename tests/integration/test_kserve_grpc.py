"""KServe v2 gRPC with the real `tritonclient.grpc` (sync, streaming, asyncio) against a real
gateway process (tests.fake_gateway: the gateway over a scripted backend).

The gateway runs in a subprocess because kvmesh's generated `inference` protos and
tritonclient's cannot share one process (see tests/fake_gateway.py).
"""

from __future__ import annotations

import queue
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
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
def client(gateway: RunningGateway) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(gateway.grpc)
    yield c
    c.close()


def expected(tok: Tokenizer, n: int) -> str:
    return str(tok.decode(tok.encode(DEFAULT_TEXT, add_special_tokens=False).ids[:n]))


def text_input(prompt: str = "Hello") -> grpcclient.InferInput:
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    return t


def scalar(name: str, value: Any, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], dtype)
    np_type = {"INT32": np.int32, "FP32": np.float32, "BOOL": bool, "INT64": np.int64}[dtype]
    t.set_data_from_numpy(np.array([value], dtype=np_type))
    return t


def test_health_and_metadata(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready("tiny", "2")
    meta = client.get_server_metadata()
    assert meta.name == "kvmesh" and "generate" in meta.extensions
    model = client.get_model_metadata("tiny", as_json=True)
    assert model["name"] == "tiny" and model["versions"] == ["1"]
    assert {"text_input", "input_ids", "stream"} <= {t["name"] for t in model["inputs"]}
    assert {"text_output", "finish_reason"} <= {t["name"] for t in model["outputs"]}
    config = client.get_model_config("tiny").config
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_unary_infer(client: grpcclient.InferenceServerClient, tok: Tokenizer) -> None:
    result = client.infer(
        "tiny",
        [text_input(), scalar("max_tokens", 6, "INT32"), scalar("temperature", 0.0, "FP32")],
        request_id="req-1",
        parameters={"top_k": 4, "seed": 3},
    )
    assert result.get_response().id == "req-1"
    assert result.as_numpy("text_output")[0].decode() == expected(tok, 6)
    assert result.as_numpy("finish_reason")[0] == b"length"
    assert result.as_numpy("num_output_tokens")[0] == 6
    prompt_tokens = len(tok.encode("Hello", add_special_tokens=True).ids)
    assert result.as_numpy("num_input_tokens")[0] == prompt_tokens
    # without max_tokens: OpenAI completions' default of 16
    result = client.infer("tiny", [text_input()])
    assert result.as_numpy("num_output_tokens")[0] == 16


def test_token_ids_in_and_out(client: grpcclient.InferenceServerClient, tok: Tokenizer) -> None:
    ids = np.array([tok.encode("Hello there").ids], dtype=np.int64)
    t = grpcclient.InferInput("input_ids", list(ids.shape), "INT64")
    t.set_data_from_numpy(ids)
    result = client.infer(
        "tiny",
        [t, scalar("max_tokens", 5, "INT32")],
        outputs=[
            grpcclient.InferRequestedOutput("output_ids"),
            grpcclient.InferRequestedOutput("text_output"),
        ],
    )
    out = result.as_numpy("output_ids")
    assert out.dtype == np.int64 and out.shape == (1, 5)
    assert out[0].tolist() == tok.encode(DEFAULT_TEXT, add_special_tokens=False).ids[:5]
    assert result.as_numpy("text_output").shape == (1, 1)
    assert result.as_numpy("finish_reason") is None  # not requested


def _collect(q: queue.Queue[Any], request_id: str | None = None) -> list[Any]:
    """Responses (result, error) until a final response or an error."""
    out = []
    while True:
        result, error = q.get(timeout=10)
        out.append((result, error))
        if error is not None:
            return out
        if result.get_response().parameters["triton_final_response"].bool_param:
            return out


def test_streaming(client: grpcclient.InferenceServerClient, tok: Tokenizer) -> None:
    q: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(
            "tiny",
            [text_input(), scalar("max_tokens", 8, "INT32"), scalar("stream", True, "BOOL")],
            request_id="s-1",
            enable_empty_final_response=True,
        )
        responses = _collect(q)
        assert all(error is None for _, error in responses)
        *data, final = [r for r, _ in responses]
        assert final.get_response().outputs == [] and final.get_response().id == "s-1"
        texts = [r.as_numpy("text_output")[0].decode() for r in data]
        assert len(texts) > 1 and "".join(texts) == expected(tok, 8)
        reasons = [r.as_numpy("finish_reason")[0] for r in data]
        assert reasons[-1] == b"length" and set(reasons[:-1]) == {b""}
        assert data[-1].as_numpy("num_output_tokens")[0] == 8
        assert not any(
            r.get_response().parameters["triton_final_response"].bool_param for r in data
        )

        # stream=false on the stream: one complete response
        client.async_stream_infer(
            "tiny", [text_input(), scalar("max_tokens", 3, "INT32")], request_id="s-2"
        )
        result, error = q.get(timeout=10)
        assert error is None and result.as_numpy("text_output")[0].decode() == expected(tok, 3)
    finally:
        client.stop_stream()


def test_concurrent_requests_on_one_stream(
    client: grpcclient.InferenceServerClient, tok: Tokenizer
) -> None:
    q: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        for i in range(4):
            client.async_stream_infer(
                "tiny",
                [text_input(f"@slow@ {i}"), scalar("max_tokens", 4 + i, "INT32")],
                request_id=f"c-{i}",
                parameters={"stream": True},
                enable_empty_final_response=True,
            )
        texts: dict[str, str] = {}
        done: set[str] = set()
        order = []
        while len(done) < 4:
            result, error = q.get(timeout=10)
            assert error is None
            response = result.get_response()
            order.append(response.id)
            if response.parameters["triton_final_response"].bool_param:
                done.add(response.id)
            else:
                texts[response.id] = (
                    texts.get(response.id, "") + result.as_numpy("text_output")[0].decode()
                )
        assert texts == {f"c-{i}": expected(tok, 4 + i) for i in range(4)}
        assert order[:4] != ["c-0"] * 4  # interleaved, not one request after the other
    finally:
        client.stop_stream()


@pytest.mark.parametrize(
    ("prompt", "inputs", "model", "message"),
    [
        ("Hi", [], "nope", "does not exist"),
        ("Hi", [("bogus", 1, "INT32")], "tiny", "unexpected input 'bogus'"),
        ("@error:exhausted@", [], "tiny", "overloaded"),
        ("@error:unavailable@", [], "tiny", "no worker"),
        ("@error:internal@", [], "tiny", "internal error"),
        ("Hi", [("max_tokens", 600, "INT32")], "tiny", "maximum context length"),
    ],
)
def test_stream_errors_are_in_band(
    client: grpcclient.InferenceServerClient,
    prompt: str,
    inputs: list[tuple[str, Any, str]],
    model: str,
    message: str,
) -> None:
    q: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        extra = [scalar(*i) for i in inputs]
        client.async_stream_infer(
            model, [text_input(prompt), *extra], request_id="bad", parameters={"stream": True}
        )
        _, error = q.get(timeout=10)
        assert error is not None and message in error.message()
        assert "scripted internal failure" not in error.message()  # details stay in the log
        # the stream stays usable
        client.async_stream_infer("tiny", [text_input(), scalar("max_tokens", 2, "INT32")])
        result, error = q.get(timeout=10)
        assert error is None and result.as_numpy("num_output_tokens")[0] == 2
    finally:
        client.stop_stream()


def test_stream_error_after_tokens(client: grpcclient.InferenceServerClient) -> None:
    q: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(
            "tiny",
            [text_input("@midfail@"), scalar("stream", True, "BOOL")],
            request_id="mid",
            enable_empty_final_response=True,
        )
        responses = _collect(q)
        errors = [e for _, e in responses if e is not None]
        assert len(responses) >= 2 and len(errors) == 1 and "went away" in errors[0].message()
    finally:
        client.stop_stream()


@pytest.mark.parametrize(
    ("prompt", "inputs", "model", "status"),
    [
        ("Hi", [], "nope", "NOT_FOUND"),
        ("Hi", [("bogus", 1, "INT32")], "tiny", "INVALID_ARGUMENT"),
        ("Hi", [("stream", True, "BOOL")], "tiny", "INVALID_ARGUMENT"),
        ("Hi", [("temperature", 9.0, "FP32")], "tiny", "INVALID_ARGUMENT"),
        ("@error:exhausted@", [], "tiny", "RESOURCE_EXHAUSTED"),
        ("@error:unavailable@", [], "tiny", "UNAVAILABLE"),
        ("@error:internal@", [], "tiny", "INTERNAL"),
    ],
)
def test_unary_errors_are_status_codes(
    client: grpcclient.InferenceServerClient,
    prompt: str,
    inputs: list[tuple[str, Any, str]],
    model: str,
    status: str,
) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, [text_input(prompt), *(scalar(*i) for i in inputs)])
    assert info.value.status() == f"StatusCode.{status}"
    message = info.value.message()
    assert "Traceback" not in message and "scripted internal failure" not in message


def test_guided_sampling_parameters(client: grpcclient.InferenceServerClient) -> None:
    sampling = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([b'{"guided_choice": ["yes", "no"]}'], dtype=object))
    with pytest.raises(InferenceServerException) as info:
        client.infer("tiny", [text_input(), sampling])
    assert "GUIDED_DECODING" in info.value.message()
    assert client.infer("tiny-guided", [text_input(), sampling]).as_numpy("text_output") is not None


def test_cancelling_the_stream_frees_the_requests(
    client: grpcclient.InferenceServerClient, gateway: RunningGateway
) -> None:
    q: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer(
        "tiny", [text_input("@slow@"), scalar("stream", True, "BOOL")], request_id="long"
    )
    q.get(timeout=10)  # it started
    client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 5
    while True:
        with urllib.request.urlopen(gateway.http + "/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        if 'kvmesh_frontend_inflight_requests{model="tiny"} 0.0' in metrics:
            break
        assert time.monotonic() < deadline, "the cancelled request is still in flight"
        time.sleep(0.05)
    assert (
        'kvmesh_frontend_requests_total{endpoint="kserve_grpc_stream_infer",'
        'error_type="cancelled",model="tiny",request_type="stream",status="error"} 1.0' in metrics
    )


def test_cancelled_unary_infer_is_counted(
    client: grpcclient.InferenceServerClient, gateway: RunningGateway
) -> None:
    """A unary ModelInfer the client gives up on (deadline) frees its request and is counted
    as cancelled."""
    with pytest.raises(InferenceServerException):
        client.infer("tiny", [text_input("@slow@")], client_timeout=0.1)
    deadline = time.monotonic() + 5
    line = (
        'kvmesh_frontend_requests_total{endpoint="kserve_grpc_infer",error_type="cancelled",'
        'model="tiny",request_type="unary",status="error"} 1.0'
    )
    while True:
        with urllib.request.urlopen(gateway.http + "/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        if line in metrics and 'kvmesh_frontend_inflight_requests{model="tiny"} 0.0' in metrics:
            break
        assert time.monotonic() < deadline, "the cancelled call is not counted"
        time.sleep(0.05)


async def test_asyncio_client_streaming(gateway: RunningGateway, tok: Tokenizer) -> None:
    client = aiogrpcclient.InferenceServerClient(gateway.grpc)
    try:
        assert await client.is_server_ready()

        async def requests() -> Any:
            for i in range(2):
                t = aiogrpcclient.InferInput("text_input", [1], "BYTES")
                t.set_data_from_numpy(np.array([b"Hi"], dtype=object))
                m = aiogrpcclient.InferInput("max_tokens", [1], "INT32")
                m.set_data_from_numpy(np.array([3 + i], dtype=np.int32))
                yield {
                    "model_name": "tiny",
                    "inputs": [t, m],
                    "request_id": f"a-{i}",
                    "parameters": {"stream": True},
                    "enable_empty_final_response": True,
                }

        texts: dict[str, str] = {}
        finals = 0
        async for result, error in client.stream_infer(requests()):
            assert error is None
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
                if finals == 2:
                    break
                continue
            piece = result.as_numpy("text_output")[0].decode()
            texts[response.id] = texts.get(response.id, "") + piece
        assert texts == {"a-0": expected(tok, 3), "a-1": expected(tok, 4)}
    finally:
        await client.close()
