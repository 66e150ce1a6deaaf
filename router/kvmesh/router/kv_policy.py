"""How the KV-aware scheduler scores a candidate worker: the policies KvScheduler chooses by.

Both policies see, per candidate worker (kvmesh.router.kv_scheduler computes these, the same on
every router replica: the exact KV index, and bookings shared with peer replicas, corrected by
the worker's fresh load metrics):

  * `new_tokens`: the prompt tokens the worker would prefill (prompt minus the prefix it holds);
  * `queued_prefill_tokens`: prefill work already booked on the worker and not yet done (own and
    peer replicas' bookings until their first token);
  * `decode_tokens`: KV held by the requests the worker is running (bookings until they end);
  * the worker's KV capacity in tokens.

`KvPolicyKind.COST` (`cost_score`) is the original linear cost, in blocks:

    cost = overlap_weight * (queued_prefill + new) + decode + new

`KvPolicyKind.TTFT` (`TtftPredictor`) predicts the request's time to first token on the worker
with the engine's step timing model (kvmesh.runtime.timing: the mocker's model, or a measured
table), and adds a bounded penalty for the inter-token latency it would decode at there:

    work   = queued_prefill + new                      tokens the worker prefills before our
                                                       first token (FIFO admission)
    steps  = ceil(work / chunk)                        chunked prefill, `chunk` tokens a step
    ttft   = sum of prefill_ms over the steps' chunks  (full chunks, then the remainder)
             + steps * decode_ms(u)                    each of those steps also decodes the
                                                       running batch, u = decode / capacity
    itl    = decode_ms((decode + prompt) / capacity)   the step time it would then decode at
    delay  = prefill_ms(queued + new) - prefill_ms(queued)   if prefill is queued there (the
                                                       request joins that step), else
             prefill_ms(new)                           (a step of its own, with the step's
                                                       fixed cost): what its prefill adds to
                                                       the steps of the requests running there
                                                       (0 where every request slot is taken)
    score  = ttft + d * used * delay
             + used * min(w * output * max(0, itl - r * best itl), itl_penalty_cap_ms)

`output` is the request's expected output tokens (its max_tokens; the mean of past requests when
unknown), `w` the `itl_weight`, `d` the `decode_delay_weight`, `best itl` the lowest over the
candidates, `r` the `itl_penalty_ratio`, and `used` the fraction of the worker's request slots
taken (requests running or waiting / max_num_seqs, capped at 1; 1 for the ITL penalty and the KV
usage for the delay when the engine does not say): decode speed matters to everyone's TTFT when
request slots run short, because then a new request waits for running ones to finish, which
they do at the pace of the decode steps. The lowest score wins (near-ties, ties and temperature
sampling: KvScheduler._choose_agreed, which makes router replicas agree).

The ITL penalty is the time the request would lose decoding its output on a worker that decodes
more than `r` times slower than the best candidate (the excess only): with r = 2 it adds
nothing while the fleet decodes within 2x of its best worker, where TTFT alone routes best, and
it stops the one failure TTFT alone cannot see: a worker holding the prompts' prefixes (a
tenant's system prompt, the sessions of before a scale-up) keeps winning on TTFT, its prefill
being short, while its decode batch grows until every request on it decodes several times
slower than on the idle workers beside it. Seen in `kvmesh replay` with the SLA planner on a
multi-tenant day (`tests/benchmarks/bench_planner.py --traces tenants-day`): the workers the
planner added stayed idle and 30-47 % of the requests missed the ITL target. The penalty fades
out on workers with free slots, and it is capped, so a worker's TTFT advantage is never traded
away whole for ITL. Its defaults (w = 1: a millisecond of the request's own decode time counts
as a millisecond of TTFT; r = 2) are chosen by cross-validation over the routing matrix (which
scores TTFT only), where they score slightly better than no penalty and are never above
round-robin; r = 1 (any ITL above the best worker's) put conv bursts above round-robin.

The delay term is the cost the request's prefill puts on the others (TTFT alone is its own
cost): every request running on the worker waits out its prefill in one more step. A worker
whose decode batch is larger pays more, so the term balances decode batches (a worker's decode
throughput saturates as its batch grows: decode_ms rises with KV usage), and a prefill that
joins one already queued costs only its tokens, not a step's fixed cost (the mocker's 16.5 ms,
about 1,100 tokens' worth), so it batches prefills. Without it the policy, scoring only the
request's own TTFT, spread prefills over workers with no queue, one step each, and let decode
batches drift apart by 40-50 requests of 256: the fleet decoded 3-8 % slower than Dynamo's
(which balances decode blocks) and, in the cells where requests end up waiting for request
slots, carried 20-30 more requests when the slots filled, which then waited 200 ms longer
(conv steady moderate, 4 workers). Weighted by `used`, it costs nothing while workers are
idle; `d` (DEFAULT_DECODE_DELAY_WEIGHT) is chosen by cross-validation. It is not scored on a
worker whose request slots are all taken: the request waits there for a slot, so it joins no
prefill queued now, and the requests its prefill will delay are those running when a slot
frees, the same on every full worker. Scored there, it held a saturated burst's requests on the
workers with the most prefill queued and slowed the burst's tail (conv bursty overload at 16
workers: p99 9,021 ms, above round-robin's 8,593; 8,343 without it there).

SLO. Given the deployment's targets (`itl_slo_ms`, `ttft_slo_ms` on KvRouterConfig: the
`--router-itl-slo-ms` / `--router-ttft-slo-ms` flags, or the SLA planner's targets, which
`kvmesh up --planner sla` and `kvmesh replay --planner sla` hand their routers), the router
keeps requests off a worker whose requests decode over the ITL target when another serves the
request within both. A worker's ITL is the predicted `itl` above times what its ended requests
realized over it (their mean token gap / the step predicted while they decoded, a running
mean; the fleet's for a worker with none yet): prefill steps interleaving with the decode
steps, which the step model leaves out, made it 3-4x on the Mooncake day (13k-token prompts).
A worker is ruled out of the choice when that ITL is over the target and another worker's is
within it, starts the request within the TTFT target, and is predicted to decode over `r`
(`itl_penalty_ratio`) times faster than the fastest worker over the target; the lowest score
among the rest wins. The last
condition keeps the rule to the failure it is for, the one the ITL penalty above weighs but
cannot outweigh (it is capped and scaled by the slots taken): a prefix holder loaded to the
limit beside workers that just started and hold no prefix (the SLA planner's multi-tenant day:
the planner grows the pool, the router keeps every tenant on the worker that holds its 14k-token
prompt). Between workers that decode alike (where the ratio is high everywhere, Mooncake's long
prompts near a 30 ms target) moving a request costs its cached prefix for a step time no
better, and the rule does not fire. Without targets (the default) nothing changes; the routing
matrix scores TTFT with none.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kvmesh.runtime.config import opt
from kvmesh.runtime.timing import PolynomialTiming, TimingModel

__all__ = [
    "DEFAULT_DECODE_DELAY_WEIGHT",
    "DEFAULT_ITL_PENALTY_CAP_MS",
    "DEFAULT_ITL_PENALTY_RATIO",
    "DEFAULT_ITL_WEIGHT",
    "DEFAULT_POLICY",
    "KvPolicyFlags",
    "KvPolicyKind",
    "TtftPrediction",
    "TtftPredictor",
    "cost_score",
    "itl_penalized",
]

DEFAULT_ITL_WEIGHT = 1.0
"""The ttft policy's default ITL-penalty weight, chosen by cross-validation over the routing
matrix (tests/benchmarks/routing_matrix.py --cv)."""
DEFAULT_ITL_PENALTY_RATIO = 2.0
"""The ttft policy's ITL penalty counts only the predicted ITL above this multiple of the best
candidate's, chosen with DEFAULT_ITL_WEIGHT."""
DEFAULT_ITL_PENALTY_CAP_MS = 10_000.0
"""The ttft policy's default cap of the ITL penalty (ms): a bound, not a tuning (a cap of 10 s or
of 100 s gives the same result in every cross-validation cell of the routing matrix)."""
DEFAULT_DECODE_DELAY_WEIGHT = 1.0
"""The ttft policy's default weight of the delay a request's prefill adds to the requests running
on the worker (x the fraction of its request slots taken), chosen by cross-validation over the
routing matrix (tests/benchmarks/routing_matrix.py --cv) among the weights never above
round-robin: 1, a millisecond of every running request's decode counting as a millisecond of TTFT
when the slots are full. By score alone CV prefers more (2, 4), which put conv bursts above
round-robin. Over all 120 cells at 2-16 workers the same rule took 0 while 1 was above
round-robin in one cell (by 5 % at p99; 0 routes 3-8 % slower over the matrix); that cell was
the term scored on workers with every slot taken, which it no longer is, and the rule then
chooses 1 over all 120 cells (README, routing policies: the full-slot change)."""


class KvPolicyKind(enum.Enum):
    """How KvScheduler scores workers."""

    TTFT = "ttft"
    """Predicted time to first token plus a bounded ITL penalty (TtftPredictor): the default
    (DEFAULT_POLICY); near-ties are decided by state every router replica shares
    (KvScheduler._choose_agreed)."""
    COST = "cost"
    """The linear cost over blocks to prefill and blocks decoding (cost_score)."""


DEFAULT_POLICY = KvPolicyKind.TTFT
"""The KV router's default policy (live and in `kvmesh replay`), chosen by cross-validation over
the routing matrix (tests/benchmarks/routing_matrix.py --cv)."""


@dataclass
class KvPolicyFlags:
    """The scoring flags of the KV router, the same for a live router (MeshConfig) and
    `kvmesh replay` (ReplayConfig)."""

    router_policy: KvPolicyKind = opt(
        DEFAULT_POLICY,
        "kv: how workers are scored; ttft: predicted time to first token (+ a bounded ITL "
        "penalty), cost: the linear cost over blocks to prefill and blocks decoding",
    )
    router_itl_weight: float = opt(
        DEFAULT_ITL_WEIGHT,
        "kv ttft: weight of the ITL penalty (x expected output tokens x ms of predicted ITL "
        "above --router-itl-penalty-ratio x the best worker's); 0: no penalty",
    )
    router_itl_penalty_ratio: float = opt(
        DEFAULT_ITL_PENALTY_RATIO,
        "kv ttft: the ITL penalty counts the predicted ITL above this multiple of the best "
        "worker's (>= 1; 1: any ITL above the best worker's)",
    )
    router_itl_penalty_cap_ms: float = opt(
        DEFAULT_ITL_PENALTY_CAP_MS, "kv ttft: cap of the ITL penalty, ms"
    )
    router_decode_delay_weight: float = opt(
        DEFAULT_DECODE_DELAY_WEIGHT,
        "kv ttft: weight of the delay the request's prefill adds to the requests running on "
        "the worker (x the fraction of its request slots taken); 0: score its own TTFT only",
    )
    router_ttft_slo_ms: float = opt(
        0.0,
        "kv ttft: the deployment's TTFT target, ms (0: none): a worker over the ITL target "
        "gives way only to one predicted to start the request within it",
    )
    router_itl_slo_ms: float = opt(
        0.0,
        "kv ttft: the deployment's ITL target (a request's mean ITL), ms (0: none): a worker "
        "whose requests decode over it takes no request another worker serves within the "
        "targets while decoding --router-itl-penalty-ratio x faster (kvmesh replay with "
        "--planner, kvmesh up with --planner sla: the planner's targets)",
    )
    router_inflight_prefixes: bool = opt(
        True,
        "kv: count the prompt prefix a worker is about to compute for requests routed there "
        "(waiting or prefilling) as cached on it",
    )


def itl_penalized(
    score_ms: float,
    itl_ms: float,
    free_itl_ms: float,
    weight: float,
    cap_ms: float,
    slots_used: float,
) -> float:
    """The ttft policy's `score_ms` (predicted TTFT and the delay term) plus the bounded ITL
    penalty (module doc) for an ITL of `itl_ms`, where up to `free_itl_ms` (itl_penalty_ratio x
    the best candidate's) costs nothing; `weight` is itl_weight times the request's expected
    output tokens. Positional, it is on the routing path."""
    if itl_ms <= free_itl_ms:
        return score_ms
    used = slots_used if slots_used < 1.0 else 1.0
    penalty = weight * (itl_ms - free_itl_ms)
    return score_ms + (used if used > 0.0 else 0.0) * (penalty if penalty < cap_ms else cap_ms)


def cost_score(
    *, overlap_weight: float, new_blocks: float, queued_prefill_blocks: float, decode_blocks: float
) -> float:
    """The linear cost of KvPolicyKind.COST (lower is better), in blocks."""
    return overlap_weight * (queued_prefill_blocks + new_blocks) + decode_blocks + new_blocks


@dataclass(slots=True, frozen=True)
class TtftPrediction:
    """What TtftPredictor expects on one worker, in milliseconds."""

    ttft_ms: float
    itl_ms: float


class TtftPredictor:
    """Predicts TTFT and ITL on a worker from the engine's step timing (see the module doc).

    `timing`: the engine's step timing model (default: the Dynamo mocker polynomial);
    `chunk_tokens`: the engine's token budget per step (vLLM's max_num_batched_tokens).
    """

    __slots__ = ("_chunk_ms", "chunk_tokens", "timing")

    def __init__(self, timing: TimingModel | None = None, *, chunk_tokens: int = 8192) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.timing: TimingModel = timing if timing is not None else PolynomialTiming()
        self.chunk_tokens = chunk_tokens
        self._chunk_ms = self.timing.prefill_ms(chunk_tokens)

    def prefill_ms(self, tokens: float, decode_ms: float) -> float:
        """Time to prefill `tokens` tokens FIFO in chunks of `chunk_tokens`, each step also
        decoding the running batch for `decode_ms` (0: nothing decodes)."""
        full = int(tokens // self.chunk_tokens)
        rest = tokens - full * self.chunk_tokens
        ms = full * (self._chunk_ms + decode_ms)
        if rest > 0:
            ms += self.timing.prefill_ms(math.ceil(rest)) + decode_ms
        return ms

    def decode_delay_ms(self, new_tokens: float, queued_prefill_tokens: float) -> float:
        """What prefilling `new_tokens` adds to the steps of the requests running on a worker
        with `queued_prefill_tokens` of prefill ahead of it: only its tokens' time when it joins
        a queued prefill (chunked in `chunk_tokens` steps), else a step's prefill of its own,
        fixed cost included. Positional, on the routing path."""
        new = math.ceil(new_tokens) if new_tokens > 1.0 else 1
        prefill_ms = self.timing.prefill_ms
        if queued_prefill_tokens <= 0:
            if new <= self.chunk_tokens:
                return prefill_ms(new)
            return self.prefill_ms(new, 0.0)
        queued = math.ceil(queued_prefill_tokens)
        if queued + new <= self.chunk_tokens:
            return prefill_ms(queued + new) - prefill_ms(queued)
        return self.prefill_ms(queued + new, 0.0) - self.prefill_ms(queued, 0.0)

    def predict(
        self,
        *,
        new_tokens: float,
        queued_prefill_tokens: float,
        decode_tokens: float,
        prompt_tokens: int,
        kv_capacity_tokens: float,
        requests: float = 0.0,
        max_num_seqs: int = 0,
        completion_rate: float = 0.0,
        output_tokens: float = 0.0,
    ) -> TtftPrediction:
        """TTFT and ITL of a request of `prompt_tokens` tokens, `new_tokens` of them not cached,
        on a worker with `queued_prefill_tokens` of prefill ahead of it and `decode_tokens` of
        KV decoding, out of `kv_capacity_tokens` (0: unknown, decode time at zero usage).

        Slots: with `requests` already running or waiting there and room for `max_num_seqs`
        (0: no limit), the request waits for the excess to end first, one every
        1 / `completion_rate` s (requests ending per second there; KvScheduler gives its busy
        slots over the slot hold it measured, first token to end, scaled to the worker's step
        time; 0: estimated as the ITL times `output_tokens`, the mean output, over the running
        requests)."""
        ttft = self.ttft_ms(
            new_tokens,
            queued_prefill_tokens,
            decode_tokens,
            kv_capacity_tokens,
            requests,
            max_num_seqs,
            completion_rate,
            output_tokens,
        )
        return TtftPrediction(ttft, self.itl_ms(decode_tokens, prompt_tokens, kv_capacity_tokens))

    def itl_ms(
        self, decode_tokens: float, prompt_tokens: float, kv_capacity_tokens: float
    ) -> float:
        """The ITL of `predict` alone: the decode step time once the request's prompt joins
        `decode_tokens` of KV decoding (positional, on the routing path)."""
        capacity = kv_capacity_tokens if kv_capacity_tokens > 0 else math.inf
        decoding = decode_tokens if decode_tokens > 0 else 0.0
        return self.timing.decode_ms((decoding + prompt_tokens) / capacity)

    def ttft_ms(
        self,
        new_tokens: float,
        queued_prefill_tokens: float,
        decode_tokens: float,
        kv_capacity_tokens: float,
        requests: float = 0.0,
        max_num_seqs: int = 0,
        completion_rate: float = 0.0,
        output_tokens: float = 0.0,
    ) -> float:
        """The TTFT of `predict` alone (what the router scores by when the ITL penalty is off);
        positional, it is on the routing path."""
        decoding = decode_tokens if decode_tokens > 0 else 0.0
        if decoding:
            capacity = kv_capacity_tokens if kv_capacity_tokens > 0 else math.inf
            step_decode_ms = self.timing.decode_ms(decoding / capacity)
        else:
            step_decode_ms = 0.0
        new = new_tokens if new_tokens > 1.0 else 1.0
        work = new + queued_prefill_tokens if queued_prefill_tokens > 0 else new
        if work <= self.chunk_tokens:  # one step (prefill_ms, inlined: the common case)
            ttft = self.timing.prefill_ms(math.ceil(work)) + step_decode_ms
        else:
            ttft = self.prefill_ms(work, step_decode_ms)
        excess = requests + 1 - max_num_seqs
        if max_num_seqs and excess > 0:
            if completion_rate > 0:
                interval_ms = 1e3 / completion_rate
            else:
                itl = max(step_decode_ms, self.timing.decode_ms(0.0))
                interval_ms = itl * max(1.0, output_tokens) / max(1.0, min(requests, max_num_seqs))
            ttft = max(ttft, excess * interval_ms + self.prefill_ms(new, step_decode_ms))
        return ttft
