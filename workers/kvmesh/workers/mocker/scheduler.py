"""The mocker's synchronous core: a vLLM-v1-style continuous-batching scheduler over a paged KV
block pool. No asyncio and no wall clock: callers pass `now` and sleep `duration_s` themselves, so
the live engine (MockerEngine) and a virtual-time trace replay drive the same code.

One `step(now)` is the shared core's `schedule()` and `complete()` (kvmesh.workers.batching)
with a timing model and a fake sampler in between:
  1. Running requests, in admission order, each get the tokens they still need: 1 for a decode,
     the rest of the prompt (up to the remaining budget) for a chunked prefill. FIFO admission
     with chunked prefill leaves at most the newest admitted request mid-prefill, so this
     schedules decodes first, then the continuing prefill. A request that needs a new block when
     none is free preempts the most recently admitted running request (recompute mode: its blocks
     are released, it goes back to the front of the waiting queue, and on resume it re-prefills
     its prompt plus the tokens it already generated, which are not emitted again), repeating
     until the block fits or the request preempted itself.
  2. If nothing was preempted, waiting requests are admitted in (priority, arrival) order (lower
     priority value first) while the token budget, `max_num_seqs` and the KV pool allow: a
     request's cached prefix is reused (at least its last token is always computed), its first
     chunk is scheduled, and admission keeps `watermark * num_blocks` blocks free. Without chunked
     prefill a prompt is admitted only when it fits the remaining budget whole. Admission stops
     at the first request that does not fit (no overtaking).
  3. The step's duration comes from the timing model (see timing.py): prefill time over the new
     tokens of prefilling requests, plus decode time at the step's decode KV usage if any request
     decodes. That usage counts token slots, as Dynamo's mocker does: the decoding requests'
     context lengths (prompt + tokens generated so far, each request counting its whole context
     even where requests share cached blocks) over the pool's capacity (blocks x block size).
     Requests prefilling in the same step add prefill time only.
  4. Every request whose tokens are now all computed samples one token (a pure function of the
     request and the position, see sampling.py) and is checked for stop conditions: length
     (max_tokens, the model length) first, then stop token ids once min_tokens are reached.
     Blocks that became full are cached (KV events), finished requests release their blocks.

Disaggregated serving (the same contract as the torch scheduler's):
  * prefill side: `add(request, now, pin=True)`; unless its first token ends it, the request is
    handed off after that token (SeqOutput.handoff) and its blocks stay referenced in
    `pinned[request_id]` until `release_pinned(request_id)`;
  * decode side: `reserve_prefilled(prompt)` takes blocks for a prompt whose KV arrives from
    elsewhere (reusing its cached prefix), `commit_prefilled` caches them once the KV is there,
    and `add(request, now, first_token=t, blocks=b)` decodes after the first token `t`, ahead
    of ordinary waiting requests (without `blocks` it recomputes prompt + t, never emitting t).
    Tokens are the same as aggregated serving's: the stream key depends on the prompt only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.runtime.kv_events import KvEventLog, KvTier
from kvmesh.runtime.timing import TimingModel, load_timing
from kvmesh.runtime.types import EngineRequest, TokenLogprob
from kvmesh.workers.batching.scheduler import BatchScheduler, Seq, SeqOutput, SeqStatus
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.mocker.config import MockerConfig
from kvmesh.workers.mocker.sampling import TokenSampler

__all__ = ["MockerScheduler", "SeqOutput", "SeqStatus", "StepResult"]


@dataclass(slots=True)
class StepResult:
    """What one step did and how long it takes (simulated time, before speedup)."""

    duration_s: float
    outputs: list[SeqOutput]
    num_scheduled: int = 0
    """Requests that got tokens this step (0: the step did nothing)."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_preempted: int = 0
    kv_usage: float = 0.0
    """The decode timing input: the decoding requests' context tokens / the pool's token slots
    (0 when nothing decodes; see the module docstring)."""


@dataclass(slots=True, frozen=True)
class _Sampled:
    token_id: int
    logprob: TokenLogprob | None


class _Seq(Seq):
    """Scheduler state of one request, with its fake-sampling stream."""

    __slots__ = ("arrival_time", "greedy", "key", "top_logprobs")

    def __init__(self, request: EngineRequest, arrival: int, now: float) -> None:
        super().__init__(request, arrival)
        self.arrival_time = now
        self.greedy = request.sampling.temperature == 0
        self.key = 0
        self.stop_ids = frozenset(request.stop.stop_token_ids)
        self.top_logprobs = request.sampling.top_logprobs


class MockerScheduler(BatchScheduler[_Seq, MockerConfig]):
    """Continuous-batching scheduler + KV block pool + fake sampler (see the module docstring).

    Synchronous and single-threaded; `now` is only recorded. Requests are identified by
    `request_id`, unique among unfinished requests.

    `max_model_len`: the longest sequence (prompt + output) a request may reach. A sequence also
    never outgrows what the pool can hold with the watermark kept free (it ends with LENGTH there;
    vLLM would refuse such a configuration at startup), nor, without chunked prefill, what one
    step can prefill.
    """

    def __init__(
        self,
        config: MockerConfig,
        *,
        vocab_size: int,
        excluded_token_ids: Iterable[int] = (),
        max_model_len: int,
        events: KvEventLog | None = None,
        timing: TimingModel | None = None,
        tiers: KvTierConfig | None = None,
    ) -> None:
        super().__init__(
            config,
            num_blocks=config.num_gpu_blocks,
            max_model_len=max_model_len,
            watermark_blocks=config.watermark_blocks,
            events=events,
            tiers=tiers,
            kv_block_bytes=config.kv_block_bytes,
        )
        self.timing: TimingModel = (
            timing if timing is not None else load_timing(config.timing_profile)
        )
        self.sampler = TokenSampler(vocab_size, excluded_token_ids)

    def _new_seq(self, request: EngineRequest, arrival: int, now: float) -> _Seq:
        seq = _Seq(request, arrival, now)
        if seq.greedy:
            seed = None
        elif request.sampling.seed is not None:
            seed = request.sampling.seed
        else:
            seed = self._rng.getrandbits(64)
        seq.key = self.sampler.stream_key(seq.tokens, seed)
        return seq

    def _blocks_to_onboard(self, seq: _Seq, hit_blocks: int, sources: list[KvTier]) -> int:
        """Onboard only what saves time: all the blocks found below the device, else their
        leading host-tier run, if its simulated move (MockerConfig.tier_move_s; host and disk
        moves run side by side) is shorter than the prefill time it saves (timing model, this
        prompt alone); else none."""
        cfg = self.config
        bs = self.block_size
        new = len(seq.tokens) - hit_blocks * bs
        full_ms = self.timing.prefill_ms(new)
        host_run = next((i for i, t in enumerate(sources) if t is not KvTier.HOST), len(sources))
        for n in (len(sources), host_run):
            if n == 0:
                break
            host = sum(1 for t in sources[:n] if t is KvTier.HOST)
            move_s = max(
                cfg.tier_move_s(KvTier.HOST, host * cfg.kv_block_bytes),
                cfg.tier_move_s(KvTier.DISK, (n - host) * cfg.kv_block_bytes),
            )
            if move_s * 1000.0 < full_ms - self.timing.prefill_ms(new - n * bs):
                return n
        return 0

    def step(self, now: float) -> StepResult:
        """Schedule and simulate one forward pass (see the module docstring)."""
        step = self.schedule()
        seqs = step.seqs
        if not seqs:
            return StepResult(0.0, [], num_preempted=step.num_preempted)
        timing = self.timing
        ms = timing.prefill_ms(step.prefill_tokens) if step.prefill_tokens else 0.0
        usage = 0.0
        if step.decode_tokens:
            context = sum(len(seq.tokens) for seq in seqs if seq.decoding)
            usage = context / (self.num_blocks * self.block_size)
            ms += timing.decode_ms(usage)
        sampler = self.sampler
        sampled: list[_Sampled] = []
        for seq, sample in zip(seqs, step.sample, strict=True):
            if sample:
                pos = len(seq.tokens)
                t = sampler.token(seq.key, pos)
                lp = seq.top_logprobs
                sampled.append(
                    _Sampled(
                        t, None if lp is None else sampler.logprob(seq.key, pos, t, lp, seq.greedy)
                    )
                )
        return StepResult(
            ms / 1000.0,
            self.complete(step, sampled),
            num_scheduled=len(seqs),
            prefill_tokens=step.prefill_tokens,
            decode_tokens=step.decode_tokens,
            num_preempted=step.num_preempted,
            kv_usage=usage,
        )
