"""The PyTorch engine: real models from Hugging Face directories, served with continuous batching.

One loop task on the event loop runs: `scheduler.schedule()` -> the forward pass and sampling
on the engine's single executor thread (`run_in_executor`, so the gRPC server stays responsive
while the model computes) -> `scheduler.complete()` -> the sampled tokens go to the requests'
sinks, on the loop thread. With nothing to do it awaits an event (no busy loop).

Everything that touches the KV tensors (forwards, block export/import) runs on that one thread,
in submission order, so a KV copy never races a forward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvmesh.errors import InvalidRequest, ResourceExhausted, Unavailable

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
from ..kv_events import AllCleared, CachedBlock, KvEventLog
from ..validation import validate_request
from .config import TorchConfig
from .kv_cache import KvCacheSpec, PagedKvCache
from .model_runner import LoadedModel, ModelRunner, load_model
from .scheduler import SeqOutput, TorchScheduler

__all__ = ["TorchEngine", "kv_cache_blocks"]

log = logging.getLogger(__name__)

_GIB = 1 << 30
_CPU_DEFAULT_KV_GB = 1.0
_CUDA_MEMORY_FRACTION = 0.9


class _Request:
    """A submitted request: where its outputs go and what was delivered."""

    __slots__ = ("delivered", "prompt_tokens", "sink")

    def __init__(self, sink: OutputSink, prompt_tokens: int) -> None:
        self.sink = sink
        self.prompt_tokens = prompt_tokens
        self.delivered = 0


class _Handle:
    __slots__ = ("engine", "request_id")

    def __init__(self, engine: TorchEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id

    def cancel(self) -> None:
        self.engine._cancel(self.request_id)


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
        self._requests: dict[str, _Request] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._forward: asyncio.Future[Any] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._accepting = False

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
            role=Role.AGGREGATED,
            max_num_seqs=cfg.max_num_seqs,
            eos_token_ids=self._eos,
            capabilities=("KV_EVENTS", "LOGPROBS") if self._events is not None else ("LOGPROBS",),
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
        self._scheduler.add(request)
        self._requests[rid] = _Request(sink, len(request.prompt))
        self._wake.set()
        return _Handle(self, rid)

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
            if out.finish_reason is None:
                req.sink.output(EngineOutput([out.token_id], logprobs))
            else:
                del requests[out.request_id]
                req.sink.output(
                    EngineOutput(
                        [out.token_id], logprobs, out.finish_reason, out.usage, out.stop_token_id
                    )
                )
