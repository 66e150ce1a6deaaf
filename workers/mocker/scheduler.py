"""The mocker's synchronous core: a vLLM-v1-style continuous-batching scheduler over a paged KV
block pool. No asyncio and no wall clock: callers pass `now` and sleep `duration_s` themselves, so
the live engine (MockerEngine) and a virtual-time trace replay drive the same code.

One `step(now)`:
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
     tokens of prefilling requests, plus decode time at the current KV usage if any request
     decodes.
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

import enum
import heapq
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmesh.errors import InvalidRequest, RequestTooLarge, ResourceExhausted

from ..engine import EngineRequest, FinishReason, LoadInfo, TokenLogprob, Usage
from ..kv_events import KvEventLog
from .block_pool import BlockPool, block_hash
from .config import MockerConfig
from .sampling import TokenSampler
from .timing import TimingModel, load_timing

__all__ = ["MockerScheduler", "SeqOutput", "SeqStatus", "StepResult"]


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
    its blocks are in `MockerScheduler.pinned` (usage is set, finish_reason is not)."""


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
    """Fraction of blocks referenced during the step."""


class _Seq:
    """Scheduler state of one request."""

    __slots__ = (
        "arrival",
        "arrival_time",
        "blocks",
        "cached_tokens",
        "decoding",
        "greedy",
        "hashes",
        "key",
        "lora",
        "max_len",
        "min_len",
        "num_cached_blocks",
        "num_computed",
        "pin",
        "priority",
        "prompt_len",
        "request_id",
        "status",
        "stop_ids",
        "tokens",
        "top_logprobs",
    )

    def __init__(self, request: EngineRequest, arrival: int, now: float) -> None:
        self.request_id = request.request_id
        self.tokens: list[int] = list(request.prompt)
        self.prompt_len = len(self.tokens)
        self.lora = request.lora_name
        self.priority = request.priority
        self.arrival = arrival
        self.arrival_time = now
        self.blocks: list[int] = []
        self.hashes: list[int] = []
        self.num_computed = 0
        self.num_cached_blocks = 0
        self.cached_tokens = -1
        self.decoding = False
        self.status = SeqStatus.WAITING
        self.greedy = request.sampling.temperature == 0
        self.key = 0
        self.max_len = 0
        self.min_len = self.prompt_len + request.stop.min_tokens
        self.stop_ids: frozenset[int] | None = (
            frozenset(request.stop.stop_token_ids) if request.stop.stop_token_ids else None
        )
        self.top_logprobs = request.sampling.top_logprobs
        self.pin = False

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.tokens) - self.prompt_len,
            cached_tokens=max(self.cached_tokens, 0),
        )


class MockerScheduler:
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
    ) -> None:
        if max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_gpu_blocks
        self.max_model_len = max_model_len
        self.pool = BlockPool(
            config.num_gpu_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            events=events,
        )
        self.timing: TimingModel = (
            timing if timing is not None else load_timing(config.timing_profile)
        )
        self.sampler = TokenSampler(vocab_size, excluded_token_ids)
        self._watermark_blocks = config.watermark_blocks
        pool_tokens = (config.num_gpu_blocks - self._watermark_blocks) * config.block_size
        cap = min(max_model_len, pool_tokens + 1)
        if not config.enable_chunked_prefill:
            cap = min(cap, config.max_num_batched_tokens + 1)
        self.max_seq_len = cap
        """The longest a sequence (prompt + output) gets before it ends with LENGTH."""
        self._rng = random.Random(config.seed)
        self._seqs: dict[str, _Seq] = {}
        self._waiting: list[tuple[int, int, _Seq]] = []
        self._num_waiting = 0
        self._running: list[_Seq] = []
        self._arrivals = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_steps = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self.pinned: dict[str, list[int]] = {}
        """Handed-off requests' blocks, referenced until release_pinned (disaggregation)."""
        self._num_pinned_blocks = 0
        self._prefilled: deque[_Seq] = deque()
        """Remote-prefilled requests holding their blocks, admitted before the waiting heap."""

    # -- requests ------------------------------------------------------------------------------

    def check(self, request: EngineRequest) -> None:
        """Raise what `add` would raise for `request`, without queueing it."""
        rid = request.request_id
        if rid in self._seqs:
            raise InvalidRequest(f"request id {rid!r} is already in flight", param="request_id")
        n = len(request.prompt)
        if n == 0:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if n >= self.max_model_len:
            raise RequestTooLarge(
                f"prompt has {n} tokens; the limit is {self.max_model_len - 1} "
                f"(max model length {self.max_model_len} includes at least one output token)",
                param="prompt",
            )
        bs = self.block_size
        blocks = -(-n // bs)
        if blocks > self.num_blocks - self._watermark_blocks:
            raise ResourceExhausted(
                f"prompt of {n} tokens needs {blocks} KV blocks; the pool has {self.num_blocks} "
                f"({self._watermark_blocks} kept free)"
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
        now: float,
        *,
        pin: bool = False,
        first_token: int | None = None,
        blocks: list[int] | None = None,
        cached_tokens: int = 0,
    ) -> None:
        """Queue `request` (assumed validated, see kvmesh.workers.validation).

        `pin`, `first_token`, `blocks`, `cached_tokens`: disaggregated serving (see the module
        docstring).

        Raises InvalidRequest for a duplicate request id, RequestTooLarge when the prompt does not
        leave room for one token within max_model_len, ResourceExhausted when the prompt can never
        be scheduled (more blocks than the pool has beyond the watermark, or, without chunked
        prefill, more tokens than one step's budget).
        """
        self.check(request)
        rid = request.request_id
        n = len(request.prompt)
        if blocks is not None and (first_token is None or len(blocks) * self.block_size < n):
            raise ValueError("blocks need first_token and must hold the whole prompt")
        seq = _Seq(request, self._arrivals, now)
        self._arrivals += 1
        seq.max_len = self.max_len(request)
        seq.pin = pin
        if seq.greedy:
            seed = None
        elif request.sampling.seed is not None:
            seed = request.sampling.seed
        else:
            seed = self._rng.getrandbits(64)
        seq.key = self.sampler.stream_key(seq.tokens, seed)
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

    def prefix_hashes(self, token_ids: Sequence[int], lora_name: str = "") -> list[int]:
        """Chained hashes of the full blocks of `token_ids`."""
        bs = self.block_size
        hashes: list[int] = []
        parent: int | None = None
        for i in range(len(token_ids) // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs], lora_name)
            hashes.append(parent)
        return hashes

    def reserve_prefilled(
        self, prompt: Sequence[int], lora_name: str = ""
    ) -> tuple[list[int], list[int], int] | None:
        """Take referenced blocks for a prompt whose KV comes from another worker: its cached
        leading blocks, then fresh ones. Returns (blocks, full-block hashes, number of cached
        leading blocks, which need no transfer), or None when the pool cannot take them now
        (keeping the watermark free)."""
        pool = self.pool
        bs = self.block_size
        nb = -(-len(prompt) // bs)
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

    def abort(self, request_id: str) -> bool:
        """Remove an unfinished request and release its blocks; False if unknown/finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SeqStatus.WAITING:
            self._num_waiting -= 1  # its heap / prefilled entry is skipped lazily
            self.pool.release(seq.blocks)  # a remote-prefilled request holds its blocks
            seq.blocks = []
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
        """Current load (O(requests))."""
        pending = 0
        for seq in self._seqs.values():
            if not seq.decoding:
                pending += len(seq.tokens) - seq.num_computed
        return LoadInfo(
            num_running=len(self._running),
            num_waiting=self._num_waiting,
            kv_active_blocks=self.pool.num_used,
            kv_total_blocks=self.num_blocks,
            pending_prefill_tokens=pending,
            prefix_cache_hit_rate=self.prefix_cache_hit_rate,
            requests_finished_total=self.num_finished,
            preemptions_total=self.num_preemptions,
            kv_pinned_blocks=self._num_pinned_blocks,
        )

    # -- the step ------------------------------------------------------------------------------

    def _ensure_hashes(self, seq: _Seq, upto: int) -> None:
        hashes = seq.hashes
        i = len(hashes)
        if i >= upto:
            return
        bs, tokens, lora = self.block_size, seq.tokens, seq.lora
        parent = hashes[-1] if hashes else None
        while i < upto:
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], lora)
            hashes.append(parent)
            i += 1

    def _preempt(self, seq: _Seq) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        seq.decoding = False
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._num_waiting += 1
        self.num_preemptions += 1

    def step(self, now: float) -> StepResult:
        """Schedule and simulate one forward pass (see the module docstring)."""
        self.num_steps += 1
        cfg = self.config
        pool = self.pool
        bs = self.block_size
        budget = cfg.max_num_batched_tokens
        running = self._running
        sched: list[_Seq] = []
        counts: list[int] = []
        preempted = 0

        # 1. running requests, admission order.
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = len(seq.tokens) - seq.num_computed
            if n > budget:
                n = budget
            end = seq.num_computed + n
            if end > len(seq.blocks) * bs:
                need = (end + bs - 1) // bs - len(seq.blocks)
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

        # 2. admissions.
        if not preempted:
            self._admit(sched, counts, budget)

        if not sched:
            return StepResult(0.0, [], num_preempted=preempted)

        # 3. timing.
        prefill_tokens = 0
        decodes = 0
        for seq, n in zip(sched, counts, strict=True):
            if seq.decoding:
                decodes += 1
            else:
                prefill_tokens += n
        usage = pool.num_used / self.num_blocks
        timing = self.timing
        ms = timing.prefill_ms(prefill_tokens) if prefill_tokens else 0.0
        if decodes:
            ms += timing.decode_ms(usage)

        # 4. execute: advance, cache full blocks, sample, check stops.
        outputs: list[SeqOutput] = []
        caching = pool.enable_caching
        sampler = self.sampler
        token_of = sampler.token
        finished = False
        for seq, n in zip(sched, counts, strict=True):
            c = seq.num_computed + n
            seq.num_computed = c
            tokens = seq.tokens
            if caching and c // bs > seq.num_cached_blocks:
                full = c // bs
                self._ensure_hashes(seq, full)
                pool.cache_full_blocks(
                    seq.blocks, seq.hashes, seq.num_cached_blocks, full, tokens, seq.lora
                )
                seq.num_cached_blocks = full
            pos = len(tokens)
            if c < pos:
                continue  # prefill continues next step
            t = token_of(seq.key, pos)
            tokens.append(t)
            seq.decoding = True
            out = SeqOutput(
                seq.request_id,
                t,
                None
                if seq.top_logprobs is None
                else sampler.logprob(seq.key, pos, t, seq.top_logprobs, seq.greedy),
            )
            outputs.append(out)
            if pos + 1 >= seq.max_len:
                out.finish_reason = FinishReason.LENGTH
            elif seq.stop_ids is not None and t in seq.stop_ids and pos + 1 >= seq.min_len:
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
            self._running = [s for s in running if s.status is SeqStatus.RUNNING]

        return StepResult(
            ms / 1000.0,
            outputs,
            num_scheduled=len(sched),
            prefill_tokens=prefill_tokens,
            decode_tokens=decodes,
            num_preempted=preempted,
            kv_usage=usage,
        )

    def _admit(self, sched: list[_Seq], counts: list[int], budget: int) -> None:
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
                break
            need = (seq.num_computed + n + bs - 1) // bs - len(seq.blocks)
            if need > pool.num_free:
                break
            prefilled.popleft()
            self._num_waiting -= 1
            seq.blocks.extend(pool.allocate(need))
            seq.status = SeqStatus.RUNNING
            running.append(seq)
            sched.append(seq)
            counts.append(n)
            budget -= n
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
            else:
                hit = []
            hit_tokens = len(hit) * bs
            n = num_tokens - hit_tokens
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            need = (hit_tokens + n + bs - 1) // bs - len(hit)
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
            if seq.cached_tokens < 0:
                seq.cached_tokens = hit_tokens
            self._query_tokens += num_tokens
            self._hit_tokens += hit_tokens
            running.append(seq)
            sched.append(seq)
            counts.append(n)
            budget -= n

    def _finish(self, seq: _Seq, handoff: bool = False) -> None:
        seq.status = SeqStatus.FINISHED
        if handoff:  # keep the prompt's blocks for the decode worker
            self.pinned[seq.request_id] = seq.blocks
            self._num_pinned_blocks += len(seq.blocks)
            seq.blocks = []
        self.pool.release(seq.blocks)
        seq.blocks = []
        del self._seqs[seq.request_id]
        self.num_finished += 1

    # -- inspection (tests, replay) ------------------------------------------------------------

    def cached_blocks(self) -> dict[int, tuple[int | None, tuple[int, ...], str]]:
        """The pool's cached blocks, in the shape of KvEventLog.cached()."""
        return self.pool.cached_blocks()

    def clear_cache(self) -> int:
        """Drop every unreferenced cached block (see BlockPool.clear)."""
        return self.pool.clear()

    def check_invariants(self) -> None:
        """Assert the pool's reference counts match what the requests hold (tests, debugging)."""
        refs = [0] * self.num_blocks
        for seq in self._running:
            for b in seq.blocks:
                refs[b] += 1
            assert len(seq.blocks) * self.block_size >= seq.num_computed, seq.request_id
        for seq in self._seqs.values():
            if seq.status is SeqStatus.WAITING:
                assert not seq.blocks or seq in self._prefilled, seq.request_id
                for b in seq.blocks:
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
