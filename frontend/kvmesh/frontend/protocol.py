"""OpenAI wire format: typed requests parsed from JSON, typed results, and their encoders.

Parsing turns a request body into frozen-shape dataclasses (`ChatCompletionRequest`,
`CompletionRequest`) and raises kvmesh.runtime.errors.InvalidRequest (HTTP 400, with `param`) for
anything malformed: wrong types, missing fields, out-of-range values. Unknown fields are
ignored, as OpenAI and vLLM do; `null` means "not set" for every optional field.

Encoding is on the hot path of streaming: `ChatChunkEncoder` / `TextChunkEncoder` pre-encode
the bytes shared by every chunk of a response (id, created, model, system_fingerprint) once per
request and only JSON-encode the text of each delta. Chats whose output goes through a tool-call
or reasoning parser use `ParsedChatChunkEncoder`, so plain streams pay nothing for those
features. Unary results are plain orjson dumps.

Structured output (`response_format`, and vLLM's `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` / `structured_outputs`) is parsed into one
kvmesh.runtime.types.GuidedDecoding; whether the engine can honour it is the service's check.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.types import GuidedDecoding, GuidedKind, ModelInfo

__all__ = [
    "DONE_EVENT",
    "ChatChunkEncoder",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceDelta",
    "ChoiceResult",
    "CompletionRequest",
    "CompletionResult",
    "EmbeddingRequest",
    "EmbeddingResult",
    "GenerationOptions",
    "ParsedChatChunkEncoder",
    "TextChunkEncoder",
    "TokenLogprobInfo",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "UsageInfo",
    "encode_embeddings",
    "encode_error_event",
    "encode_model",
    "encode_models",
    "encode_result",
    "parse_chat_request",
    "parse_completion_request",
    "parse_embedding_request",
]

MAX_STOP_STRINGS = 4
_U32 = 2**32 - 1
"""Largest value of the uint32 fields the worker contract carries (max_tokens, top_k ...)."""
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# --------------------------------------------------------------------------------------------
# Typed requests


@dataclass(slots=True)
class GenerationOptions:
    """Sampling and stopping options shared by chat and text completions."""

    max_tokens: int | None = None
    """None: the endpoint's default (chat: until the context is full; completions: 16)."""
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k (the OpenAI-compatible -1 is mapped to 0)."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    """Choice i of a request uses seed + i."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    """Stop strings, never part of the output."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    """None: no logprobs; k >= 0: the chosen token's logprob plus k alternatives."""
    skip_special_tokens: bool = True
    priority: int = 0
    guided: GuidedDecoding | None = None
    """Structured-output constraint (response_format / guided_*); None: unconstrained."""
    guided_param: str = "response_format"
    """The request field `guided` came from (named in the error if the engine lacks it)."""
    return_token_ids: bool = False
    """Deltas carry the generated token ids (KServe output_ids)."""


@dataclass(slots=True)
class ToolChoice:
    """How the model may call tools: "none", "auto", "required", or one named "function"."""

    mode: Literal["none", "auto", "required", "function"] = "auto"
    name: str | None = None
    """The function to call when mode is "function"."""


@dataclass(slots=True)
class ChatMessage:
    """One chat message, content flattened to text."""

    role: str
    content: str | None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The dict chat templates expect."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


@dataclass(slots=True)
class ChatCompletionRequest:
    """POST /v1/chat/completions."""

    model: str
    messages: list[ChatMessage]
    options: GenerationOptions = field(default_factory=GenerationOptions)
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] | None = None
    """Tool definitions rendered into the prompt (None: no tools, or tool_choice "none")."""
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    """False: only the first tool call the model makes is returned."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    user: str | None = None


@dataclass(slots=True)
class CompletionRequest:
    """POST /v1/completions. Each prompt is text or token ids."""

    model: str
    prompts: list[str | list[int]]
    options: GenerationOptions = field(default_factory=GenerationOptions)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    user: str | None = None


@dataclass(slots=True)
class EmbeddingRequest:
    """POST /v1/embeddings. Each input is text or token ids."""

    model: str
    inputs: list[str | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    """Truncate (and re-normalize) vectors to this many dimensions; None: full size."""
    user: str | None = None


# --------------------------------------------------------------------------------------------
# Typed results


@dataclass(slots=True)
class ToolCall:
    """A complete tool call the model made. `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """A streamed fragment of tool call `index`: its first fragment has `id` and `name`; later
    ones append to `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class TokenLogprobInfo:
    """A generated token's logprob and its top alternatives, as text and bytes."""

    token: str
    token_bytes: bytes
    logprob: float
    top: list[tuple[str, bytes, float]]


@dataclass(slots=True)
class ChoiceDelta:
    """New output of one choice. `finish_reason` ("stop" / "length" / "tool_calls") is set on
    its last delta. `reasoning` and `tool_calls` are only ever set by the output parsers;
    `token_ids` only when the request asked for them."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprobInfo] | None = None
    token_ids: list[int] | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


@dataclass(slots=True)
class UsageInfo:
    """Token accounting of a whole request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """prompt + completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict[str, Any]:
        """OpenAI `usage` object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class ChoiceResult:
    """One finished choice of a unary response."""

    index: int
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobInfo] | None = None
    token_ids: list[int] | None = None
    reasoning: str | None = None
    """Reasoning text separated by the reasoning parser (None: no parser, or none found)."""
    tool_calls: list[ToolCall] | None = None


@dataclass(slots=True)
class CompletionResult:
    """A finished, non-streamed chat or text completion."""

    id: str
    created: int
    model: str
    kind: Literal["chat", "text"]
    choices: list[ChoiceResult]
    usage: UsageInfo
    system_fingerprint: str = ""
    """Identifies the serving configuration (OpenAI's `system_fingerprint`); "" omits it."""


@dataclass(slots=True)
class EmbeddingResult:
    """Embedding vectors, one per input, in input order."""

    model: str
    vectors: list[list[float]]
    prompt_tokens: int


# --------------------------------------------------------------------------------------------
# Parsing helpers


def _load(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def _type_error(key: str, expected: str) -> InvalidRequest:
    return InvalidRequest(f"'{key}' must be {expected}", param=key)


def _str(body: dict[str, Any], key: str, *, required: bool = False) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise InvalidRequest(f"'{key}' is required", param=key)
        return None
    if not isinstance(value, str):
        raise _type_error(key, "a string")
    return value


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(key, "a boolean")
    return value


def _int(
    body: dict[str, Any], key: str, *, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(key, "an integer")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidRequest(f"'{key}' must be {_range(lo, hi)}, got {value}", param=key)
    return value


def _float(
    body: dict[str, Any],
    key: str,
    default: float,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(key, "a number")
    number = float(value)
    if number != number or (  # NaN
        (lo is not None and (number < lo or (lo_open and number == lo)))
        or (hi is not None and number > hi)
    ):
        bound = f"> {lo}" if lo_open and hi is None else _range(lo, hi, lo_open=lo_open)
        raise InvalidRequest(f"'{key}' must be {bound}, got {value}", param=key)
    return number


def _range(lo: float | None, hi: float | None, *, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in ({lo}, {hi}]" if lo_open else f"between {lo} and {hi}"
    if lo is not None:
        return f"> {lo}" if lo_open else f">= {lo}"
    return f"<= {hi}"


def _token_ids(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _U32 for v in value
    ):
        raise _type_error(key, "a list of non-negative integer token ids")
    return value


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        if not isinstance(options, dict):
            raise _type_error("stream_options", "an object")
        include_usage = _bool(options, "include_usage", False)
    return stream, include_usage


def _options(body: dict[str, Any], *, default_logprobs: int | None) -> GenerationOptions:
    max_tokens = _int(body, "max_tokens", hi=_U32)
    max_completion = _int(body, "max_completion_tokens", hi=_U32)
    if max_completion is not None:
        max_tokens, key = max_completion, "max_completion_tokens"
    else:
        key = "max_tokens"
    if max_tokens is not None and max_tokens <= 0:
        raise InvalidRequest(f"'{key}' must be >= 1, got {max_tokens}", param=key)
    min_tokens = _int(body, "min_tokens", lo=0, hi=_U32) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(
            f"'min_tokens' ({min_tokens}) must not exceed '{key}' ({max_tokens})",
            param="min_tokens",
        )

    stop_raw = body.get("stop")
    stop: tuple[str, ...]
    if stop_raw is None:
        stop = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        if len(stop_raw) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                f"'stop' accepts at most {MAX_STOP_STRINGS} strings, got {len(stop_raw)}",
                param="stop",
            )
        stop = tuple(s for s in stop_raw if s)
    else:
        raise _type_error("stop", "a string or a list of strings")

    stop_ids_raw = body.get("stop_token_ids")
    stop_token_ids = (
        () if stop_ids_raw is None else tuple(_token_ids(stop_ids_raw, "stop_token_ids"))
    )

    bias_raw = body.get("logit_bias")
    logit_bias: dict[int, float] = {}
    if bias_raw is not None:
        if not isinstance(bias_raw, dict):
            raise _type_error("logit_bias", "an object mapping token ids to numbers")
        for token, bias in bias_raw.items():
            try:
                token_id = int(token)
            except ValueError:
                raise InvalidRequest(
                    f"'logit_bias' key {token!r} is not a token id", param="logit_bias"
                ) from None
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise _type_error("logit_bias", "an object mapping token ids to numbers")
            if not 0 <= token_id <= _U32 or not -100.0 <= bias <= 100.0:
                raise InvalidRequest(
                    "'logit_bias' needs token ids >= 0 and biases between -100 and 100",
                    param="logit_bias",
                )
            logit_bias[token_id] = float(bias)

    top_k = _int(body, "top_k", lo=-1, hi=_U32) or 0
    seed = _int(body, "seed", lo=-(2**63), hi=2**63 - 1)
    guided, guided_param = _guided(body)
    return GenerationOptions(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=_float(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_float(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=max(top_k, 0),
        min_p=_float(body, "min_p", 0.0, lo=0.0, hi=1.0),
        presence_penalty=_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True),
        seed=seed,
        logit_bias=logit_bias,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=_bool(body, "ignore_eos", False),
        n=_int(body, "n", lo=1, hi=_U32) or 1,
        logprobs=default_logprobs,
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        priority=_int(body, "priority", lo=-(2**31), hi=2**31 - 1) or 0,
        guided=guided,
        guided_param=guided_param,
    )


def _schema_text(value: Any, key: str) -> str:
    """A JSON Schema given as an object (or boolean) or as JSON text -> JSON text."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise InvalidRequest(f"'{key}' is not valid JSON", param=key) from None
    if not isinstance(value, (dict, bool)):
        raise _type_error(key, "a JSON Schema object")
    return orjson.dumps(value).decode()


def _guided_choice(value: Any, key: str) -> GuidedDecoding:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _type_error(key, "a non-empty list of non-empty strings")
    return GuidedDecoding(GuidedKind.CHOICE, choices=tuple(value))


def _guided_text(kind: GuidedKind, value: Any, key: str) -> GuidedDecoding:
    if not isinstance(value, str) or not value:
        raise _type_error(key, "a non-empty string")
    return GuidedDecoding(kind, value)


def _response_format(fmt: Any) -> GuidedDecoding | None:
    key = "response_format"
    if not isinstance(fmt, dict):
        raise _type_error(key, "an object")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding(GuidedKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest(
                "response_format of type 'json_schema' needs a 'json_schema' object", param=key
            )
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest("response_format.json_schema.name must be a string", param=key)
        schema = spec.get("schema")
        if schema is None:
            return GuidedDecoding(GuidedKind.JSON_OBJECT)
        return GuidedDecoding(GuidedKind.JSON_SCHEMA, _schema_text(schema, key))
    raise InvalidRequest(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        param=key,
    )


def _structured_outputs(spec: Any) -> GuidedDecoding | None:
    key = "structured_outputs"
    if not isinstance(spec, dict):
        raise _type_error(key, "an object")
    found: list[GuidedDecoding] = []
    if spec.get("json") is not None:
        found.append(GuidedDecoding(GuidedKind.JSON_SCHEMA, _schema_text(spec["json"], key)))
    if spec.get("json_object"):
        found.append(GuidedDecoding(GuidedKind.JSON_OBJECT))
    if spec.get("regex") is not None:
        found.append(_guided_text(GuidedKind.REGEX, spec["regex"], key))
    if spec.get("grammar") is not None:
        found.append(_guided_text(GuidedKind.GRAMMAR, spec["grammar"], key))
    if spec.get("choice") is not None:
        found.append(_guided_choice(spec["choice"], key))
    if len(found) > 1:
        raise InvalidRequest("structured_outputs may set only one constraint", param=key)
    return found[0] if found else None


_GUIDED_KEYS = frozenset(
    {
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_grammar",
        "guided_choice",
        "structured_outputs",
    }
)
_TOOL_KEYS = frozenset({"tools", "functions", "tool_choice", "function_call"})
_NO_TOOLS = ToolChoice("none")
"""Shared by requests without tools (never mutated)."""


def _guided(body: dict[str, Any]) -> tuple[GuidedDecoding | None, str]:
    """The structured-output constraint of a request and the field it came from."""
    if _GUIDED_KEYS.isdisjoint(body):
        return None, "response_format"
    found: list[tuple[GuidedDecoding, str]] = []
    sources = (
        ("response_format", _response_format),
        ("guided_json", lambda v: GuidedDecoding(
            GuidedKind.JSON_SCHEMA, _schema_text(v, "guided_json"))),
        ("guided_regex", lambda v: _guided_text(GuidedKind.REGEX, v, "guided_regex")),
        ("guided_grammar", lambda v: _guided_text(GuidedKind.GRAMMAR, v, "guided_grammar")),
        ("guided_choice", lambda v: _guided_choice(v, "guided_choice")),
        ("structured_outputs", _structured_outputs),
    )  # fmt: skip
    for key, parse in sources:
        value = body.get(key)
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


def _tool_name(tool: dict[str, Any]) -> str | None:
    fn = tool.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        return str(fn["name"])
    return None


def _tools(data: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, ToolChoice]:
    """`tools` (or the deprecated `functions`) and `tool_choice` (or `function_call`)."""
    if _TOOL_KEYS.isdisjoint(data):
        return None, _NO_TOOLS
    tools = data.get("tools")
    key = "tools"
    if tools is None and data.get("functions") is not None:
        key = "functions"
        functions = data["functions"]
        if not isinstance(functions, list) or not all(isinstance(f, dict) for f in functions):
            raise _type_error(key, "a list of function objects")
        tools = [{"type": "function", "function": f} for f in functions]
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise _type_error(key, "a list of tool objects")
    for tool in tools or ():
        kind = tool.get("type", "function")
        if kind != "function":
            raise InvalidRequest(
                f"tool type {kind!r} is not supported (function tools only)", param=key
            )
        fn = tool.get("function")
        if fn is not None and (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
            raise InvalidRequest("every tool function needs a string 'name'", param=key)

    raw = data.get("tool_choice")
    choice_key = "tool_choice"
    if raw is None and data.get("function_call") is not None:
        choice_key = "function_call"
        raw = data["function_call"]
        if isinstance(raw, dict):
            raw = {"type": "function", "function": raw}
    if raw is None:
        choice = ToolChoice("auto" if tools else "none")
    elif raw in ("none", "auto", "required"):
        choice = ToolChoice(raw)
    elif isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(
                f"'{choice_key}' of type 'function' needs function.name", param=choice_key
            )
        choice = ToolChoice("function", fn["name"])
    elif isinstance(raw, dict) and raw.get("type") == "allowed_tools":
        allowed = raw.get("allowed_tools")
        if not isinstance(allowed, dict) or allowed.get("mode", "auto") not in (
            "auto",
            "required",
        ):
            raise InvalidRequest(
                "allowed_tools needs a mode of 'auto' or 'required'", param=choice_key
            )
        listed = allowed.get("tools")
        if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
            raise InvalidRequest("allowed_tools.tools must be a list of tools", param=choice_key)
        names = {_tool_name(t) for t in listed}
        tools = [t for t in tools or () if _tool_name(t) in names]
        choice = ToolChoice("required" if allowed.get("mode") == "required" else "auto")
    else:
        raise InvalidRequest(
            f"'{choice_key}' must be 'none', 'auto', 'required' or a named function",
            param=choice_key,
        )
    if choice.mode in ("required", "function") and not tools:
        raise InvalidRequest(
            f"'{choice_key}' {choice.name or choice.mode!r} needs 'tools'", param=choice_key
        )
    if choice.mode == "function" and all(_tool_name(t) != choice.name for t in tools or ()):
        raise InvalidRequest(
            f"'{choice_key}' names {choice.name!r}, which is not in 'tools'", param=choice_key
        )
    return (tools or None) if choice.mode != "none" else None, choice


def _content(value: Any, index: int) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts: list[str] = []
        for part in value:
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise InvalidRequest(
                    f"messages[{index}].content parts must be objects", param="messages"
                )
            kind = part.get("type")
            if kind in ("text", "input_text", "refusal"):
                text = part.get("text", part.get("refusal"))
                if not isinstance(text, str):
                    raise InvalidRequest(
                        f"messages[{index}].content text part needs a string 'text'",
                        param="messages",
                    )
                texts.append(text)
            else:
                raise InvalidRequest(
                    f"content part type {kind!r} is not supported (text only)", param="messages"
                )
        return "\n".join(texts)
    raise InvalidRequest(
        f"messages[{index}].content must be a string, a list of parts or null", param="messages"
    )


def _message(raw: Any, index: int) -> ChatMessage:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"messages[{index}] must be an object", param="messages")
    role = raw.get("role")
    if not isinstance(role, str):
        raise InvalidRequest(f"messages[{index}].role must be a string", param="messages")
    if role not in CHAT_ROLES:
        raise InvalidRequest(f"messages[{index}].role {role!r} is not supported", param="messages")
    content = _content(raw.get("content"), index)
    if content is None and role not in ("assistant", "function"):
        raise InvalidRequest(f"messages[{index}].content is required", param="messages")
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"messages[{index}].name must be a string", param="messages")
    tool_calls = raw.get("tool_calls")
    if tool_calls is not None and (
        not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls)
    ):
        raise InvalidRequest(
            f"messages[{index}].tool_calls must be a list of objects", param="messages"
        )
    tool_call_id = raw.get("tool_call_id")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise InvalidRequest(f"messages[{index}].tool_call_id must be a string", param="messages")
    reasoning = raw.get("reasoning_content", raw.get("reasoning"))
    return ChatMessage(
        role=role,
        content=content,
        name=name,
        tool_calls=tool_calls or None,
        tool_call_id=tool_call_id,
        reasoning_content=reasoning if isinstance(reasoning, str) else None,
    )


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parse and validate a chat completion request body. Raises InvalidRequest."""
    data = _load(body)
    model = _str(data, "model", required=True)
    assert model is not None
    raw_messages = data.get("messages")
    if raw_messages is None:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(raw_messages, list):
        raise _type_error("messages", "a list of messages")
    if not raw_messages:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    messages = [_message(m, i) for i, m in enumerate(raw_messages)]

    want_logprobs = _bool(data, "logprobs", False)
    top_logprobs = _int(data, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if top_logprobs is not None and top_logprobs > 0 and not want_logprobs:
        raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    stream, include_usage = _stream_flags(data)
    tools, tool_choice = _tools(data)
    kwargs = data.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _type_error("chat_template_kwargs", "an object")
    effort = _str(data, "reasoning_effort")
    if effort is not None:
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    options = _options(data, default_logprobs=(top_logprobs or 0) if want_logprobs else None)
    if _int(data, "best_of") not in (None, options.n):
        raise InvalidRequest("'best_of' other than n is not supported", param="best_of")
    return ChatCompletionRequest(
        model=model,
        messages=messages,
        options=options,
        stream=stream,
        include_usage=include_usage,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_bool(data, "parallel_tool_calls", True),
        add_generation_prompt=_bool(data, "add_generation_prompt", True),
        chat_template_kwargs=kwargs or {},
        user=_str(data, "user"),
    )


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Parse and validate a text completion request body. Raises InvalidRequest."""
    data = _load(body)
    model = _str(data, "model", required=True)
    assert model is not None
    raw = data.get("prompt")
    prompts: list[str | list[int]]
    if raw is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    if isinstance(raw, str):
        prompts = [raw]
    elif isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            prompts = list(raw)
        elif all(isinstance(p, int) and not isinstance(p, bool) for p in raw):
            prompts = [_token_ids(raw, "prompt")]
        elif all(isinstance(p, list) for p in raw):
            prompts = [_token_ids(p, "prompt") for p in raw]
            if any(not p for p in prompts):
                raise InvalidRequest("token prompts must not be empty", param="prompt")
        else:
            raise _type_error(
                "prompt", "a string, a list of strings, a list of token ids or a list of those"
            )
    else:
        raise _type_error(
            "prompt", "a string, a non-empty list of strings, token ids or lists of token ids"
        )
    logprobs = _int(data, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    echo = _bool(data, "echo", False)
    if echo and logprobs is not None:
        raise InvalidRequest("'echo' together with 'logprobs' is not supported", param="echo")
    suffix = _str(data, "suffix")
    if suffix:
        raise InvalidRequest("'suffix' is not supported", param="suffix")
    stream, include_usage = _stream_flags(data)
    options = _options(data, default_logprobs=logprobs)
    if _int(data, "best_of") not in (None, options.n):
        raise InvalidRequest("'best_of' other than n is not supported", param="best_of")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        options=options,
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        user=_str(data, "user"),
    )


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """Parse and validate an embeddings request body. Raises InvalidRequest."""
    data = _load(body)
    model = _str(data, "model", required=True)
    assert model is not None
    raw = data.get("input")
    inputs: list[str | list[int]]
    if raw is None:
        raise InvalidRequest("'input' is required", param="input")
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        inputs = list(raw)
    elif (
        isinstance(raw, list)
        and raw
        and all(isinstance(p, int) and not isinstance(p, bool) for p in raw)
    ):
        inputs = [_token_ids(raw, "input")]
    elif isinstance(raw, list) and raw and all(isinstance(p, list) and p for p in raw):
        inputs = [_token_ids(p, "input") for p in raw]
    else:
        raise _type_error(
            "input", "a string, a non-empty list of strings, token ids or lists of token ids"
        )
    if any(not p for p in inputs):
        raise InvalidRequest("'input' must not contain empty strings", param="input")
    fmt = _str(data, "encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise InvalidRequest(
            "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
        )
    return EmbeddingRequest(
        model=model,
        inputs=inputs,
        encoding_format="base64" if fmt == "base64" else "float",
        dimensions=_int(data, "dimensions", lo=1, hi=1 << 20),
        user=_str(data, "user"),
    )


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


def _finish_bytes(reason: str | None) -> bytes:
    encoded = _FINISH.get(reason)
    return encoded if encoded is not None else _dumps(reason)


def _chat_logprobs(infos: Sequence[TokenLogprobInfo]) -> list[dict[str, Any]]:
    return [
        {
            "token": info.token,
            "logprob": info.logprob,
            "bytes": list(info.token_bytes),
            "top_logprobs": [
                {"token": tok, "logprob": lp, "bytes": list(raw)} for tok, raw, lp in info.top
            ],
        }
        for info in infos
    ]


def _text_logprobs(infos: Sequence[TokenLogprobInfo], offset: int) -> tuple[dict[str, Any], int]:
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for info in infos:
        tokens.append(info.token)
        token_logprobs.append(info.logprob)
        top.append({tok: lp for tok, _, lp in info.top})
        offsets.append(offset)
        offset += len(info.token)
    return (
        {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
         "text_offset": offsets},
        offset,
    )  # fmt: skip


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
        logprobs = (
            b"null" if d.logprobs is None else _dumps({"content": _chat_logprobs(d.logprobs)})
        )
        return (
            self._prefix
            + idx
            + body
            + b'},"logprobs":'
            + logprobs
            + b',"finish_reason":'
            + _finish_bytes(d.finish_reason)
            + self._tail
        )

    def usage(self, usage: UsageInfo) -> bytes:
        """The final usage chunk (`choices: []`)."""
        return self._head + b',"choices":[],"usage":' + _dumps(usage.to_json()) + b"}\n\n"


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
        logprobs = (
            b"null" if d.logprobs is None else _dumps({"content": _chat_logprobs(d.logprobs)})
        )
        return (
            self._prefix
            + idx
            + b",".join(parts)
            + b'},"logprobs":'
            + logprobs
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
            logprobs = _dumps(obj)
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
        return self._head + b',"choices":[],"usage":' + _dumps(usage.to_json()) + b"}\n\n"


def encode_error_event(payload: dict[str, Any]) -> bytes:
    """An SSE error event (sent when a stream fails after it started), then [DONE]."""
    return b"data: " + _dumps(payload) + b"\n\n" + DONE_EVENT


def encode_result(result: CompletionResult) -> bytes:
    """JSON body of a unary chat or text completion."""
    choices: list[dict[str, Any]] = []
    if result.kind == "chat":
        for c in result.choices:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": c.text
                if c.text or (c.tool_calls is None and c.reasoning is None)
                else None,
                "refusal": None,
            }
            if c.reasoning is not None:
                message["reasoning_content"] = c.reasoning
            if c.tool_calls is not None:
                message["tool_calls"] = [
                    {
                        "id": t.id,
                        "type": "function",
                        "function": {"name": t.name, "arguments": t.arguments},
                    }
                    for t in c.tool_calls
                ]
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": None
                    if c.logprobs is None
                    else {"content": _chat_logprobs(c.logprobs), "refusal": None},
                    "finish_reason": c.finish_reason,
                }
            )
        object_ = "chat.completion"
    else:
        for c in result.choices:
            choices.append(
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": None if c.logprobs is None else _text_logprobs(c.logprobs, 0)[0],
                    "finish_reason": c.finish_reason,
                }
            )
        object_ = "text_completion"
    body: dict[str, Any] = {
        "id": result.id,
        "object": object_,
        "created": result.created,
        "model": result.model,
    }
    if result.system_fingerprint:
        body["system_fingerprint"] = result.system_fingerprint
    body["choices"] = choices
    body["usage"] = result.usage.to_json()
    return _dumps(body)


def encode_embeddings(result: EmbeddingResult, encoding_format: str) -> bytes:
    """JSON body of POST /v1/embeddings (`base64`: little-endian float32, as OpenAI sends)."""
    data: list[dict[str, Any]] = []
    for i, vector in enumerate(result.vectors):
        embedding: list[float] | str = vector
        if encoding_format == "base64":
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return _dumps(
        {
            "object": "list",
            "data": data,
            "model": result.model,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        }
    )


def _model_card(info: ModelInfo, created: int) -> dict[str, Any]:
    return {
        "id": info.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "kvmesh",
        "max_model_len": info.context_length,
    }


def encode_models(models: Sequence[ModelInfo], created: int) -> bytes:
    """JSON body of GET /v1/models."""
    return _dumps({"object": "list", "data": [_model_card(m, created) for m in models]})


def encode_model(info: ModelInfo, created: int) -> bytes:
    """JSON body of GET /v1/models/{model}."""
    return _dumps(_model_card(info, created))
