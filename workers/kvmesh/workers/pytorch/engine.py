"""The PyTorch engine: real models from Hugging Face directories, served with continuous batching.

TorchScheduler inside the shared async engine core (kvmesh.workers.batching.engine). A step
(`_run_step`) is `scheduler.schedule()` (event loop) -> the forward pass and sampling on the
engine's single executor thread (`run_in_executor`, so the gRPC server stays responsive while
the model computes) -> `scheduler.complete()` (event loop).

Everything that touches the KV tensors (forwards, block export/import) runs on that one thread,
in submission order, so a KV copy never races a forward.

KV tiers (`tiers`, kvmesh.workers.batching.tiers): a host tier in a CPU tensor and a disk tier in
block files under `--kv-disk-dir` (kvmesh.workers.pytorch.kv_tiers); their copies run on one
thread per lane (device to host, host to device, disk writes, disk reads) beside the forward
thread. The disk tier persists: its files are
named by block hash under a fingerprint of the model, so a restarted worker serves them. A disk
directory that cannot be used (unwritable, locked by another worker) is logged and the worker
runs without the disk tier.

Disaggregated serving (kvmesh.workers.disagg): the KV cache tensor is registered with a NIXL
agent (host memory on CPU, GPU memory on CUDA). A prefill engine's handles point into that tensor
(`_kv_source`) and it drives NIXL's progress while blocks are pinned; a decode engine reads the
blocks with a NIXL READ straight into free blocks of its cache (`_read_kv`, after the forward in
flight, which may still write blocks an abort just freed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvmesh.runtime.errors import (
    InvalidRequest,
    KvmeshError,
    RequestTooLarge,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from kvmesh.runtime.kv_events import AllCleared, KvEventLog
from kvmesh.runtime.types import (
    EngineRequest,
    KvBlockDescriptor,
    KvLayout,
    KvTransferHandle,
    ModelInfo,
    PrefillResult,
    Role,
)
from kvmesh.workers.adapters.config import parse_lora_modules
from kvmesh.workers.batching.block_files import BlockFiles
from kvmesh.workers.batching.engine import BatchingEngine, KvSource
from kvmesh.workers.batching.tiers import KvTierConfig, Lane, TierJob
from kvmesh.workers.disagg.layout import block_pieces
from kvmesh.workers.disagg.nixl_agent import NixlKvAgent, nixl_available
from kvmesh.workers.pytorch.config import TorchConfig
from kvmesh.workers.pytorch.draft import DraftModel, check_draft_vocab
from kvmesh.workers.pytorch.embedding import EmbeddingHead, embed_prompts
from kvmesh.workers.pytorch.guided import GrammarCompiler
from kvmesh.workers.pytorch.kv_cache import KvCacheSpec, PagedKvCache
from kvmesh.workers.pytorch.kv_tiers import TorchTierStore, fingerprint
from kvmesh.workers.pytorch.lora import LoraAdapter, load_adapter
from kvmesh.workers.pytorch.model_runner import (
    LoadedModel,
    ModelRunner,
    dtype_option,
    load_model,
)
from kvmesh.workers.pytorch.sampler import Sampled
from kvmesh.workers.pytorch.scheduler import ScheduledStep, SeqOutput, TorchScheduler
from kvmesh.workers.pytorch.vision import ImageEncoder

__all__ = ["TorchEngine", "kv_cache_blocks"]

log = logging.getLogger(__name__)

_GIB = 1 << 30
_CPU_DEFAULT_KV_GB = 1.0
_CUDA_MEMORY_FRACTION = 0.9


def _barrier() -> None:
    """Runs on the executor thread: returns once the forward in flight has finished."""


def _draft_then_run(draft: DraftModel, runner: ModelRunner, step: ScheduledStep) -> list[Sampled]:
    """A step with a draft model (forward thread): the draft proposes, the model verifies."""
    draft.propose(step.chunks)
    return runner.execute(step.chunks)


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


class TorchEngine(BatchingEngine[TorchScheduler]):
    """A real inference engine over a Hugging Face causal LM (Llama, Mistral, Qwen2/3 style, or
    a LLaVA-style image-text model with such a language model: MULTIMODAL, in every role):
    continuous batching, paged KV cache with prefix caching, LRU eviction, preemption by
    recompute, KV events, real sampling and logprobs.

    `model_dir`: a local model directory (config + weights). `loaded`: an already loaded model
    to use instead of loading `model_dir` at start (engines may share one; it is never
    modified). `eos_token_ids` stop generation (from the model card); `context_length` defaults
    to the model config's; `config.max_model_len` overrides it. `tiers`: KV tiers below the
    device pool (the disk tier needs `kv_disk_dir`).

    Beyond the Engine contract: what BatchingEngine offers (`scheduler`, `cached_blocks()`, ...),
    `kv_spec` (block layout), `kv_cache`, and `read_blocks` / `export_blocks` / `import_blocks`
    (move cached KV blocks between engines).
    """

    engine_name = "torch"
    kv_transfer_backend = "nixl"

    def __init__(
        self,
        config: TorchConfig,
        *,
        model_dir: str | Path,
        served_model_name: str,
        eos_token_ids: Iterable[int] = (),
        context_length: int = 0,
        loaded: LoadedModel | None = None,
        tiers: KvTierConfig | None = None,
    ) -> None:
        if tiers is not None and tiers.kv_disk_blocks and not tiers.kv_disk_dir:
            raise ValueError("the torch engine's disk KV tier needs --kv-disk-dir")
        if tiers is not None and tiers.enabled and not config.enable_prefix_caching:
            raise ValueError("KV tiers need prefix caching (--torch-enable-prefix-caching)")
        super().__init__(events=KvEventLog() if config.enable_prefix_caching else None)
        self.config = config
        self.model_dir = Path(model_dir)
        self._served_model_name = served_model_name
        self._eos = tuple(eos_token_ids)
        self._context_length = context_length
        self._loaded = loaded
        self._shared_model = loaded is not None
        self._runner: ModelRunner | None = None
        self._forward: asyncio.Future[Any] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._agent: NixlKvAgent | None = None
        self._pump: asyncio.Task[None] | None = None
        self._grammars: GrammarCompiler | None = None
        self._tiers = tiers if tiers is not None and tiers.enabled else None
        self._tier_store: TorchTierStore | None = None
        self._lane_executors: dict[Lane, concurrent.futures.ThreadPoolExecutor] = {}
        self._embedding_head: EmbeddingHead | None = None
        self._images: ImageEncoder | None = None
        self._draft: DraftModel | None = None

    @property
    def kv_spec(self) -> KvCacheSpec:
        """Layout of one KV block (valid after start); see kv_cache.PagedKvCache."""
        if self._runner is None:
            raise Unavailable("the torch engine has not been started")
        return self._runner.cache.spec

    # -- resources and steps -------------------------------------------------------------------

    async def _open(self) -> None:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "torch-engine")
        if self._tiers is not None and not self._lane_executors:
            self._lane_executors = {
                lane: concurrent.futures.ThreadPoolExecutor(1, f"kv-{lane.value}") for lane in Lane
            }
        if self._runner is None or self._scheduler is None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, self._setup)
        if self._disagg.role is not Role.AGGREGATED:
            self._ensure_agent()  # fail at startup, not on the first request
        await self._load_lora_modules(
            parse_lora_modules(self.config.lora_modules, "--torch-lora-modules")
        )

    async def _open_lora(self, name: str, path: str) -> LoraAdapter:
        loaded = self._loaded
        assert loaded is not None
        adapter: LoraAdapter = await self._on_executor(
            functools.partial(
                load_adapter,
                name,
                path,
                num_layers=loaded.num_layers,
                shapes=loaded.linear_shapes(),
                device=loaded.device,
                dtype=loaded.dtype,
            )
        )
        return adapter

    def _setup(self) -> None:
        """Load the model, allocate the KV cache, build the scheduler (executor thread)."""
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)  # the forward runs on this thread too
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
        if cfg.draft_model:
            if not cfg.num_speculative_tokens:
                raise ValueError("--torch-draft-model needs --torch-num-speculative-tokens >= 1")
            # The draft runs where the main model runs and in its dtype (with --torch-dtype auto
            # the two checkpoints' own dtypes could differ; a preloaded main model ignores the
            # config's dtype): proposals are then judged by the same arithmetic they came from.
            draft = load_model(cfg.draft_model, str(loaded.device), dtype_option(loaded.dtype))
            check_draft_vocab(loaded, draft)
            self._draft = DraftModel(draft, num_blocks, cfg.block_size)
        if self._grammars is None:
            self._grammars = self._grammar_compiler(loaded.vocab_size)
        if self._images is None:
            self._images = loaded.image_encoder()
        images = self._images
        tiers = self._tiers
        files, on_disk = None, []
        if tiers is not None and tiers.kv_disk_blocks:
            files = BlockFiles(
                tiers.kv_disk_dir, fingerprint(self.model_dir, spec), spec.block_bytes
            )
            try:
                on_disk = files.open()
            except OSError as exc:
                log.error(
                    "disk KV tier disabled: %s cannot be used (%s); running with the host tier "
                    "only",
                    tiers.kv_disk_dir,
                    exc,
                )
                files = None
                tiers = dataclasses.replace(tiers, kv_disk_dir="", kv_disk_blocks=0)
        sched = TorchScheduler(
            cfg,
            num_blocks=num_blocks,
            vocab_size=loaded.vocab_size,
            eos_token_ids=self._eos,
            max_model_len=max_len,
            device=loaded.device,
            events=self._events,
            grammars=self._grammars,
            tiers=tiers,
            kv_block_bytes=spec.block_bytes,
            images=images,
        )
        if sched.tiers is not None:
            self._tier_store = TorchTierStore(cache, sched.tiers.host_slots, files)
            if files is not None and sched.tiers is not None:
                kept = sched.tiers.load_disk(on_disk)
                log.info(
                    "disk KV tier: %s, %d of %d blocks from earlier runs",
                    files.dir,
                    kept,
                    len(on_disk),
                )
        self._scheduler = sched
        self._info = ModelInfo(
            served_model_name=self._served_model_name,
            engine=self.engine_name,
            kv_block_size=cfg.block_size,
            kv_total_blocks=num_blocks,
            context_length=sched.max_seq_len,
            model_path=str(self.model_dir),
            role=self._disagg.role,
            max_num_seqs=cfg.max_num_seqs,
            eos_token_ids=self._eos,
            capabilities=self._capabilities(),
            image_token_id=images.image_token_id if images is not None else None,
            tokens_per_image=images.tokens_per_image if images is not None else 0,
        )
        log.info(
            "torch engine: %s (%s%s) on %s as %s, %d KV blocks of %d tokens (%.1f MiB), "
            "max model length %d",
            self.model_dir,
            loaded.model_type,
            f", images of {images.tokens_per_image} tokens" if images is not None else "",
            loaded.device,
            loaded.dtype,
            num_blocks,
            cfg.block_size,
            num_blocks * spec.block_bytes / (1 << 20),
            sched.max_seq_len,
        )

    def _grammar_compiler(self, vocab_size: int) -> GrammarCompiler | None:
        """Structured output needs llguidance and the model directory's tokenizer; without them
        the engine runs without the GUIDED_DECODING capability (guided requests are refused)."""
        try:
            return GrammarCompiler.from_model_dir(self.model_dir, vocab_size)
        except Exception as exc:  # no llguidance, no (fast) tokenizer in the directory
            log.warning("torch engine: no guided decoding for %s: %s", self.model_dir, exc)
            return None

    def _capabilities(self) -> tuple[str, ...]:
        """MULTIMODAL with a multimodal model, in every role: a prefill worker computes the image
        features and the KV, a decode worker takes the images too (its block hashes are salted
        by them, and it prefills itself when the pull fails or the prompt is short)."""
        caps = (*super()._capabilities(), "EMBEDDINGS")
        caps += ("GUIDED_DECODING",) if self._grammars is not None else ()
        return caps + (("MULTIMODAL",) if self._images is not None else ())

    async def _close(self) -> None:
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        forward, self._forward = self._forward, None
        if forward is not None:
            with contextlib.suppress(BaseException):
                await forward  # the thread cannot be interrupted: let the step finish
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        lanes, self._lane_executors = self._lane_executors, {}
        for lane in lanes.values():
            lane.shutdown(wait=True)  # copies in flight finish before the tensors go
        store, self._tier_store = self._tier_store, None
        if store is not None and store.files is not None:
            store.files.close()
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.close()  # before the KV cache it registered goes away
        # Release the KV cache (and the model, if this engine loaded it); start() rebuilds them.
        sched = self._scheduler
        if sched is not None and self._events is not None and sched.pool.num_cached:
            self._events.publish(AllCleared())
        self._runner = None
        self._draft = None
        self._scheduler = None
        if not self._shared_model:
            self._loaded = None
            self._images = None

    async def _run_step(self, sched: TorchScheduler) -> Sequence[SeqOutput] | None:
        step = sched.schedule()
        if not step.chunks:
            return [] if step.num_preempted else None
        runner, executor = self._runner, self._executor
        assert runner is not None and executor is not None
        loop = asyncio.get_running_loop()
        draft = self._draft
        if draft is None or not step.chunks:
            self._forward = loop.run_in_executor(executor, runner.execute, step.chunks)
        else:
            self._forward = loop.run_in_executor(executor, _draft_then_run, draft, runner, step)
        sampled = await asyncio.shield(self._forward)
        self._forward = None
        return sched.complete(step, sampled)

    # -- KV tiers ------------------------------------------------------------------------------

    async def _move_kv(self, job: TierJob) -> int:
        store = self._tier_store
        executor = self._lane_executors.get(job.lane)
        if store is None or executor is None:
            raise Unavailable("the torch engine is not running")
        done: int = await asyncio.get_running_loop().run_in_executor(executor, store.run, job)
        return done

    # -- embeddings ----------------------------------------------------------------------------

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """Pooled final hidden states (kvmesh.workers.pytorch.embedding), computed on the
        engine's executor thread between steps. A multimodal model embeds text only (its
        language model's states): an input holding its image token is InvalidRequest."""
        loaded, executor, sched = self._loaded, self._executor, self._scheduler
        if loaded is None or executor is None or sched is None:
            raise Unavailable("the torch engine has not been started")
        limit = sched.max_seq_len
        image_token = self._images.image_token_id if self._images is not None else None
        for i, ids in enumerate(prompts):
            if len(ids) > limit:
                raise RequestTooLarge(
                    f"input {i} has {len(ids)} tokens; the model's maximum is {limit}"
                )
            if image_token is not None and image_token in ids:
                raise InvalidRequest(
                    f"input {i} holds the image token (id {image_token}): embeddings on this "
                    "model take text only, not images",
                    param="input",
                )
        head = self._embedding_head
        if head is None:
            cfg = self.config
            head = EmbeddingHead.resolve(
                self.model_dir, cfg.embedding_pooling, cfg.embedding_normalize
            )
            self._embedding_head = head
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            executor, embed_prompts, loaded.model, head, prompts, loaded.device, loaded.vocab_size
        )

    # -- KV transfer over NIXL -----------------------------------------------------------------

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

    def _kv_source(self) -> KvSource:
        agent = self._ensure_agent()
        return KvSource(
            self._block_address,
            agent.name,
            agent.metadata,
            agent.memory_kind,
            agent.device_id,
        )

    async def prefill_remote(self, request: EngineRequest) -> PrefillResult:
        result = await super().prefill_remote(request)
        agent = self._agent
        if result.remote.handle is not None and agent is not None:
            if self._pump is None or self._pump.done():  # progress while decode workers read
                self._pump = asyncio.create_task(agent.pump(lambda: len(self._pins) > 0))
        return result

    def _can_read_kv(self, handle: KvTransferHandle) -> bool:
        try:
            self._ensure_agent()
        except (KvmeshError, ImportError) as exc:
            log.warning("cannot pull remote KV: %s", exc)
            return False
        local, remote = self.kv_layout, handle.layout
        return (
            bool(handle.agent_name)
            and local.compatible(remote)
            and local.chunk_bytes == remote.chunk_bytes
        )

    async def _read_kv(
        self, handle: KvTransferHandle, blocks: list[int], remote: Sequence[KvBlockDescriptor]
    ) -> int:
        if not blocks:
            return 0
        agent = self._ensure_agent()
        await self._on_executor(_barrier)
        return await agent.read(
            handle.agent_name,
            handle.agent_metadata,
            block_pieces([self._block_address(b) for b in blocks], self.kv_layout, agent.device_id),
            block_pieces([d.address for d in remote], handle.layout, handle.blocks[0].device_id),
            remote_kind=handle.memory_kind,
            timeout_s=self._disagg.transfer_timeout_s,
        )

    # -- extras --------------------------------------------------------------------------------

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
        self._dispatch_tier_jobs()
        return need

    @staticmethod
    def _read(cache: PagedKvCache, blocks: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return cache.read_blocks(blocks)

    @staticmethod
    def _write(cache: PagedKvCache, blocks: list[int], kv: torch.Tensor) -> None:
        with torch.inference_mode():
            cache.write_blocks(blocks, kv)
