"""The mocker engine: MockerScheduler inside the shared async engine core (BatchingEngine).

A step (`_run_step`) is the scheduler's `step(now)`, then a sleep of its simulated duration
(divided by `speedup_ratio`, measured from the step's start on the injected Clock); the sampled
tokens then go to the requests' streams. It always yields to the event loop once per step,
however large the speedup.

Disaggregated serving is simulated with the real bookkeeping (kvmesh.workers.batching.engine): a
prefill mocker pins the prompt's blocks and hands out a KvTransferHandle without a NIXL agent
(a block's "address" is its id times the block size in bytes); a decode mocker receives the
blocks it does not already cache by waiting their simulated transfer time
(`MockerConfig.transfer_s`: fixed latency + bytes / bandwidth, divided by `speedup_ratio`).

KV tiers (`tiers`: kvmesh.workers.batching.tiers) are the shared bookkeeping for real: blocks
are written through to the host tier, moved to the disk tier, onboarded back, with their KV
events and counters; no byte moves, each move waits its simulated time
(`MockerConfig.tier_move_s`, divided by `speedup_ratio`) on its lane.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvmesh.runtime.clock import Clock
from kvmesh.runtime.kv_events import KvEventLog
from kvmesh.runtime.types import KvBlockDescriptor, KvLayout, KvTransferHandle, ModelInfo
from kvmesh.workers.adapters.config import parse_lora_modules
from kvmesh.workers.batching.engine import BatchingEngine, KvSource
from kvmesh.workers.batching.scheduler import SeqOutput
from kvmesh.workers.batching.tiers import KvTierConfig, TierJob
from kvmesh.workers.mocker.config import MockerConfig
from kvmesh.workers.mocker.scheduler import MockerScheduler

__all__ = ["MockerEngine"]


class MockerEngine(BatchingEngine[MockerScheduler]):
    """A simulated vLLM-like engine: real scheduling, KV block accounting, prefix caching and KV
    events; fake tokens (deterministic, see sampling.py) and simulated step times (timing.py).

    `special_token_ids` and `eos_token_ids` are never generated. `context_length` is the model's;
    `config.max_model_len` overrides it when set (without chunked prefill it is further capped at
    `max_num_batched_tokens`, which vLLM requires). `info.context_length` is the result.
    Beyond the Engine contract: see BatchingEngine (`scheduler`, `cached_blocks()`, ...).
    """

    engine_name = "mocker"
    kv_transfer_backend = "simulated"

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
        tiers: KvTierConfig | None = None,
    ) -> None:
        super().__init__(events=KvEventLog() if config.enable_prefix_caching else None, clock=clock)
        self.config = config
        eos = tuple(eos_token_ids)
        max_len = config.max_model_len or context_length
        if not config.enable_chunked_prefill:
            max_len = min(max_len, config.max_num_batched_tokens)
        self._scheduler = MockerScheduler(
            config,
            vocab_size=vocab_size,
            excluded_token_ids={*special_token_ids, *eos},
            max_model_len=max_len,
            events=self._events,
            tiers=tiers,
        )
        self._info = ModelInfo(
            served_model_name=served_model_name,
            engine=self.engine_name,
            kv_block_size=config.block_size,
            kv_total_blocks=config.num_gpu_blocks,
            context_length=max_len,
            model_path=model_path,
            role=self._disagg.role,
            max_num_seqs=config.max_num_seqs,
            eos_token_ids=eos,
            capabilities=self._capabilities(),
        )

    async def _open(self) -> None:
        await self._load_lora_modules(
            parse_lora_modules(self.config.lora_modules, "--lora-modules")
        )

    async def _run_step(self, sched: MockerScheduler) -> Sequence[SeqOutput] | None:
        clock = self._clock
        start = clock.now()
        result = sched.step(start)
        if result.num_scheduled == 0 and result.num_preempted == 0:
            return None
        await clock.sleep(start + result.duration_s / self.config.speedup_ratio - clock.now())
        return result.outputs

    # -- simulated KV transfer -----------------------------------------------------------------

    @property
    def kv_layout(self) -> KvLayout:
        """The simulated block layout (block size and bytes; no real memory behind it)."""
        cfg = self.config
        return KvLayout(0, 0, 0, cfg.block_size, "mocker", cfg.kv_block_bytes)

    def _kv_source(self) -> KvSource:
        block_bytes = self.config.kv_block_bytes
        return KvSource(lambda block: block * block_bytes)

    def _can_read_kv(self, handle: KvTransferHandle) -> bool:
        layout = handle.layout
        return layout.block_size == self.config.block_size and layout.dtype == "mocker"

    async def _read_kv(
        self, handle: KvTransferHandle, blocks: list[int], remote: Sequence[KvBlockDescriptor]
    ) -> int:
        nbytes = sum(b.length_bytes for b in remote)
        await self._clock.sleep(self.config.transfer_s(nbytes) / self.config.speedup_ratio)
        return nbytes

    async def _move_kv(self, job: TierJob) -> int:
        cfg = self.config
        await self._clock.sleep(cfg.tier_move_s(job.lane.tier, job.nbytes) / cfg.speedup_ratio)
        return len(job)
