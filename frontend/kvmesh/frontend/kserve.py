"""KServe v2 (Open Inference Protocol) inference requests <-> the typed data plane.

Both KServe transports (the gRPC servicer in kvmesh.frontend.kserve_grpc and the REST routes in
kvmesh.frontend.kserve_http) decode their wire format into the typed `InferRequest` / `Tensor`
here; `to_generation` maps it to the data plane's `CompletionRequest`
(kvmesh.frontend.dataplane) for `OpenAIService.completion`, and `InferEncoder` turns the
service's deltas or result into `InferResponse`s. Sampling values are checked by the same code
as an OpenAI body's (kvmesh.frontend.protocol.generation_options), with the same messages.

LLM tensor convention (as Triton's vLLM / TRT-LLM backends and Dynamo use it):

- in: `text_input` (BYTES, one element: the prompt) or `input_ids` (INT32/INT64/UINT32/UINT64:
  prompt token ids, for clients that tokenize themselves); optional scalar tensors
  `max_tokens`, `min_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`,
  `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `ignore_eos`, `stop` /
  `stop_words` (BYTES, one stop string per element), `stream` / `streaming`,
  `exclude_input_in_output`, `return_finish_reason`, `return_num_input_tokens`,
  `return_num_output_tokens`, `return_output_ids`, `sampling_parameters` (BYTES: a JSON object
  of vLLM sampling parameters), and TRT-LLM's `random_seed`, `runtime_top_k`,
  `runtime_top_p`, `min_length`, `beam_width` (1 only). The same names are accepted as request
  parameters. Precedence: sampling_parameters < request parameters < input tensors.
  Any other input tensor is refused (INVALID_ARGUMENT), as Dynamo does; unknown request
  parameters are ignored (Triton reserves several for itself).
- out: `text_output` (BYTES), `finish_reason` (BYTES: "stop", "length", "" while
  streaming), `num_input_tokens` / `num_output_tokens` (UINT32), and `output_ids` (the
  input_ids datatype, INT32 for text prompts) when the prompt was token ids or
  `return_output_ids` is set. Each output has the shape of the prompt tensor's batch
  dimensions ([1] or [1, 1]); output_ids has [n] or [1, n]. Requested `outputs` select and
  order them (an unknown name is INVALID_ARGUMENT).

Defaults follow Dynamo: the prompt is not echoed (`exclude_input_in_output` defaults to true,
unlike Triton's vLLM backend) and max_tokens defaults to 16 as in OpenAI completions.
Streaming (`stream: true`) requires ModelStreamInfer (or REST generate_stream); plain
ModelInfer / infer refuse it. `triton_enable_empty_final_response` makes every streamed
response carry `triton_final_response`, the last one an empty response with it set to true.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any, Literal

import orjson
from msgspec import Struct, field

from kvmesh.frontend.dataplane import (
    ChoiceDelta,
    CompletionRequest,
    CompletionResult,
    EmbeddingRequest,
    EmbeddingResult,
)
from kvmesh.frontend.protocol import generation_options, token_ids
from kvmesh.runtime import __version__
from kvmesh.runtime.errors import InvalidRequest, NotFound
from kvmesh.runtime.types import ModelInfo

__all__ = [
    "DATATYPES",
    "EXTENSIONS",
    "INPUT_TYPES",
    "OUTPUT_TYPES",
    "SERVER_METADATA",
    "SERVER_NAME",
    "GenerationCall",
    "InferEncoder",
    "InferRequest",
    "InferResponse",
    "ModelMetadataResponse",
    "ParamValue",
    "ServerMetadataResponse",
    "Tensor",
    "TensorMetadata",
    "check_version",
    "decode_bytes_tensor",
    "decode_raw",
    "encode_bytes_tensor",
    "encode_raw",
    "model_config",
    "model_metadata",
    "to_generation",
]

ParamValue = bool | int | float | str
"""A request or response parameter (InferParameter's oneof)."""

SERVER_NAME = "kvmesh"
SERVER_VERSION = __version__
EXTENSIONS = ("model_configuration", "generate", "binary_tensor_data")
"""Extensions ServerMetadata reports (Triton's names)."""
MODEL_VERSION = "1"
"""kvmesh models have a single version; "" and "1" both select it."""

_RAW_FORMATS = {
    "BOOL": "?",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
DATATYPES = frozenset([*_RAW_FORMATS, "BYTES", "BF16"])
"""Every datatype name of the protocol."""
_ID_TYPES = frozenset({"INT32", "INT64", "UINT32", "UINT64"})
MAX_ELEMENTS = 1 << 24
"""Largest tensor (elements) accepted."""


class Tensor(Struct):
    """A decoded tensor: `data` is flat, row-major; bytes for BYTES, bool / int / float
    otherwise."""

    name: str
    datatype: str
    shape: list[int]
    data: list[Any]


class InferRequest(Struct):
    """A decoded ModelInferRequest (either transport)."""

    model: str
    version: str = ""
    id: str = ""
    parameters: dict[str, ParamValue] = field(default_factory=dict)
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    """Requested output names in order; empty: the default outputs."""


class InferResponse(Struct):
    """A ModelInferResponse to encode (either transport)."""

    model: str
    version: str
    id: str
    outputs: list[Tensor]
    parameters: dict[str, ParamValue] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Raw tensor contents


def element_count(shape: list[int], name: str) -> int:
    """Number of elements of `shape`; InvalidRequest for negative or huge shapes."""
    count = 1
    for dim in shape:
        if dim < 0:
            raise InvalidRequest(f"input '{name}' has a negative dimension in shape {shape}")
        count *= dim
        if count > MAX_ELEMENTS:
            raise InvalidRequest(f"input '{name}' is too large (shape {shape})")
    return count


def decode_bytes_tensor(raw: bytes, name: str) -> list[bytes]:
    """Elements of a raw BYTES tensor: each a 4-byte little-endian length, then the bytes."""
    out: list[bytes] = []
    i = 0
    n = len(raw)
    while i < n:
        if i + 4 > n:
            raise InvalidRequest(f"raw contents of input '{name}' end inside a length prefix")
        (size,) = struct.unpack_from("<I", raw, i)
        i += 4
        if i + size > n:
            raise InvalidRequest(f"raw contents of input '{name}' end inside an element")
        out.append(raw[i : i + size])
        i += size
    return out


def encode_bytes_tensor(items: list[bytes]) -> bytes:
    """Raw form of a BYTES tensor."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def decode_raw(datatype: str, raw: bytes, shape: list[int], name: str) -> list[Any]:
    """Elements of raw tensor contents, checked against the shape."""
    count = element_count(shape, name)
    if datatype == "BYTES":
        items: list[Any] = decode_bytes_tensor(raw, name)
    else:
        fmt = _RAW_FORMATS.get(datatype)
        if fmt is None:
            raise InvalidRequest(f"input '{name}' has unsupported datatype {datatype!r}")
        size = struct.calcsize(fmt)
        if len(raw) % size:
            raise InvalidRequest(
                f"raw contents of input '{name}' ({len(raw)} bytes) do not hold whole "
                f"{datatype} elements"
            )
        items = list(struct.unpack(f"<{len(raw) // size}{fmt}", raw))
    if len(items) != count:
        raise InvalidRequest(
            f"input '{name}' has {len(items)} elements but its shape {shape} needs {count}"
        )
    return items


def encode_raw(tensor: Tensor) -> bytes:
    """Raw contents of an output tensor."""
    if tensor.datatype == "BYTES":
        return encode_bytes_tensor(tensor.data)
    fmt = _RAW_FORMATS[tensor.datatype]
    return struct.pack(f"<{len(tensor.data)}{fmt}", *tensor.data)


# --------------------------------------------------------------------------------------------
# Requests -> CompletionRequest

ScalarKind = Literal["int", "float", "bool"]
_SCALARS: dict[str, tuple[ScalarKind, str]] = {
    # input / parameter name -> (kind, SamplingParameters field)
    "max_tokens": ("int", "max_tokens"),
    "min_tokens": ("int", "min_tokens"),
    "min_length": ("int", "min_tokens"),
    "temperature": ("float", "temperature"),
    "top_p": ("float", "top_p"),
    "runtime_top_p": ("float", "top_p"),
    "top_k": ("int", "top_k"),
    "runtime_top_k": ("int", "top_k"),
    "min_p": ("float", "min_p"),
    "seed": ("int", "seed"),
    "random_seed": ("int", "seed"),
    "presence_penalty": ("float", "presence_penalty"),
    "frequency_penalty": ("float", "frequency_penalty"),
    "repetition_penalty": ("float", "repetition_penalty"),
    "ignore_eos": ("bool", "ignore_eos"),
}
_FLAGS = frozenset(
    {
        "stream",
        "streaming",
        "exclude_input_in_output",
        "return_finish_reason",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "return_output_ids",
    }
)
_PROMPTS = frozenset({"text_input", "input_ids"})
_KIND_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool}
INPUT_TYPES: dict[str, Any] = {
    "text_input": str,
    "input_ids": list[int],
    **{name: _KIND_TYPES[kind] for name, (kind, _) in _SCALARS.items()},
    **dict.fromkeys(sorted(_FLAGS), bool),
    "stop": str | list[str],
    "stop_words": str | list[str],
    "sampling_parameters": str,
    "beam_width": int,
}
"""Input tensors the LLM models accept, with their JSON type in the generate extension."""
INPUT_NAMES = frozenset(INPUT_TYPES)
OUTPUT_TYPES: dict[str, Any] = {
    "text_output": str,
    "finish_reason": str,
    "num_input_tokens": int,
    "num_output_tokens": int,
    "output_ids": list[int],
}
"""Output tensors, with their JSON type in the generate extension."""
OUTPUT_NAMES = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")
OPTIONAL_OUTPUTS = ("output_ids",)
SAMPLING_KEYS = frozenset(
    {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "ignore_eos",
        "stop",
        "stop_token_ids",
        "skip_special_tokens",
        "logit_bias",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "n",
        "best_of",
    }
)
"""The vLLM sampling parameters `sampling_parameters` may hold (SamplingParameters fields)."""


class GenerationCall(Struct):
    """What a KServe inference request asks of the service, and how to answer it."""

    request: CompletionRequest
    stream: bool
    outputs: list[str]
    """Output tensors to return, in order."""
    ids_datatype: str
    """Datatype of output_ids."""
    batched: bool
    """The prompt tensor had a leading batch dimension: outputs get one too."""
    empty_final: bool
    """triton_enable_empty_final_response was set."""


def check_version(model: str, version: str) -> None:
    """NotFound unless `version` selects the (single) version of a model."""
    if version not in ("", MODEL_VERSION):
        raise NotFound(f"version {version!r} of model {model!r} does not exist", param="model")


def _one(tensor: Tensor) -> Any:
    if len(tensor.data) != 1:
        raise InvalidRequest(
            f"input '{tensor.name}' must hold exactly one element, got {len(tensor.data)}"
        )
    return tensor.data[0]


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise InvalidRequest(f"'{name}' is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"'{name}' must be a string (BYTES)")


def _convert(value: Any, kind: str, name: str) -> ParamValue:
    """A tensor element or parameter value as `kind` ("int", "float", "bool", "str")."""
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, (str, bytes)):
            text = _text(value, name).strip().lower()
            if text in ("true", "1"):
                return True
            if text in ("false", "0"):
                return False
        raise InvalidRequest(f"'{name}' must be a boolean")
    if kind == "int":
        if isinstance(value, bool):
            raise InvalidRequest(f"'{name}' must be an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, (str, bytes)):
            try:
                return int(_text(value, name).strip())
            except ValueError:
                pass
        raise InvalidRequest(f"'{name}' must be an integer")
    if kind == "float":
        if isinstance(value, bool):
            raise InvalidRequest(f"'{name}' must be a number")
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, (str, bytes)):
            try:
                number = float(_text(value, name).strip())
            except ValueError:
                raise InvalidRequest(f"'{name}' must be a number") from None
        else:
            raise InvalidRequest(f"'{name}' must be a number")
        if not math.isfinite(number):
            raise InvalidRequest(f"'{name}' must be a finite number")
        return number
    return _text(value, name)


def _stop_list(value: Any, name: str) -> list[str]:
    """Stop strings from a parameter: a JSON list of strings, or one string."""
    text = _text(value, name)
    if text.startswith("["):
        try:
            items = orjson.loads(text)
        except orjson.JSONDecodeError:
            items = None
        if isinstance(items, list) and all(isinstance(s, str) for s in items):
            return items
    return [text]


def _sampling_parameters(value: Any) -> dict[str, Any]:
    text = _text(value, "sampling_parameters")
    try:
        params = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise InvalidRequest(
            "'sampling_parameters' must be a JSON object", param="sampling_parameters"
        ) from None
    if not isinstance(params, dict):
        raise InvalidRequest(
            "'sampling_parameters' must be a JSON object", param="sampling_parameters"
        )
    unknown = sorted(k for k in params if k not in SAMPLING_KEYS)
    if unknown:
        raise InvalidRequest(
            f"unsupported sampling parameter(s): {', '.join(map(repr, unknown))}",
            param="sampling_parameters",
        )
    for key in ("n", "best_of"):
        if params.get(key) not in (None, 1):
            raise InvalidRequest(f"sampling parameter '{key}' must be 1", param=key)
    params.pop("n", None)
    params.pop("best_of", None)
    return params


def _apply(fields: dict[str, Any], flags: dict[str, bool], name: str, value: Any) -> None:
    """Set one named value (tensor element or parameter) on the sampling fields / flags."""
    if name in _SCALARS:
        kind, key = _SCALARS[name]
        fields[key] = _convert(value, kind, name)
    elif name in _FLAGS:
        flags[name] = bool(_convert(value, "bool", name))
    elif name in ("stop", "stop_words"):
        fields["stop"] = _stop_list(value, name)
    elif name == "beam_width":
        if _convert(value, "int", name) != 1:
            raise InvalidRequest("only beam_width 1 is supported", param="beam_width")


def to_generation(req: InferRequest, *, allow_stream: bool) -> GenerationCall:
    """Map an inference request to a text completion. Raises InvalidRequest / NotFound."""
    if not req.model:
        raise InvalidRequest("model_name is required", param="model")
    check_version(req.model, req.version)
    fields: dict[str, Any] = {}
    """SamplingParameters fields: sampling_parameters < request parameters < input tensors."""
    flags: dict[str, bool] = {}
    seen: set[str] = set()
    for tensor in req.inputs:
        if tensor.name in seen:
            raise InvalidRequest(f"input '{tensor.name}' is given twice")
        seen.add(tensor.name)
        if tensor.name not in INPUT_NAMES:
            raise InvalidRequest(
                f"unexpected input '{tensor.name}' (this model takes text_input or input_ids, "
                "plus optional sampling inputs)"
            )
    sampling = next((t for t in req.inputs if t.name == "sampling_parameters"), None)
    if sampling is not None:
        fields.update(_sampling_parameters(_one(sampling)))
    elif "sampling_parameters" in req.parameters:
        fields.update(_sampling_parameters(req.parameters["sampling_parameters"]))
    for name, value in req.parameters.items():
        if name in INPUT_NAMES and name not in _PROMPTS and name != "sampling_parameters":
            _apply(fields, flags, name, value)
    prompt: Tensor | None = None
    for tensor in req.inputs:
        name = tensor.name
        if name == "sampling_parameters":
            continue
        if name in _PROMPTS:
            if prompt is not None:
                raise InvalidRequest("give either text_input or input_ids, not both")
            prompt = tensor
        elif name in ("stop", "stop_words"):
            fields["stop"] = [_text(v, name) for v in tensor.data]
        else:
            _apply(fields, flags, name, _one(tensor))
    if prompt is None:
        raise InvalidRequest("missing input 'text_input' (or 'input_ids')")
    prompts: list[str | list[int]]
    if prompt.name == "text_input":
        if prompt.datatype != "BYTES":
            raise InvalidRequest("input 'text_input' must have datatype BYTES")
        text = _text(_one(prompt), "text_input")
        if not text:
            raise InvalidRequest("input 'text_input' is empty", param="prompt")
        prompts = [text]
        ids_datatype = "INT32"
    else:
        if prompt.datatype not in _ID_TYPES:
            raise InvalidRequest("input 'input_ids' must have an integer datatype")
        if not prompt.data:
            raise InvalidRequest("input 'input_ids' is empty", param="prompt")
        prompts = [prompt.data]
        ids_datatype = prompt.datatype
    stream = flags.get("stream", flags.get("streaming", False))
    if stream and not allow_stream:
        raise InvalidRequest(
            "streaming needs the ModelStreamInfer RPC (or REST generate_stream); "
            "ModelInfer returns one response per request"
        )
    # Streamed responses carry only new text: the prompt is echoed in unary ones only.
    echo = not flags.get("exclude_input_in_output", True) and not stream
    if any(isinstance(v, int) and not -(2**63) <= v < 2**64 for v in fields.values()):
        raise InvalidRequest("inputs hold values that cannot be used")  # past int64 / uint64
    if prompt.name == "input_ids":
        token_ids(prompt.data, "prompt")
    options = generation_options(fields)
    outputs = _outputs(req.outputs, flags, prompt.name == "input_ids")
    options.return_token_ids = "output_ids" in outputs
    request = CompletionRequest(req.model, prompts, options, stream=stream, echo=echo)
    empty_final = req.parameters.get("triton_enable_empty_final_response") is True
    return GenerationCall(
        request, stream, outputs, ids_datatype, len(prompt.shape) > 1, empty_final
    )


EMBEDDING_OUTPUT = "embedding"
"""The output an embedding inference requests (FP32, [batch, dimensions])."""


def wants_embedding(req: InferRequest) -> bool:
    """Whether `req` asks for embeddings (it requests the `embedding` output)."""
    return EMBEDDING_OUTPUT in req.outputs


def to_embedding(req: InferRequest) -> EmbeddingRequest:
    """Map an embedding inference to the data plane's EmbeddingRequest: `text_input` (BYTES,
    one text per element) or `input_ids` ([n] or [batch, n] integers); optional `dimensions`
    (a request parameter or an INT scalar input). Raises InvalidRequest / NotFound."""
    if not req.model:
        raise InvalidRequest("model_name is required", param="model")
    check_version(req.model, req.version)
    if req.outputs != [EMBEDDING_OUTPUT]:
        raise InvalidRequest(f"an embedding inference has one output, '{EMBEDDING_OUTPUT}'")
    dimensions: Any = req.parameters.get("dimensions")
    inputs: list[str | list[int]] | None = None
    for tensor in req.inputs:
        if tensor.name == "dimensions":
            dimensions = _one(tensor)
        elif tensor.name in _PROMPTS and inputs is not None:
            raise InvalidRequest("give either text_input or input_ids, not both")
        elif tensor.name == "text_input":
            if tensor.datatype != "BYTES" or not tensor.data:
                raise InvalidRequest("input 'text_input' must be a non-empty BYTES tensor")
            inputs = [_text(v, "text_input") for v in tensor.data]
        elif tensor.name == "input_ids":
            if tensor.datatype not in _ID_TYPES or not tensor.data:
                raise InvalidRequest("input 'input_ids' must be a non-empty integer tensor")
            ids = token_ids(tensor.data, "input_ids")
            rows = tensor.shape[0] if len(tensor.shape) == 2 else 1
            width = len(ids) // rows
            inputs = [ids[r * width : (r + 1) * width] for r in range(rows)]
        else:
            raise InvalidRequest(
                f"unexpected input '{tensor.name}' (an embedding inference takes text_input or "
                "input_ids, and optionally dimensions)"
            )
    if inputs is None:
        raise InvalidRequest("missing input 'text_input' (or 'input_ids')")
    if any(not i for i in inputs):
        raise InvalidRequest("inputs must not be empty", param="input")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise InvalidRequest("'dimensions' must be an integer >= 1", param="dimensions")
    return EmbeddingRequest(req.model, inputs, dimensions=dimensions)


def embedding_response(result: EmbeddingResult, model: str, request_id: str) -> InferResponse:
    """The response of an embedding inference: `embedding`, FP32 [batch, dimensions]."""
    vectors = result.vectors
    width = len(vectors[0]) if vectors else 0
    data = [x for v in vectors for x in v]
    tensor = Tensor(EMBEDDING_OUTPUT, "FP32", [len(vectors), width], data)
    return InferResponse(model, MODEL_VERSION, request_id, [tensor])


def _outputs(requested: list[str], flags: Mapping[str, bool], token_prompt: bool) -> list[str]:
    if requested:
        known = (*OUTPUT_NAMES, *OPTIONAL_OUTPUTS)
        for name in requested:
            if name not in known:
                raise InvalidRequest(
                    f"unknown output '{name}' (outputs: {', '.join(known)})", param="outputs"
                )
        return list(dict.fromkeys(requested))
    outputs = [
        name for name in OUTPUT_NAMES if name == "text_output" or flags.get(f"return_{name}", True)
    ]
    if flags.get("return_output_ids", token_prompt):
        outputs.append("output_ids")
    return outputs


# --------------------------------------------------------------------------------------------
# Results -> responses


class InferEncoder:
    """Builds the InferResponses of one request from the service's deltas or result."""

    __slots__ = ("_call", "_id", "_model", "_prompt_tokens", "_scalar_shape", "_tokens")

    def __init__(self, call: GenerationCall, model: str, request_id: str) -> None:
        self._call = call
        self._model = model
        self._id = request_id
        self._scalar_shape = [1, 1] if call.batched else [1]
        self._prompt_tokens = 0
        self._tokens = 0

    def _response(
        self,
        text: str,
        finish: str,
        ids: list[int],
        prompt_tokens: int,
        completion_tokens: int,
        final: bool | None,
    ) -> InferResponse:
        shape = self._scalar_shape
        outputs: list[Tensor] = []
        for name in self._call.outputs:
            if name == "text_output":
                outputs.append(Tensor(name, "BYTES", list(shape), [text.encode()]))
            elif name == "finish_reason":
                outputs.append(Tensor(name, "BYTES", list(shape), [finish.encode()]))
            elif name == "num_input_tokens":
                outputs.append(Tensor(name, "UINT32", list(shape), [prompt_tokens]))
            elif name == "num_output_tokens":
                outputs.append(Tensor(name, "UINT32", list(shape), [completion_tokens]))
            else:
                id_shape = [1, len(ids)] if self._call.batched else [len(ids)]
                outputs.append(Tensor(name, self._call.ids_datatype, id_shape, list(ids)))
        params: dict[str, ParamValue] = {}
        if final is not None:
            params["triton_final_response"] = final
        return InferResponse(self._model, MODEL_VERSION, self._id, outputs, params)

    def delta(self, d: ChoiceDelta, prompt_tokens: int, completion_tokens: int) -> InferResponse:
        """One streamed response (`prompt_tokens` / `completion_tokens`: counts so far)."""
        final = False if self._call.empty_final else None
        return self._response(
            d.text,
            d.finish_reason or "",
            d.token_ids or [],
            prompt_tokens,
            completion_tokens,
            final,
        )

    def result(self, result: CompletionResult) -> InferResponse:
        """The one response of a non-streamed request."""
        choice = result.choices[0]
        final = False if self._call.empty_final else None
        return self._response(
            choice.text,
            choice.finish_reason,
            choice.token_ids or [],
            result.usage.prompt_tokens,
            result.usage.completion_tokens,
            final,
        )

    def final(self) -> InferResponse:
        """The empty response that ends a request (triton_enable_empty_final_response)."""
        return InferResponse(
            self._model, MODEL_VERSION, self._id, [], {"triton_final_response": True}
        )


# --------------------------------------------------------------------------------------------
# Metadata


class TensorMetadata(Struct):
    """A tensor of a model's metadata (-1: a dimension of any size)."""

    name: str
    datatype: str
    shape: list[int]


class ModelMetadataResponse(Struct):
    """A model's metadata (both transports: REST JSON, and the gRPC message)."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    properties: dict[str, str]


class ServerMetadataResponse(Struct):
    """The server's name, version and protocol extensions."""

    name: str
    version: str
    extensions: list[str]


SERVER_METADATA = ServerMetadataResponse(SERVER_NAME, SERVER_VERSION, list(EXTENSIONS))
_T = TensorMetadata


def model_metadata(info: ModelInfo, name: str) -> ModelMetadataResponse:
    """ModelMetadata of an LLM."""
    return ModelMetadataResponse(
        name,
        [MODEL_VERSION],
        "kvmesh",
        [
            _T("text_input", "BYTES", [1]),
            _T("input_ids", "INT64", [-1]),
            _T("stream", "BOOL", [1]),
            _T("sampling_parameters", "BYTES", [1]),
            _T("max_tokens", "INT32", [1]),
            _T("temperature", "FP32", [1]),
            _T("top_p", "FP32", [1]),
            _T("top_k", "INT32", [1]),
            _T("seed", "INT64", [1]),
            _T("stop", "BYTES", [-1]),
            _T("exclude_input_in_output", "BOOL", [1]),
        ],
        [
            _T("text_output", "BYTES", [-1]),
            _T("finish_reason", "BYTES", [-1]),
            _T("num_input_tokens", "UINT32", [1]),
            _T("num_output_tokens", "UINT32", [1]),
            _T("output_ids", "INT64", [-1]),
        ],
        {
            "engine": info.engine,
            "context_length": str(info.context_length),
            "served_model_name": info.served_model_name,
        },
    )


def model_config(info: ModelInfo, name: str) -> dict[str, Any]:
    """Triton model configuration (subset): decoupled, no batching, the metadata's tensors."""
    meta = model_metadata(info, name)
    return {
        "name": name,
        "platform": "kvmesh",
        "backend": "kvmesh",
        "max_batch_size": 0,
        "input": [
            {
                "name": t.name,
                "data_type": _config_type(t.datatype),
                "dims": t.shape,
                "optional": t.name != "text_input",
            }
            for t in meta.inputs
        ],
        "output": [
            {"name": t.name, "data_type": _config_type(t.datatype), "dims": t.shape}
            for t in meta.outputs
        ],
        "model_transaction_policy": {"decoupled": True},
    }


def _config_type(datatype: str) -> str:
    """Protocol datatype -> Triton model_config DataType name."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
