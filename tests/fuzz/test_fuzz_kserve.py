"""Hypothesis-generated KServe v2 messages against a real gateway: gRPC ModelInfer and
ModelStreamInfer (messages built with tritonclient's own protobuf classes) and the REST infer /
generate routes. Whatever arrives, the answer is a proper status (never INTERNAL / UNKNOWN or
HTTP 5xx), stream errors are in-band, and the gateway keeps serving.

The fast smoke runs by default; `-m slow` runs many more examples.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from tests.fake_gateway import RunningGateway

pytestmark = pytest.mark.integration

DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
    "BF16",
]
INPUT_NAMES = [
    "text_input",
    "input_ids",
    "stream",
    "streaming",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "random_seed",
    "stop",
    "stop_words",
    "sampling_parameters",
    "exclude_input_in_output",
    "return_output_ids",
    "beam_width",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
]
OUTPUT_NAMES = [
    "text_output",
    "finish_reason",
    "num_input_tokens",
    "num_output_tokens",
    "output_ids",
    "nope",
]
CONTENTS = {
    "BOOL": ("bool_contents", st.booleans()),
    "INT8": ("int_contents", st.integers(-(2**31), 2**31 - 1)),
    "INT16": ("int_contents", st.integers(-(2**31), 2**31 - 1)),
    "INT32": ("int_contents", st.integers(-(2**31), 2**31 - 1)),
    "INT64": ("int64_contents", st.integers(-(2**63), 2**63 - 1)),
    "UINT8": ("uint_contents", st.integers(0, 2**32 - 1)),
    "UINT16": ("uint_contents", st.integers(0, 2**32 - 1)),
    "UINT32": ("uint_contents", st.integers(0, 2**32 - 1)),
    "UINT64": ("uint64_contents", st.integers(0, 2**64 - 1)),
    "FP32": ("fp32_contents", st.floats(width=32)),
    "FP64": ("fp64_contents", st.floats()),
    "BYTES": ("bytes_contents", st.binary(max_size=40) | st.text(max_size=40).map(str.encode)),
}
SAMPLING_JSON = st.dictionaries(
    st.sampled_from(
        [
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop",
            "n",
            "guided_choice",
            "logit_bias",
            "min_tokens",
            "bogus",
        ]
    ),
    st.none()
    | st.booleans()
    | st.integers(-5, 10**12)
    | st.floats()
    | st.text(max_size=10)
    | st.lists(st.text(max_size=5), max_size=3),
    max_size=4,
).map(lambda d: json.dumps(d, allow_nan=True).encode())
SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": list(HealthCheck),
}


def _parameter(value: Any) -> pb.InferParameter:
    param = pb.InferParameter()
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        if value >= 2**63:
            param.uint64_param = value
        else:
            param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = value
    return param


PARAM_VALUES = (
    st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | SAMPLING_JSON.map(bytes.decode)
)


@st.composite
def tensors(draw: st.DrawFn, raw: bool) -> tuple[pb.ModelInferRequest.InferInputTensor, bytes]:
    name = draw(st.sampled_from(INPUT_NAMES) | st.text(max_size=8))
    datatype = draw(st.sampled_from(DATATYPES) | st.text(max_size=5))
    if name == "text_input" and draw(st.booleans()):
        datatype = "BYTES"
    if name == "sampling_parameters" and draw(st.booleans()):
        datatype = "BYTES"
    shape = draw(st.lists(st.integers(-2, 4), max_size=3))
    tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    data = b""
    if raw:
        data = draw(st.binary(max_size=64))
    elif datatype in CONTENTS:
        attr, values = CONTENTS[datatype]
        if name == "sampling_parameters" and datatype == "BYTES":
            values = SAMPLING_JSON
        getattr(tensor.contents, attr).extend(draw(st.lists(values, max_size=4)))
    return tensor, data


SCALARS = {  # well-typed sampling inputs, with values inside and outside their ranges
    "max_tokens": ("INT32", st.integers(-3, 700)),
    "min_tokens": ("INT32", st.integers(-1, 20)),
    "top_k": ("INT32", st.integers(-2, 50)),
    "beam_width": ("INT32", st.integers(0, 3)),
    "seed": ("INT64", st.integers(-(2**63), 2**63 - 1)),
    "temperature": ("FP32", st.floats(-1, 3, width=32) | st.just(float("nan"))),
    "top_p": ("FP32", st.floats(-0.5, 1.5, width=32)),
    "presence_penalty": ("FP32", st.floats(-3, 3, width=32)),
    "stream": ("BOOL", st.booleans()),
    "exclude_input_in_output": ("BOOL", st.booleans()),
    "return_output_ids": ("BOOL", st.booleans()),
    "ignore_eos": ("BOOL", st.booleans()),
    "sampling_parameters": ("BYTES", SAMPLING_JSON),
}


@st.composite
def good_inputs(draw: st.DrawFn) -> list[pb.ModelInferRequest.InferInputTensor]:
    """A prompt plus well-formed sampling tensors: requests that reach the service."""
    batched = draw(st.booleans())
    if draw(st.integers(0, 3)):
        prompt = pb.ModelInferRequest.InferInputTensor(
            name="text_input", datatype="BYTES", shape=[1, 1] if batched else [1]
        )
        prompt.contents.bytes_contents.append(draw(st.text(min_size=1, max_size=30)).encode())
    else:
        ids = draw(st.lists(st.integers(0, 140_000), min_size=1, max_size=12))
        dtype = draw(st.sampled_from(["INT32", "INT64", "UINT32"]))
        prompt = pb.ModelInferRequest.InferInputTensor(
            name="input_ids", datatype=dtype, shape=[1, len(ids)] if batched else [len(ids)]
        )
        attr = {"INT32": "int_contents", "INT64": "int64_contents", "UINT32": "uint_contents"}
        getattr(prompt.contents, attr[dtype]).extend(ids)
    out = [prompt]
    for name in draw(st.lists(st.sampled_from(sorted(SCALARS)), max_size=4, unique=True)):
        dtype, values = SCALARS[name]
        tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype=dtype, shape=[1])
        getattr(tensor.contents, CONTENTS[dtype][0]).append(draw(values))
        out.append(tensor)
    if draw(st.booleans()):
        stops = draw(st.lists(st.text(max_size=4), max_size=5))
        tensor = pb.ModelInferRequest.InferInputTensor(
            name="stop", datatype="BYTES", shape=[len(stops)]
        )
        tensor.contents.bytes_contents.extend(s.encode() for s in stops)
        out.append(tensor)
    return out


MODELS = st.sampled_from(["tiny", "tiny", "tiny", "tiny-guided", "", "nope"]) | st.text(max_size=8)


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    """Half well-formed requests that reach the service (with edge values), half anything."""
    clean = draw(st.booleans())
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(["tiny", "tiny-guided"]) if clean else MODELS),
        model_version=draw(st.sampled_from(["", "1"] if clean else ["", "1", "2"])),
        id=draw(st.text(max_size=8)),
    )
    if clean:
        params = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "stream": st.booleans(),
                    "temperature": st.floats(0, 2),
                    "max_tokens": st.integers(1, 20),
                },
            )
        )
        params["triton_enable_empty_final_response"] = draw(st.booleans())
    else:
        names = st.sampled_from(INPUT_NAMES) | st.text(max_size=8)
        params = draw(st.dictionaries(names, PARAM_VALUES, max_size=4))
    for key, value in params.items():
        request.parameters[key].CopyFrom(_parameter(value))
    if clean or draw(st.booleans()):
        request.inputs.extend(draw(good_inputs()))
    else:
        raw = draw(st.booleans())
        for tensor, data in draw(st.lists(tensors(raw), max_size=4)):
            request.inputs.append(tensor)
            if raw:
                request.raw_input_contents.append(data)
    outputs = st.sampled_from(OUTPUT_NAMES[:-1] if clean else OUTPUT_NAMES)
    for name in draw(st.lists(outputs, max_size=3)):
        request.outputs.add(name=name)
    return request


BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED}


@pytest.fixture(scope="module")
def stub(gateway: RunningGateway) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(gateway.grpc)
    yield pb_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _check_grpc(
    stub: pb_grpc.GRPCInferenceServiceStub, requests_: list[pb.ModelInferRequest]
) -> None:
    try:
        stub.ModelInfer(requests_[0], timeout=30)
    except grpc.RpcError as err:
        assert err.code() not in BAD_CODES, (err.code(), err.details(), requests_[0])
    responses = list(stub.ModelStreamInfer(iter(requests_), timeout=30))
    for response in responses:
        assert response.error_message != "internal error", requests_
        if response.error_message:
            assert response.infer_response.id in {r.id for r in requests_}


def _check_rest(gateway: RunningGateway, model: str, path: str, body: Any) -> None:
    resp = requests.post(
        f"{gateway.http}/v2/models/{model}/{path}",
        data=json.dumps(body).encode(),  # NaN / Infinity included: not JSON, must be a 400
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code < 500, (resp.status_code, resp.text, body)
    if resp.status_code != 200:
        assert set(resp.json()) == {"error"}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
REST_INPUT = st.fixed_dictionaries(
    {
        "name": st.sampled_from(INPUT_NAMES),
        "datatype": st.sampled_from(DATATYPES),
        "shape": st.lists(st.integers(-1, 3), max_size=2),
    },
    optional={"data": JSON, "parameters": st.dictionaries(st.text(max_size=5), JSON, max_size=2)},
)
REST_INFER = st.fixed_dictionaries(
    {"inputs": st.lists(REST_INPUT, max_size=3)},
    optional={
        "id": st.text(max_size=5),
        "parameters": st.dictionaries(st.sampled_from(INPUT_NAMES), JSON, max_size=3),
        "outputs": JSON,
    },
)
GENERATE = st.dictionaries(st.sampled_from([*INPUT_NAMES, "parameters", "id"]), JSON, max_size=5)


@given(st.lists(infer_requests(), min_size=1, max_size=3))
@settings(max_examples=40, **SETTINGS)  # type: ignore[arg-type]
def test_grpc_smoke(
    stub: pb_grpc.GRPCInferenceServiceStub, reqs: list[pb.ModelInferRequest]
) -> None:
    _check_grpc(stub, reqs)


@given(REST_INFER, GENERATE, st.sampled_from(["tiny", "nope", "tiny-guided/versions/1"]))
@settings(max_examples=40, **SETTINGS)  # type: ignore[arg-type]
def test_rest_smoke(gateway: RunningGateway, infer: Any, generate: Any, model: str) -> None:
    _check_rest(gateway, model, "infer", infer)
    _check_rest(gateway, model, "generate", generate)


@pytest.mark.slow
@given(st.lists(infer_requests(), min_size=1, max_size=3))
@settings(max_examples=1500, **SETTINGS)  # type: ignore[arg-type]
def test_grpc_thorough(
    stub: pb_grpc.GRPCInferenceServiceStub, reqs: list[pb.ModelInferRequest]
) -> None:
    _check_grpc(stub, reqs)


@pytest.mark.slow
@given(REST_INFER, GENERATE, st.sampled_from(["tiny", "nope", "tiny-guided/versions/1"]))
@settings(max_examples=1500, **SETTINGS)  # type: ignore[arg-type]
def test_rest_thorough(gateway: RunningGateway, infer: Any, generate: Any, model: str) -> None:
    _check_rest(gateway, model, "infer", infer)
    _check_rest(gateway, model, "generate", generate)
