"""`kvmesh replay --prefill-workers N`: the disaggregated counterpart of kvmesh.sim.replay's
simulation, for comparing aggregated and disaggregated pools of the same total size.

`--workers` W workers become N prefill and W - N decode mockers (MockerScheduler, the same
engine core the live mocker runs), routed by the real KvScheduler the way the gateway's
MeshBackend routes them (kvmesh.router.backend):

  * arrival: the router picks a decode worker D among the decode workers (KV-aware cost, so
    D's cached prefix is known); if the part of the prompt D does not cache is at most
    `--disagg-local-prefill-tokens`, D prefills it itself (conditional disaggregation);
    otherwise the router picks a prefill worker P and P runs the prompt as a pinned request;
  * P's step that samples the first token: the first token is out (TTFT), P's blocks stay
    pinned, D reserves blocks for the prompt (its cached prefix needs no transfer) and the
    transfer of the other blocks starts: it lasts `MockerConfig.transfer_s(bytes)` (fixed
    latency + bytes / `--kv-transfer-gbps`, `--kv-bytes-per-token` per token) in virtual time.
    D without room for the blocks recomputes the prompt instead (a fallback);
  * transfer end: P releases the pinned blocks, D caches the received blocks (KV events) and
    decodes after the first token (ahead of its waiting queue).

Everything else (virtual-time event loop, KV events applied at step ends, load metrics every
`--load-interval-ms`, metrics) is kvmesh.sim.replay's. ITL includes the gap between the first token
(from P) and the second (from D after the transfer).
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections.abc import Callable

from kvmesh.router.kv_scheduler import KvRouterConfig, KvScheduler, LoadSample
from kvmesh.runtime.errors import InvalidRequest, RequestTooLarge, ResourceExhausted
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.sim.replay import (
    VOCAB_SIZE,
    ModeResult,
    ReplayConfig,
    ReplayError,
    Trace,
    _EventBuffer,
    _PromptBuilder,
    _result,
    _Timeline,
    _Worker,
)
from kvmesh.workers.mocker.scheduler import MockerScheduler

__all__ = ["DisaggStats", "simulate_disaggregated"]

_STEP = 0
_TRANSFER = 1
_ARRIVAL = 2


class DisaggStats:
    """Which path the requests of a disaggregated replay took."""

    __slots__ = (
        "blocks_in_use_at_end",
        "kv_transfer_bytes",
        "local_prefills",
        "remote_prefills",
        "transfer_fallbacks",
    )

    def __init__(self) -> None:
        self.remote_prefills = 0
        self.local_prefills = 0
        """Prefilled on the decode worker (short uncached part)."""
        self.transfer_fallbacks = 0
        """Prefilled remotely, but the decode worker had no room for the blocks: recomputed."""
        self.kv_transfer_bytes = 0
        self.blocks_in_use_at_end = 0
        """Blocks still referenced (pinned or held) when the replay ended: 0 unless requests
        were left unfinished."""


def simulate_disaggregated(
    trace: Trace,
    config: ReplayConfig,
    prefill_workers: int,
    local_prefill_tokens: int,
    *,
    progress: Callable[[int, int, float], None] | None = None,
) -> tuple[ModeResult, DisaggStats]:
    """Replay `trace` on `prefill_workers` prefill and `config.workers - prefill_workers` decode
    mockers with KV-aware routing (see the module docstring)."""
    if not 0 < prefill_workers < config.workers:
        raise ReplayError("--prefill-workers must be between 1 and --workers - 1")
    t_wall = time.perf_counter()
    mcfg = config.mocker
    reqs = trace.requests
    n_req = len(reqs)
    speed = config.speedup
    bs = mcfg.block_size
    builder = _PromptBuilder(config.trace_block_size)
    max_model_len = mcfg.max_model_len or (
        max(r.input_length + max(1, r.output_length) for r in reqs) + 1
    )
    n_dec = config.workers - prefill_workers
    worker_ids = [f"p{i}" for i in range(prefill_workers)] + [f"d{i}" for i in range(n_dec)]
    prefill_ids, decode_ids = worker_ids[:prefill_workers], worker_ids[prefill_workers:]
    caching = mcfg.enable_prefix_caching
    workers: list[_Worker] = []
    for i in range(config.workers):
        events = _EventBuffer() if caching else None
        sched = MockerScheduler(
            mcfg, vocab_size=VOCAB_SIZE, max_model_len=max_model_len, events=events
        )
        workers.append(_Worker(i, sched, events))
    index_of = {w: i for i, w in enumerate(worker_ids)}
    router = KvScheduler(
        KvRouterConfig(
            overlap_weight=config.router_overlap_weight,
            temperature=config.router_temperature,
            seed=config.seed,
        ),
        router_id="replay",
    )
    for wid in worker_ids:
        router.add_worker(
            wid, block_size=bs, kv_total_blocks=mcfg.num_gpu_blocks, kv_events=caching
        )
    load_interval = config.load_interval_ms / 1e3
    stats = DisaggStats()

    arrival = [r.timestamp_ms / 1e3 / speed for r in reqs]
    first_at = [math.nan] * n_req
    last_at = [0.0] * n_req
    ntok = [0] * n_req
    finished_at = [math.nan] * n_req
    cached = [0] * n_req
    requests: list[EngineRequest | None] = [None] * n_req
    decode_of = [0] * n_req
    first_token = [0] * n_req
    remote = [False] * n_req
    transfers: dict[int, tuple[list[int], list[int], int, int]] = {}
    itl = array("d")
    rejected = 0
    done = 0
    output_tokens = 0
    overlap_blocks = prompt_blocks = 0

    heap: list[tuple[float, int, int, int]] = [(t, _ARRIVAL, i, i) for i, t in enumerate(arrival)]
    heapq.heapify(heap)
    seq = n_req
    push, pop = heapq.heappush, heapq.heappop

    def start_step(w: _Worker, now: float) -> None:
        nonlocal seq
        result = w.sched.step(now)
        if result.num_scheduled == 0 and result.num_preempted == 0:
            return
        w.result = result
        w.busy_s += result.duration_s
        push(heap, (now + result.duration_s, _STEP, seq, w.index))
        seq += 1

    def flush_events(w: _Worker) -> None:
        if w.events is not None and w.events.pending:
            wid = worker_ids[w.index]
            for kind in w.events.pending:
                router.indexer.apply_event(wid, kind)
            w.events.pending = []

    def token(i: int, now: float) -> None:
        if ntok[i]:
            itl.append(now - last_at[i])
        else:
            first_at[i] = now
            router.first_token(f"r{i}")
        ntok[i] += 1
        last_at[i] = now

    def finish(i: int, now: float, w: _Worker, cached_tokens: int) -> None:
        nonlocal done, output_tokens
        finished_at[i] = now
        if not remote[i]:  # a remote prefill's hits were credited to its prefill worker
            cached[i] = cached_tokens
            w.cached_tokens += cached_tokens
        output_tokens += ntok[i]
        router.free(f"r{i}")
        router.free(f"r{i}/prefill")
        done += 1

    def admit(
        w: _Worker,
        i: int,
        now: float,
        *,
        pin: bool = False,
        first: int | None = None,
        blocks: list[int] | None = None,
    ) -> bool:
        nonlocal rejected
        request = requests[i]
        assert request is not None
        try:
            w.sched.add(
                request, now, pin=pin, first_token=first, blocks=blocks, cached_tokens=cached[i]
            )
        except (InvalidRequest, RequestTooLarge, ResourceExhausted):
            rejected += 1
            router.free(f"r{i}")
            router.free(f"r{i}/prefill")
            return False
        if w.result is None:
            start_step(w, now)
        return True

    next_report = 0.0
    now = 0.0
    while heap:
        now, kind, _, idx = pop(heap)
        if kind == _STEP:
            w = workers[idx]
            result = w.result
            assert result is not None
            w.result = None
            flush_events(w)
            for out in result.outputs:
                i = int(out.request_id[1:])
                token(i, now)
                if out.handoff:  # P sampled the first token: transfer the prompt to D
                    router.free(f"r{i}/prefill")
                    d = workers[decode_of[i]]
                    request = requests[i]
                    assert request is not None
                    first_token[i] = out.token_id
                    cached[i] = out.usage.cached_tokens if out.usage is not None else 0
                    w.cached_tokens += cached[i]
                    reserved = d.sched.reserve_prefilled(request.prompt)
                    if reserved is None:  # no room on D: it recomputes the prompt
                        stats.transfer_fallbacks += 1
                        w.sched.release_pinned(request.request_id)
                        admit(d, i, now, first=out.token_id)
                        continue
                    blocks, hashes, had = reserved
                    nbytes = (len(blocks) - had) * mcfg.kv_block_bytes
                    stats.kv_transfer_bytes += nbytes
                    transfers[i] = (blocks, hashes, had, idx)
                    push(heap, (now + mcfg.transfer_s(nbytes), _TRANSFER, seq, i))
                    seq += 1
                elif out.finish_reason is not None:
                    if idx < prefill_workers:  # the first token ended it on P
                        w.cached_tokens += out.usage.cached_tokens if out.usage else 0
                        cached[i] = out.usage.cached_tokens if out.usage else 0
                    finish(i, now, w, out.usage.cached_tokens if out.usage is not None else 0)
            if w.sched.has_work:
                start_step(w, now)
            if load_interval and (w.result is None or now - w.last_load >= load_interval):
                info = w.sched.load()
                router.update_load(
                    worker_ids[idx],
                    LoadSample(
                        kv_active_blocks=info.kv_active_blocks,
                        kv_total_blocks=info.kv_total_blocks,
                        num_running=info.num_running,
                        num_waiting=info.num_waiting,
                        pending_prefill_tokens=info.pending_prefill_tokens,
                    ),
                    now,
                )
                w.last_load = now
        elif kind == _TRANSFER:
            i = idx
            blocks, hashes, had, p_index = transfers.pop(i)
            request = requests[i]
            assert request is not None
            workers[p_index].sched.release_pinned(request.request_id)
            d = workers[decode_of[i]]
            d.sched.commit_prefilled(blocks, hashes, had, request.prompt)
            flush_events(d)
            if not admit(d, i, now, first=first_token[i], blocks=blocks):
                d.sched.pool.release(blocks)
        else:
            r = reqs[idx]
            prompt = builder.prompt(r, idx)
            osl = max(1, r.output_length)
            rid = f"r{idx}"
            requests[idx] = EngineRequest(
                rid,
                prompt,
                SamplingParams(temperature=0.0),
                StopParams(max_tokens=osl, ignore_eos=True),
            )
            sel = router.select(prompt, now, candidates=decode_ids)
            router.book(rid, sel, now, expected_output_tokens=osl)
            overlap_blocks += sel.overlap_blocks
            prompt_blocks += sel.prompt_blocks
            d = workers[index_of[sel.worker_id]]
            decode_of[idx] = d.index
            d.requests += 1
            d.prompt_tokens += len(prompt)
            if len(prompt) - sel.overlap_blocks * bs <= local_prefill_tokens:
                stats.local_prefills += 1
                admit(d, idx, now)
                continue
            psel = router.select(prompt, now, candidates=prefill_ids)
            router.book(f"{rid}/prefill", psel, now)
            p = workers[index_of[psel.worker_id]]
            p.requests += 1
            p.prompt_tokens += len(prompt)
            remote[idx] = True
            stats.remote_prefills += 1
            admit(p, idx, now, pin=True)
        if progress is not None:
            wall = time.perf_counter()
            if wall >= next_report:
                next_report = wall + 0.2
                progress(done + rejected, n_req, now)
    if progress is not None:
        progress(done + rejected, n_req, now)

    stats.blocks_in_use_at_end = sum(w.sched.pool.num_used for w in workers)
    mode_result = _result(
        f"kv-disagg-{prefill_workers}p{n_dec}d",
        trace,
        config,
        bs,
        speed,
        workers,
        worker_ids,
        _Timeline(arrival, first_at, finished_at, cached, itl, output_tokens, rejected),
        overlap_blocks / prompt_blocks if prompt_blocks else 0.0,
        t_wall,
    )
    return mode_result, stats
