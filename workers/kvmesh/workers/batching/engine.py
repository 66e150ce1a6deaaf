"""The async engine core shared by the mocker and the torch engine, around their BatchScheduler.

`BatchingEngine` implements the Engine contract (kvmesh.workers.engine) once: request
submission and validation, the step loop, delivery to the sinks, cancellation, stop, load, the
prefix cache and its KV events, and both sides of disaggregated serving. A subclass supplies
its scheduler and model card and a few hooks:

  `_run_step(scheduler)`  execute one step: schedule, produce the tokens (the mocker waits its
                          timing model's duration and samples fake tokens; the torch engine runs
                          the model on its executor thread), complete; returns the outputs, or
                          None when nothing could be scheduled (the loop then waits for a change)
  `kv_layout`             the block layout other workers see in this engine's transfer handles
  `_kv_source()`          prefill side: where a decode worker reads this engine's blocks; called
                          before the prefill, so it may raise (the torch engine without NIXL)
  `_can_read_kv(handle)`  decode side: whether this engine can use the blocks of `handle`
  `_read_kv(handle, blocks, remote)`
                          decode side: move the KV of the `remote` descriptors into local
                          `blocks`; returns the bytes moved (the mocker waits the simulated
                          transfer time; the torch engine reads over NIXL)
  `_move_kv(job)`         KV tiers: move the blocks of one TierJob between the device, host and
                          disk tiers (the mocker waits the modelled transfer time; the torch
                          engine copies KV tensors and block files); returns how many leading
                          blocks moved. Only called when the scheduler has tiers.
  `_open()`, `_close()`   acquire before the loop starts / release after it ended whatever the
                          engine runs on (model, KV cache, executor, transfer agent)

The loop: one task runs `_run_step` while the scheduler has work and hands each output to its
request's sink, on the event loop thread; with nothing to do it awaits an event (no busy loop).

KV tiers: the moves the scheduler decides (kvmesh.workers.batching.tiers) run on one task per
lane (device to host, host to device, disk writes, disk reads), each lane's jobs strictly in
order, beside the step loop: offloads never wait in a step, and a request whose prefix is
onboarding waits while the others run. Each
finished job goes back to the scheduler (`complete_tier_job`) and wakes the loop.

Disaggregated serving
  Prefill side: `prefill_remote` runs the prompt as a pinned request (BatchScheduler `pin`); its
  blocks stay referenced under a transfer id (PinnedTransfers: freed by `release_kv` or when they
  expire) and the handle names them by `_kv_source()`.
  Decode side: `submit` of a request with `remote_prefill` starts a task that reserves blocks for
  the prompt (reusing its cached prefix), reads the rest with `_read_kv`, releases the prefill
  worker's blocks, caches the received ones when the release confirms they were still pinned
  (else recomputes the prompt) and decodes after the first token. Every path (success, failed
  read, cancellation, stop) releases every block it took.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from kvmesh.runtime.clock import Clock, RealClock
from kvmesh.runtime.errors import InvalidRequest, KvmeshError, Unavailable
from kvmesh.runtime.kv_events import CachedBlock, KvEventLog, KvTier
from kvmesh.runtime.tasks import TaskSet
from kvmesh.runtime.telemetry import SpanKind, Step, tracer, wall_ns
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
from kvmesh.workers.batching.scheduler import BatchScheduler, SeqOutput
from kvmesh.workers.batching.tiers import Lane, TierJob
from kvmesh.workers.disagg.pins import PinnedTransfers
from kvmesh.workers.engine import DisaggSettings, Engine, OutputSink, RequestHandle
from kvmesh.workers.metrics import EngineStats
from kvmesh.workers.validation import validate_request

__all__ = ["BatchingEngine", "KvSource"]

log = logging.getLogger(__name__)

SchedT = TypeVar("SchedT", bound=BatchScheduler[Any, Any])


@dataclass(frozen=True, slots=True)
class KvSource:
    """Where a decode worker reads a prefill engine's pinned blocks (BatchingEngine._kv_source)."""

    address: Callable[[int], int]
    """Block id -> address of the block (of its first piece, for a chunked layout)."""
    agent_name: str = ""
    """The transfer agent decode workers read from; empty: none (a simulated transfer)."""
    agent_metadata: bytes = b""
    memory_kind: str = "DRAM"
    device_id: int = 0


@dataclass(slots=True)
class _Received:
    """Blocks reserved for a remote prefill's prompt and filled with its KV, not yet cached."""

    blocks: list[int]
    hashes: list[int]
    num_had: int
    """Leading blocks that were already cached here (nothing moved for them)."""
    nbytes: int


class BatchingEngine(Engine, Generic[SchedT]):
    """An Engine over a BatchScheduler (see the module docstring for the hooks).

    A subclass sets `engine_name`, puts its scheduler in `_scheduler` and its model card in
    `_info` (in `__init__`, or in `_open` when they need the model; the card's role is
    `_disagg.role`, its capabilities `_capabilities()`), and implements the hooks.
    Beyond the Engine contract: `scheduler` (the synchronous core), `cached_blocks()` /
    `cached_block_hashes()` (the pool's view of the prefix cache), `num_pinned_transfers`.
    """

    engine_name: ClassVar[str]
    """Names the engine in errors and logs ("the mocker engine is not running")."""
    kv_transfer_backend: ClassVar[str] = ""
    """How `_read_kv` moves KV ("nixl", "simulated"): the kv_transfer span's backend."""

    def __init__(self, *, events: KvEventLog | None, clock: Clock | None = None) -> None:
        self._events = events
        self._clock: Clock = clock if clock is not None else RealClock()
        self._scheduler: SchedT | None = None
        self._info: ModelInfo | None = None
        self._requests: dict[str, SubmittedRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._accepting = False
        self._disagg = DisaggSettings()
        self._pins: PinnedTransfers[str] = PinnedTransfers(self._release_pinned)
        self._pulls = TaskSet()
        self._stats = EngineStats()
        self.stats = self._stats
        self._lanes: dict[Lane, deque[TierJob]] = {}
        """Tier moves waiting per lane (the head is running)."""
        self._lane_tasks: dict[Lane, asyncio.Task[None]] = {}

    # -- hooks ---------------------------------------------------------------------------------

    @abc.abstractmethod
    async def _run_step(self, sched: SchedT) -> Sequence[SeqOutput] | None:
        """Run one scheduler step (schedule, compute, complete) and return its outputs; None
        when nothing was scheduled or preempted (nothing can run until a request comes or
        goes). Called only while `sched.has_work`; it must yield to the event loop."""

    @property
    @abc.abstractmethod
    def kv_layout(self) -> KvLayout:
        """This engine's KV block layout, as transfer handles describe it."""

    @abc.abstractmethod
    def _kv_source(self) -> KvSource:
        """Prefill side: where decode workers read this engine's blocks. Raises when this engine
        cannot serve remote prefills (checked before the prefill runs)."""

    @abc.abstractmethod
    def _can_read_kv(self, handle: KvTransferHandle) -> bool:
        """Decode side: whether `_read_kv` can move `handle`'s blocks into this engine (its
        prompt length and block count already match)."""

    @abc.abstractmethod
    async def _read_kv(
        self, handle: KvTransferHandle, blocks: list[int], remote: Sequence[KvBlockDescriptor]
    ) -> int:
        """Decode side: move the KV of the `remote` descriptors of `handle` into local `blocks`
        (fresh, referenced; same count, possibly none); return the bytes moved. Raise (after
        the transfer has ended) when it failed: the prompt is recomputed."""

    async def _move_kv(self, job: TierJob) -> int:
        """KV tiers: move `job`'s blocks (see kvmesh.workers.batching.tiers.TierJob) and return
        how many leading blocks moved; called one job at a time per lane, in order. Log what
        failed: the scheduler recomputes what did not arrive."""
        raise NotImplementedError(f"the {self.engine_name} engine has no KV tiers")

    async def _open_lora(self, name: str, path: str) -> Any:
        """Read the LoRA adapter at `path` for `name` into what the scheduler's seqs carry;
        raise InvalidRequest when it cannot be used. The mocker keeps only the name."""
        return name

    async def _open(self) -> None:
        """Acquire what the engine runs on and set `_scheduler` and `_info` if not yet set
        (start, before the loop runs)."""

    async def _close(self) -> None:
        """Release what `_open` acquired (stop, after the loop ended and every request was
        finished)."""

    # -- Engine --------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise Unavailable(f"the {self.engine_name} engine has not been started")
        return self._info

    @property
    def kv_events(self) -> KvEventLog | None:
        return self._events

    @property
    def scheduler(self) -> SchedT:
        """The synchronous core (for the torch engine: while started)."""
        if self._scheduler is None:
            raise Unavailable(f"the {self.engine_name} engine has not been started")
        return self._scheduler

    async def start(self) -> None:
        if self._task is not None and not self._task.done():
            self._accepting = True
            return
        await self._open()
        self._accepting = True
        self._task = asyncio.create_task(self._run(), name=f"{self.engine_name}-engine-loop")

    async def stop(self) -> None:
        self._accepting = False
        await self._pulls.cancel()  # each frees what it took
        self._pins.release_all()
        await self._stop_lanes()
        sched = self._scheduler
        requests, self._requests = self._requests, {}
        for rid, req in requests.items():
            usage = sched.usage(rid) if sched is not None else None
            cached = usage.cached_tokens if usage is not None else 0
            req.sink.output(
                EngineOutput(
                    [],
                    finish_reason=FinishReason.CANCELLED,
                    usage=Usage(req.prompt_tokens, req.delivered, cached),
                )
            )
        if sched is not None:
            sched.abort_all()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._close()

    def submit(self, request: EngineRequest, sink: OutputSink) -> RequestHandle:
        self._accept(request)
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequest(f"request id {rid!r} is already in flight", param="request_id")
        if request.remote_prefill is not None:
            return self._submit_remote(request, sink)
        self._enqueue(request, sink)
        return CancelHandle(self._cancel, rid)

    def _accept(self, request: EngineRequest) -> SchedT:
        """The scheduler, once the engine is known to run and `request` to be valid."""
        sched = self._scheduler
        if not self._accepting or sched is None:
            raise Unavailable(f"the {self.engine_name} engine is not running")
        validate_request(request, self.info)
        return sched

    def _enqueue(self, request: EngineRequest, sink: OutputSink, *, pin: bool = False) -> None:
        now = self._clock.now()
        self.scheduler.add(request, now, pin=pin)
        self._requests[request.request_id] = SubmittedRequest(
            sink, len(request.prompt), now, request.trace
        )
        self._wake.set()

    def _cancel(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None and self._scheduler is not None:
            self._scheduler.abort(request_id)
            self._wake.set()

    def load(self) -> LoadInfo:
        sched = self._scheduler
        return sched.load() if sched is not None else LoadInfo()

    async def clear_kv_cache(self) -> int:
        sched = self._scheduler
        if sched is None:
            return 0
        await self._tier_moves_done()  # blocks being offloaded are referenced until then
        n = sched.clear_cache()
        self._dispatch_tier_jobs()
        return n

    # -- LoRA ------------------------------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> ModelInfo:
        sched = self._accept_control()
        sched.loras.check_new(name)
        if name == self.info.served_model_name:
            raise InvalidRequest(
                f"LoRA adapter name {name!r} is the served model's name", param="lora_name"
            )
        if not path:
            raise InvalidRequest("lora_path must not be empty", param="lora_path")
        adapter = await self._open_lora(name, path)
        evicted = sched.loras.add(name, adapter)  # raises if loaded meanwhile
        for old in evicted:
            log.info("LoRA adapter %s unloaded (least recently used)", old)
        log.info("LoRA adapter %s loaded from %s", name, path)
        self.info.lora_adapters = sched.loras.names()
        return self.info

    async def unload_lora(self, name: str) -> ModelInfo:
        sched = self._accept_control()
        sched.loras.remove(name)
        log.info("LoRA adapter %s unloaded", name)
        self.info.lora_adapters = sched.loras.names()
        return self.info

    def _accept_control(self) -> SchedT:
        sched = self._scheduler
        if not self._accepting or sched is None:
            raise Unavailable(f"the {self.engine_name} engine is not running")
        return sched

    async def _load_lora_modules(self, modules: dict[str, str]) -> None:
        """Load the adapters of the engine's `--lora-modules` at start (a bad one fails it)."""
        sched = self.scheduler
        for name, path in modules.items():
            if name not in sched.loras:
                sched.loras.add(name, await self._open_lora(name, path))
        self.info.lora_adapters = sched.loras.names()

    def cached_blocks(self, tier: KvTier = KvTier.DEVICE) -> dict[int, CachedBlock]:
        """The blocks cached on `tier` (the device pool, or the host or disk tier: those whose
        copy is done): hash -> (parent_hash, token_ids, lora_name)."""
        sched = self.scheduler
        if tier is KvTier.DEVICE:
            return sched.cached_blocks()
        return sched.tiers.cached_blocks(tier) if sched.tiers is not None else {}

    def cached_block_hashes(self) -> set[int]:
        """Hashes of the pool's cached blocks (referenced or evictable)."""
        return set(self.scheduler.cached_blocks())

    # -- disaggregated serving: roles, prefill side ---------------------------------------------

    def configure_disaggregation(self, settings: DisaggSettings) -> None:
        self._disagg = settings
        self._pins.default_ttl_s = settings.pin_timeout_s
        if self._info is not None:  # the card follows (else it is built with them)
            self._info.role = settings.role
            self._info.capabilities = self._capabilities()

    def _capabilities(self) -> tuple[str, ...]:
        """The model card's capabilities: KV events if published, logprobs, LoRA adapters,
        resumed output, and disaggregation in a prefill or decode role."""
        # RESUME: a migrated request's output continues exactly (Seq.prompt_len).
        caps: tuple[str, ...] = ("KV_EVENTS",) if self._events is not None else ()
        caps += ("LOGPROBS", "LORA", "RESUME")
        return caps + (("DISAGGREGATION",) if self._disagg.role is not Role.AGGREGATED else ())

    async def prefill_remote(self, request: EngineRequest) -> PrefillResult:
        sched = self._accept(request)
        source = self._kv_source()
        tid = self._pins.new_id()  # also the internal request id: never collides
        internal = EngineRequest(
            tid,
            request.prompt,
            request.sampling,
            request.stop,
            request.lora_name,
            request.priority,
            media=request.media,
            trace=request.trace,
        )
        sink = FirstOutput()
        self._enqueue(internal, sink, pin=True)
        try:
            out = await sink.future
        except BaseException:  # cancelled (the caller went away) or the engine failed
            self._cancel(tid)
            if self._scheduler is sched:
                sched.release_pinned(tid)
            raise
        if out.finish_reason is FinishReason.CANCELLED:
            raise Unavailable(f"the {self.engine_name} engine stopped during the prefill")
        assert out.usage is not None and out.token_ids
        remote = RemotePrefill(
            first_token_id=out.token_ids[0],
            first_logprob=out.logprobs[0] if out.logprobs else None,
            cached_tokens=out.usage.cached_tokens,
        )
        if out.finish_reason is not None:  # the first token ends the request: nothing pinned
            return PrefillResult(remote, out.usage, out.finish_reason, out.stop_token_id)
        blocks = sched.pinned[tid]
        expires_ms = self._pins.pin(tid, tid, request_id=request.request_id)
        layout = self.kv_layout
        n_full = len(request.prompt) // layout.block_size
        pool = sched.pool
        remote.handle = KvTransferHandle(
            transfer_id=tid,
            layout=layout,
            blocks=[
                KvBlockDescriptor(
                    (pool.hash_of(b) or 0) if i < n_full else 0,
                    source.address(b),
                    layout.block_bytes,
                    source.device_id,
                )
                for i, b in enumerate(blocks)
            ],
            num_computed_tokens=len(request.prompt),
            agent_name=source.agent_name,
            agent_metadata=source.agent_metadata,
            memory_kind=source.memory_kind,
            expires_after_ms=expires_ms,
        )
        return PrefillResult(remote, out.usage)

    async def release_kv(self, transfer_id: str = "", request_id: str = "") -> bool:
        released = self._pins.release(transfer_id)  # "" is never pinned, nor a request id ""
        return self._pins.release_request(request_id) or released

    @property
    def num_pinned_transfers(self) -> int:
        """Transfers pinned now (prefill side)."""
        return len(self._pins)

    def _release_pinned(self, key: str) -> None:
        if self._scheduler is not None and self._scheduler.release_pinned(key):
            # Requests may be waiting for those blocks: without a wake-up they would wait for
            # the next arrival (none, at the end of a burst: PrefillRemote then timed out).
            self._wake.set()

    # -- disaggregated serving: decode side ------------------------------------------------------

    def _submit_remote(self, request: EngineRequest, sink: OutputSink) -> RequestHandle:
        """Start a remote-prefilled request: receive its KV, then decode (a task per request)."""
        self.scheduler.check(request)
        rid = request.request_id
        entry = SubmittedRequest(sink, len(request.prompt), trace=request.trace)
        entry.delivered = 1  # the first token, sampled on the prefill worker
        entry.remote = True
        self._requests[rid] = entry
        self._pulls.spawn(self._guard_remote(request, entry), name=f"kv-pull-{rid}")
        return CancelHandle(self._cancel, rid)

    async def _guard_remote(self, request: EngineRequest, entry: SubmittedRequest) -> None:
        try:
            await self._continue_remote(request, entry)
        except Exception as exc:  # a bug: fail the request rather than leave it hanging
            log.exception("continuing remote prefill of %s failed", request.request_id)
            if self._requests.get(request.request_id) is entry:
                del self._requests[request.request_id]
                entry.sink.fail(Unavailable(f"the {self.engine_name} engine failed: {exc!r}"))
        finally:
            # Whichever way it ended (queued to decode, or its blocks freed: cancelled, failed,
            # recomputing), the engine loop looks at its queue again: requests may be waiting
            # for those blocks, and no other event may come.
            self._wake.set()

    async def _continue_remote(self, request: EngineRequest, entry: SubmittedRequest) -> None:
        rp = request.remote_prefill
        assert rp is not None
        sched = self.scheduler
        pool = sched.pool
        handle = rp.handle
        blocks: list[int] | None = None
        if handle is not None:
            started = self._clock.now()
            received = await self._receive(request, handle)
            try:
                confirmed = await self._disagg.release_remote(handle)
            except Exception:
                log.exception("releasing transfer %s failed", handle.transfer_id)
                confirmed = False
            except BaseException:
                if received is not None:
                    pool.release(received.blocks)
                raise
            if received is not None and confirmed:
                blocks = received.blocks
                sched.commit_prefilled(
                    blocks,
                    received.hashes,
                    received.num_had,
                    sched.hash_ids(request),
                    request.lora_name,
                )
                entry.kv_bytes = received.nbytes
            elif received is not None:
                log.warning(
                    "transfer %s was released or expired before the pull was confirmed; "
                    "recomputing the prompt",
                    handle.transfer_id,
                )
                pool.release(received.blocks)
            entry.fallback = blocks is None
            looked_up = len(request.prompt)
            if received is not None:
                looked_up -= min(looked_up, received.num_had * sched.block_size)
            self._transferred(entry, handle, received, blocks is not None, started, looked_up)
        rid = request.request_id
        if self._requests.get(rid) is not entry or self._scheduler is not sched:
            if blocks is not None:
                pool.release(blocks)  # cancelled meanwhile: the received prefix stays cached
            return
        if len(request.prompt) + 1 >= sched.max_len(request):
            # This engine's context ends right after the first token.
            if blocks is not None:
                pool.release(blocks)
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
        entry.arrived = now = self._clock.now()
        try:
            sched.add(
                request,
                now,
                first_token=rp.first_token_id,
                blocks=blocks,
                cached_tokens=rp.cached_tokens,
            )
        except KvmeshError as exc:
            if blocks is not None:
                pool.release(blocks)
            del self._requests[rid]
            entry.sink.fail(exc)

    async def _receive(self, request: EngineRequest, handle: KvTransferHandle) -> _Received | None:
        """Reserve blocks for the prompt and read into them the KV it does not cache here; None
        when the KV cannot be received (the caller recomputes the prompt). The blocks returned
        are referenced."""
        sched = self.scheduler
        n = len(request.prompt)
        if (
            handle.num_computed_tokens != n
            or len(handle.blocks) != -(-n // sched.block_size)
            or not self._can_read_kv(handle)
        ):
            log.warning("transfer %s does not fit this engine's KV layout", handle.transfer_id)
            return None
        reserved = sched.reserve_prefilled(sched.hash_ids(request), request.lora_name)
        if reserved is None:
            log.warning("no room for the KV of transfer %s; recomputing", handle.transfer_id)
            return None
        blocks, hashes, had = reserved
        try:
            nbytes = await self._read_kv(handle, blocks[had:], handle.blocks[had:])
        except BaseException as exc:
            if self._scheduler is sched:
                sched.pool.release(blocks)
            if not isinstance(exc, Exception):
                raise
            log.warning("pulling transfer %s failed: %s", handle.transfer_id, exc, exc_info=True)
            return None
        return _Received(blocks, hashes, had, nbytes)

    # -- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as e:  # a bug or a device error: fail every request, stop accepting
            log.exception("%s engine loop failed", self.engine_name)
            self._accepting = False
            error = Unavailable(f"the {self.engine_name} engine failed: {e!r}")
            requests, self._requests = self._requests, {}
            for req in requests.values():
                req.sink.fail(error)

    async def _loop(self) -> None:
        sched = self.scheduler
        wake = self._wake
        requests = self._requests
        clock = self._clock
        while True:
            self._dispatch_tier_jobs()
            if sched.has_work:
                started = clock.now()
                outputs = await self._run_step(sched)
                for rid in sched.admitted:
                    req = requests.get(rid)
                    if req is not None and req.admitted is None:
                        req.admitted = started
                if outputs is not None:
                    self._deliver(outputs)
                    continue
                self._dispatch_tier_jobs()  # the step may have started onboarding
            # Nothing can run until something changes (an abort, a new request, a tier move).
            wake.clear()
            await wake.wait()

    # -- KV tiers ------------------------------------------------------------------------------

    def _dispatch_tier_jobs(self) -> None:
        """Queue the tier moves the scheduler decided on their lanes."""
        sched = self._scheduler
        if sched is None or sched.tiers is None:
            return
        for job in sched.take_tier_jobs():
            lane = self._lanes.setdefault(job.lane, deque())
            lane.append(job)
            task = self._lane_tasks.get(job.lane)
            if task is None or task.done():
                self._lane_tasks[job.lane] = asyncio.create_task(
                    self._run_lane(sched, lane), name=f"kv-{job.lane.value}-lane"
                )

    async def _run_lane(self, sched: SchedT, lane: deque[TierJob]) -> None:
        while lane:
            job = lane[0]
            try:
                done = await self._move_kv(job)
            except Exception:
                log.exception("%s of %d KV blocks failed", job.op.value, len(job))
                done = 0
            lane.popleft()
            if self._scheduler is not sched:
                return
            sched.complete_tier_job(job, done)
            self._dispatch_tier_jobs()
            self._wake.set()

    async def _tier_moves_done(self) -> None:
        """Wait until no tier move is queued or running."""
        while True:
            self._dispatch_tier_jobs()
            running = [t for t in self._lane_tasks.values() if not t.done()]
            if not running:
                return
            await asyncio.wait(running)

    async def _stop_lanes(self) -> None:
        """Stop running tier moves; the scheduler forgets the ones not completed."""
        tasks = list(self._lane_tasks.values())
        self._lane_tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lanes.clear()
        sched = self._scheduler
        if sched is not None:
            sched.abandon_tier_jobs()

    def _deliver(self, outputs: Sequence[SeqOutput]) -> None:
        requests = self._requests
        now = self._clock.now()
        for out in outputs:
            req = requests.get(out.request_id)
            if req is None:
                continue  # cancelled while the step ran
            req.delivered += 1
            if req.first_at is None:
                req.first_at = now
            logprobs = [out.logprob] if out.logprob is not None else None
            if out.finish_reason is None and not out.handoff:
                req.sink.output(EngineOutput([out.token_id], logprobs))
            else:
                del requests[out.request_id]
                self._finished(req, out, now)
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

    # -- metrics and spans -----------------------------------------------------------------------

    def _finished(self, req: SubmittedRequest, out: SeqOutput, now: float) -> None:
        """Record a request that ended (or, pinned on a prefill worker, was handed off): the
        worker's metrics, and its spans when its trace is sampled (queue, prefill, decode)."""
        stats = self._stats
        first = req.first_at if req.first_at is not None else now
        admitted = req.admitted if req.admitted is not None else req.arrived
        usage = out.usage
        generated = (req.delivered - 1) if req.remote else req.delivered
        stats.generation_tokens += generated
        if usage is not None:
            stats.prompt_tokens += usage.prompt_tokens
            if not req.remote or req.fallback:
                stats.prefix_query_tokens += usage.prompt_tokens
                stats.prefix_hit_tokens += usage.cached_tokens
        if out.finish_reason is not None:
            stats.finished[out.finish_reason] = stats.finished.get(out.finish_reason, 0) + 1
        stats.queue.observe(admitted - req.arrived)
        prefilled_here = not req.remote or req.fallback
        if prefilled_here:
            stats.ttft.observe(first - req.arrived)
            stats.prefill.observe(first - admitted)
        decode_from = first if prefilled_here else admitted
        gaps = req.delivered - 1
        if not out.handoff:
            stats.e2e.observe(now - req.arrived)
            stats.decode.observe(now - decode_from)
            if gaps > 0:
                stats.itl.observe((now - first) / gaps, gaps)
        trace = req.trace
        if trace is None or not trace.sampled:
            return
        t = tracer()
        if not t.enabled:
            return
        rid = out.request_id
        epoch = wall_ns(0.0)  # the wall clock at monotonic 0: one clock reading for every time
        arrived, admitted_ns = epoch + int(req.arrived * 1e9), epoch + int(admitted * 1e9)
        steps = [Step("queue", arrived, admitted_ns, {"kvmesh.request_id": rid})]
        if prefilled_here:
            prefill = {
                "kvmesh.request_id": rid,
                "gen_ai.usage.input_tokens": req.prompt_tokens,
                "kvmesh.cached_tokens": usage.cached_tokens if usage is not None else 0,
            }
            steps.append(Step("prefill", admitted_ns, epoch + int(first * 1e9), prefill))
        if not out.handoff:
            decode: dict[str, Any] = {
                "kvmesh.request_id": rid,
                "gen_ai.usage.output_tokens": generated,
                "gen_ai.server.time_per_output_token": (now - first) / gaps if gaps > 0 else 0.0,
            }
            if prefilled_here:
                decode["gen_ai.server.time_to_first_token"] = first - req.arrived
            if out.finish_reason is not None:
                decode["gen_ai.response.finish_reasons"] = (out.finish_reason.value,)
            decode_ns = epoch + int(decode_from * 1e9)
            steps.append(Step("decode", decode_ns, epoch + int(now * 1e9), decode))
        t.record(trace, steps, remote=True)  # one queued item for the request's engine spans

    def _transferred(
        self,
        entry: SubmittedRequest,
        handle: KvTransferHandle,
        received: _Received | None,
        used: bool,
        started: float,
        looked_up: int,
    ) -> None:
        """Record a decode-side KV pull (metrics; the kv_transfer span when sampled).
        `looked_up`: prompt tokens not cached here, which the pull was to bring (vLLM's
        connector prefix-cache queries; its hits when the pulled KV is used)."""
        now = self._clock.now()
        nbytes = received.nbytes if received is not None else 0
        stats = self._stats
        stats.kv_transfer.observe(now - started)
        stats.kv_transfer_bytes += nbytes
        stats.external_prefix_query_tokens += looked_up
        if used:
            stats.external_prefix_hit_tokens += looked_up
        else:
            stats.kv_transfer_failures += 1
        trace = entry.trace
        if trace is None or not trace.sampled or not tracer().enabled:
            return
        span = tracer().start(
            "kv_transfer",
            trace,
            kind=SpanKind.CLIENT,
            remote=True,
            attributes={
                "kvmesh.kv_transfer.bytes": nbytes,
                "kvmesh.kv_transfer.blocks": (
                    len(received.blocks) - received.num_had if received is not None else 0
                ),
                "kvmesh.kv_transfer.cached_blocks": (
                    received.num_had if received is not None else 0
                ),
                "kvmesh.kv_transfer.duration_ms": (now - started) * 1000.0,
                "kvmesh.kv_transfer.backend": self.kv_transfer_backend,
                "kvmesh.kv_transfer.id": handle.transfer_id,
                "kvmesh.kv_transfer.prefill_worker_id": handle.prefill_worker_id,
                "kvmesh.kv_transfer.used": used,
            },
            start_ns=wall_ns(started),
        )
        if not used:
            span.error("kv_transfer_failed", "the pulled KV could not be used; recomputing")
        span.end(wall_ns(now))
