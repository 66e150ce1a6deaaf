"""Structured output on the torch engine: what the grammar mask costs the batch (not collected
by pytest).

Usage:
  .venv/bin/python tests/benchmarks/bench_guided.py [--model tiny|large|DIR] [--batch 8]
      [--new 96] [--rounds 3]

Output tokens/s of `--batch` concurrent sampled requests (temperature 1, `--new` tokens at
most) with none, half and all of them guided by a JSON schema (a string field long enough that
guided requests run about as long as plain ones), best of `--rounds`; and per guided step, the
time spent filling and applying the masks (kvmesh.workers.pytorch.guided.apply_grammars).
Plain requests ignore EOS; guided ones end when their JSON does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch

from kvmesh.runtime.types import (
    EngineRequest,
    GuidedDecoding,
    GuidedKind,
    SamplingParams,
    StopParams,
)
from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.guided import GrammarCompiler, apply_grammars
from kvmesh.workers.pytorch.model_runner import load_model
from tests.benchmarks.bench_torch_engine import engine, model_dir, prompt_of

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "text": {"type": "string", "minLength": 150, "maxLength": 200},
        },
        "required": ["id", "text"],
        "additionalProperties": False,
    }
)


async def tps(eng: TorchEngine, batch: int, guided: int, new: int) -> float:
    async def one(i: int) -> int:
        g = GuidedDecoding(GuidedKind.JSON_SCHEMA, SCHEMA) if i < guided else None
        request = EngineRequest(
            f"g-{i}-{time.monotonic_ns()}",
            prompt_of(64, 300 + i),
            SamplingParams(temperature=1.0, seed=i, guided=g),
            StopParams(max_tokens=new, ignore_eos=g is None),
        )
        return sum([len(o.token_ids) async for o in eng.generate(request)])

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(batch)))
    return sum(counts) / (time.perf_counter() - t0)


def mask_ms(path: Path, vocab: int, batch: int, guided: int, steps: int = 60) -> float:
    """Mean time of one step's `apply_grammars` over `guided` rows of a [batch, vocab] logits
    tensor (each row's grammar advanced by its best allowed token)."""
    compiler = GrammarCompiler.from_model_dir(path, vocab)
    g = GuidedDecoding(GuidedKind.JSON_SCHEMA, SCHEMA)
    states = [compiler.state(g, [vocab - 2]) for _ in range(guided)]
    outputs: list[list[int]] = [[] for _ in range(guided)]
    gen = torch.Generator().manual_seed(0)
    spent = 0.0
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        apply_grammars(logits, list(enumerate(states)))
        spent += time.perf_counter() - t0
        for row, state in enumerate(states):
            outputs[row].append(int(torch.argmax(logits[row])))
            state.advance(outputs[row])
    return spent / steps * 1e3


async def run(path: Path, device: str, batch: int, new: int, rounds: int) -> None:
    loaded = load_model(path, device, TorchDType.FLOAT32)
    eng = engine(path, loaded)
    await eng.start()
    print(f"batch {batch}, up to {new} output tokens each, temperature 1, best of {rounds}:")
    await tps(eng, batch, batch, 8)  # warm-up
    for guided in (0, batch // 2, batch):
        best = max([await tps(eng, batch, guided, new) for _ in range(rounds)])
        mask = ""
        if guided:
            mask = f"   mask {mask_ms(path, loaded.vocab_size, batch, guided):.2f} ms/step"
        print(f"  {guided}/{batch} guided: {best:8.1f} output tok/s{mask}", flush=True)
    await eng.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, large or a model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        path = model_dir(ns.model, Path(tmp))
        asyncio.run(run(path, ns.device, ns.batch, ns.new, ns.rounds))


if __name__ == "__main__":
    main()
