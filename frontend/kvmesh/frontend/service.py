"""The service behind every door: everything between a typed request and a typed result.

Transports stay thin: the aiohttp routes (kvmesh.frontend.app: OpenAI and KServe v2 REST) and
the KServe v2 gRPC servicer (kvmesh.frontend.kserve_grpc) turn their wire format into the typed
requests of kvmesh.frontend.dataplane, call ONE method of `OpenAIService` (`chat_completion`,
`completion`, `embeddings`), and encode the typed result or stream it returns.

Per request the service: refuses new work while draining; resolves the model card and the
tokenizer; applies the chat template and tokenizes; validates against the context window;
fans out `n` backend generations (per prompt) concurrently, each with its own seed (seed + i)
and request id; waits for every choice's first output before returning, so errors from the
backend (no worker, unknown adapter, overload) still become proper HTTP statuses; then
detokenizes incrementally, applies stop strings (never emitted) and accounts usage and metrics.

Large prompts never stall the event loop: text longer than OFFLOAD_CHARS is tokenized on a
worker thread (the chunked encoder, kvmesh.frontend.tokencache, hands the GIL back between
chunks), and text that cannot fit the context window whatever its tokens (more than `context`
x the longest token's characters x 2) is refused before tokenizing (one tokenizers call, on a
text it cannot chunk, holds the GIL throughout).

Chat output parsing: when the model has a reasoning parser (kvmesh.frontend.reasoning) or the
request offers tools (kvmesh.frontend.tool_parsers), each choice's deltas pass through a
per-choice `_OutputParser` that splits reasoning, content and tool calls; plain chats never
touch it. Parsers are chosen per model from `FrontendConfig.tool_call_parser` /
`reasoning_parser` ("auto" reads the chat template). tool_choice "required" or a named function
is enforced with guided decoding (like vLLM), so it needs an engine with GUIDED_DECODING, as
does `response_format`; without it the request is refused (400) instead of silently ignored.

Context-window policy (documented deviation from vLLM, which answers 400): a prompt that
leaves no room for a single output token, or whose prompt + max_tokens exceed the context
window, is refused with RequestTooLarge (HTTP 400, code "context_length_exceeded"), with
vLLM's message. Without max_tokens, chat generates until the window is full and completions
generate `default_completion_max_tokens` (16, like OpenAI).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Literal

import msgspec

from kvmesh.frontend.backend import EmbeddingBackend, GenerateBackend, LoraBackend
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.dataplane import (
    ChatCompletionRequest,
    ChoiceDelta,
    ChoiceResult,
    CompletionRequest,
    CompletionResult,
    EmbeddingRequest,
    EmbeddingResult,
    GenerationOptions,
    TokenLogprobInfo,
    ToolCallDelta,
    UsageInfo,
    tool_name,
)
from kvmesh.frontend.detokenize import IncrementalDetokenizer, StopStringMatcher
from kvmesh.frontend.media import load_images
from kvmesh.frontend.metrics import FrontendMetrics, ModelMetrics
from kvmesh.frontend.reasoning import (
    ReasoningParser,
    ReasoningStream,
    detect_reasoning_parser,
    get_reasoning_parser,
)
from kvmesh.frontend.tokenizer import Tokenizer, TokenizerRegistry
from kvmesh.frontend.tool_parsers import (
    TOOL_PARSERS,
    JsonListParser,
    NamedToolCallStream,
    ToolCallStream,
    ToolParser,
    collect_calls,
    detect_tool_parser,
    get_tool_parser,
)
from kvmesh.runtime import __version__
from kvmesh.runtime.errors import (
    InvalidRequest,
    KvmeshError,
    NotFound,
    RequestTooLarge,
    Unavailable,
    Unimplemented,
)
from kvmesh.runtime.multimodal import expand_placeholders
from kvmesh.runtime.telemetry import Step, tracer
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    GuidedKind,
    MediaInput,
    ModelInfo,
    SamplingParams,
    StopParams,
    TokenLogprob,
)

__all__ = ["CompletionStream", "OpenAIService"]

log = logging.getLogger(__name__)

_FINISH_TEXT = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
_perf = time.perf_counter
_SEED_MOD = 2**64
"""Seeds travel as uint64: a negative seed (or seed + i past the range) wraps around."""
GUIDED_DECODING = "GUIDED_DECODING"
EMBEDDINGS = "EMBEDDINGS"
MULTIMODAL = "MULTIMODAL"


class _Choice:
    """State of one choice (one backend generation) of a request."""

    __slots__ = (
        "completion_tokens",
        "detok",
        "echo",
        "final",
        "finish_reason",
        "first",
        "index",
        "iterator",
        "logprobs",
        "min_tokens",
        "prompt_index",
        "prompt_len",
        "stops",
        "token_ids",
    )

    def __init__(
        self,
        index: int,
        prompt_index: int,
        prompt_len: int,
        iterator: AsyncIterator[EngineOutput],
        detok: IncrementalDetokenizer,
        stops: StopStringMatcher | None,
        logprobs: bool,
        min_tokens: int,
        echo: str | None,
        token_ids: bool = False,
    ) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.prompt_len = prompt_len
        self.iterator = iterator
        self.detok = detok
        self.stops = stops
        self.logprobs = logprobs
        self.min_tokens = min_tokens
        self.echo = echo
        self.token_ids = token_ids
        """Deltas carry the generated token ids."""
        self.first: EngineOutput | None = None
        self.completion_tokens = 0
        self.final: EngineOutput | None = None
        """The backend's last output (finish reason, usage), once received."""
        self.finish_reason: str | None = None


async def _close(iterator: AsyncIterator[EngineOutput]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


def _usage(choices: Sequence[_Choice]) -> UsageInfo:
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for ch in choices:
        prompt_tokens[ch.prompt_index] = ch.prompt_len
        final = ch.final.usage if ch.final is not None else None
        if final is not None:
            completion += max(final.completion_tokens, ch.completion_tokens)
            cached[ch.prompt_index] = max(cached.get(ch.prompt_index, 0), final.cached_tokens)
        else:
            completion += ch.completion_tokens
    return UsageInfo(sum(prompt_tokens.values()), completion, sum(cached.values()))


class CompletionStream:
    """A started, streamed completion. Iterate it for ChoiceDelta events; always `aclose()` it.

    Choices interleave in arrival order; each choice's last delta has `finish_reason` set.
    `usage` is complete once iteration has ended. `aclose()` (idempotent) cancels every backend
    request still running and releases the request's in-flight slot. Errors raised during
    iteration are kvmesh.runtime.errors exceptions (or unexpected ones, to be reported as internal).
    """

    __slots__ = (
        "_choices",
        "_closed",
        "_events",
        "_on_close",
        "created",
        "id",
        "kind",
        "model",
        "parsed",
        "system_fingerprint",
    )

    def __init__(
        self,
        id_: str,
        created: int,
        model: str,
        kind: Literal["chat", "text"],
        choices: list[_Choice],
        events: AsyncGenerator[ChoiceDelta, None],
        on_close: _InflightSlot,
        *,
        system_fingerprint: str = "",
        parsed: bool = False,
    ) -> None:
        self.id = id_
        """Response id (chatcmpl-... / cmpl-...)."""
        self.created = created
        """Unix seconds."""
        self.model = model
        """Model name as the client gave it."""
        self.kind: Literal["chat", "text"] = kind
        """"chat" or "text" completion."""
        self.system_fingerprint = system_fingerprint
        """OpenAI `system_fingerprint` of the serving configuration."""
        self.parsed = parsed
        """Deltas may carry reasoning and tool calls (output parsers are active)."""
        self._choices = choices
        self._events = events
        self._on_close = on_close
        self._closed = False

    @property
    def num_choices(self) -> int:
        """Number of choices (prompts x n)."""
        return len(self._choices)

    @property
    def usage(self) -> UsageInfo:
        """Token usage so far (final once iteration ended)."""
        return _usage(self._choices)

    def prompt_tokens(self, index: int = 0) -> int:
        """Prompt tokens of choice `index`."""
        return self._choices[index].prompt_len

    def completion_tokens(self, index: int = 0) -> int:
        """Tokens choice `index` generated so far."""
        return self._choices[index].completion_tokens

    def __aiter__(self) -> AsyncGenerator[ChoiceDelta, None]:
        return self._events

    async def aclose(self) -> None:
        """Stop: cancel what still runs on the backend; release the request slot."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._events.aclose()
        finally:
            try:
                # Choices whose generator never started still hold an open backend iterator.
                for ch in self._choices:
                    await _close(ch.iterator)
            finally:
                self._on_close.release()


OFFLOAD_CHARS = 32768
"""Prompt text longer than this is tokenized on a worker thread, not on the event loop."""


async def _encode(
    tok: Tokenizer, info: ModelInfo, text: str, *, add_special_tokens: bool, param: str
) -> list[int]:
    """Token ids of `text`, large texts off the event loop (see the module docstring)."""
    if len(text) <= OFFLOAD_CHARS:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    context = info.context_length or tok.context_length
    if context > 0:
        bound = context * tok.max_token_chars * 2
        if len(text) > bound:
            raise RequestTooLarge(
                f"This model's maximum context length is {context} tokens. However, your "
                f"prompt has {len(text)} characters, more than {context} tokens can hold.",
                param=param,
            )
    return await asyncio.to_thread(tok.encode, text, add_special_tokens=add_special_tokens)


class _InflightSlot:
    """A request's in-flight (and, until its first token, queued) count, released exactly
    once."""

    __slots__ = ("_metrics", "_queued", "_released", "_service")

    def __init__(self, service: OpenAIService, metrics: ModelMetrics) -> None:
        self._service = service
        self._metrics = metrics
        self._released = False
        self._queued = True
        service._inflight += 1
        metrics.inflight += 1
        metrics.queued += 1

    def first_token(self) -> None:
        """The request is no longer waiting for its first token."""
        if self._queued:
            self._queued = False
            self._metrics.queued -= 1

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.first_token()
        self._metrics.inflight -= 1
        service = self._service
        service._inflight -= 1
        if service._inflight == 0 and service._idle is not None:
            service._idle.set()


class OpenAIService:
    """OpenAI chat/text completions over a GenerateBackend. Shared by every transport.

    Lifecycle: construct, serve; `start_drain()` makes `ready()` false and refuses new
    requests with Unavailable while in-flight ones finish (`wait_idle()` waits for them).
    All methods run on one event loop.
    """

    def __init__(
        self,
        backend: GenerateBackend,
        tokenizers: TokenizerRegistry | Mapping[str, Tokenizer],
        config: FrontendConfig | None = None,
        *,
        metrics: FrontendMetrics | None = None,
    ) -> None:
        """`tokenizers`: served model name -> Tokenizer (or a registry that also loads them
        from the model card's path on first use). `metrics`: a new FrontendMetrics by default.
        """
        self.backend = backend
        self.config = config if config is not None else FrontendConfig()
        self.metrics = metrics if metrics is not None else FrontendMetrics()
        self.tokenizers = (
            tokenizers
            if isinstance(tokenizers, TokenizerRegistry)
            else TokenizerRegistry(
                tokenizers, chunk_cache_entries=self.config.tokenizer_cache_entries
            )
        )
        self._draining = False
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self._id_prefix = f"{random.getrandbits(64):016x}"
        self._counter = itertools.count(1)
        self._tool_setting = _parser_setting(self.config.tool_call_parser, get_tool_parser)
        self._reasoning_setting = _parser_setting(
            self.config.reasoning_parser, get_reasoning_parser
        )
        self._tool_parsers: dict[str, type[ToolParser] | None] = {}
        self._reasoning_parsers: dict[str, ReasoningParser | None] = {}
        self._fingerprints: dict[tuple[str, str, str], str] = {}
        self.log_content = False
        """Log each request's prompt and output text (`--log-content`; off: never)."""

    # -- lifecycle -------------------------------------------------------------------------

    def ready(self) -> bool:
        """Healthy: the backend has a ready worker and the service is not draining."""
        return not self._draining and self.backend.ready()

    @property
    def draining(self) -> bool:
        """Whether start_drain() was called."""
        return self._draining

    @property
    def in_flight(self) -> int:
        """Requests started and not finished (streams count until closed)."""
        return self._inflight

    def start_drain(self) -> None:
        """Refuse new requests (Unavailable); let in-flight ones finish. Idempotent."""
        self._draining = True

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no request is in flight; False if `timeout_s` seconds passed first."""
        if self._inflight == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return self._inflight == 0
        return True

    def models(self) -> list[ModelInfo]:
        """Cards of the models served now."""
        return self.backend.models()

    def model_info(self, model: str) -> ModelInfo | None:
        """The card of `model` (a served model or LoRA adapter name); None if unknown."""
        return self.backend.model_info(model)

    async def load_lora_adapter(self, name: str, path: str, model: str = "") -> list[str]:
        """Load LoRA adapter `name` from `path` on the workers (see LoraBackend); returns their
        worker ids. InvalidRequest when `name` is already a served model's name; Unimplemented
        when the backend cannot load adapters."""
        backend = self.backend
        if not isinstance(backend, LoraBackend):
            raise Unimplemented("this gateway's backend cannot load LoRA adapters")
        if any(info.served_model_name == name for info in backend.models()):
            raise InvalidRequest(f"{name!r} is the name of a served model", param="lora_name")
        return await backend.load_lora(name, path, model)

    async def unload_lora_adapter(self, name: str) -> list[str]:
        """Unload LoRA adapter `name` from every worker that has it (see LoraBackend)."""
        backend = self.backend
        if not isinstance(backend, LoraBackend):
            raise Unimplemented("this gateway's backend cannot unload LoRA adapters")
        return await backend.unload_lora(name)

    def model_ready(self, model: str) -> bool:
        """Whether `model` is known and the service can take requests for it now."""
        return self.ready() and self.backend.model_info(model) is not None

    def system_fingerprint(self, info: ModelInfo) -> str:
        """OpenAI `system_fingerprint`: identifies kvmesh's version, the model and its engine,
        so clients can tell when the serving configuration (hence seeded output) changed."""
        key = (info.served_model_name, info.engine, info.model_path)
        fp = self._fingerprints.get(key)
        if fp is None:
            digest = hashlib.sha256("|".join((__version__, *key)).encode()).hexdigest()
            fp = self._fingerprints[key] = "fp_" + digest[:10]
        return fp

    # -- requests --------------------------------------------------------------------------

    async def chat_completion(
        self, request: ChatCompletionRequest, trace: TraceContext | None = None
    ) -> CompletionStream | CompletionResult:
        """Run a chat completion: a CompletionStream if `request.stream`, else the result.

        Raises kvmesh.runtime.errors exceptions before anything is streamed (see the module
        docstring).
        `trace`: the context of the caller's (server) span: the preprocess span and the backend's
        spans are its children.
        """
        start = _perf()
        info, tok = await self._resolve(request.model)
        media = await self._chat_media(request, info)
        recording = trace is not None and trace.sampled and tracer().enabled
        began = time.time_ns() if recording else 0
        resolved = _perf()
        prompt = self._chat_text(request, tok)
        templated = _perf()
        ids = await self._chat_ids(prompt, info, tok, len(media))
        if recording:
            assert trace is not None
            _preprocessed(trace, began, templated - resolved, _perf() - templated, len(ids))
        if self.log_content:
            log.info("chat prompt (%d tokens): %r", len(ids), prompt)
        options, parsers = self._chat_output(request, info, tok, prompt)
        return await self._start(
            "chat",
            request.model,
            info,
            tok,
            [ids],
            None,
            options,
            options.max_tokens,
            stream=request.stream,
            trace=trace,
            start=start,
            parsers=parsers,
            media=media,
        )

    async def count_chat_tokens(self, request: ChatCompletionRequest) -> int:
        """The number of prompt tokens `request` would send: its rendered chat template, each
        image counted as the placeholder tokens it expands to (what usage reports)."""
        info, tok = await self._resolve(request.model)
        media = await self._chat_media(request, info)
        return len(await self._chat_ids(self._chat_text(request, tok), info, tok, len(media)))

    async def _chat_media(
        self, request: ChatCompletionRequest, info: ModelInfo
    ) -> tuple[MediaInput, ...]:
        """The chat's images, loaded and checked (kvmesh.frontend.media); InvalidRequest when
        the model's engine does not take images."""
        urls = [url for m in request.messages for url in m.images]
        media = await load_images(urls, self.config) if urls else ()
        if media and MULTIMODAL not in info.capabilities:
            raise InvalidRequest(
                f"model `{request.model}` does not take images (its engine "
                f"{info.engine or 'unknown'!r} does not advertise the MULTIMODAL capability)",
                param="messages",
            )
        return media

    @staticmethod
    async def _chat_ids(prompt: str, info: ModelInfo, tok: Tokenizer, num_media: int) -> list[int]:
        """The token ids of a rendered chat `prompt` with `num_media` images: on a model with
        image placeholders (its card's `image_token_id`, `tokens_per_image`), each image token
        the template rendered repeated `tokens_per_image` times, as the engine takes them."""
        ids = await _encode(tok, info, prompt, add_special_tokens=False, param="messages")
        if num_media and info.image_token_id is not None and info.tokens_per_image:
            ids = expand_placeholders(ids, info.image_token_id, info.tokens_per_image, num_media)
        return ids

    @staticmethod
    def _chat_text(request: ChatCompletionRequest, tok: Tokenizer) -> str:
        """The chat's prompt text: its rendered chat template."""
        return tok.apply_chat_template(
            [m.to_template() for m in request.messages],
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            template_kwargs=request.chat_template_kwargs,
        )

    async def completion(
        self, request: CompletionRequest, trace: TraceContext | None = None
    ) -> CompletionStream | CompletionResult:
        """Run a text completion (one or several prompts x n choices); see chat_completion."""
        start = _perf()
        info, tok = await self._resolve(request.model)
        recording = trace is not None and trace.sampled and tracer().enabled
        began = time.time_ns() if recording else 0
        resolved = _perf()
        prompts: list[list[int]] = []
        echoes: list[str] | None = [] if request.echo else None
        for prompt in request.prompts:
            if isinstance(prompt, str):
                prompts.append(
                    await _encode(tok, info, prompt, add_special_tokens=True, param="prompt")
                )
                if echoes is not None:
                    echoes.append(prompt)
            else:
                bad = next((t for t in prompt if t >= tok.vocab_size), None)
                if bad is not None:
                    raise InvalidRequest(
                        f"token id {bad} is out of the vocabulary (size {tok.vocab_size})",
                        param="prompt",
                    )
                prompts.append(prompt)
                if echoes is not None:
                    echoes.append(tok.decode(prompt, skip_special_tokens=False))
        if recording:
            assert trace is not None
            _preprocessed(trace, began, 0.0, _perf() - resolved, sum(len(p) for p in prompts))
        if self.log_content:
            log.info("completion prompts: %r", request.prompts)
        max_tokens = request.options.max_tokens
        if max_tokens is None:
            max_tokens = self.config.default_completion_max_tokens
        if request.options.guided is not None:
            self._require_guided(
                info, request.model, request.options.guided_param, "structured output"
            )
        return await self._start(
            "text",
            request.model,
            info,
            tok,
            prompts,
            echoes,
            request.options,
            max_tokens,
            stream=request.stream,
            trace=trace,
            start=start,
        )

    async def embeddings(
        self, request: EmbeddingRequest, trace: TraceContext | None = None
    ) -> EmbeddingResult:
        """Embed every input. InvalidRequest when the model's engine has no EMBEDDINGS
        capability; Unimplemented when the backend cannot reach an embedding engine."""
        info, tok = await self._resolve(request.model)
        if EMBEDDINGS not in info.capabilities:
            raise InvalidRequest(
                f"model `{request.model}` does not support embeddings (its engine "
                f"{info.engine or 'unknown'!r} does not advertise the EMBEDDINGS capability)",
                param="model",
            )
        backend = self.backend
        if not isinstance(backend, EmbeddingBackend):
            raise Unimplemented("this gateway's backend cannot compute embeddings")
        prompts: list[list[int]] = []
        for item in request.inputs:
            if isinstance(item, str):
                prompts.append(
                    await _encode(tok, info, item, add_special_tokens=True, param="input")
                )
            else:
                bad = next((t for t in item if t >= tok.vocab_size), None)
                if bad is not None:
                    raise InvalidRequest(
                        f"token id {bad} is out of the vocabulary (size {tok.vocab_size})",
                        param="input",
                    )
                prompts.append(item)
        context = info.context_length or tok.context_length
        for ids in prompts:
            if context > 0 and len(ids) > context:
                raise RequestTooLarge(
                    f"This model's maximum context length is {context} tokens. However, an "
                    f"input has {len(ids)} tokens.",
                    param="input",
                )
        span = trace if trace is not None else TraceContext.new()
        slot = _InflightSlot(self, self.metrics.model(info.served_model_name))
        try:
            vectors = await backend.embed(request.model, prompts, span)
        finally:
            slot.release()
        if request.dimensions is not None:
            vectors = [_truncate(v, request.dimensions) for v in vectors]
        return EmbeddingResult(request.model, vectors, sum(len(p) for p in prompts))

    # -- internals -------------------------------------------------------------------------

    def _tool_parser(self, model: str, tok: Tokenizer) -> type[ToolParser] | None:
        if model in self._tool_parsers:
            return self._tool_parsers[model]
        name = self._tool_setting.get(model, self._tool_setting.get("", "auto"))
        if name == "auto":
            name = (
                detect_tool_parser(tok.chat_template("tool_use") or tok.chat_template("default"))
                or "none"
            )
        cls = None if name == "none" else get_tool_parser(name)
        self._tool_parsers[model] = cls
        return cls

    def _reasoning_parser(self, model: str, tok: Tokenizer) -> ReasoningParser | None:
        if model in self._reasoning_parsers:
            return self._reasoning_parsers[model]
        name = self._reasoning_setting.get(model, self._reasoning_setting.get("", "auto"))
        if name == "auto":
            name = detect_reasoning_parser(tok.chat_template("default")) or "none"
        parser = None if name == "none" else get_reasoning_parser(name)
        self._reasoning_parsers[model] = parser
        return parser

    def _require_guided(self, info: ModelInfo, model: str, param: str, what: str) -> None:
        if GUIDED_DECODING not in info.capabilities:
            raise InvalidRequest(
                f"{what} needs guided decoding, which model `{model}` does not support "
                f"(its engine {info.engine or 'unknown'!r} does not advertise the "
                "GUIDED_DECODING capability)",
                param=param,
            )

    def _chat_output(
        self, request: ChatCompletionRequest, info: ModelInfo, tok: Tokenizer, prompt: str
    ) -> tuple[GenerationOptions, Callable[[], _OutputParser] | None]:
        """Options to generate with, and a factory of per-choice output parsers (None for a
        plain chat: no reasoning parser, no tools)."""
        options = request.options
        name = info.served_model_name
        reasoning = self._reasoning_parser(name, tok)
        tools = request.tools
        choice = request.tool_choice
        make_tools: Callable[[], ToolCallStream | NamedToolCallStream] | None = None
        tool_finish = "tool_calls"
        if tools and choice.mode in ("required", "function"):
            if options.guided is not None:
                raise InvalidRequest(
                    f"tool_choice {choice.name or choice.mode!r} cannot be combined with "
                    f"'{options.guided_param}'",
                    param="tool_choice",
                )
            what = f"tool_choice {choice.name or choice.mode!r}"
            self._require_guided(info, request.model, "tool_choice", what)
            schema = _tool_schema(tools, choice.name, request.parallel_tool_calls)
            options = _with(
                options, guided=GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(schema))
            )
            options.guided_param = "tool_choice"
            if choice.name is not None:
                function = choice.name
                tool_finish = "stop"
                make_tools = lambda: NamedToolCallStream(function)  # noqa: E731
            else:
                parallel = request.parallel_tool_calls
                make_tools = lambda: ToolCallStream(  # noqa: E731
                    JsonListParser(), parallel_tool_calls=parallel
                )
        elif tools:
            parser_cls = self._tool_parser(name, tok)
            if parser_cls is None:
                raise InvalidRequest(
                    f"tool calling is not set up for model `{request.model}`: its chat template "
                    "names no known tool-call format; start the frontend with "
                    f"--tool-call-parser ({', '.join(sorted(TOOL_PARSERS))})",
                    param="tools",
                )
            names = [n for n in (tool_name(t) for t in tools) if n is not None]
            parallel = request.parallel_tool_calls
            make_tools = lambda: ToolCallStream(  # noqa: E731
                parser_cls(names), parallel_tool_calls=parallel
            )
            if parser_cls.needs_special_tokens and options.skip_special_tokens:
                options = _with(options, skip_special_tokens=False)
        if options.guided is not None and options.guided_param != "tool_choice":
            self._require_guided(info, request.model, options.guided_param, "structured output")
        if reasoning is not None and reasoning.needs_special_tokens and options.skip_special_tokens:
            options = _with(options, skip_special_tokens=False)
        if reasoning is None and make_tools is None:
            return options, None
        return options, lambda: _OutputParser(
            reasoning.stream(prompt) if reasoning is not None else None,
            make_tools() if make_tools is not None else None,
            tool_finish,
        )

    async def _resolve(self, model: str) -> tuple[ModelInfo, Tokenizer]:
        if self._draining:
            raise Unavailable("the server is shutting down")
        info = self.backend.model_info(model)
        if info is None:
            raise NotFound(f"The model `{model}` does not exist.", param="model")
        tok = self.tokenizers.lookup(info.served_model_name)
        if tok is None:
            tok = await self.tokenizers.load(info)
        return info, tok

    def _new_id(self, kind: str) -> str:
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return f"{prefix}{self._id_prefix}{next(self._counter):016x}"

    def _check(
        self,
        tok: Tokenizer,
        info: ModelInfo,
        prompts: list[list[int]],
        options: GenerationOptions,
        max_tokens: int | None,
    ) -> None:
        if options.n > self.config.max_n:
            raise InvalidRequest(f"'n' must be <= {self.config.max_n}", param="n")
        vocab = tok.vocab_size
        for key, token_ids in (
            ("stop_token_ids", options.stop_token_ids),
            ("logit_bias", tuple(options.logit_bias)),
        ):
            bad = next((t for t in token_ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    f"token id {bad} in '{key}' is out of the vocabulary (size {vocab})",
                    param=key,
                )
        context = info.context_length or tok.context_length
        for ids in prompts:
            if not ids:
                raise InvalidRequest("the prompt is empty", param="prompt")
            if context <= 0:
                continue
            if len(ids) >= context:
                raise RequestTooLarge(
                    f"This model's maximum context length is {context} tokens. However, your "
                    f"prompt has {len(ids)} tokens, which leaves no room for output.",
                    param="messages",
                )
            if max_tokens is not None and len(ids) + max_tokens > context:
                raise RequestTooLarge(
                    f"This model's maximum context length is {context} tokens. However, you "
                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                    f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                    param="max_tokens",
                )

    async def _start(
        self,
        kind: Literal["chat", "text"],
        model: str,
        info: ModelInfo,
        tok: Tokenizer,
        prompts: list[list[int]],
        echoes: list[str] | None,
        options: GenerationOptions,
        max_tokens: int | None,
        *,
        stream: bool,
        trace: TraceContext | None,
        start: float,
        parsers: Callable[[], _OutputParser] | None = None,
        media: tuple[MediaInput, ...] = (),
    ) -> CompletionStream | CompletionResult:
        self._check(tok, info, prompts, options, max_tokens)
        mm = self.metrics.model(info.served_model_name)
        request_id = self._new_id(kind)
        span = trace if trace is not None else TraceContext.new()
        n = options.n
        total = len(prompts) * n
        choices: list[_Choice] = []
        backend = self.backend
        slot = _InflightSlot(self, mm)
        try:
            for p, ids in enumerate(prompts):
                mm.isl.observe(len(ids))
                for j in range(n):
                    index = p * n + j
                    engine_request = EngineRequest(
                        request_id=request_id if total == 1 else f"{request_id}-{index}",
                        prompt=ids,
                        sampling=SamplingParams(
                            temperature=options.temperature,
                            top_p=options.top_p,
                            top_k=options.top_k,
                            min_p=options.min_p,
                            presence_penalty=options.presence_penalty,
                            frequency_penalty=options.frequency_penalty,
                            repetition_penalty=options.repetition_penalty,
                            seed=None if options.seed is None else (options.seed + j) % _SEED_MOD,
                            top_logprobs=options.logprobs,
                            logit_bias=options.logit_bias,
                            guided=options.guided,
                        ),
                        stop=StopParams(
                            max_tokens=max_tokens,
                            min_tokens=options.min_tokens,
                            stop_token_ids=options.stop_token_ids,
                            ignore_eos=options.ignore_eos,
                        ),
                        lora_name=model if model != info.served_model_name else "",
                        priority=options.priority,
                        media=media,
                    )
                    choices.append(
                        _Choice(
                            index,
                            p,
                            len(ids),
                            backend.generate(model, engine_request, span),
                            tok.detokenizer(ids, skip_special_tokens=options.skip_special_tokens),
                            StopStringMatcher(options.stop) if options.stop else None,
                            options.logprobs is not None,
                            options.min_tokens,
                            echoes[p] if echoes is not None else None,
                            options.return_token_ids,
                        )
                    )
            await self._prime(choices)
            slot.first_token()
        except BaseException:
            for ch in choices:
                await _close(ch.iterator)
            slot.release()
            raise

        runs = [self._run_choice(ch, tok, mm, start) for ch in choices]
        if parsers is not None:
            runs = [_parse_choice(run, parsers()) for run in runs]
        events = runs[0] if len(runs) == 1 else _merge(runs)
        stream_obj = CompletionStream(
            request_id,
            int(time.time()),
            model,
            kind,
            choices,
            events,
            slot,
            system_fingerprint=self.system_fingerprint(info),
            parsed=parsers is not None,
        )
        if stream:
            return stream_obj
        try:
            return await self._collect(stream_obj)
        finally:
            await stream_obj.aclose()

    async def _prime(self, choices: list[_Choice]) -> None:
        """Fetch every choice's first output, so backend errors surface before streaming."""
        if len(choices) == 1:
            ch = choices[0]
            ch.first = await _first(ch.iterator)
            return
        results = await asyncio.gather(
            *(_first(ch.iterator) for ch in choices), return_exceptions=True
        )
        for ch, result in zip(choices, results, strict=True):
            if isinstance(result, BaseException):
                raise result
            ch.first = result

    async def _collect(self, stream: CompletionStream) -> CompletionResult:
        n = stream.num_choices
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprobInfo] | None] = [None] * n
        finish: list[str] = ["stop"] * n
        token_ids: list[list[int] | None] = [None] * n
        reasoning: list[list[str] | None] = [None] * n
        calls: list[list[ToolCallDelta]] = [[] for _ in range(n)]
        stop_sequences: list[str | None] = [None] * n
        async for delta in stream:
            i = delta.index
            if delta.text:
                texts[i].append(delta.text)
            if delta.logprobs is not None:
                existing = logprobs[i]
                if existing is None:
                    logprobs[i] = list(delta.logprobs)
                else:
                    existing.extend(delta.logprobs)
            if delta.token_ids is not None:
                ids = token_ids[i]
                if ids is None:
                    token_ids[i] = list(delta.token_ids)
                else:
                    ids.extend(delta.token_ids)
            if delta.reasoning:
                parts = reasoning[i]
                if parts is None:
                    reasoning[i] = [delta.reasoning]
                else:
                    parts.append(delta.reasoning)
            if delta.tool_calls:
                calls[i].extend(delta.tool_calls)
            if delta.finish_reason is not None:
                finish[i] = delta.finish_reason
                stop_sequences[i] = delta.stop_sequence
        choices = [
            ChoiceResult(
                i,
                "".join(texts[i]),
                finish[i],
                logprobs[i],
                token_ids[i],
                "".join(parts) if (parts := reasoning[i]) is not None else None,
                collect_calls(calls[i]) if calls[i] else None,
                stop_sequences[i],
            )
            for i in range(n)
        ]
        return CompletionResult(
            stream.id,
            stream.created,
            stream.model,
            stream.kind,
            choices,
            stream.usage,
            stream.system_fingerprint,
        )

    async def _run_choice(
        self, ch: _Choice, tok: Tokenizer, mm: ModelMetrics, start: float
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """Deltas of one choice; closes its backend iterator however it ends."""
        iterator = ch.iterator
        next_output = iterator.__anext__
        out = ch.first
        assert out is not None
        detok_step = ch.detok.step
        stops = ch.stops
        index = ch.index
        want_ids = ch.token_ids
        last = first_at = start
        first_token = True
        texts: list[str] | None = [] if self.log_content else None
        try:
            if ch.echo:
                yield ChoiceDelta(index, ch.echo)
            while True:
                ids = out.token_ids
                finish = out.finish_reason
                text = ""
                if ids:
                    now = _perf()
                    count = len(ids)
                    if first_token:
                        mm.ttft.observe(now - start)
                        first_at = now
                        first_token = False
                    else:
                        mm.itl.observe((now - last) / count, count)
                    last = now
                    ch.completion_tokens += count
                    stop_id = out.stop_token_id
                    if stop_id is not None and ids[-1] == stop_id:
                        ids = ids[:-1]
                    if ids:
                        text = detok_step(ids)
                reason: str | None = None
                if finish is not None:
                    if finish is FinishReason.CANCELLED:
                        raise Unavailable("the worker cancelled the request")
                    ch.final = out
                    text += ch.detok.flush()
                if stops is not None and ch.completion_tokens >= ch.min_tokens:
                    text, matched = stops.feed(text)
                    if matched:
                        reason = "stop"
                    elif finish is not None:
                        text += stops.flush()
                if reason is None and finish is not None:
                    reason = _FINISH_TEXT[finish]
                logprobs = (
                    _logprob_infos(tok, out.logprobs) if ch.logprobs and out.logprobs else None
                )
                if texts is not None:
                    texts.append(text)
                if reason is not None:
                    ch.finish_reason = reason  # before the yield: a consumer may stop there
                if reason is not None and stops is not None and stops.matched is not None:
                    yield ChoiceDelta(
                        index,
                        text,
                        reason,
                        logprobs,
                        list(ids) if want_ids else None,
                        stop_sequence=stops.matched,
                    )
                elif want_ids:
                    if text or reason is not None or logprobs or ids:
                        yield ChoiceDelta(index, text, reason, logprobs, list(ids))
                elif text or reason is not None or logprobs:
                    yield ChoiceDelta(index, text, reason, logprobs)
                if reason is not None:
                    return
                try:
                    out = await next_output()
                except StopAsyncIteration:
                    raise KvmeshError(
                        "the backend ended a generation without a finish reason"
                    ) from None
        finally:
            mm.osl.observe(ch.completion_tokens)
            mm.output_tokens += ch.completion_tokens
            final = ch.final
            if final is not None and final.usage is not None:
                mm.cached.observe(final.usage.cached_tokens)
            if final is not None and ch.completion_tokens > 1:
                mm.request_itl.observe((last - first_at) / (ch.completion_tokens - 1))
            mm.duration.observe(_perf() - start)
            if texts is not None:
                log.info("choice %d output (%s): %r", index, ch.finish_reason, "".join(texts))
            await _close(iterator)


def _preprocessed(
    trace: TraceContext, began_ns: int, template_s: float, tokenize_s: float, tokens: int
) -> None:
    """Record the `preprocess` span (chat template, tokenization), a child of `trace`."""
    attributes = {
        "kvmesh.preprocess.template_ms": template_s * 1000.0,
        "kvmesh.preprocess.tokenize_ms": tokenize_s * 1000.0,
        "gen_ai.usage.input_tokens": tokens,
    }
    tracer().record(trace, (Step("preprocess", began_ns, time.time_ns(), attributes),))


class _OutputParser:
    """Splits one choice's text into reasoning, content and tool calls (a reasoning parser
    first, then a tool-call parser over the content)."""

    __slots__ = ("reasoning", "tool_finish", "tools")

    def __init__(
        self,
        reasoning: ReasoningStream | None,
        tools: ToolCallStream | NamedToolCallStream | None,
        tool_finish: str,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.tool_finish = tool_finish
        """The finish reason of a choice that called tools and stopped by itself."""

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def feed(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
        calls: list[ToolCallDelta] = []
        if self.tools is not None and text:
            text, calls = self.tools.feed(text)
        return text, reasoning, calls

    def finish(self) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning = text = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.finish()
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text) if text else ("", [])
            more, rest = self.tools.finish()
            text += more
            calls += rest
        return text, reasoning, calls


async def _parse_choice(
    events: AsyncGenerator[ChoiceDelta, None], parser: _OutputParser
) -> AsyncGenerator[ChoiceDelta, None]:
    """One choice's deltas with reasoning and tool calls split out of the text."""
    try:
        async for d in events:
            text, reasoning, calls = parser.feed(d.text)
            reason = d.finish_reason
            if reason is not None:
                more, more_reasoning, more_calls = parser.finish()
                text += more
                reasoning += more_reasoning
                calls += more_calls
                if reason == "stop" and parser.called:
                    reason = parser.tool_finish
            elif not (text or reasoning or calls or d.logprobs or d.token_ids):
                continue
            yield ChoiceDelta(
                d.index,
                text,
                reason,
                d.logprobs,
                d.token_ids,
                reasoning or None,
                calls or None,
                d.stop_sequence,
            )
            if reason is not None:
                return
    finally:
        await events.aclose()


def _tool_parameters(tool: Mapping[str, Any]) -> Any:
    fn = tool.get("function")
    params = fn.get("parameters") if isinstance(fn, Mapping) else None
    return params if isinstance(params, (dict, bool)) else {"type": "object"}


def _tool_schema(
    tools: Sequence[Mapping[str, Any]], name: str | None, parallel: bool = True
) -> dict[str, Any]:
    """JSON Schema forcing a tool call: the named function's arguments, or (tool_choice
    "required") a non-empty list of {"name", "parameters"} objects, as vLLM builds them, with
    no other keys (as xgrammar's strict mode, vLLM's default, enforces: a grammar that allows
    extra keys lets a model write them instead of ending the call); one call at most when
    `parallel` (parallel_tool_calls) is false."""
    if name is not None:
        for tool in tools:
            if tool_name(tool) == name:
                params = _tool_parameters(tool)
                return params if isinstance(params, dict) else {"type": "object"}
    variants = [
        {
            "properties": {
                "name": {"type": "string", "enum": [function]},
                "parameters": _tool_parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
        if (function := tool_name(tool)) is not None
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _with(options: GenerationOptions, **changes: Any) -> GenerationOptions:
    """A copy of `options` with `changes` (the parsed request is left as it was)."""
    return msgspec.structs.replace(options, **changes)


def _parser_setting(spec: str, lookup: Callable[[str], object]) -> dict[str, str]:
    """`--tool-call-parser` / `--reasoning-parser`: "auto", "none", a parser name, or
    comma-separated `model=name` entries plus an optional default entry. Names are checked
    now so a typo fails at startup. Returns {model or "": name}."""
    out: dict[str, str] = {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        model, _, name = entry.rpartition("=")
        name = name.strip()
        if name not in ("auto", "none"):
            lookup(name)
        out[model.strip()] = name
    return out or {"": "none"}


def _truncate(vector: list[float], dimensions: int) -> list[float]:
    """The first `dimensions` components, re-normalized to unit length (OpenAI's semantics)."""
    if dimensions > len(vector):
        raise InvalidRequest(
            f"'dimensions' ({dimensions}) exceeds the model's embedding size ({len(vector)})",
            param="dimensions",
        )
    head = vector[:dimensions]
    norm = sum(x * x for x in head) ** 0.5
    return [x / norm for x in head] if norm > 0 else head


async def _first(iterator: AsyncIterator[EngineOutput]) -> EngineOutput:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        raise KvmeshError("the backend ended a generation without any output") from None


def _logprob_infos(tok: Tokenizer, logprobs: list[TokenLogprob]) -> list[TokenLogprobInfo]:
    token_str = tok.token_str
    token_bytes = tok.token_bytes
    return [
        TokenLogprobInfo(
            token_str(lp.token_id),
            token_bytes(lp.token_id),
            lp.logprob,
            [(token_str(t), token_bytes(t), v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


async def _merge(
    generators: list[AsyncGenerator[ChoiceDelta, None]],
) -> AsyncGenerator[ChoiceDelta, None]:
    """Interleave several choices' deltas in arrival order; cancel them all on exit."""
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(gen: AsyncGenerator[ChoiceDelta, None]) -> None:
        try:
            async for delta in gen:
                queue.put_nowait(delta)
            queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # reported to the consumer, which re-raises it
            queue.put_nowait(_Failed(exc))
        finally:
            await gen.aclose()

    tasks = [asyncio.create_task(pump(g)) for g in generators]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, _Failed):
                raise item.exc
            else:
                assert isinstance(item, ChoiceDelta)
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
