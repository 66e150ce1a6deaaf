"""KV-cache-aware routing: the synchronous scheduler core (`KvScheduler`) and its policy.

`KvScheduler` (sync, no asyncio, no wall clock: every call that needs time takes `now`, seconds
on any monotonic clock, wall or virtual) holds:
  * the exact prefix index fed by KV events (`scheduler.indexer`, a KvIndexer), and an
    approximate index fed by the scheduler's own decisions with a TTL, for workers whose engine
    publishes no KV events;
  * predicted load per worker: every booked request adds its blocks still to prefill (until its
    first token) and its decode blocks (until it is freed), corrected by the workers' load
    metrics when they arrive;
  * the cost function and the choice among workers.

Cost of worker w for a request of T prompt tokens (block size B, w caching its first O blocks):

    new(w)  = T/B - O                        blocks the request would add on w

(O is tier-weighted, KvIndexer.find_credits: a block w holds on its host or disk tier counts
`host_hit_weight` / `disk_hit_weight` of a device block, what onboarding it saves.)
    cost(w) = overlap_weight * (prefill(w) + new(w)) + (decode(w) + new(w))

prefill(w) is the worker's predicted blocks still to prefill and decode(w) the blocks its
running requests added (each booking counts the blocks it allocates: its prompt and expected
output minus the prefix the worker had cached), both from bookings plus the correction from the
worker's last fresh load metrics. The first term is the prefill work queued on the worker with
this request, the second the KV blocks it would hold (Dynamo's "potential prefill" and
"potential active blocks"). Every input is the same on every router replica (the KV index is
exact, bookings are shared as numbers), so replicas that see the same bookings decide alike.

The lowest cost wins; among equal costs the worker holding the fewest cached blocks wins (new
prefixes spread over the fleet rather than evicting one worker's), then a random one (seeded),
so an idle fleet is never simply sent to its first worker. The ttft policy (the default) decides
near-ties by state every replica shares instead (`_choose_agreed`: most cached prompt blocks
within one idle decode step of the best prediction; exact ties by rendezvous hashing of the
prompt), so replicas agree on the worker holding a prefix. With temperature > 0 the choice is
sampled from softmax(-normalized cost / T) instead (Dynamo's `router_temperature`). Workers
over a busy threshold (KV usage fraction, waiting requests, draining; from fresh load metrics)
are skipped; if all are, `Unavailable` (HTTP 503).

Driving it directly (what `kvmesh replay` does with mocker schedulers in virtual time):

    sched = KvScheduler(KvRouterConfig(overlap_weight=1.0), router_id="replay")
    sched.add_worker("w0", block_size=64, kv_total_blocks=16384)    # kv_events=True
    # every KV event the worker's engine publishes (KvEventLog.publish):
    sched.indexer.apply_event("w0", kind)        # or .apply(id, record/chunk, log_id)
    sel = sched.select(prompt_token_ids, now)    # -> Selection (worker_id, overlap, ...)
    sched.book(request_id, sel, now, expected_output_tokens=osl)
    sched.first_token(request_id)                # when the first token is out
    sched.free(request_id, output_tokens=n)      # when it finishes or is cancelled
    sched.update_load("w0", LoadSample(...), now)  # optional: the engine's load metrics

KvEventLog.publish is synchronous, so a simulator can hand each published kind to
`sched.indexer.apply_event` right away (e.g. from a KvEventLog subclass). Nothing here awaits,
sleeps or reads a clock.

The live, async side (`KvRouter`, over a WorkerPool and the workers' streams) is
kvmesh.router.kv_router.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import random
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from xxhash import xxh3_64_intdigest

from kvmesh.router.hashing import block_hashes
from kvmesh.router.indexer import ApproxIndex, InflightIndex
from kvmesh.router.kv_policy import (
    DEFAULT_DECODE_DELAY_WEIGHT,
    DEFAULT_ITL_PENALTY_CAP_MS,
    DEFAULT_ITL_PENALTY_RATIO,
    DEFAULT_ITL_WEIGHT,
    DEFAULT_POLICY,
    KvPolicyKind,
    TtftPredictor,
    cost_score,
    itl_penalized,
)
from kvmesh.router.kv_state import DISK_HIT_WEIGHT, HOST_HIT_WEIGHT, KvIndexer
from kvmesh.runtime.errors import Unavailable
from kvmesh.runtime.timing import load_timing

__all__ = [
    "KvRouterConfig",
    "KvScheduler",
    "LoadEvent",
    "LoadEventKind",
    "LoadSample",
    "Selection",
    "WorkerLoad",
]

log = logging.getLogger(__name__)

SLOT_HOLD_SMOOTHING = 0.05
"""Weight of each ended request in the running mean of how long a request holds its slot."""
ITL_RATIO_SMOOTHING = 0.1
"""Weight of each ended request in a worker's running ratio of realized to predicted ITL."""
FLEET_ITL_RATIO_SMOOTHING = 0.02
"""The same over every worker: the ratio a worker none of whose requests ended yet is given."""


@dataclass(slots=True)
class KvRouterConfig:
    """Knobs of KV-aware routing (the CLI exposes them through kvmesh.router.stack.MeshConfig)."""

    overlap_weight: float = 1.0
    """Weight of blocks to prefill against blocks decoding in the cost (>= 0)."""
    temperature: float = 0.0
    """0: lowest cost wins (ties at random); > 0: softmax sampling over -normalized cost."""
    busy_kv_fraction: float = 0.0
    """Skip workers whose KV usage (active / total blocks) reaches this; 0 disables."""
    busy_waiting_requests: int = 0
    """Skip workers with at least this many queued requests; 0 disables."""
    approx_ttl_s: float = 120.0
    """Approximate mode: how long a routed prompt counts as cached on its worker."""
    load_max_age_s: float = 2.0
    """Load metrics older than this are ignored (no correction, no busy verdict)."""
    load_settle_s: float = 0.25
    """Bookings younger than this when load metrics arrive are assumed not to show in them yet
    (the request may still be on its way to the worker): they are added to the measurement
    instead of being corrected away."""
    seed: int = 0
    """Seed of tie-breaking and sampling."""
    policy: KvPolicyKind = DEFAULT_POLICY
    """How workers are scored (kvmesh.router.kv_policy): predicted TTFT, or the linear cost."""
    itl_weight: float = DEFAULT_ITL_WEIGHT
    """ttft: weight of the ITL penalty: the request's expected output tokens times the ms of
    predicted ITL above `itl_penalty_ratio` times the best candidate's count this many times in
    its score (>= 0; 0: no penalty)."""
    itl_penalty_ratio: float = DEFAULT_ITL_PENALTY_RATIO
    """ttft: the ITL penalty counts only the predicted ITL above this multiple of the best
    candidate's (>= 1)."""
    itl_penalty_cap_ms: float = DEFAULT_ITL_PENALTY_CAP_MS
    """ttft: the ITL penalty never exceeds this many ms (>= 0)."""
    decode_delay_weight: float = DEFAULT_DECODE_DELAY_WEIGHT
    """ttft: weight of the delay the request's prefill adds to the steps of the requests running
    on the worker, times the fraction of its request slots taken (kvmesh.router.kv_policy;
    0: the request's own TTFT only; >= 0)."""
    chunk_tokens: int = 8192
    """ttft: the engines' prefill token budget per step (vLLM's max_num_batched_tokens)."""
    timing_profile: str = ""
    """ttft: the engines' step timing table (kvmesh.runtime.timing JSON); empty: the mocker's
    polynomial model."""
    host_hit_weight: float = HOST_HIT_WEIGHT
    """What a prompt block a worker holds on its host tier counts for in the cost, a device
    block counting 1 (1 - onboarding cost / recompute cost)."""
    disk_hit_weight: float = DISK_HIT_WEIGHT
    """The same for a block a worker holds only on its disk tier."""
    inflight_prefixes: bool = True
    """Count as cached on a worker the prompt prefix that requests booked there and still
    waiting or prefilling will have computed (kvmesh.router.indexer.InflightIndex): the next
    turn of a conversation, or the rest of a burst sharing a new prefix, then follows the first
    instead of prefilling the prefix again elsewhere. Own bookings only (peers share loads,
    not prompts)."""
    ttft_slo_ms: float = 0.0
    """ttft: the deployment's TTFT target (ms; 0: none): with `itl_slo_ms`, a worker over the
    ITL target gives way only to one predicted to start the request within this."""
    itl_slo_ms: float = 0.0
    """ttft: the deployment's ITL target (ms, a request's mean ITL; 0: none): a worker whose
    requests decode over it (predicted, corrected by what its ended requests realized) takes no
    request another worker serves within both targets and decodes over `itl_penalty_ratio`
    times faster (KvScheduler.select; kvmesh.router.kv_policy, SLO)."""
    inflight_hold_s: float = 1.0
    """How long after a request's first token the prefix it computed stays counted that way:
    the worker's KV events announcing those blocks may still be on their way, and a request
    sent right after (the next turn, the same prompt again) would otherwise find the prefix
    nowhere and go elsewhere. 0: until the first token (the replay, where events arrive at
    once)."""

    def __post_init__(self) -> None:
        if not self.overlap_weight >= 0:
            raise ValueError("overlap_weight must be >= 0")
        if not self.temperature >= 0:
            raise ValueError("temperature must be >= 0")
        if not 0 <= self.busy_kv_fraction <= 1:
            raise ValueError("busy_kv_fraction must be in [0, 1]")
        if self.busy_waiting_requests < 0:
            raise ValueError("busy_waiting_requests must be >= 0")
        if not self.approx_ttl_s > 0 or not self.load_max_age_s > 0:
            raise ValueError("approx_ttl_s and load_max_age_s must be > 0")
        if not self.load_settle_s >= 0 or not self.inflight_hold_s >= 0:
            raise ValueError("load_settle_s and inflight_hold_s must be >= 0")
        if not (self.ttft_slo_ms >= 0 and self.itl_slo_ms >= 0):
            raise ValueError("ttft_slo_ms and itl_slo_ms must be >= 0")
        self.policy = KvPolicyKind(self.policy)
        if not self.itl_weight >= 0 or not self.itl_penalty_cap_ms >= 0:
            raise ValueError("itl_weight and itl_penalty_cap_ms must be >= 0")
        if not (self.itl_penalty_ratio >= 1 and math.isfinite(self.itl_penalty_ratio)):
            raise ValueError("itl_penalty_ratio must be a number >= 1")
        if not self.decode_delay_weight >= 0:
            raise ValueError("decode_delay_weight must be >= 0")
        if self.chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        if not (0 <= self.host_hit_weight <= 1 and 0 <= self.disk_hit_weight <= 1):
            raise ValueError("host_hit_weight and disk_hit_weight must be in [0, 1]")


@dataclass(slots=True, frozen=True)
class LoadSample:
    """A worker's load metrics (kvmesh.api.common.v1.LoadMetrics) as the scheduler uses them."""

    kv_active_blocks: int = 0
    kv_total_blocks: int = 0
    """0: unknown (the worker's model card value is used)."""
    num_running: int = 0
    num_waiting: int = 0
    pending_prefill_tokens: int = 0
    draining: bool = False


class LoadEventKind(enum.Enum):
    """How a booking changed."""

    BOOKED = "booked"
    FIRST_TOKEN = "first_token"
    FREED = "freed"


@dataclass(slots=True, frozen=True)
class LoadEvent:
    """One booking change, as shared with peer router replicas."""

    router_id: str
    request_id: str
    worker_id: str
    kind: LoadEventKind
    prefill_blocks: int = 0
    """Blocks still to prefill (0 after the first token)."""
    decode_blocks: int = 0


@dataclass(slots=True)
class WorkerLoad:
    """Scheduler state of one worker."""

    worker_id: str
    block_size: int
    kv_total_blocks: int = 0
    kv_events: bool = True
    """False: approximate mode (the index learns from routing decisions)."""
    booked_prefill: int = 0
    """Blocks still to prefill of the requests booked here (until their first token)."""
    booked_decode: int = 0
    """Blocks added by the requests booked here (until they are freed)."""
    sample: LoadSample | None = None
    sample_at: float = -math.inf
    prefill_offset: float = 0.0
    """Measured minus booked prefill blocks when the last sample arrived; a shortfall counts
    only beyond one step's budget (`chunk_tokens`: the step in flight, which a sample may leave
    out; KvScheduler.update_load)."""
    decode_offset: float = 0.0
    """Measured minus booked decode blocks when the last sample arrived."""
    recent: deque[tuple[float, _Booking]] = field(default_factory=deque)
    """Bookings of the last `load_settle_s`, oldest first (may hold freed ones)."""
    freed: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(time, prefill, decode blocks) of the bookings freed in the last `load_settle_s`, oldest
    first: a load sample arriving now may have been measured while they still ran."""
    max_num_seqs: int = 0
    """Requests the engine runs at once (model card; 0: unknown, no limit assumed)."""
    booked_requests: int = 0
    """Requests booked here (own and peers'), until they are freed."""
    requests_offset: float = 0.0
    """Measured (running + waiting) minus booked requests when the last sample arrived."""
    itl_ratio: float = 0.0
    """Running mean of realized / predicted ITL over the requests that ended here (their mean
    token gap over the step time predicted while they decoded; 0: none yet), those this router
    replica booked (a peer's end carries no token count). Above 1 where prefill steps
    interleave with the decode steps, or the timing model runs short."""

    def fresh(self, now: float, max_age_s: float) -> bool:
        """Whether the last load sample is recent enough to trust."""
        return self.sample is not None and now - self.sample_at <= max_age_s

    def prefill_blocks(self, now: float, max_age_s: float) -> float:
        """Predicted blocks still to prefill (corrected by fresh metrics)."""
        if self.fresh(now, max_age_s):
            return max(0.0, self.booked_prefill + self.prefill_offset)
        return float(self.booked_prefill)

    def decode_blocks(self, now: float, max_age_s: float) -> float:
        """Predicted blocks held by running requests (corrected by fresh metrics)."""
        if self.fresh(now, max_age_s):
            return max(0.0, self.booked_decode + self.decode_offset)
        return float(self.booked_decode)

    def view(self, now: float, max_age_s: float) -> tuple[float, float, float]:
        """(prefill_blocks, decode_blocks, requests) at once (one freshness check)."""
        if self.sample is not None and now - self.sample_at <= max_age_s:
            return (
                max(0.0, self.booked_prefill + self.prefill_offset),
                max(0.0, self.booked_decode + self.decode_offset),
                max(0.0, self.booked_requests + self.requests_offset),
            )
        return float(self.booked_prefill), float(self.booked_decode), float(self.booked_requests)

    def requests(self, now: float, max_age_s: float) -> float:
        """Predicted requests on the worker, running or waiting (corrected by fresh metrics)."""
        if self.fresh(now, max_age_s):
            return max(0.0, self.booked_requests + self.requests_offset)
        return float(self.booked_requests)


@dataclass(slots=True)
class Selection:
    """What `KvScheduler.select` chose, and why."""

    worker_id: str
    overlap_blocks: int
    """Leading prompt blocks the worker holds (exact or approximate index; blocks on its host or
    disk tier count by their weight, rounded down)."""
    prompt_blocks: int
    """Full blocks in the prompt."""
    prompt_tokens: int
    block_size: int
    block_hashes: list[int]
    """Router hashes of the prompt's full blocks at the worker's block size."""
    cost: float
    costs: dict[str, float]
    """Cost of every worker considered (busy ones excluded)."""


@dataclass(slots=True, eq=False)
class _Booking:
    load: WorkerLoad
    """The worker's state object when booked (a worker that left and rejoined gets a new one,
    so late frees never touch the new one's counters)."""
    prefill: int
    decode: int
    live: bool = True
    inflight: Sequence[int] = ()
    """The prompt blocks it will compute (after the prefix its worker holds or computes for
    others), in the scheduler's InflightIndex until its first token."""
    at: float | None = None
    """When it was booked (None: no time given)."""
    first_at: float | None = None
    """When its first token came (None: not yet, or no time known)."""
    first_step_ms: float = 0.0
    """The decode step time predicted on its worker at its first token (0: not taken: no ITL
    target, or no first token yet)."""


class KvScheduler:
    """The synchronous core of KV-aware routing (see the module doc for the cost and usage).

    Contract:
      * `add_worker` before routing to a worker or feeding its events; `remove_worker` when it
        leaves (its index entries go; bookings on it are dropped from every sum).
      * `select(tokens, now, candidates=...)` chooses among registered workers (all of them when
        `candidates` is None; unknown ids are ignored) and books nothing. Raises Unavailable when
        no candidate is registered or all are busy.
      * `book(request_id, selection, now)` books the request (re-booking an id replaces it);
        `first_token(id)` moves it past prefill; `free(id)` ends it. Both return False for
        unknown ids and are idempotent. Each own booking change is reported to listeners
        (`add_listener`) as a LoadEvent, for peer replicas.
      * `apply_peer(source, event)` applies a peer replica's booking change; `drop_peer(source)`
        forgets all of that peer's bookings (its stream ended).
      * `now` never decreases between calls.
    """

    def __init__(
        self,
        config: KvRouterConfig | None = None,
        *,
        indexer: KvIndexer | None = None,
        router_id: str = "",
    ) -> None:
        self.config = config if config is not None else KvRouterConfig()
        self.indexer = (
            indexer
            if indexer is not None
            else KvIndexer(
                host_hit_weight=self.config.host_hit_weight,
                disk_hit_weight=self.config.disk_hit_weight,
            )
        )
        self.approx: ApproxIndex[str] = ApproxIndex(self.config.approx_ttl_s)
        self.inflight: InflightIndex[str] = InflightIndex()
        self._held: deque[tuple[float, WorkerLoad, Sequence[int]]] = deque()
        """Prefixes past their requests' first token, still counted in `inflight` until the
        time first (`inflight_hold_s`), oldest first."""
        self.router_id = router_id
        self._workers: dict[str, WorkerLoad] = {}
        self._bookings: dict[tuple[str, str], _Booking] = {}
        """(source, request id) -> booking; source "" is this scheduler, else a peer."""
        self._listeners: list[Callable[[LoadEvent], None]] = []
        self._rng = random.Random(self.config.seed)
        self._output_mean = 0.0
        """Running mean of the expected output tokens of own bookings (0: none yet)."""
        self._clock = -math.inf
        """The latest `now` any call gave (it never decreases): the time of a first token or an
        end reported without one."""
        self.slot_hold_s = 0.0
        """Running mean of how long a request holds its request slot, first token to end, over
        the requests that ended (own and peers'; 0: none yet)."""
        self.slot_hold_step_ms = 0.0
        """Running mean of the decode step time (timing model, at the worker's KV usage) where
        those requests ended: a hold is output tokens x step time, so a worker that decodes
        slower now than then holds its slots longer by that ratio."""
        self.fleet_itl_ratio = 0.0
        """Running mean of realized / predicted ITL over every worker's ended requests (0: none
        yet): what a worker with no ratio of its own is taken to decode at."""
        self.predictor = TtftPredictor(
            load_timing(self.config.timing_profile), chunk_tokens=self.config.chunk_tokens
        )
        self.agree_ms = self.predictor.timing.decode_ms(0.0)
        """ttft: predictions closer than this (ms) are near-ties decided by shared state
        (`_choose_agreed`)."""

    # -- workers ----------------------------------------------------------------------------

    def add_worker(
        self,
        worker_id: str,
        *,
        block_size: int,
        kv_total_blocks: int = 0,
        kv_events: bool = True,
        max_num_seqs: int = 0,
    ) -> WorkerLoad:
        """Register a worker (replacing any previous registration of the same id)."""
        self.remove_worker(worker_id)
        load = WorkerLoad(worker_id, block_size, kv_total_blocks, kv_events)
        load.max_num_seqs = max(0, max_num_seqs)
        self._workers[worker_id] = load
        if kv_events:
            self.indexer.add_worker(worker_id, block_size)
        return load

    def set_kv_events(self, worker_id: str, kv_events: bool) -> None:
        """Switch a worker between the exact index and approximate mode (e.g. its engine turned
        out to publish no events); what one index knew about it is dropped."""
        load = self._workers.get(worker_id)
        if load is None or load.kv_events == kv_events:
            return
        load.kv_events = kv_events
        if kv_events:
            self.approx.remove_worker(worker_id)
            self.indexer.add_worker(worker_id, load.block_size)
        else:
            self.indexer.remove_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker: its index entries and its load (bookings on it stay booked but no
        longer count anywhere)."""
        if self._workers.pop(worker_id, None) is not None:
            self.indexer.remove_worker(worker_id)
            self.approx.remove_worker(worker_id)
            self.inflight.remove_worker(worker_id)

    def worker(self, worker_id: str) -> WorkerLoad | None:
        """The registered worker's state."""
        return self._workers.get(worker_id)

    def workers(self) -> list[str]:
        """Registered worker ids."""
        return list(self._workers)

    def update_load(self, worker_id: str, sample: LoadSample, now: float) -> None:
        """Record a worker's load metrics measured at `now`; from now on (until they are older
        than `load_max_age_s`) its predicted load is the measurement plus the bookings younger
        than `load_settle_s` (which it cannot show yet) plus the bookings made since."""
        load = self._workers.get(worker_id)
        if load is None:
            return
        self._tick(now)
        load.sample = sample
        load.sample_at = now
        if sample.kv_total_blocks:
            load.kv_total_blocks = sample.kv_total_blocks
        recent = load.recent
        settled = now - self.config.load_settle_s
        while recent and recent[0][0] <= settled:
            recent.popleft()
        young_prefill = young_decode = young_requests = 0
        for _, b in recent:
            if b.live:
                young_prefill += b.prefill
                young_decode += b.decode
                young_requests += 1
        # What ended in the last `load_settle_s` may still show in the measurement (taken before
        # it ended, on its way since): a worker that just finished a request must not look busy
        # with it until the next sample (the next turn of a conversation, sent at once, would
        # go elsewhere and miss the prefix this worker holds).
        freed = load.freed
        while freed and freed[0][0] <= settled:
            freed.popleft()
        gone_prefill = gone_decode = 0
        for _, prefill, decode in freed:
            gone_prefill += prefill
            gone_decode += decode
        # predicted = measured + what the measurement cannot show yet - what it shows too long
        measured_prefill = max(
            0, -(-sample.pending_prefill_tokens // load.block_size) - gone_prefill
        )
        prefill_offset: float = measured_prefill - (load.booked_prefill - young_prefill)
        if prefill_offset < 0:
            # An engine that counts a step's tokens as computed when the step starts (the
            # mocker: it steps, then waits out the step's duration) leaves out the prefill of
            # the step in flight, which still runs before the next request's: up to one step's
            # budget of bookings above the measurement is consistent with it, so only what
            # exceeds that is corrected away.
            prefill_offset = min(0.0, prefill_offset + self.config.chunk_tokens / load.block_size)
        load.prefill_offset = prefill_offset
        measured_decode = max(0, sample.kv_active_blocks - gone_decode)
        load.decode_offset = measured_decode - (load.booked_decode - young_decode)
        measured_requests = max(0, sample.num_running + sample.num_waiting - len(freed))
        load.requests_offset = measured_requests - (load.booked_requests - young_requests)

    def busy(self, load: WorkerLoad, now: float) -> bool:
        """Whether the worker is over a busy threshold (fresh metrics only)."""
        cfg = self.config
        if not load.fresh(now, cfg.load_max_age_s):
            return False
        sample = load.sample
        assert sample is not None
        if sample.draining:
            return True
        total = sample.kv_total_blocks or load.kv_total_blocks
        if (
            cfg.busy_kv_fraction > 0
            and total
            and sample.kv_active_blocks >= cfg.busy_kv_fraction * total
        ):
            return True
        return 0 < cfg.busy_waiting_requests <= sample.num_waiting

    # -- choosing ---------------------------------------------------------------------------

    def select(
        self,
        token_ids: Sequence[int],
        now: float,
        *,
        candidates: Collection[str] | None = None,
        lora_name: str = "",
        expected_output_tokens: int = 0,
    ) -> Selection:
        """Choose a worker for a prompt (books nothing; see the class doc).
        `expected_output_tokens` (0: unknown) weighs the ITL penalty of the ttft policy."""
        cfg = self.config
        self._tick(now)
        if self._held:
            self._release_held(now)
        if candidates is None:
            loads = list(self._workers.values())
        else:
            loads = [w for c in candidates if (w := self._workers.get(c)) is not None]
        if not loads:
            raise Unavailable("no workers are available")
        max_age = cfg.load_max_age_s
        ready = [w for w in loads if w.sample_at < now - max_age or not self.busy(w, now)]
        if not ready:
            raise Unavailable(f"all {len(loads)} workers are busy")
        n_tokens = len(token_ids)
        need_exact = any(w.kv_events for w in ready)
        need_approx = not all(w.kv_events for w in ready)
        inflight = self.inflight if cfg.inflight_prefixes and len(self.inflight) else None
        by_size: dict[int, tuple[list[int], Mapping[str, float], dict[str, int]]] = {}
        overlaps: dict[str, float] = {}
        for w in ready:
            bs = w.block_size
            found = by_size.get(bs)
            if found is None:
                hashes = block_hashes(token_ids, bs, lora_name)
                exact = self.indexer.find_credits(hashes) if hashes and need_exact else {}
                approx = self.approx.find_matches(hashes, now) if hashes and need_approx else {}
                found = by_size[bs] = (hashes, exact, approx)
            wid = w.worker_id
            if w.kv_events:
                credit = found[1].get(wid, 0)
                if inflight is not None:
                    credit = max(credit, inflight.extend(wid, found[0], int(credit)))
                overlaps[wid] = credit
            else:
                overlaps[wid] = found[2].get(wid, 0)
        if cfg.policy is KvPolicyKind.TTFT:
            costs, pick = self._ttft_scores(ready, overlaps, n_tokens, now, expected_output_tokens)
            chosen = self._choose_agreed(pick, overlaps, by_size, token_ids)
        else:
            costs = self._cost_scores(ready, overlaps, n_tokens, now)
            chosen = self._choose(costs)
        load = self._workers[chosen]
        hashes = by_size[load.block_size][0]
        return Selection(
            worker_id=chosen,
            overlap_blocks=int(overlaps[chosen]),
            prompt_blocks=len(hashes),
            prompt_tokens=n_tokens,
            block_size=load.block_size,
            block_hashes=hashes,
            cost=costs[chosen],
            costs=costs,
        )

    def _cost_scores(
        self, ready: list[WorkerLoad], overlaps: Mapping[str, float], n_tokens: int, now: float
    ) -> dict[str, float]:
        """KvPolicyKind.COST: the linear cost of every ready worker (kvmesh.router.kv_policy)."""
        weight = self.config.overlap_weight
        max_age = self.config.load_max_age_s
        return {
            w.worker_id: cost_score(
                overlap_weight=weight,
                new_blocks=n_tokens / w.block_size - overlaps[w.worker_id],
                queued_prefill_blocks=w.prefill_blocks(now, max_age),
                decode_blocks=w.decode_blocks(now, max_age),
            )
            for w in ready
        }

    def _ttft_scores(
        self,
        ready: list[WorkerLoad],
        overlaps: Mapping[str, float],
        n_tokens: int,
        now: float,
        output_tokens: int,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """KvPolicyKind.TTFT: predicted TTFT of every ready worker plus its bounded ITL penalty
        (kvmesh.router.kv_policy), and those of the workers the choice is made among: all of
        them, or with an ITL target, those it does not rule out (`_over_itl_slo`)."""
        cfg = self.config
        max_age = cfg.load_max_age_s
        views = []
        waiting: list[bool] = []  # the request would wait there for a request slot
        for w in ready:
            view = w.view(now, max_age)
            views.append((w, *view))
            waiting.append(0 < w.max_num_seqs < view[2] + 1)
        full = any(waiting)
        # A busy request slot frees once per slot hold (first token to end) on average: where
        # the slots are full, requests end at the worker's busy slots over that hold. Not a
        # completion rate measured over the last seconds: at the start of a burst that is the
        # lull's rate, over few running requests, and it over-predicted the wait for a slot by
        # seconds (README, routing policies).
        hold = self.slot_hold_s
        per_slot = 1.0 / hold if full and hold > 0 else 0.0
        hold_step = self.slot_hold_step_ms
        weight = cfg.itl_weight * (output_tokens if output_tokens > 0 else self._output_mean)
        cap = cfg.itl_penalty_cap_ms
        penalty = bool(weight and cap)
        predictor = self.predictor
        ttft_ms = predictor.ttft_ms
        itl_ms = predictor.itl_ms
        delay_ms = predictor.decode_delay_ms
        delay_weight = cfg.decode_delay_weight
        out_mean = self._output_mean
        costs: dict[str, float] = {}
        slo = cfg.itl_slo_ms > 0 and len(views) > 1
        ttfts: list[float] = []  # with an ITL target
        itls: list[float] = []  # with the penalty or an ITL target
        slots_used: list[float] = []  # share of request slots taken (1: the engine does not say)
        for (w, prefill, decode, n), waits in zip(views, waiting, strict=True):
            bs = w.block_size
            slots = w.max_num_seqs
            args = (
                n_tokens - overlaps[w.worker_id] * bs,
                prefill * bs,
                decode * bs,
                w.kv_total_blocks * bs,
                n,
                slots,
                0.0,
                out_mean,
            )
            if per_slot:
                # busy slots / hold, the hold scaled to the step time at this worker's KV usage
                rate = per_slot * max(1.0, min(n, slots or math.inf))
                if hold_step > 0:
                    rate *= hold_step / itl_ms(args[2], 0, args[3])
                args = (*args[:6], rate, out_mean)
            # What its prefill costs the requests running there (kv_policy's module doc); none
            # scored where it must first wait for a request slot.
            if slots:
                used = n / slots if n < slots else 1.0
            else:  # the engine does not say: its KV usage
                used = min(1.0, args[2] / args[3]) if args[3] > 0 else 0.0
            delay = (
                delay_weight * used * delay_ms(args[0], args[1])
                if used and delay_weight and not waits
                else 0.0
            )
            ttft = ttft_ms(*args)
            costs[w.worker_id] = ttft + delay
            if penalty or slo:
                itls.append(itl_ms(args[2], n_tokens, args[3]))
                if penalty:
                    slots_used.append(used if slots else 1.0)
                if slo:
                    ttfts.append(ttft)
        ruled_out = self._over_itl_slo(views, ttfts, itls) if slo else ()
        if penalty and len(itls) > 1:
            free_itl = cfg.itl_penalty_ratio * min(itls)
            if max(itls) > free_itl:  # else the fleet decodes within the ratio: no penalty
                for (w, *_), itl, share in zip(views, itls, slots_used, strict=True):
                    wid = w.worker_id
                    costs[wid] = itl_penalized(costs[wid], itl, free_itl, weight, cap, share)
        if not ruled_out:
            return costs, costs
        return costs, {wid: c for wid, c in costs.items() if wid not in ruled_out}

    def _over_itl_slo(
        self,
        views: Sequence[tuple[WorkerLoad, float, float, float]],
        ttfts: Sequence[float],
        itls: Sequence[float],
    ) -> Collection[str]:
        """With an ITL target (`itl_slo_ms`): the workers over it, where another worker serves
        the request within the targets and decodes faster by the ITL penalty's ratio; else none
        (kvmesh.router.kv_policy, SLO). A worker is over the target when its predicted ITL
        (`itls`, the timing model's step time with the request there) times its realized /
        predicted ratio (`WorkerLoad.itl_ratio`, the fleet's where it has none, 1 before any)
        is; the other must be within it the same way, start the request within `ttft_slo_ms`
        (`ttfts`; 0: any) and be predicted to decode at most 1 / `itl_penalty_ratio` of the
        fastest over worker's step: the rule moves requests off a worker a prefix holds to its
        limit, not between workers that decode alike."""
        cfg = self.config
        target = cfg.itl_slo_ms
        fleet = self.fleet_itl_ratio or 1.0
        over: set[str] = set()
        fastest_over = math.inf
        for (w, *_), itl in zip(views, itls, strict=True):
            if itl * (w.itl_ratio or fleet) > target:
                over.add(w.worker_id)
                fastest_over = min(fastest_over, itl)
        if not over or len(over) == len(views):
            return ()
        bound = fastest_over / cfg.itl_penalty_ratio
        ttft_target = cfg.ttft_slo_ms or math.inf
        for (w, *_), itl, ttft in zip(views, itls, ttfts, strict=True):
            if itl <= bound and ttft <= ttft_target and itl * (w.itl_ratio or fleet) <= target:
                return over
        return ()

    def _choose(self, costs: dict[str, float]) -> str:
        if len(costs) == 1:
            return next(iter(costs))
        lo = min(costs.values())
        temperature = self.config.temperature
        if temperature > 0:
            ids = list(costs)
            span = max(costs.values()) - lo
            if not span > 0:
                return self._rng.choice(ids)
            weights = [math.exp(-(v - lo) / span / temperature) for v in costs.values()]
            return self._rng.choices(ids, weights)[0]
        tol = 1e-9 * max(1.0, abs(lo))
        best = [i for i, v in costs.items() if v - lo <= tol]
        if len(best) > 1:
            # Equal cost (typically a cache miss on idle workers): prefer the emptiest cache, so
            # new prefixes spread over the fleet instead of evicting one worker's others; then
            # pick at random (seeded), never simply the first worker.
            sizes = [self._cached_blocks(i) for i in best]
            least = min(sizes)
            best = [i for i, n in zip(best, sizes, strict=True) if n == least]
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def _choose_agreed(
        self,
        costs: dict[str, float],
        overlaps: Mapping[str, float],
        by_size: Mapping[int, tuple[list[int], Mapping[str, float], dict[str, int]]],
        token_ids: Sequence[int],
    ) -> str:
        """KvPolicyKind.TTFT's choice, made so that router replicas agree where it matters, on
        the worker that holds the prompt's prefix. Candidates predicted within `agree_ms` of the
        best (one decode step of an idle engine: about what one booking in transit between
        replicas, or their private completion-rate and output estimates, move a prediction by)
        are near-ties; among them the most cached prompt blocks win (the KV index, which every
        replica shares), then the lowest prediction. Exact ties (an idle fleet) go to the fewest
        cached blocks in all (new prefixes spread over the fleet), then to rendezvous hashing of
        the prompt (its last full block's hash) with the worker id, never to a replica's own
        random draw. With temperature > 0: sampled as in `_choose`."""
        if len(costs) == 1 or self.config.temperature > 0:
            return self._choose(costs)
        lo = min(costs.values())
        limit = lo + self.agree_ms
        tol = 1e-9 * max(1.0, abs(lo))
        most = -math.inf
        best = math.inf
        near: list[str] = []
        for wid, v in costs.items():  # one pass: most cached, then lowest, within the margin
            if v > limit:
                continue
            o = overlaps[wid]
            if o > most or (o == most and v < best - tol):
                most, best, near = o, v, [wid]
            elif o == most and v - best <= tol:
                near.append(wid)
        if len(near) > 1:
            sizes = [self._cached_blocks(i) for i in near]
            least = min(sizes)
            near = [i for i, n in zip(near, sizes, strict=True) if n == least]
        if len(near) == 1:
            return near[0]
        hashes = next(iter(by_size.values()))[0] if by_size else []
        if not hashes and token_ids:  # shorter than a block: the prompt as one block
            hashes = block_hashes(token_ids, len(token_ids))
        key = hashes[-1] if hashes else 0
        return max(near, key=lambda i: xxh3_64_intdigest(i.encode(), seed=key))

    def _cached_blocks(self, worker_id: str) -> int:
        load = self._workers[worker_id]
        if load.kv_events:
            return self.indexer.num_blocks(worker_id)
        return self.approx.num_live(worker_id)

    # -- bookings ---------------------------------------------------------------------------

    def book(
        self, request_id: str, selection: Selection, now: float, *, expected_output_tokens: int = 0
    ) -> None:
        """Book the selected request's predicted load on its worker (replacing any booking of
        the same id): the blocks it will prefill (prompt minus cached prefix) until its first
        token, the blocks it adds (the same plus its expected output) until it is freed. In
        approximate mode the worker is assumed to cache the prompt from `now`."""
        load = self._workers.get(selection.worker_id)
        if load is None:
            raise Unavailable(f"worker {selection.worker_id} left")
        self._tick(now)
        bs = selection.block_size
        if expected_output_tokens > 0:
            mean = self._output_mean
            self._output_mean = (
                expected_output_tokens
                if not mean
                else mean + 0.01 * (expected_output_tokens - mean)
            )
        overlap = selection.overlap_blocks
        hashes = selection.block_hashes
        old = self._bookings.get(("", request_id))
        if old is not None and old.inflight:  # re-booked: it does not share its own prefix
            self._end_inflight(old)
            if load.kv_events:
                credit = self.indexer.find_credits(hashes).get(load.worker_id, 0)
                credit = max(credit, self.inflight.extend(load.worker_id, hashes, int(credit)))
                overlap = min(overlap, int(credit))
        prefill = max(0, -(-selection.prompt_tokens // bs) - overlap)
        total = -(-(selection.prompt_tokens + max(0, expected_output_tokens)) // bs)
        decode = max(0, total - overlap)
        booking = self._book("", request_id, load, prefill, decode, now)
        if hashes:
            if not load.kv_events:
                self.approx.insert(load.worker_id, hashes, now)
            elif self.config.inflight_prefixes and overlap < len(hashes):
                booking.inflight = hashes[overlap:]
                self.inflight.add(load.worker_id, booking.inflight)
        if self._listeners:
            self._emit(
                LoadEvent(
                    self.router_id,
                    request_id,
                    load.worker_id,
                    LoadEventKind.BOOKED,
                    prefill,
                    decode,
                )
            )

    def _book(
        self,
        source: str,
        request_id: str,
        load: WorkerLoad,
        prefill: int,
        decode: int,
        now: float | None,
    ) -> _Booking:
        self._drop_booking((source, request_id))
        load.booked_prefill += prefill
        load.booked_decode += decode
        load.booked_requests += 1
        booking = _Booking(load, prefill, decode, at=now)
        self._bookings[(source, request_id)] = booking
        settle = self.config.load_settle_s
        if now is not None and settle > 0:
            recent = load.recent
            while recent and recent[0][0] <= now - settle:  # bounded without load metrics too
                recent.popleft()
            recent.append((now, booking))
        return booking

    def _drop_booking(self, key: tuple[str, str]) -> _Booking | None:
        b = self._bookings.pop(key, None)
        if b is not None:
            b.load.booked_prefill -= b.prefill
            b.load.booked_decode -= b.decode
            b.load.booked_requests -= 1
            b.live = False
            self._end_inflight(b)
        return b

    def _end_inflight(self, b: _Booking) -> None:
        if b.inflight:
            self._uncount(b.load, b.inflight)
            b.inflight = ()

    def _uncount(self, load: WorkerLoad, hashes: Sequence[int]) -> None:
        wid = load.worker_id
        if self._workers.get(wid) is load:  # not a worker that left (and came back)
            self.inflight.remove(wid, hashes)

    def _tick(self, now: float | None) -> None:
        if now is not None and now > self._clock:
            self._clock = now

    def _release_held(self, now: float) -> None:
        held = self._held
        while held and held[0][0] <= now:
            _, load, hashes = held.popleft()
            self._uncount(load, hashes)

    def first_token(self, request_id: str, source: str = "", now: float | None = None) -> bool:
        """The request's prefill is done: its prefill blocks stop counting; the prefix it
        computed stays counted as in flight until `now` + `inflight_hold_s` (with `now`).
        False if unknown."""
        b = self._bookings.get((source, request_id))
        if b is None:
            return False
        self._tick(now)
        if b.first_at is None and math.isfinite(self._clock):
            b.first_at = self._clock
            if self.config.itl_slo_ms:
                b.first_step_ms = self._step_ms(b.load)
        hold = self.config.inflight_hold_s
        if b.inflight and now is not None and hold > 0:
            self._held.append((now + hold, b.load, b.inflight))
            b.inflight = ()
        else:
            self._end_inflight(b)
        if b.prefill:
            b.load.booked_prefill -= b.prefill
            b.prefill = 0
            if not source and self._listeners:
                self._emit(
                    LoadEvent(
                        self.router_id,
                        request_id,
                        b.load.worker_id,
                        LoadEventKind.FIRST_TOKEN,
                        0,
                        b.decode,
                    )
                )
        return True

    def _step_ms(self, load: WorkerLoad) -> float:
        """The decode step time the timing model predicts on `load`'s worker now."""
        _, decode, _ = load.view(self._clock, self.config.load_max_age_s)
        bs = load.block_size
        return self.predictor.itl_ms(decode * bs, 0, load.kv_total_blocks * bs)

    def free(
        self, request_id: str, source: str = "", now: float | None = None, output_tokens: int = 0
    ) -> bool:
        """The request ended (any reason): drop its booking (with `now`, load samples of the
        next `load_settle_s` may still show it: update_load). `output_tokens` (0: unknown): the
        tokens it generated on its worker, for the worker's realized ITL (with an ITL target).
        False if unknown."""
        b = self._drop_booking((source, request_id))
        if b is None:
            return False
        self._tick(now)
        if b.first_at is not None:
            held = self._clock - b.first_at
            load = b.load
            step = self._step_ms(load)
            if output_tokens > 1 and b.first_step_ms > 0 and held > 0:
                # Its mean token gap over the step time predicted while it decoded (the mean of
                # then and now).
                ratio = held * 1e3 / (output_tokens - 1) / (0.5 * (b.first_step_ms + step))
                fleet = self.fleet_itl_ratio
                if not load.itl_ratio:
                    load.itl_ratio = fleet or ratio
                load.itl_ratio += ITL_RATIO_SMOOTHING * (ratio - load.itl_ratio)
                self.fleet_itl_ratio = (
                    fleet + FLEET_ITL_RATIO_SMOOTHING * (ratio - fleet) if fleet else ratio
                )
            if not self.slot_hold_s:
                self.slot_hold_s, self.slot_hold_step_ms = held, step
            else:
                self.slot_hold_s += SLOT_HOLD_SMOOTHING * (held - self.slot_hold_s)
                self.slot_hold_step_ms += SLOT_HOLD_SMOOTHING * (step - self.slot_hold_step_ms)
        settle = self.config.load_settle_s
        if now is not None and settle > 0:
            load = b.load
            freed = load.freed
            while freed and freed[0][0] <= now - settle:  # bounded without load samples too
                freed.popleft()
            freed.append((now, b.prefill, b.decode))
            if b.at is not None and load.sample_at - settle < b.at <= load.sample_at:
                # The last sample took it for too young to show, and added it on top of what
                # it measured; the sample may have shown it all the same (a fast worker): gone
                # now, it must not stay in the offsets until the next sample.
                load.prefill_offset -= b.prefill
                load.decode_offset -= b.decode
                load.requests_offset -= 1
        if not source and self._listeners:
            self._emit(LoadEvent(self.router_id, request_id, b.load.worker_id, LoadEventKind.FREED))
        return True

    def booking_worker(self, request_id: str) -> str | None:
        """The worker this scheduler booked `request_id` on, if it is booked."""
        b = self._bookings.get(("", request_id))
        return None if b is None else b.load.worker_id

    def num_bookings(self, source: str | None = None) -> int:
        """Bookings held (of one source: "" own, else a peer's; None: all)."""
        if source is None:
            return len(self._bookings)
        return sum(1 for s, _ in self._bookings if s == source)

    # -- peers ------------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[LoadEvent], None]) -> None:
        """Hear about every own booking change (book, first token, free)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[LoadEvent], None]) -> None:
        """Stop hearing about booking changes."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _emit(self, event: LoadEvent) -> None:
        for listener in self._listeners:
            listener(event)

    def own_bookings(self) -> list[LoadEvent]:
        """The own bookings active now, as BOOKED events (what a new peer starts from)."""
        return [
            LoadEvent(
                self.router_id, rid, b.load.worker_id, LoadEventKind.BOOKED, b.prefill, b.decode
            )
            for (source, rid), b in self._bookings.items()
            if not source
        ]

    def apply_peer(self, source: str, event: LoadEvent, now: float | None = None) -> None:
        """Apply a peer replica's booking change (`source` names the peer connection; `now`:
        when it arrived, for the load correction; None: treat it as settled)."""
        if not source:
            raise ValueError("source must name the peer")
        if event.kind is LoadEventKind.BOOKED:
            load = self._workers.get(event.worker_id)
            if load is None:
                self._drop_booking((source, event.request_id))
                return
            self._book(
                source, event.request_id, load, event.prefill_blocks, event.decode_blocks, now
            )
        elif event.kind is LoadEventKind.FIRST_TOKEN:
            self.first_token(event.request_id, source)
        else:
            self.free(event.request_id, source, now)

    def drop_peer(self, source: str) -> None:
        """Forget every booking of a peer (its stream ended; a new one restarts from its
        active bookings)."""
        for key in [k for k in self._bookings if k[0] == source]:
            self._drop_booking(key)
