"""Speculative decoding (prompt lookup) on the torch engine (not collected by pytest).

Usage:
  .venv/bin/python tests/benchmarks/bench_torch_speculative.py [--model tiny|large|DIR]
      [--device cpu] [--dtype float32] [--new 128] [--batch 1] [--threads 0]

Greedy requests with a repetitive prompt (a 24-token phrase repeated 8 times), EOS ignored,
`--batch` at once, on engines with 0 (off), 2, 4 and 8 speculative tokens: output tokens/s
(after a warm-up run), the drafts' acceptance rate and tokens per step of the drafting
requests, and whether the output equals the plain engine's token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from bench_torch_engine import engine, model_dir, prompt_of

from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model


async def _one(eng: TorchEngine, rid: str, prompt: list[int], new: int) -> list[int]:
    request = EngineRequest(
        rid,
        prompt,
        SamplingParams(temperature=0.0),
        StopParams(max_tokens=new, ignore_eos=True),
    )
    return [t async for o in eng.generate(request) for t in o.token_ids]


async def run(path: Path, loaded: LoadedModel, k: int, new: int, batch: int) -> None:
    eng = engine(path, loaded, num_speculative_tokens=k)
    await eng.start()
    prompts = [prompt_of(24, salt) * 8 for salt in range(batch)]
    await asyncio.gather(*(_one(eng, f"w{i}", p, 8) for i, p in enumerate(prompts)))  # warm-up
    before = eng.scheduler.spec
    steps0, drafts0, acc0, emit0 = (
        before.steps,
        before.draft_tokens,
        before.accepted_tokens,
        before.emitted_tokens,
    )
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(_one(eng, f"r{i}", p, new) for i, p in enumerate(prompts)))
    dt = time.perf_counter() - t0
    s = eng.scheduler.spec
    steps, drafts = s.steps - steps0, s.draft_tokens - drafts0
    accepted, emitted = s.accepted_tokens - acc0, s.emitted_tokens - emit0
    await eng.stop()
    rate = accepted / drafts if drafts else 0.0
    per_step = emitted / steps if steps else 1.0
    global _PLAIN
    if k == 0:
        _PLAIN = outs
    same = "identical" if outs == _PLAIN else "DIFFERENT"
    print(
        f"  spec tokens {k}: {batch * new / dt:8.1f} tok/s   acceptance {rate:5.1%}   "
        f"tokens/step {per_step:4.2f}   output {same} to plain decoding"
    )


_PLAIN: list[list[int]] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, large or a model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=[d.value for d in TorchDType])
    parser.add_argument("--new", type=int, default=128, help="output tokens per request")
    parser.add_argument("--batch", type=int, default=1, help="concurrent requests")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        path = model_dir(ns.model, Path(tmp))
        loaded = load_model(path, ns.device, TorchDType(ns.dtype))
        print(f"model {ns.model} on {loaded.device} as {loaded.dtype}, batch {ns.batch}")
        for k in (0, 2, 4, 8):
            asyncio.run(run(path, loaded, k, ns.new, ns.batch))


if __name__ == "__main__":
    main()
