"""The mocker engine: the async shell around MockerScheduler.

One loop task runs: step the scheduler -> sleep the step's simulated duration (divided by
`speedup_ratio`, measured from the step's start on the injected Clock) -> hand the sampled tokens
to the requests' streams. With nothing waiting or running it awaits an event (no busy loop); it
always yields to the event loop once per step, however large the speedup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable

from kvmesh.clock import Clock, RealClock
from kvmesh.errors import InvalidRequest, Unavailable

from ..engine import (
    Engine,
    EngineOutput,
    EngineRequest,
    FinishReason,
    LoadInfo,
    ModelInfo,
    Role,
    TokenLogprob,
    Usage,
)
from ..kv_events import CachedBlock, KvEventLog
from ..validation import validate_request
from .config import MockerConfig
from .scheduler import MockerScheduler, SeqOutput

__all__ = ["MockerEngine"]

logger = logging.getLogger(__name__)


class _Stream:
    """Tokens produced for one request and not yet taken by its consumer."""

    __slots__ = (
        "delivered",
        "done",
        "error",
        "finish",
        "logprobs",
        "prompt_tokens",
        "stop_token_id",
        "tokens",
        "usage",
        "waiter",
    )

    def __init__(self, prompt_tokens: int, want_logprobs: bool) -> None:
        self.prompt_tokens = prompt_tokens
        self.delivered = 0
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if want_logprobs else None
        self.finish: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.usage: Usage | None = None
        self.error: Exception | None = None
        self.done = False
        self.waiter: asyncio.Future[None] | None = None

    def push(self, out: SeqOutput) -> None:
        self.delivered += 1
        self.tokens.append(out.token_id)
        if self.logprobs is not None and out.logprob is not None:
            self.logprobs.append(out.logprob)
        if out.finish_reason is not None:
            self.finish = out.finish_reason
            self.stop_token_id = out.stop_token_id
            self.usage = out.usage
            self.done = True
        self._wake()

    def cancel(self, cached_tokens: int) -> None:
        """Finish with CANCELLED; usage counts the tokens handed to this stream."""
        if self.done:
            return
        self.finish = FinishReason.CANCELLED
        self.usage = Usage(self.prompt_tokens, self.delivered, cached_tokens)
        self.done = True
        self._wake()

    def fail(self, error: Exception) -> None:
        """Make the consumer raise `error` (the engine loop died)."""
        if self.done:
            return
        self.error = error
        self.done = True
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def take(self) -> EngineOutput | None:
        if self.error is not None:
            raise self.error
        if not self.tokens and self.finish is None:
            return None
        out = EngineOutput(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=self.finish,
            usage=self.usage,
            stop_token_id=self.stop_token_id,
        )
        self.tokens = []
        if self.logprobs is not None:
            self.logprobs = []
        return out

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class MockerEngine(Engine):
    """A simulated vLLM-like engine: real scheduling, KV block accounting, prefix caching and KV
    events; fake tokens (deterministic, see sampling.py) and simulated step times (timing.py).

    `special_token_ids` and `eos_token_ids` are never generated. `context_length` is the model's;
    `config.max_model_len` overrides it when set (without chunked prefill it is further capped at
    `max_num_batched_tokens`, which vLLM requires). `info.context_length` is the result.
    Beyond the Engine contract: `cached_blocks()` returns the pool's cached blocks in the shape of
    `KvEventLog.cached()` (`cached_block_hashes()` just their hashes), and `scheduler` exposes
    the synchronous core.
    """

    def __init__(
        self,
        config: MockerConfig,
        *,
        served_model_name: str,
        vocab_size: int,
        special_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        context_length: int = 8192,
        model_path: str = "",
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self._clock: Clock = clock if clock is not None else RealClock()
        eos = tuple(eos_token_ids)
        max_len = config.max_model_len or context_length
        if not config.enable_chunked_prefill:
            max_len = min(max_len, config.max_num_batched_tokens)
        self._events = KvEventLog() if config.enable_prefix_caching else None
        self.scheduler = MockerScheduler(
            config,
            vocab_size=vocab_size,
            excluded_token_ids={*special_token_ids, *eos},
            max_model_len=max_len,
            events=self._events,
        )
        capabilities = ("KV_EVENTS", "LOGPROBS") if self._events is not None else ("LOGPROBS",)
        self._info = ModelInfo(
            served_model_name=served_model_name,
            engine="mocker",
            kv_block_size=config.block_size,
            kv_total_blocks=config.num_gpu_blocks,
            context_length=max_len,
            model_path=model_path,
            role=Role.AGGREGATED,
            max_num_seqs=config.max_num_seqs,
            eos_token_ids=eos,
            capabilities=capabilities,
        )
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._accepting = False

    # -- Engine --------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def kv_events(self) -> KvEventLog | None:
        return self._events

    async def start(self) -> None:
        if self._task is not None and not self._task.done():
            self._accepting = True
            return
        self._accepting = True
        self._task = asyncio.create_task(self._run(), name="mocker-loop")

    async def stop(self) -> None:
        self._accepting = False
        sched = self.scheduler
        for rid, stream in list(self._streams.items()):
            usage = sched.usage(rid)
            stream.cancel(usage.cached_tokens if usage is not None else 0)
        sched.abort_all()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        validate_request(request, self._info)
        if not self._accepting:
            raise Unavailable("the mocker engine is not running")
        rid = request.request_id
        if rid in self._streams:
            raise InvalidRequest(f"request id {rid!r} is already in flight", param="request_id")
        self.scheduler.add(request, self._clock.now())
        stream = _Stream(len(request.prompt), request.sampling.top_logprobs is not None)
        self._streams[rid] = stream
        self._wake.set()
        try:
            while True:
                out = stream.take()
                if out is None:
                    await stream.wait()
                    continue
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            if not stream.done:
                self.scheduler.abort(rid)
                self._wake.set()

    def load(self) -> LoadInfo:
        return self.scheduler.load()

    async def clear_kv_cache(self) -> int:
        return self.scheduler.clear_cache()

    # -- extras --------------------------------------------------------------------------------

    def cached_blocks(self) -> dict[int, CachedBlock]:
        """The pool's cached blocks: hash -> (parent_hash, token_ids, lora_name)."""
        return self.scheduler.cached_blocks()

    def cached_block_hashes(self) -> set[int]:
        """Hashes of the pool's cached blocks (referenced or evictable)."""
        return set(self.scheduler.cached_blocks())

    # -- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as e:  # a bug: fail every request instead of leaving it hanging
            logger.exception("mocker engine loop failed")
            self._accepting = False
            error = Unavailable(f"the mocker engine failed: {e!r}")
            for stream in self._streams.values():
                stream.fail(error)

    async def _loop(self) -> None:
        sched = self.scheduler
        clock = self._clock
        speedup = self.config.speedup_ratio
        wake = self._wake
        streams = self._streams
        while True:
            if not sched.has_work:
                wake.clear()
                await wake.wait()
                continue
            start = clock.now()
            result = sched.step(start)
            if result.num_scheduled == 0 and result.num_preempted == 0:
                # Nothing can run until something changes (an abort, a new request).
                wake.clear()
                await wake.wait()
                continue
            await clock.sleep(start + result.duration_s / speedup - clock.now())
            for out in result.outputs:
                stream = streams.get(out.request_id)
                if stream is not None:
                    stream.push(out)
