"""Torch engine throughput with no optional feature in use (no guided decoding, LoRA,
speculation, images), this tree against another commit, rounds alternating so the machine's
noise hits both alike (not collected by pytest).

Usage:
  .venv/bin/python tests/benchmarks/bench_torch_ab.py --base 9db7f0f [--rounds 6]
      [--batch 8] [--new 64] [--threads 1]

The base tree comes from `git archive BASE`; each run is a fresh process whose PYTHONPATH puts
that tree's packages first, on the `large` random-weight model of bench_torch_engine.py (hidden
768, 8 layers), greedy, 128-token prompts, EOS ignored, one warm-up per run. Prints tok/s and CPU
ms per output token of every run, then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("gen", "runtime", "frontend", "router", "workers", "planner", "sim", "apps")


def child(model: Path, batch: int, new: int, threads: int) -> None:
    """One run in this process (kvmesh from whichever tree PYTHONPATH names)."""
    sys.path.insert(0, str(REPO))
    import torch

    from kvmesh.workers.pytorch.config import TorchDType
    from kvmesh.workers.pytorch.model_runner import load_model
    from tests.benchmarks.bench_torch_engine import engine, engine_tps, prompt_of

    torch.set_num_threads(threads)
    loaded = load_model(model, "cpu", TorchDType.FLOAT32)

    async def run() -> tuple[float, float]:
        eng = engine(model, loaded)
        await eng.start()
        await engine_tps(eng, [prompt_of(128, 50 + i) for i in range(batch)], 4)  # warm-up
        c0 = time.process_time()
        tps = await engine_tps(eng, [prompt_of(128, 100 + i) for i in range(batch)], new)
        cpu = time.process_time() - c0
        await eng.stop()
        return tps, 1000 * cpu / (batch * new)

    tps, cpu_ms = asyncio.run(run())
    print(f"{tps:.2f} {cpu_ms:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        child(Path(ns.child), ns.batch, ns.new, ns.threads)
        return
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-ab-") as tmp:
        base = Path(tmp) / "base"
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", ns.base], check=True, capture_output=True
        ).stdout
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(base, filter="data")
        sys.path.insert(0, str(REPO))
        from tests.benchmarks.bench_torch_engine import model_dir

        model = model_dir("large", Path(tmp))
        trees = {"base": base, "this": REPO}
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in trees}
        for r in range(ns.rounds):
            for label, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree / p) for p in PACKAGES)}
                argv = [sys.executable, __file__, "--base", ns.base, "--child", str(model)]
                argv += ["--batch", str(ns.batch), "--new", str(ns.new)]
                argv += ["--threads", str(ns.threads)]
                out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
                tps, cpu_ms = (float(x) for x in out.stdout.split()[-2:])
                runs[label].append((tps, cpu_ms))
                print(f"round {r + 1} {label:4}: {tps:7.1f} tok/s {cpu_ms:6.2f} CPU ms/token")
        med = {k: statistics.median(t for t, _ in v) for k, v in runs.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
        print(
            f"batch {ns.batch}, {ns.new} tokens: this {med['this']:.1f} tok/s "
            f"({cpu['this']:.2f} CPU ms/token), {ns.base} {med['base']:.1f} "
            f"({cpu['base']:.2f}): {med['this'] / med['base']:.2f}x"
        )


if __name__ == "__main__":
    main()
