"""The virtual-time cluster every replay runs on.

One `MockerScheduler` per worker (the live mocker's synchronous core: continuous batching,
paged KV pool, prefix caching, chunked prefill, preemption, the polynomial or table timing
model), a routing policy over them (kvmesh.sim.policies: the live KvScheduler or the live simple
policies), and one heap of (time, kind, sequence, argument) events. No asyncio, no wall clock, no
sockets: the loop runs as fast as the CPU allows, and the same inputs give the same output
(everything but `wall_s`).

Events, in virtual seconds (at equal times: step ends, then transfer ends, then arrivals, each
in the order they were scheduled):
  * ARRIVAL at the request's (sped-up) trace timestamp: the replay (`Replay.arrival`) routes
    the request and `admit`s it to a worker; an idle worker starts a step at once;
  * STEP: a worker's step, computed by `MockerScheduler.step(start)`, lasts `duration_s` (the
    timing model's simulated time, no speedup). At its end the policy applies the KV events
    the step published (blocks stored, evicted), each sampled token goes to the replay
    (`Replay.output`: first token -> TTFT, gaps -> ITL, finish -> E2E, booking freed), the
    worker steps again if it has work, and its load metrics go to a KV-aware policy every
    `load_interval_ms` (and whenever it goes idle);
  * TRANSFER: a KV transfer the replay `schedule`d ended (`Replay.transfer`);
  * TIER: a move between a worker's KV tiers ended (kvmesh.workers.batching.tiers: the mocker's
    offloads, moves to disk and onboardings; each of the four lanes runs its moves one after
    another, each lasting `MockerConfig.tier_move_s`); the worker's scheduler completes it,
    and a worker that was waiting for an onboarding steps again. Moves start when the step
    that decided them ends (or at once when nothing was scheduled), as in the live mocker.
  * TIMER: a call the replay asked for (`call_later`), e.g. a planner's tick or a new worker
    becoming ready.

The replay decides what happens to requests (kvmesh.sim.replay: aggregated; kvmesh.sim.disagg:
prefill and decode pools; kvmesh.sim.planned: a pool a planner resizes); the cluster owns virtual
time, the workers and the policy. Workers can be added while it runs (`add_worker`); they join
routing when the replay tells the policy.
"""

from __future__ import annotations

import enum
import gc
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from kvmesh.runtime.errors import InvalidRequest, RequestTooLarge, ResourceExhausted
from kvmesh.runtime.kv_events import KvEventKind, KvEventLog
from kvmesh.runtime.types import EngineRequest, KvTierStats, SamplingParams, StopParams
from kvmesh.sim.config import ReplayConfig
from kvmesh.sim.policies import Policy
from kvmesh.sim.results import ModeResult, ReplicaSample, Timeline, summarize
from kvmesh.sim.trace import VOCAB_SIZE, PromptBuilder, Trace
from kvmesh.workers.batching.scheduler import SeqOutput
from kvmesh.workers.batching.tiers import Lane, TierJob
from kvmesh.workers.mocker.scheduler import MockerScheduler, StepResult

__all__ = [
    "Cluster",
    "EventBuffer",
    "EventKind",
    "Progress",
    "Replay",
    "SimWorker",
    "prefill_id",
    "request_id",
]

_LANES = {lane: i for i, lane in enumerate(Lane)}
_LANE_OF = list(Lane)

Progress = Callable[[int, int, float], None]
"""`progress(settled, total, sim_time_s)`: requests finished or rejected so far."""


def request_id(index: int) -> str:
    """The id of the `index`-th request of the trace."""
    return f"r{index}"


def prefill_id(index: int) -> str:
    """The routing id of the `index`-th request's remote prefill (as MeshBackend books it)."""
    return f"r{index}/prefill"


class EventKind(enum.IntEnum):
    """Kinds of events; at equal times the lower value comes first."""

    STEP = 0
    TRANSFER = 1
    ARRIVAL = 2
    TIER = 3
    TIMER = 4


class EventBuffer(KvEventLog):
    """Collects a worker's KV events during a step; the policy applies them at the step's end."""

    def __init__(self) -> None:
        super().__init__(backlog=0)
        self.pending: list[KvEventKind] = []

    def publish(self, kind: KvEventKind) -> int:
        self.pending.append(kind)
        return 0


class SimWorker:
    """One simulated worker: its scheduler, the step in flight, and what it counted."""

    __slots__ = (
        "busy_s",
        "cached_tokens",
        "events",
        "index",
        "lane_free",
        "lanes",
        "last_load",
        "prompt_tokens",
        "requests",
        "result",
        "sched",
        "started_at",
        "stopped_at",
        "worker_id",
    )

    def __init__(
        self, index: int, worker_id: str, sched: MockerScheduler, events: EventBuffer | None
    ) -> None:
        self.index = index
        self.worker_id = worker_id
        self.sched = sched
        self.events = events
        self.result: StepResult | None = None
        """The step in flight (None: idle)."""
        self.busy_s = 0.0
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.last_load = -math.inf
        self.started_at = -math.inf
        """When the worker was asked for (-inf: there from the start)."""
        self.stopped_at = math.inf
        """When it exited (inf: it runs to the end)."""
        self.lanes: dict[Lane, deque[TierJob]] = {lane: deque() for lane in Lane}
        """Tier moves under way per lane, in order."""
        self.lane_free = dict.fromkeys(Lane, 0.0)
        """When each lane finishes the moves it has."""

    @property
    def preemptions(self) -> int:
        return self.sched.num_preemptions

    @property
    def steps(self) -> int:
        return self.sched.num_steps

    @property
    def kv_tiers(self) -> tuple[KvTierStats, ...]:
        return self.sched.load().kv_tiers


class Replay(Protocol):
    """What a replay does with the cluster's events (`now`: the cluster's virtual time)."""

    def arrival(self, index: int, now: float) -> None:
        """The `index`-th request of the trace arrived: route and admit it."""
        ...

    def output(self, worker: SimWorker, out: SeqOutput, now: float) -> None:
        """`worker` produced `out` in the step that just ended."""
        ...

    def transfer(self, index: int, now: float) -> None:
        """The KV transfer scheduled for the `index`-th request ended."""
        ...


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: a replay allocates millions of acyclic objects
    (freed by reference counting) and full collections over the mockers' caches would cost a
    quarter of the run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Cluster:
    """Simulated workers `worker_ids` under `policy`, the trace's arrivals, virtual time."""

    def __init__(
        self, trace: Trace, config: ReplayConfig, worker_ids: list[str], policy: Policy
    ) -> None:
        self.t_wall = time.perf_counter()
        self.trace = trace
        self.config = config
        self.policy = policy
        mcfg = config.mocker
        self.block_size = mcfg.block_size
        max_model_len = mcfg.max_model_len or (
            max(r.input_length + r.max_tokens for r in trace.requests) + 1
        )
        self.max_model_len = max_model_len
        self.workers: list[SimWorker] = []
        for wid in worker_ids:
            self.add_worker(wid)
        self.load_interval_s = config.load_interval_ms / 1e3 if policy.kv_aware else 0.0
        self.builder = PromptBuilder(config.trace_block_size)
        arrival = [r.timestamp_ms / 1e3 / config.speedup for r in trace.requests]
        self.timeline = Timeline(arrival)
        self.now = 0.0
        self._heap = [(t, EventKind.ARRIVAL, i, i) for i, t in enumerate(arrival)]
        heapq.heapify(self._heap)
        self._seq = len(arrival)
        self._timers: dict[int, Callable[[], None]] = {}

    # -- what replays call -----------------------------------------------------------------

    def add_worker(self, worker_id: str) -> SimWorker:
        """A new simulated worker (the next index), idle, not yet in routing."""
        kv_events = self.policy.kv_aware and self.config.mocker.enable_prefix_caching
        events = EventBuffer() if kv_events else None
        sched = MockerScheduler(
            self.config.mocker,
            vocab_size=VOCAB_SIZE,
            max_model_len=self.max_model_len,
            events=events,
            tiers=self.config.tiers,
        )
        worker = SimWorker(len(self.workers), worker_id, sched, events)
        self.workers.append(worker)
        return worker

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Call `fn()` `delay_s` virtual seconds from now (after the steps, transfers and
        arrivals of that instant)."""
        self._timers[self._seq] = fn
        self.schedule(delay_s, EventKind.TIMER, self._seq)

    def schedule(self, delay_s: float, kind: EventKind, arg: int) -> None:
        """An event of `kind` with argument `arg`, `delay_s` virtual seconds from now."""
        heapq.heappush(self._heap, (self.now + delay_s, kind, self._seq, arg))
        self._seq += 1

    def request(self, index: int) -> EngineRequest:
        """The `index`-th request of the trace as the engine gets it (greedy, exactly its output
        length, EOS ignored)."""
        r = self.trace.requests[index]
        return EngineRequest(
            request_id(index),
            self.builder.prompt(r, index),
            SamplingParams(temperature=0.0),
            StopParams(max_tokens=r.max_tokens, ignore_eos=True),
        )

    def admit(
        self,
        worker: SimWorker,
        index: int,
        request: EngineRequest,
        *,
        pin: bool = False,
        first_token: int | None = None,
        blocks: list[int] | None = None,
    ) -> bool:
        """Queue the `index`-th request on `worker` (which starts a step if idle); False if the
        worker refuses it (counted as rejected, its bookings freed). `pin`, `first_token`,
        `blocks`: disaggregated serving (MockerScheduler.add); the request's cached tokens so
        far go with it."""
        try:
            worker.sched.add(
                request,
                self.now,
                pin=pin,
                first_token=first_token,
                blocks=blocks,
                cached_tokens=self.timeline.cached[index],
            )
        except (InvalidRequest, RequestTooLarge, ResourceExhausted):
            self.timeline.rejected += 1
            self.release(index)
            return False
        if worker.result is None:
            self._start_step(worker)
        return True

    def release(self, index: int) -> None:
        """Free every booking of the `index`-th request: its own and its remote prefill's."""
        self.policy.finished(request_id(index), self.timeline.ntok[index])
        self.policy.finished(prefill_id(index))

    def token(self, out: SeqOutput) -> int:
        """Record the token `out` carries (the policy hears of first tokens); returns the index
        of its request."""
        index = int(out.request_id[1:])
        if self.timeline.token(index, self.now):
            self.policy.first_token(request_id(index))
        return index

    def credit_cache(self, index: int, worker: SimWorker, out: SeqOutput) -> None:
        """The prompt tokens `worker` served from its cache for the `index`-th request (the
        usage `out` reports) count for the request and the worker."""
        cached = out.usage.cached_tokens if out.usage is not None else 0
        self.timeline.cached[index] = cached
        worker.cached_tokens += cached

    def finish(self, index: int) -> None:
        """The `index`-th request finished now: record it and free its bookings."""
        self.timeline.finish(index, self.now)
        self.release(index)

    def flush_events(self, worker: SimWorker) -> None:
        """Apply the KV events `worker` published since the last flush to the policy."""
        events = worker.events
        if events is not None and events.pending:
            self.policy.kv_events(worker.index, events.pending)
            events.pending = []

    # -- the loop ---------------------------------------------------------------------------

    def run(self, replay: Replay, progress: Progress | None = None) -> None:
        """Run every event through `replay` until none is left (see the module doc);
        `progress` is called now and then, and once at the end."""
        heap = self._heap
        pop = heapq.heappop
        total = len(self.timeline.arrival)
        next_report = 0.0
        with _gc_paused():
            while heap:
                self.now, kind, _, arg = pop(heap)
                if kind == EventKind.STEP:
                    self._step_done(self.workers[arg], replay)
                elif kind == EventKind.TRANSFER:
                    replay.transfer(arg, self.now)
                elif kind == EventKind.TIER:
                    worker, lane = divmod(arg, len(_LANES))
                    self._tier_done(self.workers[worker], _LANE_OF[lane])
                elif kind == EventKind.ARRIVAL:
                    replay.arrival(arg, self.now)
                else:
                    self._timers.pop(arg)()
                if progress is not None:
                    wall = time.perf_counter()
                    if wall >= next_report:
                        next_report = wall + 0.2
                        progress(self.timeline.settled, total, self.now)
        if progress is not None:
            progress(self.timeline.settled, total, self.now)

    def _start_step(self, worker: SimWorker) -> None:
        result = worker.sched.step(self.now)
        if result.num_scheduled == 0 and result.num_preempted == 0:
            self._start_moves(worker)  # the step may have started onboarding
            return  # nothing can run until a request arrives or a move ends
        worker.result = result
        worker.busy_s += result.duration_s
        self.schedule(result.duration_s, EventKind.STEP, worker.index)

    def _step_done(self, worker: SimWorker, replay: Replay) -> None:
        result = worker.result
        assert result is not None
        worker.result = None
        self.flush_events(worker)
        now = self.now
        for out in result.outputs:
            replay.output(worker, out, now)
        self._start_moves(worker)
        if worker.sched.has_work:
            self._start_step(worker)
        interval = self.load_interval_s
        if interval and (worker.result is None or now - worker.last_load >= interval):
            self.policy.load(worker.index, worker.sched.load(), now)
            worker.last_load = now

    # -- KV tiers ---------------------------------------------------------------------------

    def _start_moves(self, worker: SimWorker) -> None:
        """Queue the tier moves `worker`'s scheduler decided on their lanes."""
        if worker.sched.tiers is None:
            return
        mcfg = self.config.mocker
        for job in worker.sched.take_tier_jobs():
            lane = job.lane
            move_s = mcfg.tier_move_s(lane.tier, job.nbytes)
            end = max(self.now, worker.lane_free[lane]) + move_s
            worker.lane_free[lane] = end
            worker.lanes[lane].append(job)
            self.schedule(end - self.now, EventKind.TIER, worker.index * len(_LANES) + _LANES[lane])

    def _tier_done(self, worker: SimWorker, lane: Lane) -> None:
        job = worker.lanes[lane].popleft()
        worker.sched.complete_tier_job(job, len(job))
        self.flush_events(worker)
        self._start_moves(worker)
        if worker.result is None and worker.sched.has_work:
            self._start_step(worker)

    def summarize(
        self, mode: str, predicted_overlap_rate: float, replicas: Sequence[ReplicaSample] = ()
    ) -> ModeResult:
        """The run's metrics (kvmesh.sim.results), labelled `mode`; `replicas`: how a planned
        pool's size changed over time."""
        return summarize(
            mode,
            self.trace,
            self.config,
            self.workers,
            self.timeline,
            predicted_overlap_rate,
            self.t_wall,
            replicas,
        )
