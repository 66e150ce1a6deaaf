"""The typed data plane: what the service takes and returns, whichever door a request came in by.

`kvmesh.frontend.service.OpenAIService` runs these requests; the doors only translate:

- the OpenAI door (kvmesh.frontend.protocol) decodes JSON bodies into `ChatCompletionRequest`,
  `CompletionRequest` and `EmbeddingRequest`, and encodes `CompletionResult`s, streamed
  `ChoiceDelta`s and `EmbeddingResult`s;
- the KServe v2 door (kvmesh.frontend.kserve, shared by REST and gRPC) maps input tensors and
  parameters to a `CompletionRequest` and the results back to output tensors.

Both build `GenerationOptions` with the one validation of sampling values
(kvmesh.frontend.protocol.generation_options), so a value means the same and is refused with the
same message at either door.

The types are msgspec Structs: cheap to create (a `ChoiceDelta` per output on the streaming
path) and compared by value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from msgspec import Struct, field

from kvmesh.runtime.types import GuidedDecoding

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceDelta",
    "ChoiceResult",
    "CompletionRequest",
    "CompletionResult",
    "EmbeddingRequest",
    "EmbeddingResult",
    "GenerationOptions",
    "TokenLogprobInfo",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "UsageInfo",
    "tool_name",
]

# --------------------------------------------------------------------------------------------
# Requests


class GenerationOptions(Struct):
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


class ToolChoice(Struct):
    """How the model may call tools: "none", "auto", "required", or one named "function"."""

    mode: Literal["none", "auto", "required", "function"] = "auto"
    name: str | None = None
    """The function to call when mode is "function"."""


class ChatMessage(Struct):
    """One chat message, content flattened to text (and its images' URLs)."""

    role: str
    content: str | None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    images: tuple[str, ...] = ()
    """The URLs of the message's image parts, in order (kvmesh.frontend.media loads them)."""

    def to_template(self) -> dict[str, Any]:
        """The dict chat templates expect; a message with images has content parts, one
        `{"type": "image"}` per image and then the text (as multimodal templates take them)."""
        content: str | list[dict[str, str]] | None = self.content
        if self.images:
            content = [{"type": "image"} for _ in self.images]
            content.append({"type": "text", "text": self.content or ""})
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


def tool_name(tool: Mapping[str, Any]) -> str | None:
    """The function name of a tool as the client gave it (None if it has none)."""
    fn = tool.get("function")
    if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
        return str(fn["name"])
    return None


class ChatCompletionRequest(Struct):
    """A chat completion (POST /v1/chat/completions)."""

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


class CompletionRequest(Struct):
    """A text completion (POST /v1/completions, KServe infer). Each prompt is text or token
    ids."""

    model: str
    prompts: list[str | list[int]]
    options: GenerationOptions = field(default_factory=GenerationOptions)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    user: str | None = None


class EmbeddingRequest(Struct):
    """Embeddings (POST /v1/embeddings). Each input is text or token ids."""

    model: str
    inputs: list[str | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    """Truncate (and re-normalize) vectors to this many dimensions; None: full size."""
    user: str | None = None


# --------------------------------------------------------------------------------------------
# Results


class ToolCall(Struct):
    """A complete tool call the model made. `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


class ToolCallDelta(Struct):
    """A streamed fragment of tool call `index`: its first fragment has `id` and `name`; later
    ones append to `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class TokenLogprobInfo(Struct):
    """A generated token's logprob and its top alternatives, as text and bytes."""

    token: str
    token_bytes: bytes
    logprob: float
    top: list[tuple[str, bytes, float]]


class ChoiceDelta(Struct, gc=False):
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
    stop_sequence: str | None = None
    """The stop string that ended the choice (finish_reason "stop"), if one did."""


class UsageInfo(Struct):
    """Token accounting of a whole request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """prompt + completion tokens."""
        return self.prompt_tokens + self.completion_tokens


class ChoiceResult(Struct):
    """One finished choice of a unary response."""

    index: int
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobInfo] | None = None
    token_ids: list[int] | None = None
    reasoning: str | None = None
    """Reasoning text separated by the reasoning parser (None: no parser, or none found)."""
    tool_calls: list[ToolCall] | None = None
    stop_sequence: str | None = None
    """The stop string that ended the choice, if one did."""


class CompletionResult(Struct):
    """A finished, non-streamed chat or text completion."""

    id: str
    created: int
    model: str
    kind: Literal["chat", "text"]
    choices: list[ChoiceResult]
    usage: UsageInfo
    system_fingerprint: str = ""
    """Identifies the serving configuration (OpenAI's `system_fingerprint`); "" omits it."""


class EmbeddingResult(Struct):
    """Embedding vectors, one per input, in input order."""

    model: str
    vectors: list[list[float]]
    prompt_tokens: int
