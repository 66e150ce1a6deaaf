"""The mocker engine: the async shell around MockerScheduler.

One loop task runs: step the scheduler -> sleep the step's simulated duration (divided by
`speedup_ratio`, measured from the step's start on the injected Clock) -> hand the sampled tokens
to the requests' streams. With nothing waiting or running it awaits an event (no busy loop); it
always yields to the event loop once per step, however large the speedup.

Disaggregated serving is simulated with the real bookkeeping: a prefill mocker pins the prompt's
blocks (MockerScheduler `pin`) and hands out a KvTransferHandle without a NIXL agent; a decode
mocker reserves blocks for the prompt, waits the simulated transfer time of the blocks it does
not already cache (`MockerConfig.transfer_s`: fixed latency + bytes / bandwidth, divided by
`speedup_ratio`), releases the prefill worker's blocks, caches the received blocks (KV events)
and decodes after the first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from kvmesh.runtime.clock import Clock, RealClock
from kvmesh.runtime.errors import InvalidRequest, KvmeshError, Unavailable
from kvmesh.runtime.kv_events import CachedBlock, KvEventLog
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    KvBlockDescriptor,
    KvLayout,
    KvTransferHandle,
    LoadInfo,
    ModelInfo,
    PrefillResult,
    RemotePrefill,
    Role,
    Usage,
)
from kvmesh.workers.batching.requests import CancelHandle, FirstOutput, SubmittedRequest
from kvmesh.workers.disagg.pins import PinnedTransfers
from kvmesh.workers.engine import DisaggSettings, Engine, OutputSink, RequestHandle
from kvmesh.workers.mocker.config import MockerConfig
from kvmesh.workers.mocker.scheduler import MockerScheduler
from kvmesh.workers.validation import validate_request

__all__ = ["MockerEngine"]

logger = logging.getLogger(__name__)


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
        self._requests: dict[str, SubmittedRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._accepting = False
        self._disagg = DisaggSettings()
        self._pins: PinnedTransfers[str] = PinnedTransfers(self.scheduler.release_pinned)
        self._pulls: set[asyncio.Task[None]] = set()

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
        pulls = list(self._pulls)
        for t in pulls:
            t.cancel()
        for t in pulls:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._pins.release_all()
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
        if request.remote_prefill is not None:
            return self._submit_remote(request, sink)
        self.scheduler.add(request, self._clock.now())
        self._requests[rid] = SubmittedRequest(sink, len(request.prompt))
        self._wake.set()
        return CancelHandle(self._cancel, rid)

    def _cancel(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)
            self._wake.set()

    def load(self) -> LoadInfo:
        return self.scheduler.load()

    async def clear_kv_cache(self) -> int:
        return self.scheduler.clear_cache()

    # -- disaggregated serving (simulated transfer) ----------------------------------------------

    def configure_disaggregation(self, settings: DisaggSettings) -> None:
        self._disagg = settings
        self._pins.default_ttl_s = settings.pin_timeout_s
        self._info.role = settings.role
        caps = tuple(c for c in self._info.capabilities if c != "DISAGGREGATION")
        if settings.role is not Role.AGGREGATED:
            caps += ("DISAGGREGATION",)
        self._info.capabilities = caps

    @property
    def kv_layout(self) -> KvLayout:
        """The simulated block layout (block size and bytes; no real memory behind it)."""
        cfg = self.config
        return KvLayout(0, 0, 0, cfg.block_size, "mocker", cfg.kv_block_bytes)

    async def prefill_remote(self, request: EngineRequest) -> PrefillResult:
        validate_request(request, self._info)
        if not self._accepting:
            raise Unavailable("the mocker engine is not running")
        sched = self.scheduler
        tid = self._pins.new_id()  # also the internal request id: never collides
        internal = EngineRequest(
            tid, request.prompt, request.sampling, request.stop, request.lora_name, request.priority
        )
        sink = FirstOutput()
        sched.add(internal, self._clock.now(), pin=True)
        self._requests[tid] = SubmittedRequest(sink, len(request.prompt))
        self._wake.set()
        try:
            out = await sink.future
        except BaseException:  # cancelled (the caller went away) or the engine failed
            self._cancel(tid)
            sched.release_pinned(tid)
            raise
        if out.finish_reason is FinishReason.CANCELLED:
            raise Unavailable("the mocker engine stopped during the prefill")
        assert out.usage is not None and out.token_ids
        remote = RemotePrefill(
            first_token_id=out.token_ids[0],
            first_logprob=out.logprobs[0] if out.logprobs else None,
            cached_tokens=out.usage.cached_tokens,
        )
        if out.finish_reason is not None:  # the first token ends the request: nothing pinned
            return PrefillResult(remote, out.usage, out.finish_reason, out.stop_token_id)
        blocks = sched.pinned[tid]
        expires_ms = self._pins.pin(tid, tid)
        layout = self.kv_layout
        n_full = len(request.prompt) // layout.block_size
        pool = sched.pool
        remote.handle = KvTransferHandle(
            transfer_id=tid,
            layout=layout,
            blocks=[
                KvBlockDescriptor(
                    (pool.hash_of(b) or 0) if i < n_full else 0,
                    b * layout.block_bytes,
                    layout.block_bytes,
                )
                for i, b in enumerate(blocks)
            ],
            num_computed_tokens=len(request.prompt),
            memory_kind="DRAM",
            expires_after_ms=expires_ms,
        )
        return PrefillResult(remote, out.usage)

    async def release_kv(self, transfer_id: str) -> bool:
        return self._pins.release(transfer_id)

    @property
    def num_pinned_transfers(self) -> int:
        """Transfers pinned now (prefill side)."""
        return len(self._pins)

    def _submit_remote(self, request: EngineRequest, sink: OutputSink) -> RequestHandle:
        self.scheduler.check(request)
        rid = request.request_id
        entry = SubmittedRequest(sink, len(request.prompt))
        entry.delivered = 1  # the first token, sampled on the prefill worker
        self._requests[rid] = entry
        task = asyncio.create_task(self._guard_remote(request, entry), name=f"kv-pull-{rid}")
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)
        return CancelHandle(self._cancel, rid)

    async def _guard_remote(self, request: EngineRequest, entry: SubmittedRequest) -> None:
        try:
            await self._continue_remote(request, entry)
        except Exception as exc:  # a bug: fail the request rather than leave it hanging
            logger.exception("continuing remote prefill of %s failed", request.request_id)
            if self._requests.get(request.request_id) is entry:
                del self._requests[request.request_id]
                entry.sink.fail(Unavailable(f"the mocker engine failed: {exc!r}"))

    async def _continue_remote(self, request: EngineRequest, entry: SubmittedRequest) -> None:
        rp = request.remote_prefill
        assert rp is not None
        sched = self.scheduler
        handle = rp.handle
        blocks: list[int] | None = None
        if handle is not None:
            reserved = None
            nbytes = 0
            layout = handle.layout
            n = len(request.prompt)
            if (
                layout.block_size == self.config.block_size
                and layout.dtype == "mocker"
                and handle.num_computed_tokens == n
                and len(handle.blocks) == -(-n // layout.block_size)
            ):
                reserved = sched.reserve_prefilled(request.prompt, request.lora_name)
            try:
                if reserved is not None:
                    pulled = handle.blocks[reserved[2] :]
                    nbytes = sum(b.length_bytes for b in pulled)
                    delay = self.config.transfer_s(nbytes) / self.config.speedup_ratio
                    await self._clock.sleep(delay)
                confirmed = await self._disagg.release_remote(handle)
            except BaseException:
                if reserved is not None:
                    sched.pool.release(reserved[0])
                raise
            if reserved is not None and confirmed:
                blocks, hashes, had = reserved
                sched.commit_prefilled(blocks, hashes, had, request.prompt, request.lora_name)
                entry.kv_bytes = nbytes
            elif reserved is not None:
                sched.pool.release(reserved[0])
            entry.fallback = blocks is None
        rid = request.request_id
        if self._requests.get(rid) is not entry:
            if blocks is not None:
                sched.pool.release(blocks)  # cancelled meanwhile: the received prefix stays cached
            return
        if len(request.prompt) + 1 >= sched.max_len(request):
            if blocks is not None:
                sched.pool.release(blocks)
            del self._requests[rid]
            entry.sink.output(
                EngineOutput(
                    [],
                    finish_reason=FinishReason.LENGTH,
                    usage=Usage(len(request.prompt), 1, rp.cached_tokens),
                    kv_transfer_bytes=entry.kv_bytes,
                    remote_prefill_fallback=entry.fallback,
                )
            )
            return
        try:
            sched.add(
                request,
                self._clock.now(),
                first_token=rp.first_token_id,
                blocks=blocks,
                cached_tokens=rp.cached_tokens,
            )
        except KvmeshError as exc:
            if blocks is not None:
                sched.pool.release(blocks)
            del self._requests[rid]
            entry.sink.fail(exc)
            return
        self._wake.set()

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
                if out.finish_reason is None and not out.handoff:
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
                            req.kv_bytes,
                            req.fallback,
                        )
                    )
