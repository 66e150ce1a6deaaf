"""Speculative decoding on the torch engine: prompt lookup and a draft model, with and without
adaptive drafting (not collected by pytest).

Usage:
  .venv/bin/python tests/benchmarks/bench_torch_speculative.py [--model tiny|large|DIR]
      [--draft cut|self|none|DIR] [--device cpu] [--dtype float32] [--new 128] [--batch 1]
      [--threads 0] [--ks 2,4] [--thresholds 0,0.3] [--prompts repetitive,random] [--repeat 1]

Greedy requests, EOS ignored, `--batch` at once, on each prompt kind:
  repetitive  a 24-token phrase repeated 8 times (prompt lookup finds the continuation)
  random      192 random token ids (what the model continues with is its own business)
and engines with speculation off, then prompt lookup and the draft model at each K of `--ks`
and each adaptive threshold of `--thresholds` (`--torch-spec-min-acceptance`; 0: always draft).
`--draft`: cut = the model cut to its first layer (its other weights equal: the same seed),
self = the model itself (acceptance ~100 %: the mechanism's own cost), none, or a directory.
Per engine: output tokens/s (wall), CPU seconds per output token (process CPU time: less noisy
than wall time on a shared machine), the drafts' acceptance, tokens per verification step, the
share of drafting-eligible steps skipped by the back-off, and whether the output equals the
plain engine's token for token. Each engine gets a warm-up run; `--repeat` runs each setting
that many times (alternating) and reports the median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_torch_engine import engine, model_dir, prompt_of

from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from kvmesh.workers.pytorch.weights import create_tiny_weights


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    k: int = 0
    draft: str = ""
    threshold: float = 0.0


@dataclass(slots=True)
class Result:
    tok_s: float
    cpu_ms: float
    acceptance: float
    per_step: float
    skipped: float
    outputs: list[list[int]]


async def _one(eng: TorchEngine, rid: str, prompt: list[int], new: int) -> list[int]:
    request = EngineRequest(
        rid,
        prompt,
        SamplingParams(temperature=0.0),
        StopParams(max_tokens=new, ignore_eos=True),
    )
    return [t async for o in eng.generate(request) for t in o.token_ids]


async def run(
    path: Path, loaded: LoadedModel, s: Setting, prompts: list[list[int]], new: int
) -> Result:
    eng = engine(
        path,
        loaded,
        num_speculative_tokens=s.k,
        draft_model=s.draft,
        spec_min_acceptance=s.threshold,
    )
    await eng.start()
    try:
        await asyncio.gather(*(_one(eng, f"w{i}", p, 8) for i, p in enumerate(prompts)))
        b = eng.scheduler.spec
        steps0, drafts0, acc0, emit0, skip0 = (
            b.steps,
            b.draft_tokens,
            b.accepted_tokens,
            b.emitted_tokens,
            b.skipped_steps,
        )
        c0, t0 = time.process_time(), time.perf_counter()
        outs = await asyncio.gather(*(_one(eng, f"r{i}", p, new) for i, p in enumerate(prompts)))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        sp = eng.scheduler.spec
        steps, drafts = sp.steps - steps0, sp.draft_tokens - drafts0
        accepted, emitted = sp.accepted_tokens - acc0, sp.emitted_tokens - emit0
        skipped = sp.skipped_steps - skip0
    finally:
        await eng.stop()
    total = len(prompts) * new
    return Result(
        total / dt,
        1000 * cpu / total,
        accepted / drafts if drafts else 0.0,
        emitted / steps if steps else 1.0,
        skipped / (skipped + steps) if skipped + steps else 0.0,
        outs,
    )


def draft_dir(kind: str, main: Path, tmp: Path) -> str:
    if kind == "none":
        return ""
    if kind == "self":
        return str(main)
    if kind != "cut":
        return kind
    path = tmp / "draft-cut"
    shutil.copytree(main, path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    create_tiny_weights(path)  # the same seed: embeddings, layer 0 and lm_head equal the model's
    return str(path)


def prompts_of(kind: str, batch: int) -> list[list[int]]:
    if kind == "repetitive":
        return [prompt_of(24, salt) * 8 for salt in range(batch)]
    rng = random.Random(7)
    return [[rng.randrange(100, 3900) for _ in range(192)] for _ in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, large or a model directory")
    parser.add_argument("--draft", default="cut", help="cut, self, none or a model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=[d.value for d in TorchDType])
    parser.add_argument("--new", type=int, default=128, help="output tokens per request")
    parser.add_argument("--batch", type=int, default=1, help="concurrent requests")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--ks", default="2,4", help="speculative token counts")
    parser.add_argument("--thresholds", default="0,0.3", help="adaptive thresholds (0: off)")
    parser.add_argument("--prompts", default="repetitive,random")
    parser.add_argument("--repeat", type=int, default=1, help="runs per setting (median)")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    ks = [int(k) for k in ns.ks.split(",") if k]
    thresholds = [float(t) for t in ns.thresholds.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        path = model_dir(ns.model, Path(tmp))
        draft = draft_dir(ns.draft, path, Path(tmp))
        loaded = load_model(path, ns.device, TorchDType(ns.dtype))
        settings = [Setting("off")]
        for method, d in (("ngram", ""), ("draft", draft)):
            if method == "draft" and not draft:
                continue
            for k in ks:
                for th in thresholds:
                    settings.append(Setting(f"{method} K={k} min={th:g}", k, d, th))
        print(
            f"model {ns.model} on {loaded.device} as {loaded.dtype}, draft {ns.draft}, batch "
            f"{ns.batch}, {ns.new} new tokens, threads {torch.get_num_threads()}, "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        for kind in ns.prompts.split(","):
            prompts = prompts_of(kind, ns.batch)
            results: dict[Setting, list[Result]] = {s: [] for s in settings}
            for _ in range(ns.repeat):
                for s in settings:
                    results[s].append(asyncio.run(run(path, loaded, s, prompts, ns.new)))
            plain = results[settings[0]][0].outputs
            print(f"{kind} prompt:")
            for s in settings:
                rs = results[s]
                med = statistics.median
                same = all(r.outputs == plain for r in rs)
                print(
                    f"  {s.name:22s} {med(r.tok_s for r in rs):7.1f} tok/s  "
                    f"{med(r.cpu_ms for r in rs):6.2f} CPU ms/tok  "
                    f"acceptance {med(r.acceptance for r in rs):5.1%}  "
                    f"tokens/step {med(r.per_step for r in rs):4.2f}  "
                    f"skipped {med(r.skipped for r in rs):5.1%}  "
                    f"{'identical' if same else 'DIFFERENT'}"
                )
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
