"""`kvmesh replay`: offline, virtual-time trace replay of the real router and mocker code.

One `MockerScheduler` per worker (the mocker's synchronous core: continuous batching, paged KV
pool, prefix caching, chunked prefill, preemption, the polynomial or table timing model) and the
real routing code: `KvScheduler` with its `KvIndexer` fed by the workers' own KV events (router
mode kv), or round-robin / random / least-loaded with the semantics of
`kvmesh.router.routing.SimpleRouter`. No asyncio, no wall clock, no sockets: a discrete-event
loop over a heap of (time, event) runs as fast as the CPU allows, and the same inputs give the
same output (everything but `wall_s`).

Events, in virtual seconds:
  * arrival: the request is routed at its (sped-up) trace timestamp and queued on its worker; an
    idle worker starts a step at once;
  * step completion: a worker's step, computed by `MockerScheduler.step(start)`, lasts
    `duration_s` (the timing model's simulated time, no speedup). At its end the router applies
    the KV events the step published (blocks stored, evicted), the sampled tokens are delivered
    (first token -> TTFT, gaps -> ITL, finish -> E2E, booking freed), the worker's load metrics
    are fed to the router every `load_interval_ms`, and the worker steps again if it has work.
  Completions at a time come before arrivals at the same time.

Trace: Mooncake JSONL, one request per line: `timestamp` (ms), `input_length`, `output_length`,
`hash_ids` (ids of 512-token prefix blocks: equal leading ids = equal prefixes). Each hash id
becomes a fixed pseudo-random run of `trace_block_size` token ids (a pure function of the id,
the same in every run and process), the runs are joined and cut to `input_length`; the engine
then splits the prompt into its own `block_size`-token blocks (8 per trace block at 64). The
request asks for exactly `output_length` tokens (at least 1; max_tokens, EOS ignored).

Metrics: TTFT (first token - arrival), ITL (every gap between consecutive tokens of a request,
pooled over requests), E2E (last token - arrival), throughput over the simulated span (first
arrival to last completion), `prefix_hit_rate` = prompt tokens the mockers served from cache /
prompt tokens (each request's cached tokens at its first admission, the engine's own
accounting), and `prefix_hit_rate_bound` = the trace's infinite-cache bound: leading hash ids
seen in an earlier request / hash ids, as in `shared/ref/traces/trace_stats.json`
(`prefix_hit_rate_bound_tokens` weighs it by tokens). Per worker: requests, prompt tokens,
cached tokens, busy fraction (simulated step time / span), preemptions.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import heapq
import json
import math
import random
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvmesh.router.kv_scheduler import KvRouterConfig, KvScheduler, LoadSample
from kvmesh.router.routing import RouterMode
from kvmesh.runtime.config import add_args, opt
from kvmesh.runtime.errors import InvalidRequest, KvmeshError, RequestTooLarge, ResourceExhausted
from kvmesh.runtime.kv_events import KvEventKind, KvEventLog
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.mocker.config import MockerConfig
from kvmesh.workers.mocker.scheduler import MockerScheduler, StepResult

__all__ = [
    "ModeResult",
    "ReplayConfig",
    "ReplayError",
    "Stats",
    "Trace",
    "TraceRequest",
    "WorkerResult",
    "add_replay_args",
    "load_trace",
    "prefix_hit_bound",
    "simulate",
    "token_block",
]

VOCAB_SIZE = 256
"""Prompt token ids are in [0, 256) (see token_block); generated tokens too."""


class ReplayError(KvmeshError):
    """A replay cannot run (missing or malformed trace, bad settings)."""


@dataclass
class ReplayConfig:
    """Settings of `kvmesh replay` (the mocker's own knobs are a MockerConfig, `mocker`)."""

    trace: str = opt("", "Mooncake-format JSONL trace to replay (required)")
    workers: int = opt(4, "number of simulated mocker workers")
    router: list[RouterMode] = opt(
        [RouterMode.KV],
        "routing policy; repeat (or list several) to run each and compare: "
        "kv, round-robin, random, least-loaded",
    )
    speedup: float = opt(
        1.0, "arrival timestamps are divided by this (Dynamo's arrival_speedup_ratio)"
    )
    limit: int = opt(0, "replay only the first N requests of the trace (0: all)")
    trace_block_size: int = opt(512, "tokens per trace hash id (Mooncake traces: 512)")
    router_overlap_weight: float = opt(
        1.0, "kv: weight of blocks still to prefill against blocks decoding in the cost"
    )
    router_temperature: float = opt(
        0.0, "kv: 0 picks the lowest cost (ties at random); > 0 samples softmax(-cost/T)"
    )
    load_interval_ms: float = opt(
        100.0,
        "kv: simulated interval of the workers' load metrics fed to the router (as a live "
        "router's load stream); 0: the router only counts its own bookings",
    )
    seed: int = opt(0, "seed of the router's tie-breaking/sampling and of the random policy")
    json: bool = opt(False, "print one JSON object per router mode instead of tables")
    plot: str = opt("", "write a PNG of the TTFT CDF per router mode here (needs matplotlib)")
    progress: bool = opt(True, "progress bar on stderr (only on a terminal, never with --json)")
    prefill_workers: int = opt(
        0,
        "also replay disaggregated pools (kv routing): this many of --workers prefill, the "
        "others decode, so aggregated and disaggregated use the same total (kvmesh.sim.disagg)",
    )
    disagg_local_prefill_tokens: int = opt(
        512,
        "disaggregated replay: prefill on the decode worker when at most this many prompt tokens "
        "are not cached there",
    )
    mocker: MockerConfig = field(
        default_factory=MockerConfig,
        metadata={"help": "the simulated engine (mocker flags)", "cli": False},
    )

    def __post_init__(self) -> None:
        modes: list[RouterMode] = []
        for m in self.router:
            mode = RouterMode(m)
            if mode not in modes:
                modes.append(mode)
        if not modes:
            raise ReplayError("give at least one --router mode")
        self.router = modes
        if self.workers < 1:
            raise ReplayError("--workers must be >= 1")
        if not (self.speedup > 0 and math.isfinite(self.speedup)):
            raise ReplayError("--speedup must be a positive number")
        if self.limit < 0:
            raise ReplayError("--limit must be >= 0")
        if self.trace_block_size < 1:
            raise ReplayError("--trace-block-size must be >= 1")
        if not self.load_interval_ms >= 0:
            raise ReplayError("--load-interval-ms must be >= 0")
        if self.prefill_workers and not 0 < self.prefill_workers < self.workers:
            raise ReplayError("--prefill-workers must be between 1 and --workers - 1")
        if self.disagg_local_prefill_tokens < 0:
            raise ReplayError("--disagg-local-prefill-tokens must be >= 0")
        try:
            KvRouterConfig(
                overlap_weight=self.router_overlap_weight, temperature=self.router_temperature
            )
        except ValueError as exc:
            raise ReplayError(str(exc)) from None


def add_replay_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvmesh replay`: ReplayConfig's, then the mocker's (MockerConfig)."""
    add_args(parser, ReplayConfig, skip={"router"})
    parser.add_argument(
        "--router",
        dest="router",
        action="extend",
        nargs="+",
        choices=[m.value for m in RouterMode],
        default=argparse.SUPPRESS,
        help="routing policy; repeat (--router kv --router round-robin) or list several to run "
        "each and compare (default: kv)",
    )
    # The replay owns arrival speed and seeding; the engine's wall-clock speedup means nothing.
    add_args(parser, MockerConfig, skip={"speedup_ratio", "seed"})


# -- the trace -------------------------------------------------------------------------------


@dataclass(slots=True)
class TraceRequest:
    """One request of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(slots=True)
class Trace:
    """The requests to replay, in arrival order (stable for equal timestamps)."""

    path: str
    requests: list[TraceRequest]


def load_trace(path: str, limit: int = 0) -> Trace:
    """Read a Mooncake JSONL trace (the first `limit` lines when > 0); ReplayError if malformed."""
    if not path:
        raise ReplayError("no trace given: pass --trace FILE (a Mooncake-format JSONL file)")
    requests: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit and len(requests) >= limit:
                    break
                if not line.strip():
                    continue
                requests.append(_parse_line(line, path, lineno))
    except OSError as exc:
        raise ReplayError(f"cannot read trace {path!r}: {exc.strerror or exc}") from None
    if not requests:
        raise ReplayError(f"trace {path!r} holds no requests")
    requests.sort(key=lambda r: r.timestamp_ms)  # stable: equal timestamps keep file order
    return Trace(path, requests)


def _parse_line(line: str, path: str, lineno: int) -> TraceRequest:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ReplayError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ReplayError(f"{where}: expected a JSON object")
    try:
        ts = float(row["timestamp"])
        isl = int(row["input_length"])
        osl = int(row["output_length"])
        ids = row.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
            raise TypeError("hash_ids must be a list of integers")
    except KeyError as exc:
        raise ReplayError(f"{where}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ReplayError(f"{where}: {exc}") from None
    if not math.isfinite(ts) or ts < 0:
        raise ReplayError(f"{where}: timestamp must be a finite number >= 0")
    if isl < 1 or osl < 0:
        raise ReplayError(f"{where}: input_length must be >= 1 and output_length >= 0")
    return TraceRequest(ts, isl, osl, ids)


def prefix_hit_bound(trace: Trace, trace_block_size: int = 512) -> tuple[float, float]:
    """The infinite-cache prefix hit rate: (blocks, tokens).

    A request hits its leading hash ids that appeared in any earlier request, up to the first
    one that did not (as `trace_stats.json` computes it). Block-weighted: hits / hash ids;
    token-weighted: hit tokens (the last block may be partial) / input tokens.
    """
    seen: set[int] = set()
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    for r in trace.requests:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        hit_blocks += k
        total_blocks += len(r.hash_ids)
        hit_tokens += min(k * trace_block_size, r.input_length)
        total_tokens += r.input_length
        seen.update(r.hash_ids)
    return (
        hit_blocks / total_blocks if total_blocks else 0.0,
        hit_tokens / total_tokens if total_tokens else 0.0,
    )


def token_block(hash_id: int, size: int) -> bytes:
    """The fixed pseudo-random token run of a trace hash id: `size` token ids in [0, 256), one
    byte each (SHAKE-128 of the id; a pure function of (hash_id, size)).

    Ids below 256 are CPython's preallocated small ints, so expanding a 100k-token prompt
    allocates no int objects and the mockers' cached blocks hold pointers only; the router and
    the engine hash token ids, whose range does not matter to them.
    """
    return hashlib.shake_128(b"kvmesh-replay-block\0%d" % hash_id).digest(size)


class _PromptBuilder:
    """Expands hash ids into prompts, caching each id's token run (one byte per token)."""

    __slots__ = ("_blocks", "block_size")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[int, bytes] = {}

    def prompt(self, request: TraceRequest, index: int) -> list[int]:
        """The prompt of `request` (the `index`-th of the trace): its blocks joined, cut to
        input_length; missing trailing blocks (a short hash_ids list) are unique to the
        request."""
        bs = self.block_size
        n = request.input_length
        need = -(-n // bs)
        blocks = self._blocks
        parts: list[bytes] = []
        for h in request.hash_ids[:need]:
            b = blocks.get(h)
            if b is None:
                b = blocks[h] = token_block(h, bs)
            parts.append(b)
        for j in range(len(parts), need):
            parts.append(hashlib.shake_128(b"kvmesh-replay-pad\0%d\0%d" % (index, j)).digest(bs))
        return list(b"".join(parts)[:n])


# -- routing policies -------------------------------------------------------------------------


class _Policy(Protocol):
    def route(self, index: int, prompt: list[int], osl: int, now: float) -> int: ...
    def first_token(self, index: int) -> None: ...
    def finished(self, index: int) -> None: ...


class _KvPolicy:
    """RouterMode.KV: the real KvScheduler (and its KvIndexer) over the simulated workers."""

    def __init__(self, sched: KvScheduler, worker_ids: list[str]) -> None:
        self.sched = sched
        self.index_of = {w: i for i, w in enumerate(worker_ids)}
        self.worker_ids = worker_ids
        self.overlap_blocks = 0
        self.prompt_blocks = 0

    def route(self, index: int, prompt: list[int], osl: int, now: float) -> int:
        sched = self.sched
        sel = sched.select(prompt, now)
        sched.book(_rid(index), sel, now, expected_output_tokens=osl)
        self.overlap_blocks += sel.overlap_blocks
        self.prompt_blocks += sel.prompt_blocks
        return self.index_of[sel.worker_id]

    def first_token(self, index: int) -> None:
        self.sched.first_token(_rid(index))

    def finished(self, index: int) -> None:
        self.sched.free(_rid(index))

    def kv_events(self, worker: int, kinds: list[KvEventKind]) -> None:
        apply = self.sched.indexer.apply_event
        wid = self.worker_ids[worker]
        for kind in kinds:
            apply(wid, kind)

    def load(self, worker: int, sched: MockerScheduler, now: float) -> None:
        info = sched.load()
        self.sched.update_load(
            self.worker_ids[worker],
            LoadSample(
                kv_active_blocks=info.kv_active_blocks,
                kv_total_blocks=info.kv_total_blocks,
                num_running=info.num_running,
                num_waiting=info.num_waiting,
                pending_prefill_tokens=info.pending_prefill_tokens,
            ),
            now,
        )


class _SimplePolicy:
    """Round-robin, random or least-loaded with kvmesh.router.routing.SimpleRouter's semantics:
    one cursor; random draws from a seeded Random; least-loaded picks the fewest requests in
    flight from this router, ties broken round-robin."""

    def __init__(self, mode: RouterMode, workers: int, seed: int) -> None:
        self.mode = mode
        self.n = workers
        self.cursor = 0
        self.inflight = [0] * workers
        self.worker_of: dict[int, int] = {}
        self.rng = random.Random(seed)

    def route(self, index: int, prompt: list[int], osl: int, now: float) -> int:
        n = self.n
        if self.mode is RouterMode.RANDOM:
            w = self.rng.randrange(n)
        else:
            start = self.cursor
            self.cursor += 1
            if self.mode is RouterMode.ROUND_ROBIN:
                w = start % n
            else:
                inflight = self.inflight
                w = min(((start + i) % n for i in range(n)), key=inflight.__getitem__)
        self.inflight[w] += 1
        self.worker_of[index] = w
        return w

    def first_token(self, index: int) -> None:
        return None

    def finished(self, index: int) -> None:
        w = self.worker_of.pop(index, None)
        if w is not None:
            self.inflight[w] -= 1


def _rid(index: int) -> str:
    return f"r{index}"


# -- the simulation ---------------------------------------------------------------------------


class _EventBuffer(KvEventLog):
    """Collects a worker's KV events during a step; the router applies them at the step's end."""

    def __init__(self) -> None:
        super().__init__(backlog=0)
        self.pending: list[KvEventKind] = []

    def publish(self, kind: KvEventKind) -> int:
        self.pending.append(kind)
        return 0


class _Worker:
    __slots__ = (
        "busy_s",
        "cached_tokens",
        "events",
        "index",
        "last_load",
        "prompt_tokens",
        "requests",
        "result",
        "sched",
    )

    def __init__(self, index: int, sched: MockerScheduler, events: _EventBuffer | None) -> None:
        self.index = index
        self.sched = sched
        self.events = events
        self.result: StepResult | None = None
        """The step in flight (None: idle)."""
        self.busy_s = 0.0
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.last_load = -math.inf


@dataclass(slots=True)
class Stats:
    """Summary of a latency sample, in milliseconds (all 0 when empty)."""

    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Stats:
        """Stats of a sample given in seconds (percentiles interpolated linearly)."""
        if not seconds:
            return cls()
        xs = sorted(seconds)
        return cls(
            mean=1e3 * math.fsum(xs) / len(xs),
            p50=1e3 * _quantile(xs, 0.5),
            p90=1e3 * _quantile(xs, 0.9),
            p99=1e3 * _quantile(xs, 0.99),
            max=1e3 * xs[-1],
        )


def _quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of sorted `xs` (numpy's default)."""
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class WorkerResult:
    """One simulated worker's share of the work."""

    worker: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    busy_fraction: float
    """Simulated time spent in steps / the simulated span."""
    preemptions: int
    steps: int


@dataclass(slots=True)
class ModeResult:
    """The outcome of replaying a trace with one router mode."""

    mode: str
    trace: str
    requests: int
    """Requests that finished."""
    requests_total: int
    rejected: int
    """Requests a worker refused at admission (prompt larger than its pool or context)."""
    unfinished: int
    workers: int
    speedup: float
    block_size: int
    num_gpu_blocks: int
    duration_s: float
    """Simulated span: first arrival to last completion."""
    throughput_rps: float
    output_tokens_per_s: float
    ttft_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    prefix_hit_rate: float
    """Prompt tokens served from the workers' caches / prompt tokens (finished requests)."""
    prefix_hit_rate_bound: float
    """Infinite-cache bound: leading hash ids seen before / hash ids (trace_stats.json)."""
    prefix_hit_rate_bound_tokens: float
    """The same bound weighted by tokens."""
    predicted_overlap_rate: float
    """kv: leading prompt blocks the router found on its choice / prompt blocks (0 otherwise)."""
    preemptions: int
    steps: int
    per_worker: list[WorkerResult]
    imbalance: dict[str, float]
    """max / mean over workers of requests, prompt tokens and busy fraction."""
    wall_s: float
    """Wall-clock seconds the simulation took (the only non-deterministic field)."""
    ttft_s: list[float] = field(default_factory=list, repr=False)
    """Every finished request's TTFT in seconds (for plots; not in to_json)."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object `kvmesh replay --json` prints (floats rounded)."""
        out = asdict(self)
        del out["ttft_s"]
        rounded: dict[str, Any] = _round(out)
        return rounded


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6) if abs(value) < 1 else round(value, 3)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


_STEP = 0
_ARRIVAL = 1


def simulate(
    trace: Trace,
    config: ReplayConfig,
    mode: RouterMode,
    *,
    progress: Callable[[int, int, float], None] | None = None,
) -> ModeResult:
    """Replay `trace` with router `mode` and return the metrics (see the module doc).

    `progress(done, total, sim_time_s)` is called now and then (and once at the end).
    The cyclic garbage collector is paused meanwhile: the simulation allocates millions of
    acyclic objects (freed by reference counting) and full collections over the mockers'
    caches would cost a quarter of the run.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(trace, config, mode, progress)
    finally:
        if gc_was_enabled:
            gc.enable()


def _simulate(
    trace: Trace,
    config: ReplayConfig,
    mode: RouterMode,
    progress: Callable[[int, int, float], None] | None,
) -> ModeResult:
    t_wall = time.perf_counter()
    mcfg = config.mocker
    reqs = trace.requests
    n_req = len(reqs)
    speed = config.speedup
    builder = _PromptBuilder(config.trace_block_size)
    max_model_len = mcfg.max_model_len or (
        max(r.input_length + max(1, r.output_length) for r in reqs) + 1
    )
    kv = mode is RouterMode.KV
    worker_ids = [f"w{i}" for i in range(config.workers)]
    workers: list[_Worker] = []
    for i in range(config.workers):
        events = _EventBuffer() if kv and mcfg.enable_prefix_caching else None
        sched = MockerScheduler(
            mcfg, vocab_size=VOCAB_SIZE, max_model_len=max_model_len, events=events
        )
        workers.append(_Worker(i, sched, events))

    kv_policy: _KvPolicy | None = None
    policy: _Policy
    if kv:
        ksched = KvScheduler(
            KvRouterConfig(
                overlap_weight=config.router_overlap_weight,
                temperature=config.router_temperature,
                seed=config.seed,
            ),
            router_id="replay",
        )
        for wid in worker_ids:
            ksched.add_worker(
                wid,
                block_size=mcfg.block_size,
                kv_total_blocks=mcfg.num_gpu_blocks,
                kv_events=mcfg.enable_prefix_caching,
            )
        policy = kv_policy = _KvPolicy(ksched, worker_ids)
    else:
        policy = _SimplePolicy(mode, config.workers, config.seed)
    load_interval = config.load_interval_ms / 1e3 if kv else 0.0

    arrival = [r.timestamp_ms / 1e3 / speed for r in reqs]
    first_at = [math.nan] * n_req
    last_at = [0.0] * n_req
    ntok = [0] * n_req
    finished_at = [math.nan] * n_req
    cached = [0] * n_req
    itl = array("d")
    rejected = 0
    done = 0
    output_tokens = 0

    heap: list[tuple[float, int, int, int]] = [(t, _ARRIVAL, i, i) for i, t in enumerate(arrival)]
    heapq.heapify(heap)
    seq = n_req
    push, pop = heapq.heappush, heapq.heappop

    def start_step(w: _Worker, now: float) -> None:
        nonlocal seq
        result = w.sched.step(now)
        if result.num_scheduled == 0 and result.num_preempted == 0:
            return  # nothing can run until a request arrives
        w.result = result
        w.busy_s += result.duration_s
        push(heap, (now + result.duration_s, _STEP, seq, w.index))
        seq += 1

    next_report = 0.0
    now = 0.0
    while heap:
        now, kind, _, idx = pop(heap)
        if kind == _STEP:
            w = workers[idx]
            result = w.result
            assert result is not None
            w.result = None
            if w.events is not None and w.events.pending:
                assert kv_policy is not None
                kv_policy.kv_events(idx, w.events.pending)
                w.events.pending = []
            for out in result.outputs:
                i = int(out.request_id[1:])
                if ntok[i]:
                    itl.append(now - last_at[i])
                else:
                    first_at[i] = now
                    policy.first_token(i)
                ntok[i] += 1
                last_at[i] = now
                if out.finish_reason is not None:
                    finished_at[i] = now
                    usage = out.usage
                    c = usage.cached_tokens if usage is not None else 0
                    cached[i] = c
                    w.cached_tokens += c
                    output_tokens += ntok[i]
                    policy.finished(i)
                    done += 1
            if w.sched.has_work:
                start_step(w, now)
            if load_interval and (w.result is None or now - w.last_load >= load_interval):
                assert kv_policy is not None
                kv_policy.load(idx, w.sched, now)
                w.last_load = now
        else:
            r = reqs[idx]
            prompt = builder.prompt(r, idx)
            osl = max(1, r.output_length)
            wi = policy.route(idx, prompt, osl, now)
            w = workers[wi]
            request = EngineRequest(
                _rid(idx),
                prompt,
                SamplingParams(temperature=0.0),
                StopParams(max_tokens=osl, ignore_eos=True),
            )
            try:
                w.sched.add(request, now)
            except (InvalidRequest, RequestTooLarge, ResourceExhausted):
                rejected += 1
                policy.finished(idx)
                continue
            w.requests += 1
            w.prompt_tokens += len(prompt)
            if w.result is None:
                start_step(w, now)
        if progress is not None:
            wall = time.perf_counter()
            if wall >= next_report:
                next_report = wall + 0.2
                progress(done + rejected, n_req, now)
    if progress is not None:
        progress(done + rejected, n_req, now)

    return _result(
        mode.value,
        trace,
        config,
        mcfg.block_size,
        speed,
        workers,
        worker_ids,
        _Timeline(arrival, first_at, finished_at, cached, itl, output_tokens, rejected),
        (
            kv_policy.overlap_blocks / kv_policy.prompt_blocks
            if kv_policy is not None and kv_policy.prompt_blocks
            else 0.0
        ),
        t_wall,
    )


@dataclass(slots=True)
class _Timeline:
    """What a simulation recorded per request (NaN: never happened)."""

    arrival: list[float]
    first_at: list[float]
    finished_at: list[float]
    cached: list[int]
    itl: Sequence[float]
    output_tokens: int
    rejected: int


def _result(
    mode: str,
    trace: Trace,
    config: ReplayConfig,
    block_size: int,
    speed: float,
    workers: Sequence[_Worker],
    worker_ids: Sequence[str],
    t: _Timeline,
    predicted_overlap_rate: float,
    t_wall: float,
) -> ModeResult:
    """Summarize one simulated run (aggregated or disaggregated) into a ModeResult."""
    reqs = trace.requests
    n_req = len(t.arrival)
    fin = [i for i in range(n_req) if not math.isnan(t.finished_at[i])]
    span = (max(t.finished_at[i] for i in fin) - min(t.arrival)) if fin else 0.0
    prompt_tokens = sum(reqs[i].input_length for i in fin)
    per_worker = [
        WorkerResult(
            worker=worker_ids[w.index],
            requests=w.requests,
            prompt_tokens=w.prompt_tokens,
            cached_tokens=w.cached_tokens,
            busy_fraction=w.busy_s / span if span > 0 else 0.0,
            preemptions=w.sched.num_preemptions,
            steps=w.sched.num_steps,
        )
        for w in workers
    ]
    ttft = [t.first_at[i] - t.arrival[i] for i in fin]
    return ModeResult(
        mode=mode,
        trace=trace.path,
        requests=len(fin),
        requests_total=n_req,
        rejected=t.rejected,
        unfinished=n_req - len(fin) - t.rejected,
        workers=config.workers,
        speedup=speed,
        block_size=block_size,
        num_gpu_blocks=config.mocker.num_gpu_blocks,
        duration_s=span,
        throughput_rps=len(fin) / span if span > 0 else 0.0,
        output_tokens_per_s=t.output_tokens / span if span > 0 else 0.0,
        ttft_ms=Stats.of(ttft),
        itl_ms=Stats.of(t.itl),
        e2e_ms=Stats.of([t.finished_at[i] - t.arrival[i] for i in fin]),
        prefix_hit_rate=sum(t.cached[i] for i in fin) / prompt_tokens if prompt_tokens else 0.0,
        prefix_hit_rate_bound=0.0,
        prefix_hit_rate_bound_tokens=0.0,
        predicted_overlap_rate=predicted_overlap_rate,
        preemptions=sum(w.sched.num_preemptions for w in workers),
        steps=sum(w.sched.num_steps for w in workers),
        per_worker=per_worker,
        imbalance=_imbalance(per_worker),
        wall_s=time.perf_counter() - t_wall,
        ttft_s=ttft,
    )


def _imbalance(per_worker: list[WorkerResult]) -> dict[str, float]:
    def ratio(values: list[float]) -> float:
        mean = sum(values) / len(values)
        return max(values) / mean if mean > 0 else 0.0

    return {
        "requests_max_over_mean": ratio([float(w.requests) for w in per_worker]),
        "prompt_tokens_max_over_mean": ratio([float(w.prompt_tokens) for w in per_worker]),
        "busy_fraction_max_over_mean": ratio([w.busy_fraction for w in per_worker]),
    }
