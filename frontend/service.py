"""The OpenAI service: everything between a parsed request and a typed result.

Transports stay thin: the aiohttp routes (kvmesh.frontend.app) and, later, the KServe v2
servicer parse their wire format into the typed requests of kvmesh.frontend.protocol, call ONE
method of `OpenAIService`, and encode what it returns.

Per request the service: refuses new work while draining; resolves the model card and the
tokenizer; applies the chat template and tokenizes; validates against the context window;
fans out `n` backend generations (per prompt) concurrently, each with its own seed (seed + i)
and request id; waits for every choice's first output before returning, so errors from the
backend (no worker, unknown adapter, overload) still become proper HTTP statuses; then
detokenizes incrementally, applies stop strings (never emitted) and accounts usage and metrics.

Context-window policy (documented deviation from vLLM, which answers 400): a prompt that
leaves no room for a single output token, or whose prompt + max_tokens exceed the context
window, is refused with RequestTooLarge (HTTP 413, code "context_length_exceeded"), with
vLLM's message. Without max_tokens, chat generates until the window is full and completions
generate `default_completion_max_tokens` (16, like OpenAI).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Literal

from kvmesh.errors import InvalidRequest, KvmeshError, NotFound, RequestTooLarge, Unavailable
from kvmesh.frontend.backend import GenerateBackend
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.detokenize import IncrementalDetokenizer, StopStringMatcher
from kvmesh.frontend.metrics import FrontendMetrics, ModelMetrics
from kvmesh.frontend.protocol import (
    ChatCompletionRequest,
    ChoiceDelta,
    ChoiceResult,
    CompletionRequest,
    CompletionResult,
    GenerationOptions,
    TokenLogprobInfo,
    UsageInfo,
)
from kvmesh.frontend.tokenizer import Tokenizer, TokenizerRegistry
from kvmesh.tracing import TraceContext
from kvmesh.workers.engine import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    ModelInfo,
    SamplingParams,
    StopParams,
    TokenLogprob,
)

__all__ = ["CompletionStream", "OpenAIService"]

_FINISH_TEXT = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
_perf = time.perf_counter


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
    iteration are kvmesh.errors exceptions (or unexpected ones, to be reported as internal).
    """

    __slots__ = ("_choices", "_closed", "_events", "_on_close", "created", "id", "kind", "model")

    def __init__(
        self,
        id_: str,
        created: int,
        model: str,
        kind: Literal["chat", "text"],
        choices: list[_Choice],
        events: AsyncGenerator[ChoiceDelta, None],
        on_close: _InflightSlot,
    ) -> None:
        self.id = id_
        """Response id (chatcmpl-... / cmpl-...)."""
        self.created = created
        """Unix seconds."""
        self.model = model
        """Model name as the client gave it."""
        self.kind: Literal["chat", "text"] = kind
        """"chat" or "text" completion."""
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


class _InflightSlot:
    """Releases a request's in-flight count exactly once."""

    __slots__ = ("_metrics", "_released", "_service")

    def __init__(self, service: OpenAIService, metrics: ModelMetrics) -> None:
        self._service = service
        self._metrics = metrics
        self._released = False
        service._inflight += 1
        metrics.inflight += 1

    def release(self) -> None:
        if self._released:
            return
        self._released = True
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

    # -- requests --------------------------------------------------------------------------

    async def chat_completion(
        self, request: ChatCompletionRequest, trace: TraceContext | None = None
    ) -> CompletionStream | CompletionResult:
        """Run a chat completion: a CompletionStream if `request.stream`, else the result.

        Raises kvmesh.errors exceptions before anything is streamed (see the module docstring).
        `trace`: the caller's context (the service makes a child span for the backend).
        """
        start = _perf()
        info, tok = await self._resolve(request.model)
        messages = [m.to_template() for m in request.messages]
        prompt = tok.apply_chat_template(
            messages,
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            template_kwargs=request.chat_template_kwargs,
        )
        ids = tok.encode(prompt, add_special_tokens=False)
        return await self._start(
            "chat",
            request.model,
            info,
            tok,
            [ids],
            None,
            request.options,
            request.options.max_tokens,
            stream=request.stream,
            trace=trace,
            start=start,
        )

    async def completion(
        self, request: CompletionRequest, trace: TraceContext | None = None
    ) -> CompletionStream | CompletionResult:
        """Run a text completion (one or several prompts x n choices); see chat_completion."""
        start = _perf()
        info, tok = await self._resolve(request.model)
        prompts: list[list[int]] = []
        echoes: list[str] | None = [] if request.echo else None
        for prompt in request.prompts:
            if isinstance(prompt, str):
                prompts.append(tok.encode(prompt, add_special_tokens=True))
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
        max_tokens = request.options.max_tokens
        if max_tokens is None:
            max_tokens = self.config.default_completion_max_tokens
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

    # -- internals -------------------------------------------------------------------------

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
    ) -> CompletionStream | CompletionResult:
        self._check(tok, info, prompts, options, max_tokens)
        mm = self.metrics.model(info.served_model_name)
        request_id = self._new_id(kind)
        span = trace.child() if trace is not None else TraceContext.new()
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
                            seed=None if options.seed is None else options.seed + j,
                            top_logprobs=options.logprobs,
                            logit_bias=options.logit_bias,
                        ),
                        stop=StopParams(
                            max_tokens=max_tokens,
                            min_tokens=options.min_tokens,
                            stop_token_ids=options.stop_token_ids,
                            ignore_eos=options.ignore_eos,
                        ),
                        lora_name=model if model != info.served_model_name else "",
                        priority=options.priority,
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
                        )
                    )
            await self._prime(choices)
        except BaseException:
            for ch in choices:
                await _close(ch.iterator)
            slot.release()
            raise

        if len(choices) == 1:
            events = self._run_choice(choices[0], tok, mm, start)
        else:
            events = _merge([self._run_choice(ch, tok, mm, start) for ch in choices])
        stream_obj = CompletionStream(
            request_id, int(time.time()), model, kind, choices, events, slot
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
            if delta.finish_reason is not None:
                finish[i] = delta.finish_reason
        choices = [ChoiceResult(i, "".join(texts[i]), finish[i], logprobs[i]) for i in range(n)]
        return CompletionResult(
            stream.id, stream.created, stream.model, stream.kind, choices, stream.usage
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
        last = start
        first_token = True
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
                if text or reason is not None or logprobs:
                    yield ChoiceDelta(index, text, reason, logprobs)
                if reason is not None:
                    ch.finish_reason = reason
                    return
                try:
                    out = await next_output()
                except StopAsyncIteration:
                    raise KvmeshError(
                        "the backend ended a generation without a finish reason"
                    ) from None
        finally:
            mm.osl.observe(ch.completion_tokens)
            mm.duration.observe(_perf() - start)
            await _close(iterator)


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
