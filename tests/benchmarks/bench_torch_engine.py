"""Benchmarks of the torch engine (not collected by pytest).

Usage:
  .venv/bin/python tests/benchmarks/bench_torch_engine.py [--model tiny|large|DIR]
      [--device cpu] [--dtype float32] [--prefix 1024] [--prompt 128] [--new 128] [--shapes N]
      [--no-cudnn-sdp] [--profile N]

  --model tiny   the tiny Llama of kvmesh.runtime.tinymodel (hidden 64, 2 layers), random weights
  --model large  the same tokenizer with a larger random-weight Llama: hidden 768, 8 layers,
                 12 heads (4 KV heads), intermediate 2048
  --model DIR    any local model directory with weights

1. Prefix caching: TTFT of a request whose prompt is `--prefix` tokens + 16 tokens, then of a
   second request with the same prefix and another 16-token tail (its full prefix blocks come
   from the cache), and, as a control, the second request on an engine without prefix caching.
2. Throughput: output tokens/s of the engine with 1 and with 8 concurrent requests (`--prompt`
   tokens in, `--new` tokens out each, EOS ignored) against transformers' `generate()` called
   in a loop over the same prompts (greedy, KV cache on, same dtype and device). Each side gets
   one warm-up run first.
3. With `--shapes N`: TTFT of N prompts of N different lengths (an engine sees a new prompt
   length with nearly every request; attention kernels that plan per shape pay for each new one).
   `--no-cudnn-sdp` turns torch's cuDNN attention backend off for the whole run.
4. With `--profile N`: torch.profiler over one request decoding N tokens (batch 1), the ops by
   their own CPU time and, on CUDA, GPU time: where a step's time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch

from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.tinymodel import create_tiny_model
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from kvmesh.workers.pytorch.weights import create_tiny_weights

LARGE = {
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
}


def model_dir(kind: str, tmp: Path) -> Path:
    if kind not in ("tiny", "large"):
        return Path(kind)
    path = create_tiny_model(tmp / kind)
    if kind == "large":
        config = json.loads((path / "config.json").read_text())
        config.update(LARGE)
        (path / "config.json").write_text(json.dumps(config, indent=2))
    create_tiny_weights(path)
    return path


def prompt_of(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 131) % 3800 + 100 for i in range(n)]


def engine(path: Path, loaded: LoadedModel, **cfg: object) -> TorchEngine:
    config = TorchConfig(**{"device": str(loaded.device), "num_gpu_blocks": 4096, **cfg})  # type: ignore[arg-type]
    return TorchEngine(
        config,
        model_dir=path,
        served_model_name="bench",
        eos_token_ids=ModelDirInfo.load(path).eos_token_ids,
        loaded=loaded,
    )


async def ttft(eng: TorchEngine, prompt: list[int]) -> tuple[float, int]:
    request = EngineRequest(
        f"ttft-{time.monotonic_ns()}",
        prompt,
        SamplingParams(temperature=0.0),
        StopParams(max_tokens=1),
    )
    t0 = time.perf_counter()
    cached = 0
    async for out in eng.generate(request):
        if out.usage is not None:
            cached = out.usage.cached_tokens
    return time.perf_counter() - t0, cached


async def bench_prefix(path: Path, loaded: LoadedModel, prefix_len: int) -> None:
    prefix = prompt_of(prefix_len, 1)
    first, second = prefix + prompt_of(16, 2), prefix + prompt_of(16, 3)
    # Warm-up: a cold prompt, then one sharing its first blocks (the cached-prefix path runs
    # other kernels: attention over gathered blocks; on CUDA their first use costs ~0.1-0.7 s).
    warm = prompt_of(256, 9)
    warm_shared = warm + prompt_of(16, 10)
    eng = engine(path, loaded)
    await eng.start()
    await ttft(eng, warm)
    await ttft(eng, warm_shared)
    t1, c1 = await ttft(eng, first)
    t2, c2 = await ttft(eng, second)
    await eng.stop()
    cold = engine(path, loaded, enable_prefix_caching=False)
    await cold.start()
    await ttft(cold, warm)
    await ttft(cold, warm_shared)
    await ttft(cold, first)
    t3, _ = await ttft(cold, second)
    await cold.stop()
    n = len(first)
    print(f"prefix caching ({n}-token prompts sharing a {prefix_len}-token prefix):")
    print(f"  request 1 (cold):                 TTFT {t1 * 1e3:8.1f} ms  cached {c1} tokens")
    print(f"  request 2 (shared prefix):        TTFT {t2 * 1e3:8.1f} ms  cached {c2} tokens")
    print(f"  request 2, prefix caching off:    TTFT {t3 * 1e3:8.1f} ms")
    print(f"  speed-up of request 2: {t1 / t2:.1f}x")


async def engine_tps(eng: TorchEngine, prompts: list[list[int]], new: int) -> float:
    async def one(i: int, prompt: list[int]) -> int:
        request = EngineRequest(
            f"tp-{i}-{time.monotonic_ns()}",
            prompt,
            SamplingParams(temperature=0.0),
            StopParams(max_tokens=new, ignore_eos=True),
        )
        return sum([len(o.token_ids) async for o in eng.generate(request)])

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(counts) / (time.perf_counter() - t0)


def hf_tps(loaded: LoadedModel, prompts: list[list[int]], new: int) -> float:
    t0 = time.perf_counter()
    total = 0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=loaded.device)
        out = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )
        total += out.shape[1] - len(prompt)
    return total / (time.perf_counter() - t0)


async def bench_throughput(path: Path, loaded: LoadedModel, prompt_len: int, new: int) -> None:
    print(f"throughput ({prompt_len} prompt tokens, {new} output tokens per request):")
    eng = engine(path, loaded)
    await eng.start()
    for batch in (1, 8):
        prompts = [prompt_of(prompt_len, 100 + i) for i in range(batch)]
        await engine_tps(eng, [prompt_of(prompt_len, 50 + i) for i in range(batch)], 8)  # warm-up
        await eng.clear_kv_cache()
        ours = await engine_tps(eng, prompts, new)
        hf_tps(loaded, prompts[:1], 8)  # warm-up
        theirs = hf_tps(loaded, prompts, new)
        print(
            f"  batch {batch}: torch engine {ours:8.1f} tok/s   "
            f"transformers generate() loop {theirs:8.1f} tok/s   ({ours / theirs:.1f}x)"
        )
    await eng.stop()


async def bench_shapes(path: Path, loaded: LoadedModel, n: int, base: int) -> None:
    eng = engine(path, loaded)
    await eng.start()
    warm = prompt_of(256, 9)
    await ttft(eng, warm)
    await ttft(eng, warm + prompt_of(16, 10))
    times = []
    for i in range(n):
        t, _ = await ttft(eng, prompt_of(base + 37 * i, 20 + i))
        times.append(t * 1e3)
    await eng.stop()
    print(
        f"new prompt lengths ({base}..{base + 37 * (n - 1)} tokens, one request each): TTFT "
        f"mean {sum(times) / n:.1f} ms, min {min(times):.1f}, max {max(times):.1f}"
    )


async def profile_decode(path: Path, loaded: LoadedModel, prompt_len: int, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    eng = engine(path, loaded)
    await eng.start()
    await engine_tps(eng, [prompt_of(prompt_len, 7)], 8)  # warm-up
    activities = [ProfilerActivity.CPU]
    if loaded.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # The forward runs on the engine's executor thread: record every thread's ops.
    from torch._C._profiler import _ExperimentalConfig

    prof = profile(
        activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)
    )
    with prof:
        t0 = time.perf_counter()
        await engine_tps(eng, [prompt_of(prompt_len, 8)], steps)
        wall = time.perf_counter() - t0
    await eng.stop()
    print(
        f"profile: one request, {prompt_len} prompt tokens, {steps} output tokens, "
        f"{wall * 1e3 / steps:.2f} ms per token (profiler on)"
    )
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
        )
    )
    if loaded.device.type == "cuda":
        print(
            prof.key_averages().table(
                sort_by="self_device_time_total", row_limit=12, max_name_column_width=60
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, large or a model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=[d.value for d in TorchDType])
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix length")
    parser.add_argument("--prompt", type=int, default=128, help="prompt length (throughput)")
    parser.add_argument("--new", type=int, default=128, help="output tokens (throughput)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--profile", type=int, default=0, help="profile N decode steps (0: off)")
    parser.add_argument("--shapes", type=int, default=0, help="TTFT of N new prompt lengths")
    parser.add_argument("--no-cudnn-sdp", action="store_true", help="torch's cuDNN attention off")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        path = model_dir(ns.model, Path(tmp))
        loaded = load_model(path, ns.device, TorchDType(ns.dtype))
        params = sum(p.numel() for p in loaded.model.parameters())
        print(
            f"model {ns.model}: {loaded.model_type}, {params / 1e6:.1f}M parameters, "
            f"{loaded.num_layers} layers, on {loaded.device} as {loaded.dtype}, "
            f"{torch.get_num_threads()} threads"
        )
        asyncio.run(bench_prefix(path, loaded, ns.prefix))
        asyncio.run(bench_throughput(path, loaded, ns.prompt, ns.new))
        if ns.shapes:
            asyncio.run(bench_shapes(path, loaded, ns.shapes, ns.prefix))
        if ns.profile:
            asyncio.run(profile_decode(path, loaded, ns.prompt, ns.profile))


if __name__ == "__main__":
    main()
