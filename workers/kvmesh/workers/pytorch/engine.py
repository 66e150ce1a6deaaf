"""The PyTorch engine: real models from Hugging Face directories, served with continuous batching.

One loop task on the event loop runs: `scheduler.schedule()` -> the forward pass and sampling
on the engine's single executor thread (`run_in_executor`, so the gRPC server stays responsive
while the model computes) -> `scheduler.complete()` -> the sampled tokens go to the requests'
sinks, on the loop thread. With nothing to do it awaits an event (no busy loop).

Everything that touches the KV tensors (forwards, block export/import) runs on that one thread,
in submission order, so a KV copy never races a forward.

Disaggregated serving (kvmesh.workers.disagg): the KV cache tensor is registered with a NIXL
agent (host memory on CPU, GPU memory on CUDA). `prefill_remote` runs the prompt as a pinned
request (TorchScheduler `pin`) and returns a handle whose descriptors point into that tensor;
`submit` of a request with `remote_prefill` pulls the blocks with a NIXL READ straight into free
blocks of this engine's cache (after the forward in flight, which may still write blocks an
abort just freed), releases them on the prefill worker, caches them, and decodes from the first
token (TorchScheduler `first_token`/`blocks`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvmesh.runtime.errors import (
    InvalidRequest,
    KvmeshError,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from kvmesh.runtime.kv_events import AllCleared, CachedBlock, KvEventLog
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
from kvmesh.workers.disagg.layout import block_pieces
from kvmesh.workers.disagg.nixl_agent import NixlKvAgent, nixl_available
from kvmesh.workers.disagg.pins import PinnedTransfers
from kvmesh.workers.engine import DisaggSettings, Engine, OutputSink, RequestHandle
from kvmesh.workers.pytorch.config import TorchConfig
from kvmesh.workers.pytorch.kv_cache import KvCacheSpec, PagedKvCache
from kvmesh.workers.pytorch.model_runner import LoadedModel, ModelRunner, load_model
from kvmesh.workers.pytorch.scheduler import SeqOutput, TorchScheduler
from kvmesh.workers.validation import validate_request

__all__ = ["TorchEngine", "kv_cache_blocks"]

log = logging.getLogger(__name__)

_GIB = 1 << 30
_CPU_DEFAULT_KV_GB = 1.0
_CUDA_MEMORY_FRACTION = 0.9


@dataclass(slots=True)
class _Pulled:
    """Blocks pulled from a prefill worker, referenced, not yet cached."""

    blocks: list[int]
    hashes: list[int]
    num_had: int
    """Leading blocks that were already cached here (not pulled)."""
    nbytes: int


def _barrier() -> None:
    """Runs on the executor thread: returns once the forward in flight has finished."""


def kv_cache_blocks(
    config: TorchConfig, spec: KvCacheSpec, max_model_len: int, device: torch.device
) -> int:
    """How many KV blocks to allocate: `num_gpu_blocks` if set, else `kv_cache_gb` (auto: 1 GiB
    on CPU, 90% of the free CUDA memory), capped at what `max_num_seqs` sequences of
    `max_model_len` tokens need."""
    if config.num_gpu_blocks:
        return config.num_gpu_blocks
    if config.kv_cache_gb:
        budget = int(config.kv_cache_gb * _GIB)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _CUDA_MEMORY_FRACTION)
    else:
        budget = int(_CPU_DEFAULT_KV_GB * _GIB)
    useful = config.max_num_seqs * -(-max_model_len // spec.block_size)
    return max(1, min(budget // spec.block_bytes, useful))


class TorchEngine(Engine):
    """A real inference engine over a Hugging Face causal LM (Llama, Mistral, Qwen2/3 style):
    continuous batching, paged KV cache with prefix caching, LRU eviction, preemption by
    recompute, KV events, real sampling and logprobs.

    `model_dir`: a local model directory (config + weights). `loaded`: an already loaded model
    to use instead of loading `model_dir` at start (engines may share one; it is never
    modified). `eos_token_ids` stop generation (from the model card); `context_length` defaults
    to the model config's; `config.max_model_len` overrides it.

    Beyond the Engine contract: `cached_blocks()` / `cached_block_hashes()` (the pool's view of
    the prefix cache), `kv_spec` (block layout), `export_blocks` / `import_blocks` (move cached
    KV blocks between engines), and `scheduler` (the synchronous core).
    """

    def __init__(
        self,
        config: TorchConfig,
        *,
        model_dir: str | Path,
        served_model_name: str,
        eos_token_ids: Iterable[int] = (),
        context_length: int = 0,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.config = config
        self.model_dir = Path(model_dir)
        self._served_model_name = served_model_name
        self._eos = tuple(eos_token_ids)
        self._context_length = context_length
        self._loaded = loaded
        self._shared_model = loaded is not None
        self._events = KvEventLog() if config.enable_prefix_caching else None
        self._runner: ModelRunner | None = None
        self._scheduler: TorchScheduler | None = None
        self._info: ModelInfo | None = None
        self._requests: dict[str, SubmittedRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._forward: asyncio.Future[Any] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._accepting = False
        self._disagg = DisaggSettings()
        self._pins: PinnedTransfers[str] = PinnedTransfers(self._release_pinned)
        self._agent: NixlKvAgent | None = None
        self._pulls: set[asyncio.Task[None]] = set()
        self._pump: asyncio.Task[None] | None = None

    # -- Engine --------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise Unavailable("the torch engine has not been started")
        return self._info

    @property
    def kv_events(self) -> KvEventLog | None:
        return self._events

    @property
    def scheduler(self) -> TorchScheduler:
        """The synchronous core (valid after start)."""
        if self._scheduler is None:
            raise Unavailable("the torch engine has not been started")
        return self._scheduler

    @property
    def kv_spec(self) -> KvCacheSpec:
        """Layout of one KV block (valid after start); see kv_cache.PagedKvCache."""
        if self._runner is None:
            raise Unavailable("the torch engine has not been started")
        return self._runner.cache.spec

    async def start(self) -> None:
        if self._task is not None and not self._task.done():
            self._accepting = True
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "torch-engine")
        if self._runner is None or self._scheduler is None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, self._setup)
        if self._disagg.role is not Role.AGGREGATED:
            self._ensure_agent()  # fail at startup, not on the first request
        self._accepting = True
        self._task = asyncio.create_task(self._run(), name="torch-engine-loop")

    def _setup(self) -> None:
        """Load the model, allocate the KV cache, build the scheduler (executor thread)."""
        cfg = self.config
        loaded = self._loaded
        if loaded is None:
            loaded = load_model(self.model_dir, cfg.device, cfg.dtype)
            self._loaded = loaded
        max_len = cfg.max_model_len or self._context_length or loaded.context_length or 8192
        spec = loaded.kv_spec(cfg.block_size)
        num_blocks = kv_cache_blocks(cfg, spec, max_len, loaded.device)
        with torch.inference_mode():
            cache = PagedKvCache(spec, num_blocks, loaded.device)
        self._runner = ModelRunner(loaded, cache)
        sched = TorchScheduler(
            cfg,
            num_blocks=num_blocks,
            vocab_size=loaded.vocab_size,
            eos_token_ids=self._eos,
            max_model_len=max_len,
            device=loaded.device,
            events=self._events,
        )
        self._scheduler = sched
        self._info = ModelInfo(
            served_model_name=self._served_model_name,
            engine="torch",
            kv_block_size=cfg.block_size,
            kv_total_blocks=num_blocks,
            context_length=sched.max_seq_len,
            model_path=str(self.model_dir),
            role=self._disagg.role,
            max_num_seqs=cfg.max_num_seqs,
            eos_token_ids=self._eos,
            capabilities=(
                *(("KV_EVENTS",) if self._events is not None else ()),
                "LOGPROBS",
                *(("DISAGGREGATION",) if self._disagg.role is not Role.AGGREGATED else ()),
            ),
        )
        log.info(
            "torch engine: %s (%s) on %s as %s, %d KV blocks of %d tokens (%.1f MiB), "
            "max model length %d",
            self.model_dir,
            loaded.model_type,
            loaded.device,
            loaded.dtype,
            num_blocks,
            cfg.block_size,
            num_blocks * spec.block_bytes / (1 << 20),
            sched.max_seq_len,
        )

    async def stop(self) -> None:
        self._accepting = False
        pulls = list(self._pulls)
        for t in pulls:
            t.cancel()
        for t in pulls:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._pins.release_all()
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
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
        forward, self._forward = self._forward, None
        if forward is not None:
            with contextlib.suppress(BaseException):
                await forward  # the thread cannot be interrupted: let the step finish
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.close()  # before the KV cache it registered goes away
        # Release the KV cache (and the model, if this engine loaded it); start() rebuilds them.
        if sched is not None and self._events is not None and sched.pool.num_cached:
            self._events.publish(AllCleared())
        self._runner = None
        self._scheduler = None
        if not self._shared_model:
            self._loaded = None

    def submit(self, request: EngineRequest, sink: OutputSink) -> RequestHandle:
        if not self._accepting or self._scheduler is None:
            raise Unavailable("the torch engine is not running")
        validate_request(request, self.info)
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequest(f"request id {rid!r} is already in flight", param="request_id")
        if request.remote_prefill is not None:
            return self._submit_remote(request, sink)
        self._scheduler.add(request)
        self._requests[rid] = SubmittedRequest(sink, len(request.prompt))
        self._wake.set()
        return CancelHandle(self._cancel, rid)

    def _cancel(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None and self._scheduler is not None:
            self._scheduler.abort(request_id)
            self._wake.set()

    def load(self) -> LoadInfo:
        if self._scheduler is None:
            return LoadInfo()
        return self._scheduler.load()

    async def clear_kv_cache(self) -> int:
        return self._scheduler.clear_cache() if self._scheduler is not None else 0

    # -- disaggregated serving -----------------------------------------------------------------

    def configure_disaggregation(self, settings: DisaggSettings) -> None:
        self._disagg = settings
        self._pins.default_ttl_s = settings.pin_timeout_s
        if self._info is not None:  # already started: the card follows
            self._info.role = settings.role
            caps = tuple(c for c in self._info.capabilities if c != "DISAGGREGATION")
            if settings.role is not Role.AGGREGATED:
                caps += ("DISAGGREGATION",)
            self._info.capabilities = caps

    @property
    def kv_layout(self) -> KvLayout:
        """The KV cache's block layout as transfers see it (valid after start): each block is
        `2 * num_layers` pieces (a layer's keys, then its values), one per [layer, k|v] slab."""
        spec = self.kv_spec
        cache = self.kv_cache
        chunk = spec.block_bytes // (2 * spec.num_layers)
        return KvLayout(
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            block_size=spec.block_size,
            dtype=str(spec.dtype).removeprefix("torch."),
            block_bytes=spec.block_bytes,
            chunk_bytes=chunk,
            chunk_stride_bytes=cache.num_blocks * chunk,
        )

    def _block_address(self, block: int) -> int:
        """Address of block `block`'s first piece (layer 0 keys)."""
        return int(self.kv_cache.data[0, 0, block].data_ptr())

    def _ensure_agent(self) -> NixlKvAgent:
        """The NIXL agent with the KV cache registered (created on first use)."""
        if self._agent is None:
            if not nixl_available():
                raise Unimplemented(
                    "disaggregated serving with the torch engine needs NIXL: "
                    "pip install 'kvmesh[nixl]'"
                )
            agent = NixlKvAgent()
            try:
                agent.register(self.kv_cache.data)
            except BaseException:
                agent.close()
                raise
            self._agent = agent
        return self._agent

    async def prefill_remote(self, request: EngineRequest) -> PrefillResult:
        if not self._accepting or self._scheduler is None:
            raise Unavailable("the torch engine is not running")
        validate_request(request, self.info)
        agent = self._ensure_agent()
        sched = self._scheduler
        tid = self._pins.new_id()  # also the internal request id: never collides
        internal = EngineRequest(
            tid, request.prompt, request.sampling, request.stop, request.lora_name, request.priority
        )
        sink = FirstOutput()
        sched.add(internal, pin=True)
        self._requests[tid] = SubmittedRequest(sink, len(request.prompt))
        self._wake.set()
        try:
            out = await sink.future
        except BaseException:  # cancelled (the caller went away) or the engine failed
            self._cancel(tid)
            if self._scheduler is sched:
                sched.release_pinned(tid)
            raise
        if out.finish_reason is FinishReason.CANCELLED:
            raise Unavailable("the torch engine stopped during the prefill")
        assert out.usage is not None and out.token_ids
        usage = out.usage
        remote = RemotePrefill(
            first_token_id=out.token_ids[0],
            first_logprob=out.logprobs[0] if out.logprobs else None,
            cached_tokens=usage.cached_tokens,
        )
        if out.finish_reason is not None:  # the first token ends the request: nothing pinned
            return PrefillResult(remote, usage, out.finish_reason, out.stop_token_id)
        blocks = sched.pinned[tid]
        expires_ms = self._pins.pin(tid, tid)
        if self._pump is None or self._pump.done():  # progress while decode workers read
            self._pump = asyncio.create_task(agent.pump(lambda: len(self._pins) > 0))
        layout = self.kv_layout
        n_full = len(request.prompt) // layout.block_size
        pool = sched.pool
        remote.handle = KvTransferHandle(
            transfer_id=tid,
            layout=layout,
            blocks=[
                KvBlockDescriptor(
                    (pool.hash_of(b) or 0) if i < n_full else 0,
                    self._block_address(b),
                    layout.block_bytes,
                    agent.device_id,
                )
                for i, b in enumerate(blocks)
            ],
            num_computed_tokens=len(request.prompt),
            agent_name=agent.name,
            agent_metadata=agent.metadata,
            memory_kind=agent.memory_kind,
            expires_after_ms=expires_ms,
        )
        return PrefillResult(remote, usage)

    async def release_kv(self, transfer_id: str) -> bool:
        return self._pins.release(transfer_id)

    def _release_pinned(self, key: str) -> None:
        if self._scheduler is not None:
            self._scheduler.release_pinned(key)

    def _submit_remote(self, request: EngineRequest, sink: OutputSink) -> RequestHandle:
        """Start a remote-prefilled request: pull its KV, then decode (a task per request)."""
        assert self._scheduler is not None
        self._scheduler.check(request)
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
            log.exception("continuing remote prefill of %s failed", request.request_id)
            if self._requests.get(request.request_id) is entry:
                del self._requests[request.request_id]
                entry.sink.fail(Unavailable(f"the torch engine failed: {exc!r}"))

    async def _continue_remote(self, request: EngineRequest, entry: SubmittedRequest) -> None:
        rp = request.remote_prefill
        assert rp is not None
        sched = self.scheduler
        pool = sched.pool
        handle = rp.handle
        blocks: list[int] | None = None
        if handle is not None:
            pulled = await self._pull(request, handle)
            try:
                confirmed = await self._disagg.release_remote(handle)
            except Exception:
                log.exception("releasing transfer %s failed", handle.transfer_id)
                confirmed = False
            except BaseException:
                if pulled is not None:
                    pool.release(pulled.blocks)
                raise
            if pulled is not None and confirmed:
                blocks = pulled.blocks
                n_full = len(request.prompt) // sched.block_size
                pool.cache_full_blocks(
                    blocks, pulled.hashes, pulled.num_had, n_full, request.prompt, request.lora_name
                )
                entry.kv_bytes = pulled.nbytes
            elif pulled is not None:
                log.warning(
                    "transfer %s was released or expired before the pull was confirmed; "
                    "recomputing the prompt",
                    handle.transfer_id,
                )
                pool.release(pulled.blocks)
            entry.fallback = blocks is None
        rid = request.request_id
        if self._requests.get(rid) is not entry or self._scheduler is not sched:
            if blocks is not None:
                pool.release(blocks)  # cancelled meanwhile: the pulled prefix stays cached
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
        try:
            sched.add(
                request,
                first_token=rp.first_token_id,
                blocks=blocks,
                cached_tokens=rp.cached_tokens,
            )
        except KvmeshError as exc:
            if blocks is not None:
                pool.release(blocks)
            del self._requests[rid]
            entry.sink.fail(exc)
            return
        self._wake.set()

    async def _pull(self, request: EngineRequest, handle: KvTransferHandle) -> _Pulled | None:
        """Pull the prompt's blocks that are not cached here; None when the KV cannot be
        pulled (the caller recomputes the prompt). The blocks returned are referenced."""
        try:
            agent = self._ensure_agent()
        except (KvmeshError, ImportError) as exc:
            log.warning("cannot pull remote KV: %s", exc)
            return None
        local = self.kv_layout
        remote = handle.layout
        sched = self.scheduler
        pool = sched.pool
        bs = sched.block_size
        prompt = request.prompt
        n = len(prompt)
        nb = -(-n // bs)
        if (
            not handle.agent_name
            or not local.compatible(remote)
            or local.chunk_bytes != remote.chunk_bytes
            or handle.num_computed_tokens != n
            or len(handle.blocks) != nb
        ):
            log.warning("transfer %s does not fit this engine's KV layout", handle.transfer_id)
            return None
        hashes = sched.prefix_hashes(prompt, request.lora_name)
        have = pool.match_prefix(hashes, n // bs)
        need = nb - len(have)
        if pool.num_free - pool.count_evictable(have) < need:
            log.warning("no room for %d pulled KV blocks; recomputing the prompt", need)
            return None
        pool.acquire(have)
        fresh = pool.allocate(need)
        blocks = have + fresh
        try:
            if fresh:
                await self._on_executor(_barrier)
                nbytes = await agent.read(
                    handle.agent_name,
                    handle.agent_metadata,
                    block_pieces([self._block_address(b) for b in fresh], local, agent.device_id),
                    block_pieces(
                        [d.address for d in handle.blocks[len(have) :]],
                        remote,
                        handle.blocks[0].device_id,
                    ),
                    remote_kind=handle.memory_kind,
                    timeout_s=self._disagg.transfer_timeout_s,
                )
            else:
                nbytes = 0
        except BaseException as exc:
            if self._scheduler is sched:
                pool.release(blocks)
            if not isinstance(exc, Exception):
                raise
            log.warning("pulling transfer %s failed: %s", handle.transfer_id, exc, exc_info=True)
            return None
        return _Pulled(blocks, hashes, len(have), nbytes)

    # -- extras --------------------------------------------------------------------------------

    def cached_blocks(self) -> dict[int, CachedBlock]:
        """The pool's cached blocks: hash -> (parent_hash, token_ids, lora_name)."""
        return self.scheduler.cached_blocks()

    def cached_block_hashes(self) -> set[int]:
        """Hashes of the pool's cached blocks (referenced or evictable)."""
        return set(self.scheduler.cached_blocks())

    async def _on_executor(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            raise Unavailable("the torch engine is not running")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @property
    def kv_cache(self) -> PagedKvCache:
        """The KV storage (valid after start), e.g. to register its memory with a transfer
        library; touch its tensor only through read_blocks/import_blocks while running."""
        if self._runner is None:
            raise Unavailable("the torch engine has not been started")
        return self._runner.cache

    async def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the KV of `block_ids` (each referenced by a request or cached), shaped
        `kv_spec.block_shape(len(block_ids))`, on the engine's device."""
        pool = self.scheduler.pool
        for b in block_ids:
            if not 0 <= b < pool.num_blocks or (pool.ref_count(b) == 0 and pool.hash_of(b) is None):
                raise InvalidRequest(f"KV block {b} holds no data", param="block_ids")
        blocks = list(block_ids)
        pool.acquire(blocks)
        try:
            kv: torch.Tensor = await self._on_executor(self._read, self.kv_cache, blocks)
        finally:
            pool.release(blocks)
        return kv

    async def export_blocks(
        self, token_ids: Sequence[int], lora_name: str = ""
    ) -> tuple[int, torch.Tensor]:
        """The cached KV of the longest cached full-block prefix of `token_ids`.

        Returns (number of blocks n, a copy shaped `kv_spec.block_shape(n)` on the engine's
        device). The blocks stay pinned while they are copied.
        """
        blocks = self.scheduler.match_prefix(token_ids, lora_name)
        return len(blocks), await self.read_blocks(blocks)

    async def import_blocks(
        self, token_ids: Sequence[int], kv: torch.Tensor, lora_name: str = ""
    ) -> int:
        """Store KV for the full blocks of `token_ids` (kv shaped `kv_spec.block_shape(n)`,
        n = len(token_ids) // block_size, from the sequence's first block) as cached blocks.

        Blocks already cached are kept (their part of `kv` is skipped); the others are written
        into free blocks and published as BlocksStored. The imported blocks are unreferenced
        (evictable) afterwards, like any finished request's. Returns how many were written.
        Raises ResourceExhausted when the pool cannot take them now.
        """
        sched = self.scheduler
        runner = self._runner
        assert runner is not None
        pool = sched.pool
        spec = runner.cache.spec
        n = len(token_ids) // spec.block_size
        if tuple(kv.shape) != spec.block_shape(n):
            raise InvalidRequest(
                f"KV for {n} blocks must have shape {spec.block_shape(n)}, got {tuple(kv.shape)}"
            )
        if not pool.enable_caching or n == 0:
            return 0
        hashes = sched.prefix_hashes(token_ids, lora_name)
        have = pool.match_prefix(hashes, n)
        need = n - len(have)
        if need == 0:
            return 0
        if pool.num_free - pool.count_evictable(have) < need:
            raise ResourceExhausted(f"cannot import {need} KV blocks: {pool.num_free} free")
        pool.acquire(have)
        fresh = pool.allocate(need)
        blocks = have + fresh
        try:
            await self._on_executor(self._write, runner.cache, fresh, kv[:, :, len(have) :])
            pool.cache_full_blocks(blocks, hashes, len(have), n, token_ids, lora_name)
        finally:
            pool.release(blocks)
        return need

    @staticmethod
    def _read(cache: PagedKvCache, blocks: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return cache.read_blocks(blocks)

    @staticmethod
    def _write(cache: PagedKvCache, blocks: list[int], kv: torch.Tensor) -> None:
        with torch.inference_mode():
            cache.write_blocks(blocks, kv)

    # -- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as e:  # a bug or a device error: fail every request, stop accepting
            log.exception("torch engine loop failed")
            self._accepting = False
            error = Unavailable(f"the torch engine failed: {e!r}")
            requests, self._requests = self._requests, {}
            for req in requests.values():
                req.sink.fail(error)

    async def _loop(self) -> None:
        sched = self.scheduler
        runner = self._runner
        assert runner is not None and self._executor is not None
        executor = self._executor
        loop = asyncio.get_running_loop()
        wake = self._wake
        while True:
            if not sched.has_work:
                wake.clear()
                await wake.wait()
                continue
            step = sched.schedule()
            if not step.chunks:
                if not step.num_preempted:
                    # Nothing can run until something changes (an abort, a new request).
                    wake.clear()
                    await wake.wait()
                continue
            self._forward = loop.run_in_executor(executor, runner.execute, step.chunks)
            sampled = await asyncio.shield(self._forward)
            self._forward = None
            self._deliver(sched.complete(step, sampled))

    def _deliver(self, outputs: Sequence[SeqOutput]) -> None:
        requests = self._requests
        for out in outputs:
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
