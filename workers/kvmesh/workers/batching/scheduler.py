"""The synchronous continuous-batching core shared by the mocker and the torch engine: a
vLLM-v1-style scheduler over a paged KV block pool (block_pool.py: reference counts, prefix caching
with chained block hashes, LRU eviction of free cached blocks, KV events). No asyncio and no wall
clock. The engines differ only in how a step's tokens are produced and timed: the torch engine runs
a forward pass between `schedule()` and `complete()`, the mocker's `step(now)` asks a timing model
and a fake sampler.

  `schedule()`
     1. Running requests, in admission order, each get the tokens they still need: 1 for a
        decode, the rest of the prompt (up to the remaining token budget) for a chunked prefill.
        FIFO admission with chunked prefill leaves at most the newest admitted request
        mid-prefill, so this schedules decodes first, then the continuing prefill. A request that
        needs a new block when none is free preempts the most recently admitted running request
        (recompute: its blocks are released, it goes back to the front of the waiting queue and
        later re-prefills its prompt plus the tokens it already generated, which are not emitted
        again; its full blocks usually come back from the prefix cache), repeating until the block
        fits or the request preempted itself.
     2. If nothing was preempted, waiting requests are admitted in (priority, arrival) order
        (lower priority value first) while the token budget, `max_num_seqs` and the KV pool
        allow. A request's cached prefix (whole blocks whose chained hash is cached) is reused:
        those tokens are never computed again (at least the prompt's last token is). Admission
        keeps `watermark_blocks` blocks free. Without chunked prefill a prompt is admitted only
        when it fits the remaining budget whole. Admission stops at the first request that does
        not fit (no overtaking).
     It returns the step's ScheduledStep: per request the start position, the number of tokens
     and whether the chunk reaches the end of the known tokens (then one token is sampled).

  `complete(step, sampled)`
     Advances every request that is still running (requests aborted meanwhile are skipped),
     caches the blocks that became full (BlocksStored events), appends sampled tokens and checks
     stop conditions: length (max_tokens, the model length) first, then stop token ids once
     min_tokens are reached. Finished requests release their blocks.

KV tiers (kvmesh.workers.batching.tiers, with a KvTierConfig): blocks the pool caches are written
through to a host tier (and from there to disk). At admission, where a request's cached device
prefix ends, the blocks that follow on the host or disk tier (as many as
`_blocks_to_onboard` keeps) are onboarded instead of computed: the request takes its device hit
and device blocks for its whole prompt, leaves the waiting queue while ONBOARD jobs fill them
(other requests are admitted meanwhile), and once `complete_tier_job` reports them done it is
admitted ahead of ordinary waiting requests with those blocks computed and cached (their tokens
count as cached tokens), prefilling the rest. The engine runs the jobs (`take_tier_jobs`) and
reports each (`complete_tier_job`).

Aborting releases a request's blocks at once, even while a forward that uses them is running:
freed blocks are only handed out again by the next `schedule()` or by an import, both of which
happen after the running forward.

Disaggregated serving
  * Prefill side: `add(request, pin=True)` prefills and samples the first token like any request;
    unless that token ends it, the request is then handed off: it leaves the scheduler, its
    SeqOutput has `handoff` set, and its blocks stay referenced in `pinned[request_id]` (never
    evicted or reused) until `release_pinned(request_id)`.
  * Decode side: `reserve_prefilled(prompt)` takes blocks for a prompt whose KV arrives from
    elsewhere (reusing its cached prefix), `commit_prefilled` caches them once the KV is there,
    and `add(request, first_token=t, blocks=b)` starts a request whose prompt KV is in blocks `b`
    (referenced, full blocks cached; the reference passes to the request) and whose first token
    `t` was sampled elsewhere: it decodes from there, ahead of ordinary waiting requests. Without
    `blocks` it recomputes prompt + t (like a preempted request), never emitting t again.
"""

from __future__ import annotations

import enum
import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from kvmesh.runtime.errors import InvalidRequest, NotFound, RequestTooLarge, ResourceExhausted
from kvmesh.runtime.kv_events import CachedBlock, KvEventLog, KvTier
from kvmesh.runtime.types import (
    EngineRequest,
    FinishReason,
    KvTierStats,
    LoadInfo,
    TokenLogprob,
    Usage,
)
from kvmesh.workers.batching.block_pool import BlockPool, block_hash
from kvmesh.workers.batching.loras import LoraSlots
from kvmesh.workers.batching.tiers import KvTierConfig, KvTiers, Onboarding, TierJob

__all__ = [
    "BatchScheduler",
    "SampledToken",
    "ScheduledStep",
    "SchedulerConfig",
    "Seq",
    "SeqOutput",
    "SeqStatus",
]


class SeqStatus(enum.Enum):
    """Where a request is in the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SeqOutput:
    """One token sampled for a request in a step; the last one carries the finish."""

    request_id: str
    token_id: int
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    usage: Usage | None = None
    handoff: bool = False
    """A pinned request's first token that does not end it: the request left the scheduler and
    its blocks are in the scheduler's `pinned` (usage is set, finish_reason is not)."""


class SchedulerConfig(Protocol):
    """The settings the scheduler reads (MockerConfig and TorchConfig both have them)."""

    @property
    def block_size(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def enable_chunked_prefill(self) -> bool: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def seed(self) -> int: ...
    @property
    def max_loras(self) -> int: ...


class SampledToken(Protocol):
    """The token sampled for one chunk that reached the end of its request's known tokens."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> TokenLogprob | None: ...


class Seq:
    """Scheduler state of one request (engines subclass it for their sampling state)."""

    __slots__ = (
        "arrival",
        "blocks",
        "cached_tokens",
        "decoding",
        "hashes",
        "lora",
        "max_len",
        "min_len",
        "num_cached_blocks",
        "num_computed",
        "pin",
        "priority",
        "prompt_len",
        "request_id",
        "salted",
        "status",
        "stop_ids",
        "tokens",
    )

    def __init__(self, request: EngineRequest, arrival: int) -> None:
        self.request_id = request.request_id
        self.tokens: list[int] = list(request.prompt)
        self.prompt_len = len(self.tokens) - request.resumed_output_tokens
        """The original prompt's length: a resumed request's earlier output is output."""
        self.lora = request.lora_name
        self.priority = request.priority
        self.arrival = arrival
        self.blocks: list[int] = []
        self.hashes: list[int] = []
        self.num_computed = 0
        self.num_cached_blocks = 0
        self.cached_tokens = -1
        self.decoding = False
        self.status = SeqStatus.WAITING
        self.max_len = 0
        self.min_len = len(self.tokens) + request.stop.min_tokens
        self.stop_ids: frozenset[int] = frozenset()
        self.pin = False
        self.salted: list[int] | None = None
        """Requests with images: the token ids block hashes cover, image placeholders salted
        (kvmesh.runtime.multimodal), as far as hashed so far; None: `tokens` themselves."""

    def hash_tokens(self, upto: int) -> Sequence[int]:
        """The token ids block hashes cover, valid for the first `upto` tokens: `tokens`, or
        `salted` extended with the tokens after the prompt."""
        salted = self.salted
        if salted is None:
            return self.tokens
        if len(salted) < upto:
            salted.extend(self.tokens[len(salted) : upto])
        return salted

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.tokens) - self.prompt_len,
            cached_tokens=max(self.cached_tokens, 0),
        )


S = TypeVar("S", bound=Seq)
StepT = TypeVar("StepT", bound="ScheduledStep[Any]")
C = TypeVar("C", bound=SchedulerConfig)


@dataclass(slots=True)
class ScheduledStep(Generic[S]):
    """What one `schedule()` decided: per scheduled request, the first position to compute, the
    number of tokens, and whether the chunk ends the known tokens (a token is sampled)."""

    seqs: list[S] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    num_preempted: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class BatchScheduler(Generic[S, C]):
    """Continuous-batching scheduler + KV block pool (see the module docstring).

    Synchronous and single-threaded. Requests are identified by `request_id`, unique among
    unfinished requests. `max_model_len`: the longest sequence (prompt + output) a request may
    reach; a sequence also never outgrows what the pool can hold with the watermark kept free (it
    ends with LENGTH there), nor, without chunked prefill, what one step can prefill.

    Subclasses build their Seq in `_new_seq` and may add request checks in `_check_request`.
    `tiers`: the KV tiers below the pool (None or disabled: the pool only), `kv_block_bytes` the
    bytes of one block (what tier moves count).
    """

    _limit_prompt_by_seq_len: ClassVar[bool] = False
    """Whether `check` reports prompt limits against max_seq_len (else max_model_len)."""
    _report_watermark: ClassVar[bool] = True
    """Whether `check` mentions the blocks kept free."""

    def __init__(
        self,
        config: C,
        *,
        num_blocks: int,
        max_model_len: int,
        watermark_blocks: int = 0,
        events: KvEventLog | None = None,
        tiers: KvTierConfig | None = None,
        kv_block_bytes: int = 0,
    ) -> None:
        if max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self.config: C = config
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.pool = BlockPool(
            num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            events=events,
        )
        self._watermark_blocks = watermark_blocks
        cap = min(max_model_len, (num_blocks - watermark_blocks) * config.block_size + 1)
        if not config.enable_chunked_prefill:
            cap = min(cap, config.max_num_batched_tokens + 1)
        self.max_seq_len = cap
        """The longest a sequence (prompt + output) gets before it ends with LENGTH."""
        self._rng = random.Random(config.seed)
        self._seqs: dict[str, S] = {}
        self._waiting: list[tuple[int, int, S]] = []
        self._num_waiting = 0
        self._running: list[S] = []
        self._arrivals = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_steps = 0
        self.admitted: list[str] = []
        """Ids of the requests the last `schedule()` admitted (running from then on; a request
        preempted and admitted again appears again). The engine core times queue waits by it."""
        self._query_tokens = 0
        self._hit_tokens = 0
        self.pinned: dict[str, list[int]] = {}
        """Handed-off requests' blocks, referenced until release_pinned (disaggregation)."""
        self._num_pinned_blocks = 0
        self._prefilled: deque[S] = deque()
        """Requests holding their blocks (remote-prefilled, or onboarded from a lower tier),
        admitted before the waiting heap."""
        self.tiers: KvTiers | None = None
        """The KV tiers below the pool (None: the pool only)."""
        self.loras: LoraSlots[Any] = LoraSlots(config.max_loras)
        """The LoRA adapters requests may name (the engine loads and unloads them)."""
        if tiers is not None and tiers.enabled:
            self.tiers = KvTiers(tiers, self.pool, block_bytes=kv_block_bytes)
        self._onboarding: dict[str, Onboarding] = {}
        """Requests whose blocks are coming back from the tiers below, by request id."""
        self._device_hit_tokens = 0

    # -- requests ------------------------------------------------------------------------------

    def _check_request(self, request: EngineRequest) -> None:
        """Engine-specific checks, run after the duplicate-id check."""

    def _new_seq(self, request: EngineRequest, arrival: int, now: float) -> S:
        """Build a request's Seq with its sampling state (stop ids, seeds)."""
        raise NotImplementedError

    def check(self, request: EngineRequest) -> None:
        """Raise what `add` would raise for `request`, without queueing it."""
        rid = request.request_id
        if rid in self._seqs:
            raise InvalidRequest(f"request id {rid!r} is already in flight", param="request_id")
        if request.lora_name and request.lora_name not in self.loras:
            raise NotFound(f"LoRA adapter {request.lora_name!r} is not loaded", param="model")
        self._check_request(request)
        n = len(request.prompt)
        if n == 0:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        limit = self.max_seq_len if self._limit_prompt_by_seq_len else self.max_model_len
        if n >= limit:
            raise RequestTooLarge(
                f"prompt has {n} tokens; the limit is {limit - 1} "
                f"(max model length {limit} includes at least one output token)",
                param="prompt",
            )
        blocks = -(-n // self.block_size)
        wm = self._watermark_blocks
        if blocks > self.num_blocks - wm:
            kept = f" ({wm} kept free)" if self._report_watermark else ""
            raise ResourceExhausted(
                f"prompt of {n} tokens needs {blocks} KV blocks; the pool has {self.num_blocks}"
                + kept
            )
        cfg = self.config
        if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
            raise ResourceExhausted(
                f"prompt of {n} tokens exceeds max_num_batched_tokens={cfg.max_num_batched_tokens}"
                " and chunked prefill is disabled"
            )

    def max_len(self, request: EngineRequest) -> int:
        """The sequence length (prompt + output) at which `request` ends with LENGTH."""
        max_tokens = request.stop.max_tokens
        n = len(request.prompt)
        return self.max_seq_len if max_tokens is None else min(self.max_seq_len, n + max_tokens)

    def add(
        self,
        request: EngineRequest,
        now: float = 0.0,
        *,
        pin: bool = False,
        first_token: int | None = None,
        blocks: list[int] | None = None,
        cached_tokens: int = 0,
    ) -> None:
        """Queue `request` (assumed to pass kvmesh.workers.validation) arriving at `now`
        (recorded only; the torch engine leaves it 0).

        `pin`: hand the request off after its first token, keeping its blocks; `first_token`:
        continue a request prefilled elsewhere, with its prompt KV in `blocks` (or recompute it
        when None); `cached_tokens`: the prefix-cache hits to report for such a request (see
        "Disaggregated serving" in the module docstring).

        Raises what `check` raises: InvalidRequest for a duplicate request id (and whatever the
        engine's `_check_request` refuses), RequestTooLarge when the prompt does not leave room
        for one token, ResourceExhausted when the prompt can never be scheduled (more blocks than
        the pool has beyond the watermark or, without chunked prefill, more tokens than one
        step's budget).
        """
        self.check(request)
        rid = request.request_id
        n = len(request.prompt)
        if blocks is not None and (first_token is None or len(blocks) * self.block_size < n):
            raise ValueError("blocks need first_token and must hold the whole prompt")
        seq = self._new_seq(request, self._arrivals, now)
        self._arrivals += 1
        seq.max_len = self.max_len(request)
        seq.pin = pin
        self._seqs[rid] = seq
        self._num_waiting += 1
        if first_token is not None:
            seq.tokens.append(first_token)
            if blocks is not None:
                seq.blocks = blocks
                seq.num_computed = n
                seq.num_cached_blocks = n // self.block_size if self.pool.enable_caching else 0
                seq.cached_tokens = cached_tokens
                seq.decoding = True
                self._prefilled.append(seq)
                return
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))

    def abort(self, request_id: str) -> bool:
        """Remove an unfinished request and release its blocks; False if unknown/finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SeqStatus.WAITING:
            self._num_waiting -= 1  # its heap / prefilled entry is skipped lazily
            self.pool.release(seq.blocks)  # a remote-prefilled or onboarding request's blocks
            seq.blocks = []
            self._onboarding.pop(request_id, None)  # its jobs release their own references
        else:
            self._running.remove(seq)
            self.pool.release(seq.blocks)
            seq.blocks = []
        seq.status = SeqStatus.FINISHED
        self.num_finished += 1
        return True

    def abort_all(self) -> list[str]:
        """Abort every unfinished request; returns their ids."""
        ids = list(self._seqs)
        for rid in ids:
            self.abort(rid)
        self._waiting.clear()
        self._prefilled.clear()
        return ids

    def release_pinned(self, request_id: str) -> bool:
        """Release a handed-off request's pinned blocks; False if none are pinned for it."""
        blocks = self.pinned.pop(request_id, None)
        if blocks is None:
            return False
        self._num_pinned_blocks -= len(blocks)
        self.pool.release(blocks)
        return True

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held for handed-off requests."""
        return self._num_pinned_blocks

    def status(self, request_id: str) -> SeqStatus | None:
        """Status of an unfinished request (None: unknown or finished)."""
        seq = self._seqs.get(request_id)
        return seq.status if seq is not None else None

    def usage(self, request_id: str) -> Usage | None:
        """Token accounting so far of an unfinished request."""
        seq = self._seqs.get(request_id)
        return seq.usage() if seq is not None else None

    # -- state ---------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """True when a step would have something to do."""
        return bool(self._running) or self._num_waiting > 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached tokens / tokens looked up, over every admission so far."""
        return self._hit_tokens / self._query_tokens if self._query_tokens else 0.0

    def load(self) -> LoadInfo:
        """Current load (O(requests); O(prompt blocks) per request not admitted yet).

        `pending_prefill_tokens` is the prefill work still to do: the prompt tokens not yet
        computed, where a request still waiting for admission counts without the prefix the pool
        holds now and without the blocks another waiting request computes first (admission
        reuses both, so they are no work: a burst sharing a new prefix costs that prefix once;
        counting every waiting prompt whole overstated the queue of exactly the workers holding
        or computing the prefixes, and so steered KV routing away from them under load)."""
        pending = 0
        caching = self.pool.enable_caching
        bs = self.block_size
        match = self.pool.match_prefix
        queued: set[int] = set()  # blocks of waiting prompts counted already
        for seq in self._seqs.values():
            if seq.decoding:
                continue
            done = seq.num_computed
            if caching and not done and seq.status is SeqStatus.WAITING:
                limit = (len(seq.tokens) - 1) // bs  # as _admit: the last token is computed
                self._ensure_hashes(seq, limit)
                hashes = seq.hashes
                i = len(match(hashes, limit))
                while i < limit and hashes[i] in queued:  # chained: a prefix of counted blocks
                    i += 1
                queued.update(hashes[i:limit])
                done = i * bs
            pending += len(seq.tokens) - done
        pool = self.pool
        tiers: tuple[KvTierStats, ...] = (
            KvTierStats(
                KvTier.DEVICE,
                blocks=pool.num_cached,
                capacity_blocks=self.num_blocks,
                hit_tokens=self._device_hit_tokens,
            ),
        )
        if self.tiers is not None:
            tiers += self.tiers.stats()
        return LoadInfo(
            num_running=len(self._running),
            num_waiting=self._num_waiting,
            kv_active_blocks=pool.num_used - self._tier_held_blocks(),
            kv_total_blocks=self.num_blocks,
            pending_prefill_tokens=pending,
            prefix_cache_hit_rate=self.prefix_cache_hit_rate,
            requests_finished_total=self.num_finished,
            preemptions_total=self.num_preemptions,
            kv_pinned_blocks=self._num_pinned_blocks,
            kv_tiers=tiers if pool.enable_caching else (),
        )

    def _tier_held_blocks(self) -> int:
        """Blocks referenced only by tier moves (offloads of cached blocks nobody else uses)."""
        if self.tiers is None or not self.tiers.num_jobs:
            return 0
        ref = self.pool.ref_count
        held: dict[int, int] = {}
        for b in self.tiers.held_device_blocks():
            held[b] = held.get(b, 0) + 1
        return sum(1 for b, n in held.items() if ref(b) == n)

    # -- scheduling ----------------------------------------------------------------------------

    def _ensure_hashes(self, seq: S, upto: int) -> None:
        hashes = seq.hashes
        i = len(hashes)
        if i >= upto:
            return
        bs, tokens, lora = self.block_size, seq.hash_tokens(upto * self.block_size), seq.lora
        parent = hashes[-1] if hashes else None
        while i < upto:
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], lora)
            hashes.append(parent)
            i += 1

    def _preempt(self, seq: S) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        seq.decoding = False
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._num_waiting += 1
        self.num_preemptions += 1

    def schedule(self) -> ScheduledStep[S]:
        """Pick this step's work (see the module docstring). No scheduled request and no
        preemption means nothing can run until a request arrives or leaves."""
        return self._schedule_into(ScheduledStep())

    def _schedule_into(self, step: StepT) -> StepT:
        self.num_steps += 1
        self.admitted.clear()
        pool = self.pool
        bs = self.block_size
        budget = self.config.max_num_batched_tokens
        running = self._running
        sched: list[S] = []
        counts: list[int] = []
        preempted = 0

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            end = seq.num_computed + n
            if end > len(seq.blocks) * bs:
                need = -(-end // bs) - len(seq.blocks)
                while need > pool.num_free:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted += 1
                    if victim is seq:
                        break
                if seq.status is not SeqStatus.RUNNING:
                    break
                seq.blocks.extend(pool.allocate(need))
            budget -= n
            sched.append(seq)
            counts.append(n)
            i += 1

        if not preempted:
            self._admit(sched, counts, budget)

        step.num_preempted = preempted
        for seq, n in zip(sched, counts, strict=True):
            start = seq.num_computed
            step.seqs.append(seq)
            step.starts.append(start)
            step.counts.append(n)
            step.sample.append(start + n == len(seq.tokens))
            if seq.decoding:
                step.decode_tokens += n
            else:
                step.prefill_tokens += n
        return step

    def _admit(self, sched: list[S], counts: list[int], budget: int) -> None:
        cfg = self.config
        pool = self.pool
        bs = self.block_size
        waiting = self._waiting
        running = self._running
        caching = pool.enable_caching
        prefilled = self._prefilled
        while prefilled and budget > 0 and len(running) < cfg.max_num_seqs:
            seq = prefilled[0]
            if seq.status is not SeqStatus.WAITING:
                prefilled.popleft()  # aborted while waiting
                continue
            n = len(seq.tokens) - seq.num_computed
            if n > budget:
                if seq.decoding or not cfg.enable_chunked_prefill:
                    break
                n = budget  # an onboarded request prefills the rest of its prompt in chunks
            need = -(-(seq.num_computed + n) // bs) - len(seq.blocks)
            if need > pool.num_free:
                break
            prefilled.popleft()
            self._num_waiting -= 1
            seq.blocks.extend(pool.allocate(need))
            seq.status = SeqStatus.RUNNING
            self.admitted.append(seq.request_id)
            running.append(seq)
            sched.append(seq)
            counts.append(n)
            budget -= n
        tiers = self.tiers
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            seq = waiting[0][2]
            if seq.status is not SeqStatus.WAITING:
                heapq.heappop(waiting)  # aborted while waiting
                continue
            num_tokens = len(seq.tokens)
            if caching:
                limit = (num_tokens - 1) // bs  # the last token is always computed
                self._ensure_hashes(seq, limit)
                hit = pool.match_prefix(seq.hashes, limit)
                if tiers is not None:
                    tiers.touch(seq.hashes[: len(hit)])
                    if len(hit) < limit:
                        sources = tiers.match(seq.hashes, len(hit), limit)
                        if sources:
                            sources = sources[: self._blocks_to_onboard(seq, len(hit), sources)]
                        if sources:
                            if not self._start_onboarding(seq, hit, sources):
                                break
                            continue
            else:
                hit = []
            hit_tokens = len(hit) * bs
            n = num_tokens - hit_tokens
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            need = -(-(hit_tokens + n) // bs) - len(hit)
            if pool.num_free - pool.count_evictable(hit) - need < self._watermark_blocks:
                break
            heapq.heappop(waiting)
            self._num_waiting -= 1
            pool.acquire(hit)
            hit.extend(pool.allocate(need))
            seq.blocks = hit
            seq.num_computed = hit_tokens
            seq.num_cached_blocks = hit_tokens // bs
            seq.decoding = False
            seq.status = SeqStatus.RUNNING
            self.admitted.append(seq.request_id)
            if seq.cached_tokens < 0:  # first admission: what its usage reports
                seq.cached_tokens = hit_tokens
                self._device_hit_tokens += hit_tokens
            self._query_tokens += num_tokens
            self._hit_tokens += hit_tokens
            running.append(seq)
            sched.append(seq)
            counts.append(n)
            budget -= n

    # -- KV tiers --------------------------------------------------------------------------------

    def _blocks_to_onboard(self, seq: S, hit_blocks: int, sources: list[KvTier]) -> int:
        """How many of the blocks found below the device (`sources`: their tiers, in order,
        after `hit_blocks` device hits) to onboard rather than compute: all of them here;
        engines that know both costs keep only what is cheaper to move than to compute."""
        return len(sources)

    def _start_onboarding(self, seq: S, hit: list[int], sources: list[KvTier]) -> bool:
        """Take the waiting head `seq` out of the queue with device blocks for its whole prompt
        (its device hit `hit` first) and start onboarding `sources` into the blocks after the
        hit. False (nothing done) when the pool cannot take them now."""
        pool = self.pool
        tiers = self.tiers
        assert tiers is not None
        bs = self.block_size
        need = -(-len(seq.tokens) // bs) - len(hit)
        if pool.num_free - pool.count_evictable(hit) - need < self._watermark_blocks:
            return False
        heapq.heappop(self._waiting)
        pool.acquire(hit)
        fresh = pool.allocate(need)
        seq.blocks = hit + fresh
        seq.num_computed = len(hit) * bs
        seq.num_cached_blocks = len(hit)
        seq.decoding = False
        start = len(hit)
        self._onboarding[seq.request_id] = tiers.onboard(
            seq, seq.hashes[start : start + len(sources)], sources, fresh[: len(sources)]
        )
        return True

    def take_tier_jobs(self) -> list[TierJob]:
        """Moves between the tiers to run now (see kvmesh.workers.batching.tiers: run each lane's
        jobs in order and report each with `complete_tier_job`)."""
        return self.tiers.take_jobs() if self.tiers is not None else []

    def complete_tier_job(self, job: TierJob, done: int) -> None:
        """`job` moved its `done` leading blocks (the rest failed). An onboarding it completes
        makes its request ready to run: the blocks that arrived are cached and count as cached
        tokens, the rest of the prompt is computed."""
        tiers = self.tiers
        assert tiers is not None
        rec = tiers.complete(job, done)
        if rec is None:
            return
        seq: S = rec.owner  # type: ignore[assignment]
        rid = seq.request_id
        if self._onboarding.get(rid) is not rec:
            return  # aborted meanwhile (its blocks are released)
        del self._onboarding[rid]
        bs = self.block_size
        hit = seq.num_cached_blocks
        arrived = rec.leading_ok()
        end = hit + arrived
        if arrived:
            tokens = seq.hash_tokens(end * bs)
            self.pool.cache_full_blocks(seq.blocks, seq.hashes, hit, end, tokens, seq.lora)
        seq.num_computed = end * bs
        seq.num_cached_blocks = end
        if seq.cached_tokens < 0:  # first admission: what its usage reports
            seq.cached_tokens = end * bs
            tiers.count_hits(rec, arrived, bs)
            self._device_hit_tokens += hit * bs
        self._query_tokens += len(seq.tokens)
        self._hit_tokens += end * bs
        self._prefilled.append(seq)

    def abandon_tier_jobs(self) -> None:
        """The engine stopped running tier moves: forget the ones not completed (their blocks
        are released) and put the requests whose onboarding cannot finish back in the queue
        (they recompute)."""
        if self.tiers is None:
            return
        for rec in self.tiers.abandon():
            seq: S = rec.owner  # type: ignore[assignment]
            if self._onboarding.pop(seq.request_id, None) is rec:
                self.pool.release(seq.blocks)
                seq.blocks = []
                seq.num_computed = 0
                seq.num_cached_blocks = 0
                heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))

    def complete(self, step: ScheduledStep[S], sampled: Sequence[SampledToken]) -> list[SeqOutput]:
        """Apply a computed step: `sampled` has one entry per chunk with `sample` set."""
        pool = self.pool
        bs = self.block_size
        caching = pool.enable_caching
        outputs: list[SeqOutput] = []
        finished = False
        k = 0
        for seq, start, n, sample in zip(
            step.seqs, step.starts, step.counts, step.sample, strict=True
        ):
            result = None
            if sample:
                result = sampled[k]
                k += 1
            if seq.status is not SeqStatus.RUNNING or seq.num_computed != start:
                continue  # aborted (or preempted and re-admitted) while the forward ran
            c = start + n
            seq.num_computed = c
            tokens = seq.tokens
            if caching and c // bs > seq.num_cached_blocks:
                full = c // bs
                self._ensure_hashes(seq, full)
                pool.cache_full_blocks(
                    seq.blocks,
                    seq.hashes,
                    seq.num_cached_blocks,
                    full,
                    seq.hash_tokens(full * bs),
                    seq.lora,
                )
                seq.num_cached_blocks = full
            if result is None:
                continue  # prefill continues next step
            pos = len(tokens)
            t = result.token_id
            tokens.append(t)
            seq.decoding = True
            out = SeqOutput(seq.request_id, t, result.logprob)
            outputs.append(out)
            if pos + 1 >= seq.max_len:
                out.finish_reason = FinishReason.LENGTH
            elif t in seq.stop_ids and pos + 1 >= seq.min_len:
                out.finish_reason = FinishReason.STOP
                out.stop_token_id = t
            elif seq.pin:
                out.handoff = True
            else:
                continue
            out.usage = seq.usage()
            self._finish(seq, handoff=out.handoff)
            finished = True
        if finished:
            self._running = [s for s in self._running if s.status is SeqStatus.RUNNING]
        return outputs

    def _finish(self, seq: S, handoff: bool = False) -> None:
        seq.status = SeqStatus.FINISHED
        if handoff:  # keep the prompt's blocks for the decode worker
            self.pinned[seq.request_id] = seq.blocks
            self._num_pinned_blocks += len(seq.blocks)
            seq.blocks = []
        self.pool.release(seq.blocks)
        seq.blocks = []
        del self._seqs[seq.request_id]
        self.num_finished += 1

    # -- prefix cache: export/import, inspection ------------------------------------------------

    def prefix_hashes(self, token_ids: Sequence[int], lora_name: str = "") -> list[int]:
        """Chained hashes of the full blocks of `token_ids`."""
        bs = self.block_size
        hashes: list[int] = []
        parent: int | None = None
        for i in range(len(token_ids) // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs], lora_name)
            hashes.append(parent)
        return hashes

    def match_prefix(self, token_ids: Sequence[int], lora_name: str = "") -> list[int]:
        """Block ids of the longest cached full-block prefix of `token_ids` (not acquired)."""
        hashes = self.prefix_hashes(token_ids, lora_name)
        return self.pool.match_prefix(hashes, len(hashes))

    def hash_ids(self, request: EngineRequest) -> Sequence[int]:
        """The token ids the block hashes of `request`'s prompt cover (what reserve_prefilled
        and commit_prefilled take): the prompt itself; engines that salt some positions (the
        torch engine's image placeholders) override it."""
        return request.prompt

    def reserve_prefilled(
        self, prompt: Sequence[int], lora_name: str = ""
    ) -> tuple[list[int], list[int], int] | None:
        """Take referenced blocks for a prompt whose KV comes from another worker (`prompt`: its
        hash_ids): its cached leading blocks, then fresh ones. Returns (blocks, full-block
        hashes, number of cached leading blocks, which need no transfer), or None when the pool
        cannot take them now (keeping the watermark free)."""
        pool = self.pool
        nb = -(-len(prompt) // self.block_size)
        hashes = self.prefix_hashes(prompt, lora_name)
        have = pool.match_prefix(hashes, len(hashes))
        need = nb - len(have)
        if pool.num_free - pool.count_evictable(have) - need < self._watermark_blocks:
            return None
        pool.acquire(have)
        return have + pool.allocate(need), hashes, len(have)

    def commit_prefilled(
        self,
        blocks: list[int],
        hashes: Sequence[int],
        num_had: int,
        prompt: Sequence[int],
        lora_name: str = "",
    ) -> None:
        """The KV of reserved `blocks` arrived: cache their full blocks (BlocksStored events)."""
        self.pool.cache_full_blocks(blocks, hashes, num_had, len(hashes), prompt, lora_name)

    def cached_blocks(self) -> dict[int, CachedBlock]:
        """The pool's cached blocks, in the shape of KvEventLog.cached()."""
        return self.pool.cached_blocks()

    def clear_cache(self) -> int:
        """Drop every unreferenced cached block of the pool (see BlockPool.clear) and every block
        of the tiers below; returns how many the pool dropped."""
        if self.tiers is not None:
            self.tiers.clear()
        return self.pool.clear()

    def check_invariants(self) -> None:
        """Assert the pool's reference counts match what the requests hold (tests, debugging)."""
        refs = [0] * self.num_blocks
        for seq in self._running:
            for b in seq.blocks:
                refs[b] += 1
            assert len(seq.blocks) * self.block_size >= seq.num_computed, seq.request_id
        for s in self._seqs.values():
            if s.status is SeqStatus.WAITING:
                assert not s.blocks or s in self._prefilled or s.request_id in self._onboarding, (
                    s.request_id
                )
                for b in s.blocks:
                    refs[b] += 1
        if self.tiers is not None:
            for b in self.tiers.held_device_blocks():
                refs[b] += 1
        for blocks in self.pinned.values():
            for b in blocks:
                refs[b] += 1
        assert self._num_pinned_blocks == sum(len(b) for b in self.pinned.values())
        pool = self.pool
        for b in range(self.num_blocks):
            assert pool.ref_count(b) == refs[b], (b, pool.ref_count(b), refs[b])
        assert pool.num_used == sum(1 for r in refs if r), "num_used drifted"
        assert pool.num_free + pool.num_used == self.num_blocks, "blocks leaked"
        assert len(self._running) <= self.config.max_num_seqs
