"""Micro-benchmark of the mocker's synchronous scheduler (not collected by pytest).

Usage: .venv/bin/python tests/benchmarks/bench_mocker.py [--seqs 256] [--steps 2000]

Measures pure Python cost: steps/s and tokens/s of MockerScheduler.step() with `--seqs` requests
decoding at once (prefix caching on, KV events published to a log with no subscribers), plus the
cost of the prefill phase that admits them.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kvmesh.runtime.kv_events import KvEventLog
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.mocker import MockerConfig, MockerEngine, MockerScheduler


def run(seqs: int, steps: int, prompt_len: int, logprobs: bool) -> None:
    config = MockerConfig(num_gpu_blocks=65536, block_size=64, max_num_seqs=seqs)
    log = KvEventLog()
    sched = MockerScheduler(config, vocab_size=32000, max_model_len=1 << 20, events=log)
    for i in range(seqs):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        sched.add(
            EngineRequest(
                f"r{i}",
                prompt,
                SamplingParams(temperature=0.0, top_logprobs=5 if logprobs else None),
                StopParams(max_tokens=steps + 10),
            ),
            0.0,
        )
    t0 = time.perf_counter()
    prefill_steps = 0
    while sched.num_waiting:  # admit everything
        sched.step(0.0)
        prefill_steps += 1
    t1 = time.perf_counter()
    # Make sure every sequence is decoding (last prefill chunk done).
    while sched.load().pending_prefill_tokens:
        sched.step(0.0)
        prefill_steps += 1
    assert sched.num_running == seqs, sched.num_running
    t2 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += len(sched.step(0.0).outputs)
    t3 = time.perf_counter()
    decode = t3 - t2
    print(
        f"seqs={seqs} prompt={prompt_len} logprobs={logprobs}: "
        f"admission+prefill {prefill_steps} steps in {(t1 - t0) * 1e3:.1f} ms; "
        f"decode {steps} steps in {decode:.3f} s -> {steps / decode:,.0f} steps/s, "
        f"{tokens / decode:,.0f} tokens/s, {decode / steps * 1e6:.0f} us/step "
        f"({decode / tokens * 1e6:.2f} us/token); kv events {log.last_event_id}"
    )


async def run_engine(seqs: int, tokens: int, prompt_len: int) -> None:
    """End to end through MockerEngine (asyncio loop, per-request streams), speedup 1e9."""
    config = MockerConfig(num_gpu_blocks=65536, block_size=64, max_num_seqs=seqs, speedup_ratio=1e9)
    engine = MockerEngine(
        config, served_model_name="bench", vocab_size=32000, context_length=1 << 16
    )
    await engine.start()

    async def one(i: int) -> int:
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        request = EngineRequest(
            f"r{i}", prompt, SamplingParams(temperature=0.0), StopParams(max_tokens=tokens)
        )
        return sum([len(o.token_ids) async for o in engine.generate(request)])

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(one(i) for i in range(seqs))))
    elapsed = time.perf_counter() - t0
    steps = engine.scheduler.num_steps
    await engine.stop()
    print(
        f"engine: {seqs} concurrent requests x {tokens} tokens (prompt {prompt_len}): "
        f"{elapsed * 1e3:.0f} ms, {steps} steps, {steps / elapsed:,.0f} steps/s, "
        f"{total / elapsed:,.0f} tokens/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--prompt-len", type=int, default=512)
    args = p.parse_args()
    run(args.seqs, args.steps, args.prompt_len, logprobs=False)
    run(args.seqs, args.steps // 4, args.prompt_len, logprobs=True)
    asyncio.run(run_engine(200, 8, 128))
    asyncio.run(run_engine(args.seqs, 256, args.prompt_len))


if __name__ == "__main__":
    main()
