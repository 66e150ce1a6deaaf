"""OpenAI wire format: request and response schemas, decoding into the typed data plane, encoders.

Requests are declared once, as msgspec Structs (`CreateChatCompletionRequest`,
`CreateCompletionRequest`, `CreateEmbeddingRequest` and their parts): types, ranges and
descriptions; GET /openapi.json is generated from them (kvmesh.frontend.openapi). A body is
decoded into its Struct by kvmesh.frontend.decoding (orjson, then msgspec: every type and range
checked in C), then a build function (`_chat_request`, ...) makes the checks across fields
(mutual exclusions, n / best_of, tool_choice against tools, structured output) and returns the
typed request of kvmesh.frontend.dataplane. Unknown fields are ignored, as OpenAI and vLLM do;
`null` means "not set" for every optional field. KServe's sampling values go through the same
Struct and checks (`generation_options`).

Errors are InvalidRequest (HTTP 400, OpenAI's `param`), with the messages the gateway always
gave: a refused field is reported by `_REFUSALS` (fields with structure) or by its type and
range (kvmesh.frontend.decoding), the first one the build's checks meet.

Encoding is on the hot path of streaming: `ChatChunkEncoder` / `TextChunkEncoder` pre-encode
the bytes shared by every chunk of a response (id, created, model, system_fingerprint) once per
request and only JSON-encode the text of each delta. Chats whose output goes through a tool-call
or reasoning parser use `ParsedChatChunkEncoder`, so plain streams pay nothing for those
features. Unary responses are Structs too (`CreateChatCompletionResponse`, ...), encoded by
msgspec, so the document describes exactly what is sent.
"""

from __future__ import annotations

import base64
import struct
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar, cast

import msgspec
import orjson
from msgspec import UNSET, Meta, Struct, UnsetType

from kvmesh.frontend.dataplane import (
    ChatCompletionRequest,
    ChatMessage,
    ChoiceDelta,
    ChoiceResult,
    CompletionRequest,
    CompletionResult,
    EmbeddingRequest,
    EmbeddingResult,
    GenerationOptions,
    TokenLogprobInfo,
    ToolCallDelta,
    ToolChoice,
    UsageInfo,
    tool_name,
)
from kvmesh.frontend.decoding import Refusals, decode, load_object
from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.types import GuidedDecoding, GuidedKind, ModelInfo

__all__ = [
    "DONE_EVENT",
    "ChatChunkEncoder",
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateCompletionRequest",
    "CreateCompletionResponse",
    "CreateEmbeddingRequest",
    "CreateEmbeddingResponse",
    "ErrorResponse",
    "ListModelsResponse",
    "LoadLoraAdapterRequest",
    "Model",
    "ParsedChatChunkEncoder",
    "SamplingParameters",
    "TextChunkEncoder",
    "UnloadLoraAdapterRequest",
    "encode_embeddings",
    "encode_error_event",
    "encode_model",
    "encode_models",
    "encode_result",
    "generation_options",
    "parse_chat_request",
    "parse_completion_request",
    "parse_embedding_request",
    "parse_lora_request",
    "token_ids",
]

MAX_STOP_STRINGS = 4
U32 = 2**32 - 1
"""Largest value of the uint32 fields the worker contract carries (max_tokens, top_k ...)."""
MAX_TOP_LOGPROBS = 20
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]
CHAT_ROLES: tuple[str, ...] = typing.get_args(ChatRole)

# --------------------------------------------------------------------------------------------
# Request schemas

TokenId = Annotated[int, Meta(ge=0, le=U32)]
_NonEmpty = Annotated[str, Meta(min_length=1)]
_Choices = Annotated[list[_NonEmpty], Meta(min_length=1, description="The allowed outputs")]
JsonSchemaValue = Annotated[
    str | bool | dict[str, Any],
    Meta(description="A JSON Schema: an object (or boolean), or its JSON text"),
]


class StreamOptions(Struct):
    """Options of a streamed response."""

    include_usage: bool | None = None
    """Send a last chunk with the usage of the whole request."""


class JsonSchemaFormat(Struct):
    """The JSON Schema of `response_format` type `json_schema`."""

    name: str | None = None
    schema: JsonSchemaValue | None = None
    """None: any JSON object."""


class ResponseFormat(Struct):
    """Structured output: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None
    """Required by type `json_schema`."""


class StructuredOutputs(Struct):
    """vLLM's structured outputs: at most one constraint."""

    json: JsonSchemaValue | None = None
    json_object: Annotated[Any, Meta(description="true: any JSON object")] = None
    regex: _NonEmpty | None = None
    grammar: _NonEmpty | None = None
    choice: _Choices | None = None


class SamplingParameters(Struct, kw_only=True):
    """Sampling and stopping fields of chat and text completions (and of KServe's
    `sampling_parameters`)."""

    max_tokens: Annotated[int, Meta(le=U32, description="At least 1")] | None = None
    max_completion_tokens: (
        Annotated[int, Meta(le=U32, description="Overrides max_tokens")] | None
    ) = None
    min_tokens: Annotated[int, Meta(ge=0, le=U32)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=U32, description="-1 or 0: disabled")] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1, description="Choice i uses seed + i")] | (
        None
    ) = None
    n: Annotated[int, Meta(ge=1, le=U32)] | None = None
    best_of: Annotated[int, Meta(description="Only n is supported")] | None = None
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]],
            Meta(description="Token id (as a string) -> bias"),
        ]
        | None
    ) = None
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    response_format: ResponseFormat | None = None
    guided_json: JsonSchemaValue | None = None
    guided_regex: _NonEmpty | None = None
    guided_choice: _Choices | None = None
    guided_grammar: _NonEmpty | None = None
    structured_outputs: StructuredOutputs | None = None


class _Generation(SamplingParameters, kw_only=True):
    """The fields chat and text completions share."""

    stream: bool | None = None
    stream_options: StreamOptions | None = None
    """Only with stream: true."""
    user: str | None = None


class ImageUrl(Struct):
    """Where an image part's image is: a data: URI, a local file or an http(s) URL
    (kvmesh.frontend.media)."""

    url: str
    detail: str | None = None


class ContentPart(Struct):
    """A part of a message's content: text (`refusal` parts carry their text in `refusal`) or
    an image (`image_url`)."""

    type: Literal["text", "input_text", "refusal", "image_url"]
    text: str | UnsetType = UNSET
    refusal: Any = UNSET
    image_url: ImageUrl | UnsetType = UNSET


class ChatCompletionRequestMessage(Struct):
    """One message; content parts are joined with newlines."""

    role: ChatRole
    content: str | list[str | ContentPart] | None = None
    """Required except for assistant and function messages."""
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: Annotated[Any, Meta(description="A string; anything else is ignored")] = (
        UNSET
    )
    reasoning: Annotated[Any, Meta(description="Read when reasoning_content is absent")] = UNSET


class FunctionObject(Struct):
    """A function the model may call (passed to the chat template as given)."""

    name: str
    description: Any = None
    parameters: Annotated[Any, Meta(description="JSON Schema of the arguments")] = None


class ChatCompletionTool(Struct):
    """A tool (function tools only)."""

    type: Literal["function"] = "function"
    function: FunctionObject | None = None


class FunctionName(Struct):
    """A function, by name."""

    name: str


class ChatCompletionNamedToolChoice(Struct, tag="function", tag_field="type"):
    """Call this function."""

    function: FunctionName


class AllowedTools(Struct, kw_only=True):
    """The tools the model may use, a subset of `tools`."""

    mode: Literal["auto", "required"] = "auto"
    tools: list[dict[str, Any]]


class ChatCompletionAllowedToolsChoice(Struct, tag="allowed_tools", tag_field="type"):
    """Restrict the tools the model may call."""

    allowed_tools: AllowedTools


ToolChoiceValue = (
    Literal["none", "auto", "required"]
    | ChatCompletionNamedToolChoice
    | ChatCompletionAllowedToolsChoice
)


class CreateChatCompletionRequest(_Generation, kw_only=True):
    """POST /v1/chat/completions."""

    model: str
    messages: Annotated[list[ChatCompletionRequestMessage], Meta(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ChatCompletionTool] | None = None
    functions: Annotated[list[FunctionObject], Meta(description="Deprecated: tools")] | None = None
    tool_choice: ToolChoiceValue | None = None
    function_call: (
        Annotated[Literal["none", "auto", "required"], Meta(description="Deprecated: tool_choice")]
        | FunctionName
        | None
    ) = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None


_TokenIds = Annotated[list[TokenId], Meta(min_length=1)]
_PromptItems = Annotated[
    list[str | TokenId | _TokenIds],
    Meta(min_length=1, description="Strings, token ids, or lists of token ids (one kind)"),
]


class CreateCompletionRequest(_Generation, kw_only=True):
    """POST /v1/completions."""

    model: str
    prompt: str | _PromptItems
    logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: Annotated[str, Meta(description="Not supported (must be empty)")] | None = None


class CreateEmbeddingRequest(Struct, kw_only=True):
    """POST /v1/embeddings."""

    model: str
    input: str | _PromptItems
    encoding_format: Literal["float", "base64", ""] | None = None
    """"" (like null): float."""
    dimensions: Annotated[int, Meta(ge=1, le=1 << 20)] | None = None
    user: str | None = None


class LoadLoraAdapterRequest(Struct, kw_only=True):
    """POST /v1/load_lora_adapter (vLLM's runtime LoRA loading)."""

    lora_name: _NonEmpty
    lora_path: _NonEmpty
    """The adapter's directory (a peft checkpoint) on the workers' disk."""
    model: str = ""
    """kvmesh: the adapter's base model, needed when several models are served."""


class UnloadLoraAdapterRequest(Struct, kw_only=True):
    """POST /v1/unload_lora_adapter."""

    lora_name: _NonEmpty
    lora_int_id: int | None = None
    """vLLM's; ignored (adapters are named)."""


L = TypeVar("L", LoadLoraAdapterRequest, UnloadLoraAdapterRequest)


def parse_lora_request(cls: type[L], body: bytes) -> L:
    """Parse a load/unload LoRA adapter body. Raises InvalidRequest."""
    try:
        return msgspec.convert(load_object(body), cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc)) from None


# --------------------------------------------------------------------------------------------
# Refused fields (kvmesh.frontend.decoding): the messages of fields with structure


def _messages_error(value: Any) -> None:
    """The first problem of a message list, in the order the checks meet them."""

    def bad(problem: str) -> InvalidRequest:
        return InvalidRequest(problem, param="messages")

    if value is None:
        raise bad("'messages' is required")
    if not isinstance(value, list):
        raise bad("'messages' must be a list of messages")
    if not value:
        raise bad("'messages' must not be empty")
    for i, raw in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise bad(f"{at} must be an object")
        role = raw.get("role")
        if not isinstance(role, str):
            raise bad(f"{at}.role must be a string")
        if role not in CHAT_ROLES:
            raise bad(f"{at}.role {role!r} is not supported")
        content = raw.get("content")
        if not isinstance(content, (str, list, type(None))):
            raise bad(f"{at}.content must be a string, a list of parts or null")
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, (str, dict)):
                raise bad(f"{at}.content parts must be objects")
            if isinstance(part, dict) and part.get("type") == "image_url":
                image = part.get("image_url")
                if not isinstance(image, dict) or not isinstance(image.get("url"), str):
                    raise bad(f"{at} image_url part needs an 'image_url' object with a 'url'")
            elif isinstance(part, dict):
                _part_text(part.get("type"), part.get("text", part.get("refusal")), i)
        _check_content(content, role, i)
        if not isinstance(raw.get("name"), (str, type(None))):
            raise bad(f"{at}.name must be a string")
        calls = raw.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise bad(f"{at}.tool_calls must be a list of objects")
        if not isinstance(raw.get("tool_call_id"), (str, type(None))):
            raise bad(f"{at}.tool_call_id must be a string")


def _tools_error(value: Any, key: str = "tools") -> None:
    what = "tool" if key == "tools" else "function"
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise InvalidRequest(f"'{key}' must be a list of {what} objects", param=key)
    for tool in value:
        kind = tool.get("type", "function") if key == "tools" else "function"
        if kind != "function":
            raise InvalidRequest(
                f"tool type {kind!r} is not supported (function tools only)", param=key
            )
        fn = tool.get("function") if key == "tools" else tool
        if fn is not None and (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
            raise InvalidRequest("every tool function needs a string 'name'", param=key)


def _tool_choice_error(value: Any, key: str = "tool_choice") -> None:
    if key == "function_call" and isinstance(value, dict):
        value = {"type": "function", "function": value}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function":
        raise InvalidRequest(f"'{key}' of type 'function' needs function.name", param=key)
    if kind == "allowed_tools":
        allowed = value.get("allowed_tools")
        if not isinstance(allowed, dict) or allowed.get("mode", "auto") not in ("auto", "required"):
            raise InvalidRequest("allowed_tools needs a mode of 'auto' or 'required'", param=key)
        raise InvalidRequest("allowed_tools.tools must be a list of tools", param=key)
    raise InvalidRequest(
        f"'{key}' must be 'none', 'auto', 'required' or a named function", param=key
    )


def _json_schema_error(value: Any) -> None:
    key = "response_format"
    if not isinstance(value, dict):
        message = "response_format of type 'json_schema' needs a 'json_schema' object"
    elif value.get("name") is not None and not isinstance(value["name"], str):
        message = "response_format.json_schema.name must be a string"
    else:
        message = "'response_format' must be a JSON Schema object"
    raise InvalidRequest(message, param=key)


def _stop_error(value: Any) -> None:
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        message = f"'stop' accepts at most {MAX_STOP_STRINGS} strings, got {len(value)}"
    else:
        message = "'stop' must be a string or a list of strings"
    raise InvalidRequest(message, param="stop")


def _response_type_error(value: Any) -> None:
    raise InvalidRequest(
        f"response_format type {value!r} is not supported (text, json_object, json_schema)",
        param="response_format",
    )


def _encoding_format_error(value: Any) -> None:
    what = "'float' or 'base64'" if isinstance(value, str) else "a string"
    raise InvalidRequest(f"'encoding_format' must be {what}", param="encoding_format")


_OBJECT, _SCHEMA = "must be an object", "must be a JSON Schema object"
_TEXT, _CHOICES = "must be a non-empty string", "must be a non-empty list of non-empty strings"

_REFUSALS: Refusals = {
    "messages": _messages_error,
    "tools": _tools_error,
    "functions": lambda v: _tools_error(v, "functions"),
    "tool_choice": _tool_choice_error,
    "function_call": lambda v: _tool_choice_error(v, "function_call"),
    "prompt": lambda v: _prompts(v, "prompt", checked=False),
    "input": lambda v: _prompts(v, "input", checked=False),
    "stop": _stop_error,
    "stop_token_ids": lambda v: token_ids(v, "stop_token_ids"),
    "logit_bias": lambda v: _logit_bias(v),
    "encoding_format": _encoding_format_error,
    "response_format.type": _response_type_error,
    "response_format.json_schema": _json_schema_error,
    **{
        k: f"'{k}' {_OBJECT}" for k in ("stream_options", "chat_template_kwargs", "response_format")
    },
    "structured_outputs": f"'structured_outputs' {_OBJECT}",
    "guided_json": f"'guided_json' {_SCHEMA}",
    "structured_outputs.json": f"'structured_outputs' {_SCHEMA}",
    **{k: f"'{k}' {_TEXT}" for k in ("guided_regex", "guided_grammar")},
    **{f"structured_outputs.{k}": f"'structured_outputs' {_TEXT}" for k in ("regex", "grammar")},
    "guided_choice": f"'guided_choice' {_CHOICES}",
    "structured_outputs.choice": f"'structured_outputs' {_CHOICES}",
}
"""How refused fields with structure are reported (the rest: by their type and range)."""

# -- building the typed requests ----------------------------------------------------------------


def token_ids(value: Any, key: str) -> list[int]:
    """`value` as token ids (each an integer in [0, 2**32)); InvalidRequest naming `key`."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= U32 for v in value
    ):
        raise InvalidRequest(f"'{key}' must be a list of non-negative integer token ids", param=key)
    return value


def _prompts(value: Any, key: str, *, checked: bool) -> list[str | list[int]]:
    """The `prompt` / `input` field as a list of texts or token id lists (`checked`: msgspec has
    checked the types already, only their mix is left)."""
    ids = (lambda v: v) if checked else (lambda v: token_ids(v, key))
    if value is None:
        raise InvalidRequest(f"'{key}' is required", param=key)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
            return [ids(value)]
        if key == "input" and all(isinstance(p, list) and p for p in value):
            return [ids(p) for p in value]
        if key == "prompt":
            if all(isinstance(p, list) for p in value):
                prompts = [ids(p) for p in value]
                if any(not p for p in prompts):
                    raise InvalidRequest("token prompts must not be empty", param=key)
                return prompts
            raise InvalidRequest(
                "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                "those",
                param=key,
            )
    raise InvalidRequest(
        f"'{key}' must be a string, a non-empty list of strings, token ids or lists of token ids",
        param=key,
    )


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise InvalidRequest(
            "'logit_bias' must be an object mapping token ids to numbers", param="logit_bias"
        )
    out: dict[int, float] = {}
    for token, bias in value.items():
        try:
            token_id = int(token)
        except ValueError:
            raise InvalidRequest(
                f"'logit_bias' key {token!r} is not a token id", param="logit_bias"
            ) from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidRequest(
                "'logit_bias' must be an object mapping token ids to numbers", param="logit_bias"
            )
        if not 0 <= token_id <= U32 or not -100.0 <= bias <= 100.0:
            raise InvalidRequest(
                "'logit_bias' needs token ids >= 0 and biases between -100 and 100",
                param="logit_bias",
            )
        out[token_id] = float(bias)
    return out


def _options(b: SamplingParameters, default_logprobs: int | None) -> GenerationOptions:
    """GenerationOptions of a body, with the checks across fields."""
    max_tokens, key = b.max_tokens, "max_tokens"
    max_completion = b.max_completion_tokens
    if max_completion is not None:
        max_tokens, key = max_completion, "max_completion_tokens"
    if max_tokens is not None and max_tokens <= 0:
        raise InvalidRequest(f"'{key}' must be >= 1, got {max_tokens}", param=key)
    min_tokens = b.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(
            f"'min_tokens' ({min_tokens}) must not exceed '{key}' ({max_tokens})",
            param="min_tokens",
        )
    stop_raw = b.stop
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    else:
        stop = tuple(s for s in stop_raw if s)
    stop_ids = b.stop_token_ids
    bias = b.logit_bias
    logit_bias = _logit_bias(bias) if bias else {}
    top_k = b.top_k or 0
    seed = b.seed
    guided, guided_param = _guided(b)
    temperature, top_p, min_p = b.temperature, b.top_p, b.min_p
    presence, frequency, repetition = b.presence_penalty, b.frequency_penalty, b.repetition_penalty
    return GenerationOptions(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k, 0),
        min_p=min_p or 0.0,
        presence_penalty=presence or 0.0,
        frequency_penalty=frequency or 0.0,
        repetition_penalty=1.0 if repetition is None else repetition,
        seed=seed,
        logit_bias=logit_bias,
        stop=stop,
        stop_token_ids=tuple(stop_ids) if stop_ids else (),
        ignore_eos=b.ignore_eos or False,
        n=b.n or 1,
        logprobs=default_logprobs,
        skip_special_tokens=b.skip_special_tokens is not False,
        priority=b.priority or 0,
        guided=guided,
        guided_param=guided_param,
    )


def generation_options(fields: dict[str, Any]) -> GenerationOptions:
    """GenerationOptions from named sampling values (SamplingParameters' fields), checked and
    refused with the same messages as in an OpenAI body. For KServe, whose
    `sampling_parameters`, request parameters and input tensors merge into `fields`."""
    return decode(SamplingParameters, fields, lambda b: _options(b, None), _REFUSALS)


def _schema_text(value: str | bool | dict[str, Any], key: str) -> str:
    """A JSON Schema given as an object (or boolean) or as JSON text -> JSON text."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise InvalidRequest(f"'{key}' is not valid JSON", param=key) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest(f"'{key}' must be a JSON Schema object", param=key)
    return orjson.dumps(value).decode()


def _response_format(fmt: ResponseFormat) -> GuidedDecoding | None:
    kind = fmt.type
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding(GuidedKind.JSON_OBJECT)
    spec = fmt.json_schema
    if spec is None:
        raise InvalidRequest(
            "response_format of type 'json_schema' needs a 'json_schema' object",
            param="response_format",
        )
    if spec.schema is None:
        return GuidedDecoding(GuidedKind.JSON_OBJECT)
    return GuidedDecoding(GuidedKind.JSON_SCHEMA, _schema_text(spec.schema, "response_format"))


def _structured_outputs(spec: StructuredOutputs) -> GuidedDecoding | None:
    key = "structured_outputs"
    found: list[GuidedDecoding] = []
    if spec.json is not None:
        found.append(GuidedDecoding(GuidedKind.JSON_SCHEMA, _schema_text(spec.json, key)))
    if spec.json_object:
        found.append(GuidedDecoding(GuidedKind.JSON_OBJECT))
    if spec.regex is not None:
        found.append(GuidedDecoding(GuidedKind.REGEX, spec.regex))
    if spec.grammar is not None:
        found.append(GuidedDecoding(GuidedKind.GRAMMAR, spec.grammar))
    if spec.choice is not None:
        found.append(GuidedDecoding(GuidedKind.CHOICE, choices=tuple(spec.choice)))
    if len(found) > 1:
        raise InvalidRequest("structured_outputs may set only one constraint", param=key)
    return found[0] if found else None


_GUIDED: tuple[tuple[str, Callable[[Any], GuidedDecoding | None]], ...] = (
    ("response_format", _response_format),
    ("guided_json", lambda v: GuidedDecoding(
        GuidedKind.JSON_SCHEMA, _schema_text(v, "guided_json"))),
    ("guided_regex", lambda v: GuidedDecoding(GuidedKind.REGEX, v)),
    ("guided_grammar", lambda v: GuidedDecoding(GuidedKind.GRAMMAR, v)),
    ("guided_choice", lambda v: GuidedDecoding(GuidedKind.CHOICE, choices=tuple(v))),
    ("structured_outputs", _structured_outputs),
)  # fmt: skip


def _guided(b: SamplingParameters) -> tuple[GuidedDecoding | None, str]:
    """The structured-output constraint of a request and the field it came from."""
    found: list[tuple[GuidedDecoding, str]] = []
    for key, parse in _GUIDED:
        value = getattr(b, key)
        if value is None:
            continue
        guided = parse(value)
        if guided is not None:
            found.append((guided, key))
    if len(found) > 1:
        keys = ", ".join(k for _, k in found)
        raise InvalidRequest(
            f"only one structured-output constraint may be given, got {keys}", param=found[1][1]
        )
    return found[0] if found else (None, "response_format")


def _stream_flags(b: _Generation) -> tuple[bool, bool]:
    stream = b.stream or False
    options = b.stream_options
    if options is None:
        return stream, False
    if not stream:
        raise InvalidRequest(
            "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    return stream, options.include_usage or False


_TEXT_PARTS = ("text", "input_text", "refusal")


def _part_text(kind: Any, text: Any, index: int) -> str:
    if kind not in _TEXT_PARTS:
        raise InvalidRequest(
            f"content part type {kind!r} is not supported (text or image_url)", param="messages"
        )
    if not isinstance(text, str):
        raise InvalidRequest(
            f"messages[{index}].content text part needs a string 'text'", param="messages"
        )
    return text


def _check_content(content: Any, role: str, index: int) -> None:
    if content is None and role not in ("assistant", "function"):
        raise InvalidRequest(f"messages[{index}].content is required", param="messages")


def _messages(messages: list[ChatCompletionRequestMessage]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        content = m.content
        images: list[str] = []
        if isinstance(content, list):
            texts: list[str] = []
            for p in content:
                if isinstance(p, str):
                    texts.append(p)
                elif p.type == "image_url":
                    if not isinstance(p.image_url, ImageUrl):
                        raise InvalidRequest(
                            f"messages[{i}] image_url part needs an 'image_url' object with a "
                            "'url'",
                            param="messages",
                        )
                    if m.role != "user":
                        raise InvalidRequest(
                            f"messages[{i}] image_url parts are only allowed in user messages",
                            param="messages",
                        )
                    images.append(p.image_url.url)
                else:
                    texts.append(
                        _part_text(p.type, p.text if p.text is not UNSET else p.refusal, i)
                    )
            content = "\n".join(texts)
        _check_content(content, m.role, i)
        reasoning = m.reasoning_content if m.reasoning_content is not UNSET else m.reasoning
        out.append(
            ChatMessage(
                m.role,
                content,
                m.name,
                m.tool_calls or None,
                m.tool_call_id,
                reasoning if isinstance(reasoning, str) else None,
                tuple(images),
            )
        )
    return out


_NO_TOOLS = ToolChoice("none")
"""Shared by requests without tools (never mutated)."""


def _tools(
    b: CreateChatCompletionRequest, raw: dict[str, Any]
) -> tuple[list[dict[str, Any]] | None, ToolChoice]:
    """`tools` (or the deprecated `functions`) as the chat template takes them (the client's
    objects), and `tool_choice` (or `function_call`)."""
    if b.tools is None and b.functions is None and b.tool_choice is None:
        if b.function_call is None:
            return None, _NO_TOOLS
    tools: list[dict[str, Any]] | None = None
    names: list[str | None] = []
    if b.tools is not None:
        names = [t.function.name if t.function is not None else None for t in b.tools]
        tools = raw["tools"]
    elif b.functions is not None:
        names = [f.name for f in b.functions]
        tools = [{"type": "function", "function": f} for f in raw["functions"]]
    choice_key = "tool_choice"
    spec: ToolChoiceValue | FunctionName | None = b.tool_choice
    if spec is None and b.function_call is not None:
        choice_key, spec = "function_call", b.function_call
    if spec is None:
        choice = ToolChoice("auto" if tools else "none")
    elif isinstance(spec, str):
        choice = ToolChoice(spec)
    elif isinstance(spec, FunctionName):
        choice = ToolChoice("function", spec.name)
    elif isinstance(spec, ChatCompletionNamedToolChoice):
        choice = ToolChoice("function", spec.function.name)
    else:
        allowed = spec.allowed_tools
        listed = {tool_name(t) for t in allowed.tools}
        kept = [i for i, name in enumerate(names) if name in listed]
        tools, names = [tools[i] for i in kept] if tools else [], [names[i] for i in kept]
        choice = ToolChoice(allowed.mode)
    if choice.mode in ("required", "function") and not tools:
        raise InvalidRequest(
            f"'{choice_key}' {choice.name or choice.mode!r} needs 'tools'", param=choice_key
        )
    if choice.mode == "function" and choice.name not in names:
        raise InvalidRequest(
            f"'{choice_key}' names {choice.name!r}, which is not in 'tools'", param=choice_key
        )
    return (tools or None) if choice.mode != "none" else None, choice


def _best_of(b: SamplingParameters, n: int) -> None:
    if b.best_of not in (None, n):
        raise InvalidRequest("'best_of' other than n is not supported", param="best_of")


def _chat_request(b: CreateChatCompletionRequest, raw: dict[str, Any]) -> ChatCompletionRequest:
    model = b.model
    messages = _messages(b.messages)
    want_logprobs = b.logprobs or False
    top_logprobs = b.top_logprobs
    if top_logprobs and not want_logprobs:
        raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    stream, include_usage = _stream_flags(b)
    tools, tool_choice = _tools(b, raw)
    kwargs = b.chat_template_kwargs
    effort = b.reasoning_effort
    if effort is not None:
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    options = _options(b, (top_logprobs or 0) if want_logprobs else None)
    _best_of(b, options.n)
    return ChatCompletionRequest(
        model=model,
        messages=messages,
        options=options,
        stream=stream,
        include_usage=include_usage,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=b.parallel_tool_calls is not False,
        add_generation_prompt=b.add_generation_prompt is not False,
        chat_template_kwargs=kwargs or {},
        user=b.user,
    )


def _completion_request(b: CreateCompletionRequest) -> CompletionRequest:
    model = b.model
    prompts = _prompts(b.prompt, "prompt", checked=True)
    logprobs = b.logprobs
    echo = b.echo or False
    if echo and logprobs is not None:
        raise InvalidRequest("'echo' together with 'logprobs' is not supported", param="echo")
    if b.suffix:
        raise InvalidRequest("'suffix' is not supported", param="suffix")
    stream, include_usage = _stream_flags(b)
    options = _options(b, logprobs)
    _best_of(b, options.n)
    return CompletionRequest(model, prompts, options, stream, include_usage, echo, b.user)


def _embedding_request(b: CreateEmbeddingRequest) -> EmbeddingRequest:
    model = b.model
    inputs = _prompts(b.input, "input", checked=True)
    if any(not p for p in inputs):
        raise InvalidRequest("'input' must not contain empty strings", param="input")
    fmt = b.encoding_format
    return EmbeddingRequest(
        model, inputs, "base64" if fmt == "base64" else "float", b.dimensions, b.user
    )


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parse and validate a chat completion request body. Raises InvalidRequest."""
    raw = load_object(body)
    return decode(CreateChatCompletionRequest, raw, lambda b: _chat_request(b, raw), _REFUSALS)


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Parse and validate a text completion request body. Raises InvalidRequest."""
    return decode(CreateCompletionRequest, load_object(body), _completion_request, _REFUSALS)


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """Parse and validate an embeddings request body. Raises InvalidRequest."""
    return decode(CreateEmbeddingRequest, load_object(body), _embedding_request, _REFUSALS)


# --------------------------------------------------------------------------------------------
# Response schemas

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(Struct):
    """Prompt tokens served from the KV cache."""

    cached_tokens: int


class CompletionUsage(Struct):
    """Token accounting of a whole request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Struct):
    """An alternative token and its logprob."""

    token: str
    logprob: float
    bytes_: list[int] = msgspec.field(name="bytes")


class ChatTokenLogprob(Struct):
    """A generated token, its logprob and the top alternatives."""

    token: str
    logprob: float
    bytes_: list[int] = msgspec.field(name="bytes")
    top_logprobs: list[TopLogprob] = msgspec.field()


class ChatChoiceLogprobs(Struct):
    """Logprobs of a chat choice (or of a streamed delta, without `refusal`)."""

    content: list[ChatTokenLogprob]
    refusal: UnsetType | None = UNSET


class TextLogprobs(Struct):
    """Logprobs of a text choice, OpenAI's legacy layout."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCall(Struct):
    """The function a tool call calls; `arguments` is JSON text."""

    name: str
    arguments: str


class ChatCompletionMessageToolCall(Struct):
    """A tool call the model made."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatCompletionResponseMessage(Struct, omit_defaults=True):
    """The assistant's message of a chat choice."""

    role: Literal["assistant"]
    content: str | None
    refusal: None
    reasoning_content: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None


class ChatCompletionChoice(Struct):
    """One choice of a chat completion."""

    index: int
    message: ChatCompletionResponseMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason


class CreateChatCompletionResponse(Struct, kw_only=True, omit_defaults=True):
    """A chat completion (`chat.completion`)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str = ""
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class CompletionChoice(Struct):
    """One choice of a text completion."""

    index: int
    text: str
    logprobs: TextLogprobs | None
    finish_reason: FinishReason


class CreateCompletionResponse(Struct, kw_only=True, omit_defaults=True):
    """A text completion (`text_completion`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str = ""
    choices: list[CompletionChoice]
    usage: CompletionUsage


class Embedding(Struct):
    """One vector (base64: little-endian float32)."""

    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(Struct):
    """Tokens embedded."""

    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(Struct):
    """Embedding vectors, one per input, in input order."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Model(Struct):
    """A model served now: a base model, or a LoRA adapter with its base model as `parent`."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str = ""
    """The base model's name (vLLM: the model path or, for an adapter, its path)."""
    parent: str | None = None
    """For a LoRA adapter, the base model it runs on; null for a base model."""


class ListModelsResponse(Struct):
    """The models served now."""

    object: Literal["list"]
    data: list[Model]


class ErrorObject(Struct):
    """What went wrong (kvmesh.frontend.errors)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    """The body of every OpenAI-style error."""

    error: ErrorObject


# --------------------------------------------------------------------------------------------
# Encoding

DONE_EVENT = b"data: [DONE]\n\n"
_FINISH = {
    None: b"null",
    "stop": b'"stop"',
    "length": b'"length"',
    "tool_calls": b'"tool_calls"',
}
_dumps = orjson.dumps
_encode = msgspec.json.encode


def _finish_bytes(reason: str | None) -> bytes:
    encoded = _FINISH.get(reason)
    return encoded if encoded is not None else _dumps(reason)


def _chat_logprobs(infos: Sequence[TokenLogprobInfo]) -> list[ChatTokenLogprob]:
    return [
        ChatTokenLogprob(
            info.token,
            info.logprob,
            list(info.token_bytes),
            [TopLogprob(tok, lp, list(raw)) for tok, raw, lp in info.top],
        )
        for info in infos
    ]


def _text_logprobs(infos: Sequence[TokenLogprobInfo], offset: int) -> tuple[TextLogprobs, int]:
    logprobs = TextLogprobs([], [], [], [])
    for info in infos:
        logprobs.tokens.append(info.token)
        logprobs.token_logprobs.append(info.logprob)
        logprobs.top_logprobs.append({tok: lp for tok, _, lp in info.top})
        logprobs.text_offset.append(offset)
        offset += len(info.token)
    return logprobs, offset


def _usage(usage: UsageInfo) -> CompletionUsage:
    return CompletionUsage(
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.prompt_tokens + usage.completion_tokens,
        PromptTokensDetails(usage.cached_tokens),
    )


def _head(id_: str, object_: str, created: int, model: str, fingerprint: str) -> bytes:
    head = (
        b'data: {"id":'
        + _dumps(id_)
        + b',"object":"'
        + object_.encode()
        + b'","created":'
        + str(created).encode()
        + b',"model":'
        + _dumps(model)
    )
    if fingerprint:
        head += b',"system_fingerprint":' + _dumps(fingerprint)
    return head


def _delta_logprobs(infos: Sequence[TokenLogprobInfo]) -> bytes:
    return _encode(ChatChoiceLogprobs(_chat_logprobs(infos)))


class ChatChunkEncoder:
    """SSE events of one streamed chat completion (`chat.completion.chunk`).

    The first delta of each choice carries `"role":"assistant"`; a choice's last delta carries
    its `finish_reason`. With `include_usage`, every chunk has `"usage":null` and `usage()`
    gives the final usage chunk.
    """

    __slots__ = ("_head", "_indexes", "_prefix", "_role_sent", "_tail")

    def __init__(
        self,
        id_: str,
        created: int,
        model: str,
        *,
        include_usage: bool,
        system_fingerprint: str = "",
    ) -> None:
        self._head = _head(id_, "chat.completion.chunk", created, model, system_fingerprint)
        self._prefix = self._head + b',"choices":[{"index":'
        self._tail = b'}],"usage":null}\n\n' if include_usage else b"}]}\n\n"
        self._indexes: dict[int, bytes] = {}
        self._role_sent: set[int] = set()

    def delta(self, d: ChoiceDelta) -> bytes:
        """The SSE event of one delta."""
        index = d.index
        idx = self._indexes.get(index)
        if idx is None:
            idx = self._indexes[index] = str(index).encode() + b',"delta":{'
        if index not in self._role_sent:
            self._role_sent.add(index)
            body = b'"role":"assistant","content":' + _dumps(d.text)
        elif d.text:
            body = b'"content":' + _dumps(d.text)
        else:
            body = b""
        return (
            self._prefix
            + idx
            + body
            + b'},"logprobs":'
            + (b"null" if d.logprobs is None else _delta_logprobs(d.logprobs))
            + b',"finish_reason":'
            + _finish_bytes(d.finish_reason)
            + self._tail
        )

    def usage(self, usage: UsageInfo) -> bytes:
        """The final usage chunk (`choices: []`)."""
        return self._head + b',"choices":[],"usage":' + _encode(_usage(usage)) + b"}\n\n"


def _tool_call_deltas(calls: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for c in calls:
        item: dict[str, Any] = {"index": c.index}
        fn: dict[str, str] = {}
        if c.id is not None:
            item["id"] = c.id
            item["type"] = "function"
        if c.name is not None:
            fn["name"] = c.name
        fn["arguments"] = c.arguments
        item["function"] = fn
        out.append(item)
    return out


class ParsedChatChunkEncoder(ChatChunkEncoder):
    """ChatChunkEncoder for deltas that may carry `reasoning_content` and `tool_calls` (chats
    whose output goes through a reasoning or tool-call parser)."""

    __slots__ = ()

    def delta(self, d: ChoiceDelta) -> bytes:
        """The SSE event of one delta."""
        index = d.index
        idx = self._indexes.get(index)
        if idx is None:
            idx = self._indexes[index] = str(index).encode() + b',"delta":{'
        parts: list[bytes] = []
        if index not in self._role_sent:
            self._role_sent.add(index)
            parts.append(b'"role":"assistant"')
            if d.text or (d.reasoning is None and d.tool_calls is None):
                parts.append(b'"content":' + _dumps(d.text))
            else:
                parts.append(b'"content":null')
        elif d.text:
            parts.append(b'"content":' + _dumps(d.text))
        if d.reasoning:
            parts.append(b'"reasoning_content":' + _dumps(d.reasoning))
        if d.tool_calls:
            parts.append(b'"tool_calls":' + _dumps(_tool_call_deltas(d.tool_calls)))
        return (
            self._prefix
            + idx
            + b",".join(parts)
            + b'},"logprobs":'
            + (b"null" if d.logprobs is None else _delta_logprobs(d.logprobs))
            + b',"finish_reason":'
            + _finish_bytes(d.finish_reason)
            + self._tail
        )


class TextChunkEncoder:
    """SSE events of one streamed text completion (`text_completion`)."""

    __slots__ = ("_head", "_indexes", "_offsets", "_prefix", "_tail")

    def __init__(
        self,
        id_: str,
        created: int,
        model: str,
        *,
        include_usage: bool,
        system_fingerprint: str = "",
    ) -> None:
        self._head = _head(id_, "text_completion", created, model, system_fingerprint)
        self._prefix = self._head + b',"choices":[{"index":'
        self._tail = b'}],"usage":null}\n\n' if include_usage else b"}]}\n\n"
        self._indexes: dict[int, bytes] = {}
        self._offsets: dict[int, int] = {}

    def delta(self, d: ChoiceDelta) -> bytes:
        """The SSE event of one delta."""
        index = d.index
        idx = self._indexes.get(index)
        if idx is None:
            idx = self._indexes[index] = str(index).encode() + b',"text":'
        if d.logprobs is None:
            logprobs = b"null"
        else:
            obj, self._offsets[index] = _text_logprobs(d.logprobs, self._offsets.get(index, 0))
            logprobs = _encode(obj)
        return (
            self._prefix
            + idx
            + _dumps(d.text)
            + b',"logprobs":'
            + logprobs
            + b',"finish_reason":'
            + _finish_bytes(d.finish_reason)
            + self._tail
        )

    def usage(self, usage: UsageInfo) -> bytes:
        """The final usage chunk (`choices: []`)."""
        return self._head + b',"choices":[],"usage":' + _encode(_usage(usage)) + b"}\n\n"


def encode_error_event(payload: dict[str, Any]) -> bytes:
    """An SSE error event (sent when a stream fails after it started), then [DONE]."""
    return b"data: " + _dumps(payload) + b"\n\n" + DONE_EVENT


def _chat_choice(c: ChoiceResult) -> ChatCompletionChoice:
    calls = c.tool_calls
    message = ChatCompletionResponseMessage(
        "assistant",
        c.text if c.text or (calls is None and c.reasoning is None) else None,
        None,
        c.reasoning,
        None
        if calls is None
        else [
            ChatCompletionMessageToolCall(t.id, "function", FunctionCall(t.name, t.arguments))
            for t in calls
        ],
    )
    logprobs = None if c.logprobs is None else ChatChoiceLogprobs(_chat_logprobs(c.logprobs), None)
    return ChatCompletionChoice(c.index, message, logprobs, cast(FinishReason, c.finish_reason))


def encode_result(result: CompletionResult) -> bytes:
    """JSON body of a unary chat or text completion."""
    usage = _usage(result.usage)
    fingerprint = result.system_fingerprint
    if result.kind == "chat":
        return _encode(
            CreateChatCompletionResponse(
                id=result.id,
                object="chat.completion",
                created=result.created,
                model=result.model,
                system_fingerprint=fingerprint,
                choices=[_chat_choice(c) for c in result.choices],
                usage=usage,
            )
        )
    choices = [
        CompletionChoice(
            c.index,
            c.text,
            None if c.logprobs is None else _text_logprobs(c.logprobs, 0)[0],
            cast(FinishReason, c.finish_reason),
        )
        for c in result.choices
    ]
    return _encode(
        CreateCompletionResponse(
            id=result.id,
            object="text_completion",
            created=result.created,
            model=result.model,
            system_fingerprint=fingerprint,
            choices=choices,
            usage=usage,
        )
    )


def encode_embeddings(result: EmbeddingResult, encoding_format: str) -> bytes:
    """JSON body of POST /v1/embeddings (`base64`: little-endian float32, as OpenAI sends)."""
    data: list[Embedding] = []
    for i, vector in enumerate(result.vectors):
        embedding: list[float] | str = vector
        if encoding_format == "base64":
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append(Embedding("embedding", i, embedding))
    tokens = result.prompt_tokens
    return _encode(
        CreateEmbeddingResponse("list", data, result.model, EmbeddingUsage(tokens, tokens))
    )


def _model_cards(info: ModelInfo, created: int) -> list[Model]:
    """The card of a served model, then one per LoRA adapter loaded on it (parent: the model)."""
    name = info.served_model_name
    base = Model(name, "model", created, "kvmesh", info.context_length, name)
    return [base] + [
        Model(a, "model", created, "kvmesh", info.context_length, name, name)
        for a in info.lora_adapters
    ]


def encode_models(models: Sequence[ModelInfo], created: int) -> bytes:
    """JSON body of GET /v1/models: the served models and their LoRA adapters."""
    return _encode(
        ListModelsResponse("list", [c for m in models for c in _model_cards(m, created)])
    )


def encode_model(models: Sequence[ModelInfo], name: str, created: int) -> bytes | None:
    """JSON body of GET /v1/models/{model} for model or adapter `name`; None if unknown."""
    for info in models:
        for card in _model_cards(info, created):
            if card.id == name:
                return _encode(card)
    return None
