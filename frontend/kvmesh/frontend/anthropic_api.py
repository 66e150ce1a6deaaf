"""The Anthropic Messages API door: POST /v1/messages and /v1/messages/count_tokens.

Like the OpenAI door (kvmesh.frontend.protocol), it only translates: a Messages body decodes
into the data plane's `ChatCompletionRequest` (kvmesh.frontend.dataplane), which the same
`OpenAIService.chat_completion` runs on the same engines, and the result is encoded back as an
Anthropic `message` (unary) or its event stream (`message_start`, `content_block_start` /
`_delta` / `_stop`, `message_delta`, `message_stop`).

Mapping:
- `system` (a string or text blocks) -> a system message; `messages` alternate user and
  assistant turns of text blocks; a user's `image` blocks (`base64` or `url` source) become the
  message's images, as OpenAI `image_url` parts (a data URI, or the URL under the gateway's
  media rules; the model's engine must take images); an assistant's `tool_use` blocks become
  its `tool_calls` (arguments: the `input` object as JSON text); a user's `tool_result` blocks
  become `tool` messages (before the turn's text), answering the call with `tool_use_id`.
- `tools` (`name`, `description`, `input_schema`) -> function tools; `tool_choice` auto / any /
  tool / none -> auto / required / the named function / none;
  `disable_parallel_tool_use` -> parallel_tool_calls false.
- `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k`,
  `metadata.user_id` -> the generation options and `user`.
- Output: reasoning split by the model's reasoning parser -> a `thinking` block, text -> a
  `text` block, tool calls parsed by the model's tool-call parser -> `tool_use` blocks.
  Finish: "stop" -> `end_turn` (or `stop_sequence`, naming the stop string), "length" ->
  `max_tokens`, "tool_calls" -> `tool_use`.

Errors are Anthropic-shaped: `{"type": "error", "error": {"type", "message"}}`, with the
error types of the Anthropic API for each HTTP status (`anthropic_error_body`); in a started
stream, an `event: error` event ends it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import orjson
from msgspec import Meta, Struct

from kvmesh.frontend.dataplane import (
    ChatCompletionRequest,
    ChatMessage,
    ChoiceDelta,
    CompletionResult,
    GenerationOptions,
    ToolChoice,
)
from kvmesh.frontend.decoding import Refusals, decode, load_object
from kvmesh.runtime.errors import InvalidRequest

__all__ = [
    "AnthropicErrorResponse",
    "CountTokensRequest",
    "CountTokensResponse",
    "CreateMessageRequest",
    "MessageResponse",
    "MessageStreamEncoder",
    "anthropic_error_body",
    "encode_count",
    "encode_message",
    "parse_count_tokens_request",
    "parse_message_request",
]

U32 = 2**32 - 1

# --------------------------------------------------------------------------------------------
# Request schemas


class TextBlock(Struct, tag="text", tag_field="type"):
    """Text."""

    text: str


class Base64ImageSource(Struct, tag="base64", tag_field="type"):
    """An image's bytes, base64-encoded."""

    media_type: str
    data: str


class UrlImageSource(Struct, tag="url", tag_field="type"):
    """An image by URL (loaded as an OpenAI `image_url`: kvmesh.frontend.media's rules)."""

    url: str


class ImageBlock(Struct, tag="image", tag_field="type"):
    """An image in a user turn (for models whose engine takes images: MULTIMODAL)."""

    source: Base64ImageSource | UrlImageSource


class ToolUseBlock(Struct, tag="tool_use", tag_field="type"):
    """A tool call the assistant made earlier in the conversation."""

    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Struct, tag="tool_result", tag_field="type"):
    """The result of the tool call `tool_use_id` (in a user turn)."""

    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(Struct, tag="thinking", tag_field="type"):
    """Reasoning the assistant produced earlier (kept as its reasoning_content)."""

    thinking: str
    signature: str | None = None


ContentBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class MessageParam(Struct):
    """One turn of the conversation."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(Struct, kw_only=True):
    """A tool the model may call."""

    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceParam(Struct, kw_only=True):
    """How the model may use tools."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """The tool to call (type "tool")."""
    disable_parallel_tool_use: bool | None = None


class Metadata(Struct):
    """Request metadata."""

    user_id: str | None = None


_Messages = Annotated[list[MessageParam], Meta(min_length=1)]
_System = str | list[TextBlock] | None


class CountTokensRequest(Struct, kw_only=True):
    """POST /v1/messages/count_tokens."""

    model: str
    messages: _Messages
    system: _System = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None


class CreateMessageRequest(CountTokensRequest, kw_only=True):
    """POST /v1/messages."""

    max_tokens: Annotated[int, Meta(ge=1, le=U32)]
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=U32)] | None = None
    metadata: Metadata | None = None


_REFUSALS: Refusals = {
    "messages": "'messages' must be a non-empty list of {role, content} objects with user or "
    "assistant roles and text, image (base64 or url source), tool_use or tool_result content "
    "blocks",
    "system": "'system' must be a string or a list of text blocks",
    "tools": "'tools' must be a list of {name, description, input_schema} objects",
    "tool_choice": "'tool_choice' must be an object with type auto, any, tool or none",
}

# --------------------------------------------------------------------------------------------
# Building the data plane request


def _text(blocks: Sequence[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _messages(system: _System, turns: Sequence[MessageParam]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if system:
        out.append(ChatMessage("system", system if isinstance(system, str) else _text(system)))
    for i, turn in enumerate(turns):
        if isinstance(turn.content, str):
            out.append(ChatMessage(turn.role, turn.content))
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        thinking: list[str] = []
        images: list[str] = []
        for block in turn.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ImageBlock):
                if turn.role != "user":
                    raise InvalidRequest(
                        f"messages[{i}]: image blocks belong in user turns", param="messages"
                    )
                src = block.source
                images.append(
                    src.url
                    if isinstance(src, UrlImageSource)
                    else f"data:{src.media_type};base64,{src.data}"
                )
            elif isinstance(block, ToolUseBlock):
                if turn.role != "assistant":
                    raise InvalidRequest(
                        f"messages[{i}]: tool_use blocks belong in assistant turns",
                        param="messages",
                    )
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": arguments},
                    }
                )
            elif isinstance(block, ToolResultBlock):
                if turn.role != "user":
                    raise InvalidRequest(
                        f"messages[{i}]: tool_result blocks belong in user turns",
                        param="messages",
                    )
                content = block.content
                result = content if isinstance(content, str) else _text(content or [])
                out.append(ChatMessage("tool", result, tool_call_id=block.tool_use_id))
            else:
                thinking.append(block.thinking)
        if texts or calls or thinking or images:
            out.append(
                ChatMessage(
                    turn.role,
                    "\n".join(texts) if texts or not calls else None,
                    tool_calls=calls or None,
                    reasoning_content="".join(thinking) if thinking else None,
                    images=tuple(images),
                )
            )
    return out


def _tools(
    tools: list[Tool] | None, spec: ToolChoiceParam | None
) -> tuple[list[dict[str, Any]] | None, ToolChoice, bool]:
    """(function tools, tool choice, parallel tool calls)."""
    defs = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.input_schema,
            },
        }
        for t in tools or ()
    ]
    parallel = not (spec is not None and spec.disable_parallel_tool_use)
    kind = spec.type if spec is not None else ("auto" if defs else "none")
    if kind == "none":
        return None, ToolChoice("none"), parallel
    if kind in ("any", "tool") and not defs:
        raise InvalidRequest(f"tool_choice type {kind!r} needs 'tools'", param="tool_choice")
    if kind == "tool":
        name = spec.name if spec is not None else None
        if not name:
            raise InvalidRequest("tool_choice type 'tool' needs a 'name'", param="tool_choice")
        if name not in {t.name for t in tools or ()}:
            raise InvalidRequest(
                f"tool_choice names {name!r}, which is not in 'tools'", param="tool_choice"
            )
        return defs, ToolChoice("function", name), parallel
    return defs or None, ToolChoice("required" if kind == "any" else "auto"), parallel


def _chat(
    b: CountTokensRequest, options: GenerationOptions, stream: bool, user: str | None
) -> ChatCompletionRequest:
    tools, choice, parallel = _tools(b.tools, b.tool_choice)
    return ChatCompletionRequest(
        model=b.model,
        messages=_messages(b.system, b.messages),
        options=options,
        stream=stream,
        include_usage=stream,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        user=user,
    )


def _message_request(b: CreateMessageRequest) -> ChatCompletionRequest:
    stops = tuple(s for s in b.stop_sequences or () if s)
    options = GenerationOptions(
        max_tokens=b.max_tokens,
        temperature=1.0 if b.temperature is None else b.temperature,
        top_p=1.0 if b.top_p is None else b.top_p,
        top_k=b.top_k or 0,
        stop=stops,
    )
    user = b.metadata.user_id if b.metadata is not None else None
    return _chat(b, options, b.stream or False, user)


def parse_message_request(body: bytes) -> ChatCompletionRequest:
    """Parse and validate a Messages request body. Raises InvalidRequest."""
    return decode(CreateMessageRequest, load_object(body), _message_request, _REFUSALS)


def parse_count_tokens_request(body: bytes) -> ChatCompletionRequest:
    """Parse and validate a count_tokens body (the chat it would run). Raises InvalidRequest."""
    return decode(
        CountTokensRequest,
        load_object(body),
        lambda b: _chat(b, GenerationOptions(), False, None),
        _REFUSALS,
    )


# --------------------------------------------------------------------------------------------
# Response schemas


class TextContent(Struct, tag="text", tag_field="type"):
    """Text the model wrote."""

    text: str


class ThinkingContent(Struct, tag="thinking", tag_field="type"):
    """Reasoning the model wrote (split out by the model's reasoning parser)."""

    thinking: str
    signature: str = ""


class ToolUseContent(Struct, tag="tool_use", tag_field="type"):
    """A tool call the model made."""

    id: str
    name: str
    input: Any


ResponseContent = TextContent | ThinkingContent | ToolUseContent
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(Struct):
    """Token accounting."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0


class MessageResponse(Struct, tag="message", tag_field="type"):
    """A finished message (unary), or the `message` of a `message_start` event."""

    id: str
    model: str
    content: list[ResponseContent]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    role: Literal["assistant"] = "assistant"


class CountTokensResponse(Struct):
    """POST /v1/messages/count_tokens."""

    input_tokens: int


class AnthropicError(Struct):
    """What went wrong."""

    type: str
    message: str


class AnthropicErrorResponse(Struct, tag="error", tag_field="type"):
    """An Anthropic-shaped error."""

    error: AnthropicError


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> bytes:
    """The Anthropic error object for an answer with HTTP `status`."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return msgspec.json.encode(AnthropicErrorResponse(AnthropicError(kind, message)))


_STOP_REASONS: dict[str, StopReason] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
}


def _stop_reason(finish: str, stop_sequence: str | None) -> StopReason:
    return "stop_sequence" if stop_sequence is not None else _STOP_REASONS.get(finish, "end_turn")


def message_id(completion_id: str) -> str:
    """The `msg_` id of the message of a chat completion id."""
    return "msg_" + completion_id.partition("-")[2]


def _arguments(text: str) -> Any:
    try:
        return orjson.loads(text) if text else {}
    except orjson.JSONDecodeError:
        return {"_raw": text}


def encode_message(result: CompletionResult) -> bytes:
    """The unary `message` of a finished chat (its first choice)."""
    choice = result.choices[0]
    content: list[ResponseContent] = []
    if choice.reasoning:
        content.append(ThinkingContent(choice.reasoning))
    if choice.text:
        content.append(TextContent(choice.text))
    for call in choice.tool_calls or ():
        content.append(ToolUseContent(call.id, call.name, _arguments(call.arguments)))
    usage = result.usage
    return msgspec.json.encode(
        MessageResponse(
            message_id(result.id),
            result.model,
            content,
            _stop_reason(choice.finish_reason, choice.stop_sequence),
            choice.stop_sequence,
            MessageUsage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens),
        )
    )


def encode_count(tokens: int) -> bytes:
    """The count_tokens answer."""
    return msgspec.json.encode(CountTokensResponse(tokens))


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error_event(status: int, message: str) -> bytes:
    """The `error` event that ends a stream which failed after it started."""
    return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"


class MessageStreamEncoder:
    """The events of one streamed message, from the chat's deltas (choice 0).

    Content blocks open as their kind of output arrives (thinking, text, one per tool call)
    and the open block closes when another kind starts; tool call arguments stream as
    `input_json_delta`s.
    """

    __slots__ = ("_block", "_index", "_kind", "_tool_index")

    def __init__(self) -> None:
        self._index = -1
        self._kind: str | None = None
        self._tool_index: int | None = None
        self._block = 0

    def start(self, id_: str, model: str, input_tokens: int) -> bytes:
        """`message_start` (an empty assistant message) and a ping."""
        message = MessageResponse(
            message_id(id_), model, [], None, None, MessageUsage(input_tokens, 0)
        )
        return _event(
            "message_start", {"type": "message_start", "message": msgspec.to_builtins(message)}
        ) + _event("ping", {"type": "ping"})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._kind = kind
        return out + _event(
            "content_block_start",
            {"type": "content_block_start", "index": self._index, "content_block": block},
        )

    def _close(self) -> bytes:
        if self._kind is None:
            return b""
        self._kind = None
        self._tool_index = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": delta},
        )

    def delta(self, d: ChoiceDelta) -> bytes:
        """The events of one delta of choice 0."""
        out = b""
        if d.reasoning:
            if self._kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": d.reasoning})
        if d.text:
            if self._kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": d.text})
        for call in d.tool_calls or ():
            if self._kind != "tool_use" or self._tool_index != call.index:
                block = {"type": "tool_use", "id": call.id or "", "name": call.name or "",
                         "input": {}}  # fmt: skip
                out += self._open("tool_use", block)
                self._tool_index = call.index
            if call.arguments:
                out += self._delta({"type": "input_json_delta", "partial_json": call.arguments})
        return out

    def finish(self, finish_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes:
        """Close the open block; `message_delta` (stop reason, usage) and `message_stop`."""
        return (
            self._close()
            + _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": _stop_reason(finish_reason, stop_sequence),
                        "stop_sequence": stop_sequence,
                    },
                    "usage": {"output_tokens": output_tokens},
                },
            )
            + _event("message_stop", {"type": "message_stop"})
        )
