"""The torch engine's synchronous core: a vLLM-v1-style continuous-batching scheduler over a paged
KV block pool (the mocker's BlockPool: reference counts, prefix caching with chained block hashes,
LRU eviction of free cached blocks, KV events).

A step is split in two so the forward pass can run on another thread:

  `schedule()` (event-loop thread)
     1. Running requests, in admission order, each get the tokens they still need: 1 for a
        decode, the rest of the prompt (up to the remaining token budget) for a chunked prefill.
        A request that needs a new block when none is free preempts the most recently admitted
        running request (recompute: its blocks are released, it goes back to the front of the
        waiting queue and later re-prefills its prompt plus the tokens it already generated,
        which are not emitted again; its full blocks usually come back from the prefix cache),
        repeating until the block fits or the request preempted itself.
     2. If nothing was preempted, waiting requests are admitted in (priority, arrival) order
        while the token budget, `max_num_seqs` and the free blocks allow. A request's cached
        prefix (whole blocks whose chained hash is cached) is reused: those tokens are never
        computed again (at least the prompt's last token is, to get logits). Without chunked
        prefill a prompt is admitted only when it fits the remaining budget whole. Admission
        stops at the first request that does not fit (no overtaking).
     It returns the step's SeqChunks: the token ids to compute, their start position, the block
     table and, for chunks that reach the end of the known tokens, what the sampler needs.

  `complete(step, sampled)` (event-loop thread, after the forward)
     Advances every request that is still running (requests aborted meanwhile are skipped),
     caches the blocks that became full (BlocksStored events), appends sampled tokens and checks
     stop conditions: length (max_tokens, the model length) first, then stop token ids (EOS
     unless ignore_eos, plus stop_token_ids) once min_tokens are reached. Before min_tokens the
     sampler masks those ids, so they are not generated at all. Finished requests release their
     blocks.

Aborting (cancel) releases a request's blocks at once, even while a forward that uses them is
running: freed blocks are only handed out again by the next `schedule()` or by an import, both of
which happen after the running forward (the engine runs forwards and KV copies on one thread).

Disaggregated serving
  * Prefill side: `add(request, pin=True)` prefills and samples the first token like any request;
    unless that token ends it, the request is then handed off: it leaves the scheduler, its
    SeqOutput has `handoff` set, and its blocks stay referenced in `pinned[request_id]` (never
    evicted or reused) until `release_pinned(request_id)`.
  * Decode side: `add(request, first_token=t, blocks=b)` starts a request whose prompt KV is
    already in blocks `b` (referenced by the caller, full blocks cached; the reference passes to
    the request) and whose first token `t` was sampled elsewhere: it decodes from there, ahead of
    ordinary waiting requests. Without `blocks` it recomputes prompt + t (like a preempted
    request), never emitting t again.
"""

from __future__ import annotations

import enum
import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.errors import InvalidRequest, RequestTooLarge, ResourceExhausted

from ..engine import EngineRequest, FinishReason, LoadInfo, TokenLogprob, Usage
from ..kv_events import CachedBlock, KvEventLog
from ..mocker.block_pool import BlockPool, block_hash
from .config import TorchConfig
from .model_runner import SeqChunk
from .sampler import Sampled, SampleSpec

__all__ = ["ScheduledStep", "SeqOutput", "SeqStatus", "TorchScheduler"]


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
    its blocks are in `TorchScheduler.pinned` (usage is set, finish_reason is not)."""


class _Seq:
    """Scheduler state of one request."""

    __slots__ = (
        "arrival",
        "bias_ids",
        "bias_values",
        "blocks",
        "cached_tokens",
        "decoding",
        "generator",
        "hashes",
        "lora",
        "max_len",
        "min_len",
        "num_cached_blocks",
        "num_computed",
        "params",
        "pin",
        "priority",
        "prompt_len",
        "request_id",
        "status",
        "stop_ids",
        "suppress",
        "tokens",
    )

    def __init__(self, request: EngineRequest, arrival: int) -> None:
        self.request_id = request.request_id
        self.tokens: list[int] = list(request.prompt)
        self.prompt_len = len(self.tokens)
        self.lora = request.lora_name
        self.priority = request.priority
        self.arrival = arrival
        self.params = request.sampling
        self.blocks: list[int] = []
        self.hashes: list[int] = []
        self.num_computed = 0
        self.num_cached_blocks = 0
        self.cached_tokens = -1
        self.decoding = False
        self.status = SeqStatus.WAITING
        self.generator: torch.Generator | None = None
        self.max_len = 0
        self.min_len = self.prompt_len + request.stop.min_tokens
        self.stop_ids: frozenset[int] = frozenset()
        self.suppress: tuple[int, ...] = ()
        bias = sorted(request.sampling.logit_bias.items())
        self.bias_ids = [t for t, _ in bias]
        self.bias_values = [float(b) for _, b in bias]
        self.pin = False

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.tokens) - self.prompt_len,
            cached_tokens=max(self.cached_tokens, 0),
        )


@dataclass(slots=True)
class ScheduledStep:
    """What one `schedule()` decided."""

    seqs: list[_Seq]
    chunks: list[SeqChunk]
    num_preempted: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class TorchScheduler:
    """Continuous-batching scheduler + KV block pool (see the module docstring).

    Synchronous and single-threaded (the engine's event loop). `vocab_size` bounds token ids;
    `eos_token_ids` stop generation unless a request sets ignore_eos; `max_model_len` is the
    longest sequence (prompt + output) a request may reach (also capped by what the pool holds
    and, without chunked prefill, by one step's budget); `device` is where per-request
    sampling generators live.
    """

    def __init__(
        self,
        config: TorchConfig,
        *,
        num_blocks: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        device: torch.device,
        events: KvEventLog | None = None,
    ) -> None:
        if max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device
        self.pool = BlockPool(
            num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            events=events,
        )
        cap = min(max_model_len, num_blocks * config.block_size + 1)
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
        self.num_computed_tokens = 0
        """Tokens whose KV the forward passes computed so far (prefill, recompute and decode)."""
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
        if request.lora_name:
            raise InvalidRequest(
                f"LoRA adapter {request.lora_name!r} is not loaded (the torch engine serves no "
                "adapters)",
                param="lora_name",
            )
        if getattr(request.sampling, "guided", None) is not None:
            raise InvalidRequest(
                "the torch engine does not support guided decoding", param="response_format"
            )
        vocab = self.vocab_size
        n = len(request.prompt)
        if n == 0:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if max(request.prompt) >= vocab:
            raise InvalidRequest(
                f"prompt token ids must be < the vocabulary size {vocab}", param="prompt"
            )
        if any(t >= vocab for t in request.sampling.logit_bias):
            raise InvalidRequest(
                f"logit_bias token ids must be < the vocabulary size {vocab}", param="logit_bias"
            )
        if n >= self.max_seq_len:
            raise RequestTooLarge(
                f"prompt has {n} tokens; the limit is {self.max_seq_len - 1} "
                f"(max model length {self.max_seq_len} includes at least one output token)",
                param="prompt",
            )
        bs = self.block_size
        if -(-n // bs) > self.num_blocks:
            raise ResourceExhausted(
                f"prompt of {n} tokens needs {-(-n // bs)} KV blocks; the pool has "
                f"{self.num_blocks}"
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
        *,
        pin: bool = False,
        first_token: int | None = None,
        blocks: list[int] | None = None,
        cached_tokens: int = 0,
    ) -> None:
        """Queue `request` (assumed to pass kvmesh.workers.validation).

        `pin`: hand the request off after its first token, keeping its blocks (see the module
        docstring); `first_token`: continue a request prefilled elsewhere, with its prompt KV in
        `blocks` (or recompute it when None); `cached_tokens`: the prefix-cache hits to report
        for such a request.

        Raises InvalidRequest for a duplicate id, token ids outside the vocabulary or a LoRA
        adapter; RequestTooLarge when the prompt leaves no room for one token; ResourceExhausted
        when the prompt can never be scheduled (more blocks than the pool has or, without chunked
        prefill, more tokens than one step's budget).
        """
        self.check(request)
        rid = request.request_id
        n = len(request.prompt)
        if blocks is not None and (first_token is None or len(blocks) * self.block_size < n):
            raise ValueError("blocks need first_token and must hold the whole prompt")
        vocab = self.vocab_size
        seq = _Seq(request, self._arrivals)
        self._arrivals += 1
        seq.max_len = self.max_len(request)
        seq.pin = pin
        stop_ids = set(request.stop.stop_token_ids)
        if not request.stop.ignore_eos:
            stop_ids |= self.eos_token_ids
        seq.stop_ids = frozenset(stop_ids)
        seq.suppress = tuple(sorted(t for t in stop_ids if t < vocab))
        if request.sampling.temperature > 0:
            seed = request.sampling.seed
            if seed is None:
                seed = self._rng.getrandbits(63)
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(seed & ((1 << 64) - 1))
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

    def usage(self, request_id: str) -> Usage | None:
        """Token accounting so far of an unfinished request."""
        seq = self._seqs.get(request_id)
        return seq.usage() if seq is not None else None

    def status(self, request_id: str) -> SeqStatus | None:
        """Status of an unfinished request (None: unknown or finished)."""
        seq = self._seqs.get(request_id)
        return seq.status if seq is not None else None

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

    # -- scheduling ----------------------------------------------------------------------------

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

    def schedule(self) -> ScheduledStep:
        """Pick this step's work (see the module docstring). An empty `chunks` list with no
        preemption means nothing can run until a request arrives or leaves."""
        self.num_steps += 1
        cfg = self.config
        pool = self.pool
        bs = self.block_size
        budget = cfg.max_num_batched_tokens
        running = self._running
        sched: list[_Seq] = []
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

        step = ScheduledStep(sched, [], num_preempted=preempted)
        for seq, n in zip(sched, counts, strict=True):
            start = seq.num_computed
            end = start + n
            spec = None
            if end == len(seq.tokens):
                spec = SampleSpec(
                    seq.params,
                    seq.tokens,
                    seq.prompt_len,
                    seq.generator,
                    seq.suppress if len(seq.tokens) < seq.min_len else (),
                    seq.bias_ids,
                    seq.bias_values,
                )
            step.chunks.append(SeqChunk(seq.tokens[start:end], start, list(seq.blocks), spec))
            if seq.decoding:
                step.decode_tokens += n
            else:
                step.prefill_tokens += n
        self.num_computed_tokens += step.prefill_tokens + step.decode_tokens
        return step

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
            need = -(-(seq.num_computed + n) // bs) - len(seq.blocks)
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
            need = -(-(hit_tokens + n) // bs) - len(hit)
            if pool.num_free - pool.count_evictable(hit) < need:
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

    def complete(self, step: ScheduledStep, sampled: Sequence[Sampled]) -> list[SeqOutput]:
        """Apply a finished forward: `sampled` has one entry per chunk with a SampleSpec."""
        pool = self.pool
        bs = self.block_size
        caching = pool.enable_caching
        outputs: list[SeqOutput] = []
        finished = False
        k = 0
        for seq, chunk in zip(step.seqs, step.chunks, strict=True):
            result = None
            if chunk.sample is not None:
                result = sampled[k]
                k += 1
            if seq.status is not SeqStatus.RUNNING or seq.num_computed != chunk.start:
                continue  # aborted (or preempted and re-admitted) while the forward ran
            c = chunk.start + len(chunk.token_ids)
            seq.num_computed = c
            tokens = seq.tokens
            if caching and c // bs > seq.num_cached_blocks:
                full = c // bs
                self._ensure_hashes(seq, full)
                pool.cache_full_blocks(
                    seq.blocks, seq.hashes, seq.num_cached_blocks, full, tokens, seq.lora
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

    # -- prefix cache: inspection, export/import ------------------------------------------------

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

    def cached_blocks(self) -> dict[int, CachedBlock]:
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
