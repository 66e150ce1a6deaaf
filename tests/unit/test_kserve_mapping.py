"""KServe v2 requests -> text completions, raw tensor codecs and response encoding (no I/O)."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from kvmesh.frontend import kserve
from kvmesh.frontend.dataplane import ChoiceDelta, ChoiceResult, CompletionResult, UsageInfo
from kvmesh.frontend.kserve import InferEncoder, InferRequest, Tensor, to_generation
from kvmesh.frontend.kserve_http import decode_generate, decode_infer, encode_infer
from kvmesh.frontend.protocol import SamplingParameters
from kvmesh.runtime.errors import InvalidRequest, NotFound

pytestmark = pytest.mark.unit


def text(prompt: str = "Hello", shape: list[int] | None = None) -> Tensor:
    return Tensor("text_input", "BYTES", shape or [1], [prompt.encode()])


def req(*inputs: Tensor, **params: Any) -> InferRequest:
    return InferRequest("m", inputs=list(inputs), parameters=params)


def test_text_prompt_with_tensors_parameters_and_sampling_json() -> None:
    sampling = json.dumps({"temperature": 0.1, "top_p": 0.5, "max_tokens": 3, "stop": ["a"]})
    call = to_generation(
        req(
            text("Hi there"),
            Tensor("max_tokens", "INT32", [1], [7]),
            Tensor("sampling_parameters", "BYTES", [1], [sampling.encode()]),
            Tensor("stop_words", "BYTES", [2], [b"END", b"STOP"]),
            top_k=5,
            temperature=0.7,
            random_seed=11,
        ),
        allow_stream=False,
    )
    r = call.request
    assert r.model == "m" and r.prompts == ["Hi there"] and not r.echo and not r.stream
    o = r.options
    # sampling_parameters < request parameters < input tensors
    assert (o.max_tokens, o.temperature, o.top_p, o.top_k, o.seed) == (7, 0.7, 0.5, 5, 11)
    assert o.stop == ("END", "STOP")
    assert call.outputs == ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens"]
    assert not o.return_token_ids and not call.batched and call.ids_datatype == "INT32"


def test_token_prompt_returns_output_ids() -> None:
    call = to_generation(req(Tensor("input_ids", "INT64", [1, 3], [5, 6, 7])), allow_stream=False)
    assert call.request.prompts == [[5, 6, 7]]
    assert call.outputs[-1] == "output_ids" and call.request.options.return_token_ids
    assert call.batched and call.ids_datatype == "INT64"


def test_flags_and_requested_outputs() -> None:
    call = to_generation(
        InferRequest(
            "m",
            "1",
            "id-1",
            {"stream": True, "triton_enable_empty_final_response": True},
            [text(), Tensor("return_num_input_tokens", "BOOL", [1], [False])],
        ),
        allow_stream=True,
    )
    assert call.stream and call.request.stream and call.empty_final
    assert "num_input_tokens" not in call.outputs
    call = to_generation(
        InferRequest("m", inputs=[text()], outputs=["output_ids", "text_output"]),
        allow_stream=False,
    )
    assert call.outputs == ["output_ids", "text_output"] and call.request.options.return_token_ids
    echo = to_generation(
        req(text(), Tensor("exclude_input_in_output", "BOOL", [1], [False])), allow_stream=False
    )
    assert echo.request.echo


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (req(), "missing input 'text_input'"),
        (req(text(), Tensor("bogus", "INT32", [1], [1])), "unexpected input 'bogus'"),
        (req(text(), text()), "given twice"),
        (req(text(), Tensor("input_ids", "INT32", [1], [1])), "not both"),
        (req(Tensor("text_input", "INT32", [1], [1])), "datatype BYTES"),
        (req(Tensor("text_input", "BYTES", [2], [b"a", b"b"])), "exactly one element"),
        (req(Tensor("text_input", "BYTES", [1], [b"\xff"])), "UTF-8"),
        (req(text(""), max_tokens=1), "empty"),
        (req(Tensor("input_ids", "FP32", [1], [1.0])), "integer datatype"),
        (req(Tensor("input_ids", "INT32", [1], [-1])), "token ids"),
        (req(text(), Tensor("max_tokens", "BYTES", [1], [b"many"])), "integer"),
        (req(text(), Tensor("max_tokens", "INT32", [1], [0])), "max_tokens"),
        (req(text(), temperature=float("nan")), "finite"),
        (req(text(), stream=True), "ModelStreamInfer"),
        (req(text(), beam_width=4), "beam_width"),
        (req(text(), sampling_parameters="[1]"), "JSON object"),
        (req(text(), sampling_parameters='{"use_beam_search": true}'), "use_beam_search"),
        (req(text(), sampling_parameters='{"n": 2}'), "must be 1"),
        (InferRequest("m", inputs=[text()], outputs=["nope"]), "unknown output"),
        (InferRequest("", inputs=[text()]), "model_name"),
    ],
)
def test_invalid_requests(request_: InferRequest, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        to_generation(request_, allow_stream=False)


def test_unknown_version() -> None:
    with pytest.raises(NotFound):
        to_generation(InferRequest("m", "2", inputs=[text()]), allow_stream=False)
    to_generation(InferRequest("m", "1", inputs=[text()]), allow_stream=False)


def test_raw_codecs() -> None:
    raw = kserve.encode_bytes_tensor([b"ab", b"", "日本".encode()])
    assert kserve.decode_raw("BYTES", raw, [3], "x") == [b"ab", b"", "日本".encode()]
    assert kserve.decode_raw("INT32", struct.pack("<3i", 1, -2, 3), [1, 3], "x") == [1, -2, 3]
    assert kserve.decode_raw("BOOL", b"\x01\x00", [2], "x") == [True, False]
    assert kserve.decode_raw("FP16", struct.pack("<e", 1.5), [1], "x") == [1.5]
    for dtype, data, shape, message in [
        ("BYTES", b"\x05\x00\x00\x00ab", [1], "inside an element"),
        ("BYTES", b"\x01\x00", [1], "length prefix"),
        ("INT32", b"\x00" * 6, [1], "whole INT32"),
        ("INT64", b"\x00" * 8, [2], "needs 2"),
        ("BF16", b"\x00\x00", [1], "unsupported"),
        ("INT32", b"", [-1], "negative"),
        ("INT32", b"", [1 << 20, 1 << 20], "too large"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            kserve.decode_raw(dtype, data, shape, "x")
    out = Tensor("o", "UINT32", [2], [1, 2])
    assert kserve.encode_raw(out) == struct.pack("<2I", 1, 2)


def test_encoder_streamed_and_unary() -> None:
    call = to_generation(
        req(text(), triton_enable_empty_final_response=True, return_output_ids=True),
        allow_stream=True,
    )
    enc = InferEncoder(call, "m", "r1")
    first = enc.delta(ChoiceDelta(0, "Hel", token_ids=[1, 2]), 4, 2)
    assert first.id == "r1" and first.parameters == {"triton_final_response": False}
    outs = {t.name: t for t in first.outputs}
    assert outs["text_output"].data == [b"Hel"] and outs["finish_reason"].data == [b""]
    assert outs["num_input_tokens"].data == [4] and outs["output_ids"].data == [1, 2]
    last = enc.delta(ChoiceDelta(0, "", "length"), 4, 3)
    assert {t.name: t.data for t in last.outputs}["finish_reason"] == [b"length"]
    final = enc.final()
    assert final.outputs == [] and final.parameters == {"triton_final_response": True}
    result = CompletionResult(
        "c", 0, "m", "text", [ChoiceResult(0, "Hello", "stop", token_ids=[9])], UsageInfo(4, 1)
    )
    unary = InferEncoder(call, "m", "r2").result(result)
    assert {t.name: t.data for t in unary.outputs}["text_output"] == [b"Hello"]


def test_rest_json_and_binary_bodies() -> None:
    body = json.dumps(
        {
            "id": "q",
            "parameters": {"max_tokens": 4, "binary_data_output": True},
            "inputs": [
                {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [["Hi"]]}
            ],
            "outputs": [{"name": "text_output", "parameters": {"binary_data": True}}],
        }
    ).encode()
    infer, binary_all, binary_outputs = decode_infer(body, None, "m", "")
    assert infer.inputs[0].data == [b"Hi"] and infer.id == "q" and infer.outputs == ["text_output"]
    assert binary_all and binary_outputs == {"text_output"}
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input_ids",
                    "datatype": "INT32",
                    "shape": [2],
                    "parameters": {"binary_data_size": 8},
                }
            ]
        }
    ).encode()
    infer, _, _ = decode_infer(header + struct.pack("<2i", 3, 4), str(len(header)), "m", "")
    assert infer.inputs[0].data == [3, 4]
    for bad, length in [
        (b"[]", None),
        (b'{"inputs": 3}', None),
        (b'{"inputs": [{"name": "x", "datatype": "INT32", "shape": [2], "data": [1]}]}', None),
        (b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [1]}]}', None),
        (header, str(len(header))),  # binary part missing
        (body, "x"),
    ]:
        with pytest.raises(InvalidRequest):
            decode_infer(bad, length, "m", "")

    resp = kserve.InferResponse("m", "1", "q", [Tensor("text_output", "BYTES", [1], [b"ok"])])
    data, length = encode_infer(resp, False, set())
    assert length is None and json.loads(data)["outputs"][0]["data"] == ["ok"]
    data, length = encode_infer(resp, True, set())
    assert length is not None and data[length:] == b"\x02\x00\x00\x00ok"


def test_generate_extension_body() -> None:
    infer = decode_generate(
        json.dumps(
            {
                "text_input": "Hi",
                "max_tokens": 3,
                "stream": False,
                "stop": ["a", "b"],
                "temperature": 0.5,
                "parameters": {"top_k": 2},
            }
        ).encode(),
        "m",
        "",
    )
    call = to_generation(infer, allow_stream=False)
    o = call.request.options
    assert (o.max_tokens, o.temperature, o.top_k, o.stop) == (3, 0.5, 2, ("a", "b"))
    with pytest.raises(InvalidRequest):
        decode_generate(b'{"text_input": {"nested": 1}}', "m", "")


def _prompt_and(*inputs: Tensor, **params: Any) -> InferRequest:
    return req(text("Hi"), *inputs, **params)


@pytest.mark.parametrize(
    ("request_", "param", "message"),
    [
        (
            _prompt_and(Tensor("temperature", "FP32", [1], [3.0])),
            "temperature",
            "'temperature' must be between 0.0 and 2.0, got 3.0",
        ),
        (
            _prompt_and(random_seed=2**64 - 1),
            "seed",
            "'seed' must be between -9223372036854775808 and 9223372036854775807, "
            "got 18446744073709551615",
        ),
        (
            _prompt_and(Tensor("stop", "BYTES", [5], [b"a", b"b", b"c", b"d", b"e"])),
            "stop",
            "'stop' accepts at most 4 strings, got 5",
        ),
        (
            _prompt_and(sampling_parameters='{"guided_choice": []}'),
            "guided_choice",
            "'guided_choice' must be a non-empty list of non-empty strings",
        ),
        (
            _prompt_and(sampling_parameters='{"temperature": "hot"}'),
            "temperature",
            "'temperature' must be a number",
        ),
        (
            _prompt_and(Tensor("min_tokens", "INT32", [1], [9]), max_tokens=3),
            "min_tokens",
            "'min_tokens' (9) must not exceed 'max_tokens' (3)",
        ),
        (
            _prompt_and(Tensor("max_tokens", "BYTES", [1], [b"99999999999999999999999"])),
            None,
            "inputs hold values that cannot be used",
        ),
    ],
)
def test_sampling_values_are_checked_as_in_openai_bodies(
    request_: InferRequest, param: str | None, message: str
) -> None:
    """Same checks, same messages as an OpenAI body (kvmesh.frontend.protocol)."""
    with pytest.raises(InvalidRequest) as info:
        to_generation(request_, allow_stream=False)
    assert (info.value.param, info.value.message) == (param, message)


def test_a_tensor_overrides_a_bad_sampling_parameter() -> None:
    """sampling_parameters < request parameters < input tensors, before anything is checked."""
    call = to_generation(
        _prompt_and(
            Tensor("temperature", "FP32", [1], [0.5]),
            sampling_parameters='{"temperature": "hot", "top_k": 3}',
        ),
        allow_stream=False,
    )
    assert (call.request.options.temperature, call.request.options.top_k) == (0.5, 3)


def test_sampling_keys_are_sampling_parameters() -> None:
    assert set(SamplingParameters.__struct_fields__) >= kserve.SAMPLING_KEYS
