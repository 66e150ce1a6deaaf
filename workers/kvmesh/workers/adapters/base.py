"""What the vLLM, SGLang and TensorRT-LLM adapters share: an Engine over an async-iterator API.

Each of these engines generates through an async iterator of its own output objects (vLLM
`AsyncLLM.generate` -> RequestOutput, SGLang `Engine.async_generate(stream=True)` -> dicts,
TensorRT-LLM `LLM.generate_async(streaming=True)` -> RequestOutput). `StreamingAdapter.submit`
validates the request (kvmesh's shared rules, then the adapter's own mapping, both raising
InvalidRequest before anything reaches the engine), starts one task that iterates the engine's
iterator and pushes each translated delta to the sink, and returns a handle.

Cancellation: `handle.cancel()` takes the request out of the books at once (nothing more reaches
the sink, `load()` no longer counts it) and cancels the task; the task then aborts the request in
the engine (`_abort`: vLLM `AsyncLLM.abort`, SGLang `abort_request`, TensorRT-LLM
`RequestOutput.abort`) and closes the engine's iterator. The engine frees the request's KV blocks
when it processes the abort, a step later at most. `stop()` ends every request with
FinishReason.CANCELLED, waits for the aborts, then shuts the engine down.

Load: the engine reports its own numbers (running/waiting split, KV blocks in use, cache hit
rate) a step late or, for polled engines, an interval late; the adapter knows exactly which
requests are in flight. `load()` combines both: counts come from the adapter's books, the split
and the KV usage from the engine, with two corrections: nothing in flight means no active
blocks, and the active blocks are at least those of the largest request producing output.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

from kvmesh.runtime.errors import InvalidRequest, KvmeshError, Unavailable
from kvmesh.runtime.kv_events import KvEventLog
from kvmesh.runtime.tasks import TaskSet
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    LoadInfo,
    ModelInfo,
    TokenLogprob,
    Usage,
)
from kvmesh.workers.adapters.kv_translate import KvEventTranslator
from kvmesh.workers.engine import DisaggSettings, Engine, OutputSink, RequestHandle
from kvmesh.workers.validation import validate_request

__all__ = ["OutputDecoder", "StreamingAdapter", "top_logprobs"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def top_logprobs(
    token_id: int, candidates: Sequence[tuple[int, float]], k: int
) -> TokenLogprob | None:
    """TokenLogprob of `token_id` from (token id, logprob) candidates (in any order) with the `k`
    most likely as alternatives; None when the chosen token is not among the candidates."""
    chosen = next((lp for t, lp in candidates if t == token_id), None)
    if chosen is None:
        return None
    ranked = sorted(candidates, key=lambda c: c[1], reverse=True)[:k] if k else []
    return TokenLogprob(token_id, chosen, list(ranked))


class OutputDecoder(abc.ABC, Generic[T]):
    """Turns one request's engine outputs into EngineOutput deltas, counting tokens.

    `skip` engine tokens are dropped from the front: a request continuing a remote prefill gets
    the first token from the prefill worker (counted in `completion_tokens` from the start), and
    engines that re-emit it on the decode side have it removed here.
    """

    def __init__(self, request: EngineRequest, *, skip: int = 0) -> None:
        self.request = request
        self.prompt_tokens = len(request.prompt)
        rp = request.remote_prefill
        self.completion_tokens = 1 if rp is not None else 0
        self.cached_tokens = rp.cached_tokens if rp is not None else 0
        self.skip = skip
        self.skipped: list[int] = []
        """Engine tokens dropped by `skip`."""

    @abc.abstractmethod
    def feed(self, item: T) -> EngineOutput | None:
        """The delta carried by one engine output (None: nothing new). Raises a KvmeshError
        when the engine ended the request with an error."""

    def emit(
        self,
        tokens: Sequence[int],
        logprobs: list[TokenLogprob] | None,
        finish: FinishReason | None,
        stop_token_id: int | None = None,
    ) -> EngineOutput | None:
        """The EngineOutput for `tokens` (after dropping what `skip` asks for)."""
        tokens = list(tokens)
        if self.skip and tokens:
            n = min(self.skip, len(tokens))
            self.skipped += tokens[:n]
            tokens = tokens[n:]
            if logprobs is not None:
                logprobs = logprobs[n:]
            self.skip -= n
        self.completion_tokens += len(tokens)
        if finish is None:
            return EngineOutput(tokens, logprobs) if tokens else None
        usage = Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        return EngineOutput(tokens, logprobs, finish, usage, stop_token_id)


class _Pump:
    """One submitted request: its sink, decoder and task. Also its RequestHandle."""

    __slots__ = ("adapter", "closed", "decoder", "pending", "request", "sink", "started", "task")

    def __init__(
        self,
        adapter: StreamingAdapter[Any],
        request: EngineRequest,
        sink: OutputSink,
        decoder: OutputDecoder[Any],
    ) -> None:
        self.adapter = adapter
        self.request = request
        self.sink = sink
        self.decoder = decoder
        self.closed = False
        """Nothing more may reach the sink (finished, failed, cancelled or stopped)."""
        self.started = False
        """The engine produced output (the prompt was prefilled)."""
        self.pending = 0
        """Prompt tokens counted in the adapter's pending prefill until the first output."""
        self.task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        self.adapter._cancel(self)


class PrefillSink:
    """OutputSink of a prefill-only request: collects its outputs; the last resolves a future."""

    def __init__(self) -> None:
        self.future: asyncio.Future[EngineOutput] = asyncio.get_running_loop().create_future()
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []

    def output(self, out: EngineOutput) -> None:
        self.tokens += out.token_ids
        self.logprobs += out.logprobs or []
        if out.finish_reason is not None and not self.future.done():
            self.future.set_result(out)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class StreamingAdapter(Engine, Generic[T]):
    """Base class of the adapters (see the module docstring).

    Subclasses implement `_start_engine` (create the engine, fill in `_info`, start KV event and
    load tasks with `_spawn`), `_stop_engine`, `_prepare` (request -> engine arguments, raising
    InvalidRequest), `_open` (start the request in the engine, returning its async iterator),
    `_decoder`, `_abort` and optionally `_translate_error`.
    """

    abort_timeout_s = 10.0
    """How long stop() waits for the engine to acknowledge aborts."""

    def __init__(
        self,
        *,
        engine_name: str,
        served_model_name: str,
        model_path: str,
        eos_token_ids: Sequence[int],
        context_length: int,
    ) -> None:
        self._info = ModelInfo(
            served_model_name=served_model_name,
            engine=engine_name,
            kv_block_size=0,
            kv_total_blocks=0,
            context_length=context_length,
            model_path=model_path,
            eos_token_ids=tuple(eos_token_ids),
        )
        self._pumps: dict[str, _Pump] = {}
        self._tasks = TaskSet()
        self._background = TaskSet()
        self._running = False
        self._stopping = False
        """stop() is under way: background loops (`_spawn`) must end."""
        self._events: KvEventLog | None = None
        self._translator: KvEventTranslator | None = None
        """Engine KV events -> `_events` (set by subclasses that receive KV events)."""
        self.subscriber: Any = None
        """The ZmqKvSubscriber feeding the KvEventLog, while running (ZMQ publishers only)."""
        self._disagg = DisaggSettings()
        self._finished_total = 0
        self._pending_prefill = 0
        self.engine_load = LoadInfo()
        """The engine's latest own report (subclasses update it); see `load()`."""

    # -- Engine --------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def kv_events(self) -> KvEventLog | None:
        return self._events

    async def _start_zmq_kv_events(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_payload: Callable[[bytes], None],
        task_name: str,
    ) -> None:
        """Create the KvEventLog and follow the engine's ZMQ KV event publisher (vLLM, SGLang)."""
        from kvmesh.workers.adapters.zmq_events import ZmqKvSubscriber

        self._events = KvEventLog()
        sub = ZmqKvSubscriber(
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            on_payload=on_payload,
            on_gap=self._on_kv_gap,
        )
        self.subscriber = sub
        self._spawn(sub.run(), task_name)
        await sub.wait_connected()

    def _on_kv_gap(self, why: str) -> None:
        """Events were lost: the translator resynchronizes the log."""
        if self._translator is not None:
            self._translator.resync(why)

    async def start(self) -> None:
        if self._running:
            return
        try:
            await self._start_engine()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.stop()  # the tasks and sockets a partial start left behind
            raise
        self._running = True

    async def stop(self) -> None:
        self._running = False
        pumps = list(self._pumps.values())
        for pump in pumps:
            self._close(pump)
            d = pump.decoder
            pump.sink.output(
                EngineOutput(
                    [],
                    finish_reason=FinishReason.CANCELLED,
                    usage=Usage(d.prompt_tokens, d.completion_tokens, d.cached_tokens),
                )
            )
            if pump.task is not None:
                pump.task.cancel()
        await self._tasks.wait(self.abort_timeout_s)
        self._stopping = True
        for task in await self._background.cancel(self.abort_timeout_s):
            log.warning("%s: background task %s did not stop", self._info.engine, task)
        await self._stop_engine()
        self._stopping = False

    def submit(self, request: EngineRequest, sink: OutputSink) -> RequestHandle:
        if not self._running:
            raise Unavailable(f"the {self._info.engine} engine is not running")
        validate_request(request, self._info)
        return self._submit_prepared(request, sink, self._prepare(request))

    def _submit_prepared(self, request: EngineRequest, sink: OutputSink, prepared: Any) -> _Pump:
        """submit() with the engine arguments already prepared (validated by the caller)."""
        if not self._running:
            raise Unavailable(f"the {self._info.engine} engine is not running")
        rid = request.request_id
        if rid in self._pumps:
            raise InvalidRequest(f"request id {rid!r} is already in flight", param="request_id")
        pump = _Pump(self, request, sink, self._decoder(request, prepared))
        self._pumps[rid] = pump
        # Prefill still to do: the prompt less the prefix the engine's cache holds (its KV
        # events say which), as the router books it; the whole prompt without KV events.
        prompt = request.prompt
        cached = 0
        if self._translator is not None:
            cached = self._translator.cached_prefix_tokens(prompt, request.lora_name)
        pump.pending = len(prompt) - cached
        self._pending_prefill += pump.pending
        pump.task = self._tasks.spawn(self._pump(pump, prepared), name=f"{self._info.engine}-{rid}")
        return pump

    def load(self) -> LoadInfo:
        eng = self.engine_load
        n = len(self._pumps)
        waiting = min(eng.num_waiting, n)
        active = 0
        if n:
            # The engine's report may predate the newest requests; the blocks of the largest
            # request that is producing output are in use whatever the report says.
            size = max(self._info.kv_block_size, 1)
            floor = max(
                (
                    -(-(p.decoder.prompt_tokens + p.decoder.completion_tokens) // size)
                    for p in self._pumps.values()
                    if p.started
                ),
                default=0,
            )
            active = max(eng.kv_active_blocks, floor)
        return LoadInfo(
            num_running=n - waiting,
            num_waiting=waiting,
            kv_active_blocks=active,
            kv_total_blocks=self._info.kv_total_blocks,
            pending_prefill_tokens=self._pending_prefill,
            prefix_cache_hit_rate=eng.prefix_cache_hit_rate,
            requests_finished_total=self._finished_total,
            preemptions_total=eng.preemptions_total,
        )

    # -- for subclasses --------------------------------------------------------------------------

    @abc.abstractmethod
    async def _start_engine(self) -> None:
        """Create and start the engine; set `_info` (block size, blocks, context length)."""

    @abc.abstractmethod
    async def _stop_engine(self) -> None:
        """Shut the engine down (in-flight requests were aborted already)."""

    @abc.abstractmethod
    def _prepare(self, request: EngineRequest) -> Any:
        """The engine's arguments for `request`; raises InvalidRequest for what the engine
        cannot do."""

    @abc.abstractmethod
    async def _open(self, request: EngineRequest, prepared: Any) -> AsyncIterator[T]:
        """Start `request` in the engine; its outputs."""

    @abc.abstractmethod
    def _decoder(self, request: EngineRequest, prepared: Any) -> OutputDecoder[T]:
        """A fresh decoder for `request`'s outputs."""

    @abc.abstractmethod
    async def _abort(self, request_id: str, stream: AsyncIterator[T] | None) -> None:
        """Abort `request_id` in the engine (it may have finished or never started)."""

    def _translate_error(self, exc: Exception) -> BaseException:
        """The exception a sink gets for an engine error. Default: domain errors as they are,
        ValueError (the engines' "bad request") as InvalidRequest, the rest unchanged (the
        server reports those as internal errors)."""
        if isinstance(exc, KvmeshError):
            return exc
        if isinstance(exc, ValueError):
            return InvalidRequest(f"the {self._info.engine} engine refused the request: {exc}")
        return exc

    def _requests_changed(self) -> None:
        """A request started producing output or ended (a hook for engines whose load is
        polled: refresh it now rather than at the next tick)."""

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A background task that stop() cancels."""
        return self._background.spawn(coro, name=name)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished, failed or cancelled."""
        return len(self._pumps)

    # -- internals -----------------------------------------------------------------------------

    def _close(self, pump: _Pump) -> None:
        if pump.closed:
            return
        pump.closed = True
        if self._pumps.get(pump.request.request_id) is pump:
            del self._pumps[pump.request.request_id]
        if not pump.started:
            self._pending_prefill -= pump.pending
        self._requests_changed()

    def _cancel(self, pump: _Pump) -> None:
        if pump.closed:
            return
        self._close(pump)
        if pump.task is not None:
            pump.task.cancel()

    async def _pump(self, pump: _Pump, prepared: Any) -> None:
        request, sink, decoder = pump.request, pump.sink, pump.decoder
        rid = request.request_id
        stream: AsyncIterator[T] | None = None
        try:
            stream = await self._open(request, prepared)
            async for item in stream:
                if pump.closed:
                    continue  # finished already: let the engine's iterator end by itself
                out = decoder.feed(item)
                if out is None:
                    continue
                if not pump.started:
                    pump.started = True
                    self._pending_prefill -= pump.pending
                    self._requests_changed()
                if out.finish_reason is not None:
                    self._close(pump)
                    self._finished_total += 1
                sink.output(out)
            if not pump.closed:
                raise Unavailable(
                    f"the {self._info.engine} engine ended request {rid} without finishing it"
                )
        except asyncio.CancelledError:
            await self._abort_quietly(rid, stream)
            raise
        except Exception as exc:
            if not pump.closed:
                self._close(pump)
                if not isinstance(exc, KvmeshError):
                    log.warning("%s request %s failed: %r", self._info.engine, rid, exc)
                sink.fail(self._translate_error(exc))
            if stream is not None:
                await self._abort_quietly(rid, stream)
        finally:
            self._close(pump)
            if stream is not None:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()

    async def _abort_quietly(self, request_id: str, stream: AsyncIterator[T] | None) -> None:
        try:
            await asyncio.wait_for(self._abort(request_id, stream), self.abort_timeout_s)
        except Exception:
            log.exception("%s: aborting request %s failed", self._info.engine, request_id)
