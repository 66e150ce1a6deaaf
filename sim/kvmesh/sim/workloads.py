"""Generated workloads with known prefix sharing, for scoring routing policies (`kvmesh workload`).

Every generator returns a `Trace` (kvmesh.sim.trace) whose `hash_ids` name blocks of
`block_size` tokens (default 64, the engines' block size; replay them with
`--trace-block-size 64`, and Dynamo's replay with `trace_block_size=64`): equal leading ids are
equal prompt prefixes. Everything is a pure function of the settings and the seed.

Kinds (`WorkloadKind`):

* `mooncake`: a Mooncake trace (`source`, e.g. the shared synthetic trace; its own 512-token
  hash ids, kept as they are) with new arrival times from the arrival process below, at the
  trace's own mean rate unless `rate` is given;
* `conv`, `code`: an Azure LLM inference trace (`ContextTokens`, `GeneratedTokens`; its arrival
  times or the arrival process below) given prefix structure by `with_sessions`. Each row keeps
  its prompt and output length and becomes a turn of a conversation: it continues an open
  session when one fits (the session's last prompt plus its output plus a user message of at
  least `min_message_tokens` fits in the row's prompt, the session's last turn arrived at least
  `think_s` earlier and at most `session_idle_s` ago), with probability `follow`; otherwise it
  starts a session on one of `system_prompts` shared system prompts (Zipf(`zipf`) popularity,
  lengths uniform in `system_tokens`). A continued turn repeats the previous prompt's full blocks
  (multi-turn growth: the previous output and the new message are new blocks, as in every
  Mooncake replay, where generated tokens are not the model's); a new session shares the system
  prompt's full blocks.
* `agentic`: tool loops. Sessions start by the arrival process; each picks one of
  `agent_types` agents (Zipf popularity) whose system prompt with tool definitions (uniform in
  `agent_system_tokens`) it shares with every session of that agent, then runs a geometric
  number of steps (mean `agent_steps`): step k's prompt is step k-1's prompt plus its output
  (a tool call, lognormal around `tool_call_tokens`) plus the tool's result (lognormal around
  `tool_result_tokens`); step k arrives after step k-1's estimated service time (its prefill at
  `est_prefill_tok_per_s`, its output at `est_itl_ms`) plus the tool's latency (exponential,
  mean `tool_latency_s`). Sessions end after their steps or at `max_context_tokens`.
* `tenants`: multi-tenant serving. `tenants` tenants (Zipf popularity) each own a long prefix
  (system prompt plus few-shot examples, uniform in `tenant_prefix_tokens`); a request is its
  tenant's prefix plus a unique query (lognormal around `query_tokens`), with a lognormal output
  around `output_tokens`.

Arrivals (`ArrivalKind`), mean rate `rate` requests (or sessions) per second:
* `steady`: Poisson;
* `bursty`: a two-state Markov-modulated Poisson process with the same mean: bursts at 3x the
  mean rate (mean `burst_s` long) alternate with lulls at 1/3 of it (three times as long);
* `trace`: the source trace's own timestamps (mooncake, conv, code).

`sharing(trace)` reports the sharing a trace holds (the infinite-cache prefix bound of
kvmesh.sim.trace, plus the distinct prefixes), which the matrix records beside each result.
"""

from __future__ import annotations

import argparse
import bisect
import enum
import itertools
import math
import random
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from kvmesh.runtime.config import from_args, opt
from kvmesh.sim.config import ReplayError
from kvmesh.sim.trace import Trace, TraceRequest, load_trace, prefix_hit_bound, write_trace

__all__ = [
    "ArrivalKind",
    "WorkloadConfig",
    "WorkloadKind",
    "arrival_times",
    "generate",
    "retime",
    "run_workload",
    "sharing",
    "with_sessions",
]

AZURE_TRACES = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}
"""The Azure trace file each Azure-based kind reads (under `azure_dir`)."""


class WorkloadKind(enum.Enum):
    """What a workload models (see the module doc)."""

    MOONCAKE = "mooncake"
    CONV = "conv"
    CODE = "code"
    AGENTIC = "agentic"
    TENANTS = "tenants"


class ArrivalKind(enum.Enum):
    """How requests (or sessions) arrive (see the module doc)."""

    STEADY = "steady"
    BURSTY = "bursty"
    TRACE = "trace"


@dataclass
class WorkloadConfig:
    """Settings of `kvmesh workload` (every generator reads the ones it names)."""

    kind: WorkloadKind = opt(WorkloadKind.CONV, "what to generate: conv, code, agentic, tenants")
    out: str = opt("", "write the trace here (Mooncake JSONL; required)")
    requests: int = opt(2000, "number of requests")
    arrival: ArrivalKind = opt(
        ArrivalKind.STEADY, "steady (Poisson), bursty (on-off), trace (Azure timestamps)"
    )
    rate: float = opt(
        0.0, "mean arrivals per second (requests; sessions for agentic); 0: the kind's default"
    )
    burst_s: float = opt(10.0, "bursty: mean length of a burst, s (lulls last 3x as long)")
    seed: int = opt(0, "seed of every random choice")
    block_size: int = opt(64, "tokens per hash id (replay with --trace-block-size this)")
    azure_dir: str = opt(
        "../shared/ref/traces", "folder of AzureLLMInferenceTrace_{conv,code}.csv (conv, code)"
    )
    source: str = opt(
        "../shared/ref/traces/mooncake_synthetic_trace.jsonl", "mooncake: the trace to retime"
    )
    # conv, code
    system_prompts: int = opt(0, "conv/code: shared system prompts (0: the kind's default)")
    system_tokens: list[int] = opt([], "conv/code: system prompt length range [lo, hi]")
    zipf: float = opt(1.1, "Zipf exponent of system prompt, agent and tenant popularity")
    follow: float = opt(-1.0, "conv/code: chance a row continues a fitting session (-1: default)")
    min_message_tokens: int = opt(16, "conv/code: shortest new user message of a turn")
    think_s: float = opt(2.0, "conv/code: shortest gap between two turns of a session, s")
    session_idle_s: float = opt(600.0, "conv/code: a session idle this long is closed, s")
    # agentic
    agent_types: int = opt(4, "agentic: agents (each with its own tool-laden system prompt)")
    agent_system_tokens: list[int] = opt([2000, 6000], "agentic: system prompt length range")
    agent_steps: float = opt(8.0, "agentic: mean steps of a session (geometric)")
    tool_call_tokens: int = opt(80, "agentic: median output (tool call) tokens")
    tool_result_tokens: int = opt(400, "agentic: median tool result tokens")
    tool_latency_s: float = opt(1.0, "agentic: mean tool latency, s")
    max_context_tokens: int = opt(32768, "agentic: a session ends past this prompt length")
    est_prefill_tok_per_s: float = opt(
        20000.0, "agentic: assumed prefill speed for step spacing, tokens/s"
    )
    est_itl_ms: float = opt(20.0, "agentic: assumed inter-token latency for step spacing, ms")
    # tenants
    tenants: int = opt(100, "tenants: tenants (each with its own long prefix)")
    tenant_prefix_tokens: list[int] = opt([2000, 16000], "tenants: prefix length range")
    query_tokens: int = opt(300, "tenants: median unique query tokens")
    output_tokens: int = opt(150, "tenants: median output tokens")

    def __post_init__(self) -> None:
        self.kind = WorkloadKind(self.kind)
        self.arrival = ArrivalKind(self.arrival)
        if self.requests < 1:
            raise ReplayError("--requests must be >= 1")
        if self.block_size < 1:
            raise ReplayError("--block-size must be >= 1")
        if not (self.rate >= 0 and math.isfinite(self.rate)):
            raise ReplayError("--rate must be a finite number >= 0")
        if not self.burst_s > 0:
            raise ReplayError("--burst-s must be > 0")
        if self.arrival is ArrivalKind.TRACE and self.kind in _GENERATED:
            raise ReplayError(
                "--arrival trace needs a kind read from a trace (mooncake, conv, code)"
            )
        for name in ("system_tokens", "agent_system_tokens", "tenant_prefix_tokens"):
            rng = getattr(self, name)
            if rng and (len(rng) != 2 or not 0 <= rng[0] <= rng[1]):
                raise ReplayError(f"--{name.replace('_', '-')} must be two numbers 0 <= lo <= hi")
        if not 0 <= self.follow <= 1 and self.follow != -1:
            raise ReplayError("--follow must be in [0, 1] (or -1: the kind's default)")
        if self.zipf < 0 or self.agent_steps < 1 or self.agent_types < 1 or self.tenants < 1:
            raise ReplayError("--zipf >= 0, --agent-steps >= 1, --agent-types/--tenants >= 1")


_GENERATED = (WorkloadKind.AGENTIC, WorkloadKind.TENANTS)
"""Kinds with no source trace (their arrivals are all generated)."""

_DEFAULTS: dict[WorkloadKind, dict[str, object]] = {
    WorkloadKind.MOONCAKE: {},
    # Azure conv (ISL mean 1,155, OSL 211): chat assistants, several turns per session.
    WorkloadKind.CONV: {"system_prompts": 32, "system_tokens": [200, 1200], "follow": 0.7},
    # Azure code (ISL mean 2,048, OSL 28): a few IDE system prompts, edits re-sending context.
    WorkloadKind.CODE: {"system_prompts": 8, "system_tokens": [400, 2000], "follow": 0.5},
    WorkloadKind.AGENTIC: {"rate": 0.5},
    WorkloadKind.TENANTS: {"rate": 4.0},
}
"""Per kind: the values of settings left at their "kind's default" value (rates: requests/s;
agentic: sessions/s; kinds read from a trace keep its mean rate)."""


def _resolved(config: WorkloadConfig) -> WorkloadConfig:
    """`config` with the kind's defaults filled in."""
    defaults = _DEFAULTS[config.kind]
    changes: dict[str, object] = {}
    for f in fields(config):
        if f.name not in defaults:
            continue
        unset = f.default if f.default_factory is MISSING else f.default_factory()
        if getattr(config, f.name) == unset:  # left at its "the kind's default" value
            changes[f.name] = defaults[f.name]
    return replace(config, **changes) if changes else config  # type: ignore[arg-type]


# -- arrivals -------------------------------------------------------------------------------


def arrival_times(
    kind: ArrivalKind, n: int, rate: float, rng: random.Random, burst_s: float = 10.0
) -> list[float]:
    """`n` increasing arrival times (s, the first at 0) of mean rate `rate` per second (see the
    module doc; `kind` TRACE has no times of its own here)."""
    if kind is ArrivalKind.TRACE:
        raise ValueError("trace arrivals come from the trace")
    if not rate > 0:
        raise ValueError("rate must be > 0")
    times: list[float] = []
    t = 0.0
    if kind is ArrivalKind.STEADY:
        for _ in range(n):
            times.append(t)
            t += rng.expovariate(rate)
        return times
    hi, lo = 3.0 * rate, rate / 3.0
    # 1/4 of the time in bursts keeps the mean: 0.25 * 3r + 0.75 * r/3 = r
    burst = rng.random() < 0.25
    state_end = rng.expovariate(1.0 / (burst_s if burst else 3.0 * burst_s))
    while len(times) < n:
        gap = rng.expovariate(hi if burst else lo)
        if t + gap < state_end:
            t += gap
            times.append(t)
            continue
        # memoryless: switch state and draw again from its rate
        t = state_end
        burst = not burst
        state_end = t + rng.expovariate(1.0 / (burst_s if burst else 3.0 * burst_s))
    first = times[0]
    return [x - first for x in times]


# -- ids and lengths ------------------------------------------------------------------------


class _Ids:
    """Fresh hash ids, and the fixed ids of shared documents."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def fresh(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(max(0, n))]


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _lognormal(rng: random.Random, median: float, sigma: float = 0.8, lo: int = 1) -> int:
    return max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))


def _zipf_picker(n: int, s: float, rng: random.Random) -> list[float]:
    """Cumulative weights of Zipf(s) over n items (for rng.choices / bisect)."""
    return list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))


def _pick(cum: list[float], rng: random.Random) -> int:
    return bisect.bisect_left(cum, rng.random() * cum[-1])


def _prompt_ids(shared: list[int], shared_tokens: int, isl: int, bs: int, ids: _Ids) -> list[int]:
    """Hash ids of an `isl`-token prompt whose first `shared_tokens` tokens are those of the
    document with ids `shared`: its full blocks, then fresh ids."""
    keep = min(shared_tokens, isl) // bs
    return shared[:keep] + ids.fresh(_blocks(isl, bs) - keep)


# -- Azure traces with sessions -------------------------------------------------------------


@dataclass(slots=True)
class _Session:
    ids: list[int]
    """Hash ids of its last prompt."""
    prompt_tokens: int
    context_tokens: int
    """Last prompt plus its output: what the next turn repeats and extends."""
    last_s: float


@dataclass
class _Documents:
    """Shared documents (system prompts, agent prompts, tenant prefixes): lengths and ids."""

    tokens: list[int] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)
    cum: list[float] = field(default_factory=list)

    @classmethod
    def make(
        cls, n: int, span: list[int], zipf: float, bs: int, ids: _Ids, rng: random.Random
    ) -> _Documents:
        docs = cls()
        for _ in range(n):
            tokens = rng.randint(span[0], span[1])
            docs.tokens.append(tokens)
            docs.ids.append(ids.fresh(_blocks(tokens, bs)))
        docs.cum = _zipf_picker(n, zipf, rng)
        return docs


def with_sessions(
    rows: list[TraceRequest], config: WorkloadConfig, rng: random.Random, path: str
) -> Trace:
    """Azure rows (prompt and output lengths, arrival times; no hash ids) as turns of
    conversations on shared system prompts (see the module doc)."""
    cfg = _resolved(config)
    bs = cfg.block_size
    ids = _Ids()
    docs = _Documents.make(cfg.system_prompts, cfg.system_tokens, cfg.zipf, bs, ids, rng)
    open_sessions: list[_Session] = []
    out: list[TraceRequest] = []
    for row in rows:
        now = row.timestamp_ms / 1e3
        open_sessions = [s for s in open_sessions if now - s.last_s <= cfg.session_idle_s]
        isl = row.input_length
        session: _Session | None = None
        if rng.random() < cfg.follow:
            fits = [
                s
                for s in open_sessions
                if now - s.last_s >= cfg.think_s
                and s.context_tokens + cfg.min_message_tokens <= isl
            ]
            if fits:
                session = rng.choice(fits)
        if session is not None:
            hash_ids = _prompt_ids(session.ids, session.prompt_tokens, isl, bs, ids)
            session.ids = hash_ids
        else:
            d = _pick(docs.cum, rng)
            shared = min(docs.tokens[d], max(0, isl - cfg.min_message_tokens))
            hash_ids = _prompt_ids(docs.ids[d], shared, isl, bs, ids)
            session = _Session(hash_ids, isl, isl, now)
            open_sessions.append(session)
        session.prompt_tokens = isl
        session.context_tokens = isl + row.output_length
        session.last_s = now
        out.append(TraceRequest(row.timestamp_ms, isl, row.output_length, hash_ids))
    return Trace(path, out)


def retime(
    rows: list[TraceRequest], config: WorkloadConfig, rng: random.Random
) -> list[TraceRequest]:
    """`rows` (in arrival order) with arrival times from `config.arrival` (unchanged for
    TRACE) at `config.rate`, or at the rows' own mean rate when that is 0."""
    if config.arrival is ArrivalKind.TRACE or len(rows) < 2:
        return rows
    rate = config.rate
    if not rate:
        span_s = (rows[-1].timestamp_ms - rows[0].timestamp_ms) / 1e3
        rate = (len(rows) - 1) / span_s if span_s > 0 else 1.0
    times = arrival_times(config.arrival, len(rows), rate, rng, config.burst_s)
    return [replace(r, timestamp_ms=1e3 * t) for r, t in zip(rows, times, strict=True)]


def _read(path: str, n: int) -> list[TraceRequest]:
    rows = load_trace(path, n).requests
    if len(rows) < n:
        raise ReplayError(f"{path} holds {len(rows)} requests, fewer than --requests {n}")
    return rows


def _azure(config: WorkloadConfig, rng: random.Random) -> Trace:
    path = str(Path(config.azure_dir) / AZURE_TRACES[config.kind.value])
    return with_sessions(retime(_read(path, config.requests), config, rng), config, rng, path)


# -- agentic --------------------------------------------------------------------------------


def _agentic(config: WorkloadConfig, rng: random.Random) -> Trace:
    cfg = config
    bs = cfg.block_size
    ids = _Ids()
    docs = _Documents.make(cfg.agent_types, cfg.agent_system_tokens, cfg.zipf, bs, ids, rng)
    out: list[TraceRequest] = []
    # enough sessions for the requests: sessions average at most agent_steps requests
    starts = arrival_times(cfg.arrival, cfg.requests, cfg.rate, rng, cfg.burst_s)
    p_stop = 1.0 / cfg.agent_steps
    for start in starts:
        if len(out) >= cfg.requests:
            break
        d = _pick(docs.cum, rng)
        isl = docs.tokens[d] + _lognormal(rng, 400)
        hash_ids = _prompt_ids(docs.ids[d], docs.tokens[d], isl, bs, ids)
        t = start
        while True:
            osl = _lognormal(rng, cfg.tool_call_tokens, 0.6)
            out.append(TraceRequest(1e3 * t, isl, osl, hash_ids))
            if rng.random() < p_stop:
                break
            result = _lognormal(rng, cfg.tool_result_tokens, 1.0)
            next_isl = isl + osl + result
            if next_isl > cfg.max_context_tokens:
                break
            service = isl / cfg.est_prefill_tok_per_s + osl * cfg.est_itl_ms / 1e3
            t += service + rng.expovariate(1.0 / cfg.tool_latency_s)
            hash_ids = _prompt_ids(hash_ids, isl, next_isl, bs, ids)
            isl = next_isl
    out.sort(key=lambda r: r.timestamp_ms)
    return Trace("agentic", out[: cfg.requests])


# -- multi-tenant ---------------------------------------------------------------------------


def _tenants(config: WorkloadConfig, rng: random.Random) -> Trace:
    cfg = config
    bs = cfg.block_size
    ids = _Ids()
    docs = _Documents.make(cfg.tenants, cfg.tenant_prefix_tokens, cfg.zipf, bs, ids, rng)
    out: list[TraceRequest] = []
    for t in arrival_times(cfg.arrival, cfg.requests, cfg.rate, rng, cfg.burst_s):
        d = _pick(docs.cum, rng)
        isl = docs.tokens[d] + _lognormal(rng, cfg.query_tokens)
        hash_ids = _prompt_ids(docs.ids[d], docs.tokens[d], isl, bs, ids)
        out.append(TraceRequest(1e3 * t, isl, _lognormal(rng, cfg.output_tokens), hash_ids))
    return Trace("tenants", out)


# -- entry points ---------------------------------------------------------------------------


def generate(config: WorkloadConfig) -> Trace:
    """The workload `config` describes (deterministic in its settings and seed)."""
    cfg = _resolved(config)
    rng = random.Random(f"kvmesh-workload\0{cfg.kind.value}\0{cfg.seed}")
    if cfg.kind is WorkloadKind.MOONCAKE:
        trace = Trace(cfg.source, retime(_read(cfg.source, cfg.requests), cfg, rng))
    elif cfg.kind in (WorkloadKind.CONV, WorkloadKind.CODE):
        trace = _azure(cfg, rng)
    elif cfg.kind is WorkloadKind.AGENTIC:
        trace = _agentic(cfg, rng)
    else:
        trace = _tenants(cfg, rng)
    if cfg.out:
        trace.path = cfg.out
    return trace


def sharing(trace: Trace, block_size: int) -> dict[str, float]:
    """The sharing `trace` holds: its infinite-cache prefix hit bound (blocks, tokens), its
    requests, and the mean prompt and output lengths."""
    blocks, tokens = prefix_hit_bound(trace, block_size)
    n = len(trace.requests)
    return {
        "requests": n,
        "prefix_bound_blocks": blocks,
        "prefix_bound_tokens": tokens,
        "isl_mean": sum(r.input_length for r in trace.requests) / n,
        "osl_mean": sum(r.output_length for r in trace.requests) / n,
    }


def run_workload(ns: argparse.Namespace) -> int:
    """`kvmesh workload`: generate and write a trace, print what it holds."""
    config = from_args(WorkloadConfig, ns)
    if not config.out:
        raise ReplayError("give --out FILE")
    trace = generate(config)
    write_trace(trace, config.out)
    stats = sharing(trace, config.block_size)
    print(
        f"{config.out}: {stats['requests']:.0f} requests, ISL mean {stats['isl_mean']:.0f}, "
        f"OSL mean {stats['osl_mean']:.0f}, span {trace.requests[-1].timestamp_ms / 1e3:.0f} s, "
        f"prefix bound {100 * stats['prefix_bound_tokens']:.1f} % of tokens "
        f"(replay with --trace-block-size {config.block_size})"
    )
    return 0
