"""`kvmesh profile --engine mocker`: the mocker's performance profile (kvmesh.planner.profile),
measured by driving its scheduler (the live `MockerScheduler`) in virtual time: seconds of CPU,
no processes.

  * prefill, per prompt length: TTFT of one prompt alone on an idle worker (the sum of the
    simulated steps until its first token), and the saturated throughput (prompt tokens/s while
    `SATURATE_STEPS` steps' worth of such prompts prefill at once);
  * decode, per (context length, concurrency): that many sequences of that length prefill,
    then `DECODE_STEPS` steps in which all of them decode give the ITL (mean step duration) and
    the output tokens/s. A load that does not fit the KV cache (sequences x context > the
    pool's tokens, with its watermark) is left null.

Prompts are unique random token runs (no prefix sharing); every sequence asks for exactly its
tokens (EOS ignored). Times are what a live mocker of the config shows: simulated step times
divided by its `--speedup-ratio` (1 in a replay). Deterministic for a given MockerConfig.
"""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime

from kvmesh.planner.profile import DecodeGrid, PerfProfile, PrefillCurve, RoleProfile
from kvmesh.runtime.types import EngineRequest, Role, SamplingParams, StopParams
from kvmesh.sim.trace import VOCAB_SIZE
from kvmesh.workers.mocker.config import MockerConfig
from kvmesh.workers.mocker.scheduler import MockerScheduler

__all__ = ["DECODE_STEPS", "SATURATE_STEPS", "profile_mocker"]

ISL_POINTS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
CONTEXT_POINTS = (256, 1024, 4096, 16384, 65536)
CONCURRENCY_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DECODE_STEPS = 16
"""Decode steps timed per grid point (after every sequence has its first token)."""
SATURATE_STEPS = 4
"""Steps' worth of prompts (by the token budget) queued at once to measure throughput."""


class _Driver:
    """A fresh scheduler per measurement; unique prompts; steps summed in virtual time."""

    def __init__(self, config: MockerConfig, max_model_len: int, seed: int) -> None:
        self.config = config
        self.speedup = config.speedup_ratio
        self.max_model_len = max_model_len
        self.rng = random.Random(seed)
        self.n = 0

    def scheduler(self) -> MockerScheduler:
        return MockerScheduler(self.config, vocab_size=VOCAB_SIZE, max_model_len=self.max_model_len)

    def add(self, sched: MockerScheduler, prompt_len: int, max_tokens: int, now: float) -> str:
        self.n += 1
        rid = f"p{self.n}"
        prompt = list(self.rng.randbytes(prompt_len))
        sched.add(
            EngineRequest(
                rid,
                prompt,
                SamplingParams(temperature=0.0),
                StopParams(max_tokens=max_tokens, ignore_eos=True),
            ),
            now,
        )
        return rid

    def prefill(self, isl: int) -> tuple[float, float]:
        """(TTFT ms alone, saturated prompt tokens/s) for `isl`-token prompts."""
        sched = self.scheduler()
        self.add(sched, isl, 1, 0.0)
        now = 0.0
        while sched.has_work:
            now += sched.step(now).duration_s
        ttft_ms = 1e3 * now / self.speedup
        budget_tokens = SATURATE_STEPS * self.config.max_num_batched_tokens
        room = (self.config.num_gpu_blocks - self.config.watermark_blocks) * self.config.block_size
        count = max(1, min(budget_tokens // isl, room // max(isl, 1), self.config.max_num_seqs))
        sched = self.scheduler()
        for _ in range(count):
            self.add(sched, isl, 1, 0.0)
        now = 0.0
        while sched.has_work:
            now += sched.step(now).duration_s
        return ttft_ms, count * isl * self.speedup / now if now > 0 else 0.0

    def decode(self, context: int, concurrency: int) -> tuple[float, float] | None:
        """(ITL ms, output tokens/s) with `concurrency` sequences of about `context` tokens
        decoding; None when they do not fit."""
        cfg = self.config
        room = (cfg.num_gpu_blocks - cfg.watermark_blocks) * cfg.block_size
        # The first sequences decode while the last ones still prefill: enough tokens that
        # none finishes before the timed steps end.
        tokens = DECODE_STEPS + 2 + -(-concurrency * context // cfg.max_num_batched_tokens) + 1
        per_seq = context + tokens
        if concurrency > cfg.max_num_seqs or concurrency * (per_seq + cfg.block_size) > room:
            return None
        if per_seq > self.max_model_len:
            return None
        sched = self.scheduler()
        for _ in range(concurrency):
            self.add(sched, context, tokens, 0.0)
        now = 0.0
        started: set[str] = set()
        while len(started) < concurrency:  # prefill everything: each sequence's first token
            step = sched.step(now)
            now += step.duration_s
            started.update(o.request_id for o in step.outputs)
            if not step.num_scheduled:
                return None
        total = 0.0
        steps = 0
        while steps < DECODE_STEPS:
            step = sched.step(now)
            if step.prefill_tokens or step.num_preempted or step.decode_tokens != concurrency:
                return None  # not a clean decode step: the load does not fit
            now += step.duration_s
            total += step.duration_s
            steps += 1
        itl_s = total / steps / self.speedup
        return 1e3 * itl_s, concurrency / itl_s


def profile_mocker(
    config: MockerConfig, *, max_model_len: int = 0, model: str = "", seed: int = 0
) -> PerfProfile:
    """Measure the mocker of `config` (see the module doc). `max_model_len` 0: the config's,
    else the largest point measured."""
    limit = max_model_len or config.max_model_len or max(ISL_POINTS) + DECODE_STEPS + 8
    driver = _Driver(config, limit, seed)
    t0 = time.perf_counter()
    isl = [n for n in ISL_POINTS if n + 1 <= limit]
    ttft: list[float] = []
    thpt: list[float] = []
    for n in isl:
        t, x = driver.prefill(n)
        ttft.append(t)
        thpt.append(x)
    contexts = [c for c in CONTEXT_POINTS if c + DECODE_STEPS + 2 <= limit]
    concurrency = [c for c in CONCURRENCY_POINTS if c <= config.max_num_seqs]
    itl: list[list[float | None]] = []
    dthpt: list[list[float | None]] = []
    for ctx in contexts:
        row: list[float | None] = []
        trow: list[float | None] = []
        for conc in concurrency:
            got = driver.decode(ctx, conc) if not row or row[-1] is not None else None
            row.append(None if got is None else got[0])
            trow.append(None if got is None else got[1])
        itl.append(row)
        dthpt.append(trow)
    return PerfProfile(
        engine="mocker",
        model=model,
        source="virtual-time mocker (kvmesh.sim.profiler)",
        roles={
            Role.AGGREGATED: RoleProfile(
                PrefillCurve([float(n) for n in isl], ttft, thpt),
                DecodeGrid(
                    [float(c) for c in contexts], [float(c) for c in concurrency], itl, dthpt
                ),
            )
        },
        kv_capacity_tokens=config.num_gpu_blocks * config.block_size,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        extra={
            "block_size": config.block_size,
            "num_gpu_blocks": config.num_gpu_blocks,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_chunked_prefill": config.enable_chunked_prefill,
            "timing_profile": config.timing_profile,
            "speedup_ratio": config.speedup_ratio,
            "measure_wall_s": round(time.perf_counter() - t0, 3),
        },
    )
