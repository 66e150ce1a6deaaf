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
from collections.abc import Iterable

from kvmesh.clock import Clock, RealClock
from kvmesh.errors import InvalidRequest, Unavailable

from ..engine import (
    Engine,
    EngineOutput,
    EngineRequest,
    FinishReason,
    LoadInfo,
    ModelInfo,
    OutputSink,
    RequestHandle,
    Role,
    Usage,
)
from ..kv_events import CachedBlock, KvEventLog
from ..validation import validate_request
from .config import MockerConfig
from .scheduler import MockerScheduler

__all__ = ["MockerEngine"]

logger = logging.getLogger(__name__)


class _Request:
    """A submitted request: where its outputs go and what was delivered."""

    __slots__ = ("delivered", "prompt_tokens", "sink")

    def __init__(self, sink: OutputSink, prompt_tokens: int) -> None:
        self.sink = sink
        self.prompt_tokens = prompt_tokens
        self.delivered = 0


class _Handle:
    __slots__ = ("engine", "request_id")

    def __init__(self, engine: MockerEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id

    def cancel(self) -> None:
        self.engine._cancel(self.request_id)


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
        self._requests: dict[str, _Request] = {}
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
        requests, self._requests = self._requests, {}
        for rid, req in requests.items():
            usage = sched.usage(rid)
            cached = usage.cached_tokens if usage is not None else 0
            req.sink.output(
                EngineOutput(
                    [],
                    finish_reason=FinishReason.CANCELLED,
                    usage=Usage(req.prompt_tokens, req.delivered, cached),
                )
            )
        sched.abort_all()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def submit(self, request: EngineRequest, sink: OutputSink) -> RequestHandle:
        validate_request(request, self._info)
        if not self._accepting:
            raise Unavailable("the mocker engine is not running")
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequest(f"request id {rid!r} is already in flight", param="request_id")
        self.scheduler.add(request, self._clock.now())
        self._requests[rid] = _Request(sink, len(request.prompt))
        self._wake.set()
        return _Handle(self, rid)

    def _cancel(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)
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
            requests, self._requests = self._requests, {}
            for req in requests.values():
                req.sink.fail(error)

    async def _loop(self) -> None:
        sched = self.scheduler
        clock = self._clock
        speedup = self.config.speedup_ratio
        wake = self._wake
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
            requests = self._requests
            for out in result.outputs:
                req = requests.get(out.request_id)
                if req is None:
                    continue  # cancelled while the step ran
                req.delivered += 1
                logprobs = [out.logprob] if out.logprob is not None else None
                if out.finish_reason is None:
                    req.sink.output(EngineOutput([out.token_id], logprobs))
                else:
                    del requests[out.request_id]
                    req.sink.output(
                        EngineOutput(
                            [out.token_id],
                            logprobs,
                            out.finish_reason,
                            out.usage,
                            out.stop_token_id,
                        )
                    )
