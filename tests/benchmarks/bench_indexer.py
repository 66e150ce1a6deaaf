"""Micro-benchmark of the router's prefix index and routing path (not collected by pytest).

Two ways to run it:

1. Standalone, in kvmesh's venv, on a Mooncake-derived workload (each 512-token hash id expanded
   into fixed pseudo-random tokens, prompts cut to input_length, block size 64, requests sent
   round-robin to W workers whose simulated prefix caches emit "stored" events of <= 128 blocks,
   as in the peer harness):

       taskset -c 0 .venv/bin/python tests/benchmarks/bench_indexer.py [--workers 8 64]

   Reports per W: PrefixIndex events/s and find_matches/s with p50/p99 latency (router hashes
   precomputed, like the peer harness), the full event path (KvIndexer: engine events with token
   ids -> router hashes -> index) in blocks/s, routing overhead of KvScheduler.select (hashing +
   lookup + cost over W workers) with p50/p99, and the cost of hashing a 100k-token prompt.

2. Inside the peer harness, beside Dynamo's RadixTree (its venv has no kvmesh; this file loads
   router/indexer.py by path, which needs only the standard library):

       taskset -c 0 /tmp/dynamo_peer/venv/bin/python ../shared/peers/radix_bench.py \\
           --impl dynamo-radix-native --impl dynamo-radix --impl naive-python \\
           --impl bench_indexer:RadixBenchIndex --plugin-path tests/benchmarks --pin-cpu 0

   (`--radix-bench` below runs exactly that and summarizes it.)

3. `--live N`: routing overhead inside a live mesh: 4 in-process mocker workers on loopback gRPC
   (file discovery), KvRouter + MeshBackend (the gateway's backend), N trace requests sent 8 at
   a time; reports the per-request routing overhead (tokens in hand -> worker chosen) and the
   prefix overlap the router found.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "ref" / "traces" / "mooncake_synthetic_trace.jsonl"
RADIX_BENCH = ROOT.parent / "shared" / "peers" / "radix_bench.py"
DYNAMO_PYTHON = Path("/tmp/dynamo_peer/venv/bin/python")


def _load_indexer_module() -> Any:
    """kvmesh.router.indexer when kvmesh is installed, else router/indexer.py by path."""
    try:
        from kvmesh.router import indexer

        return indexer
    except ImportError:
        path = ROOT / "router/kvmesh/router/indexer.py"
        spec = importlib.util.spec_from_file_location("kvmesh_indexer", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


_indexer = _load_indexer_module()


class RadixBenchIndex(_indexer.PrefixIndex):  # type: ignore[misc,name-defined]
    """kvmesh's PrefixIndex under the peer harness's plug interface (apply_stored(worker,
    hashes, parent), find_matches(hashes) -> {worker: blocks}); used as is."""

    name = "kvmesh-prefix-index"


# -- workload (standalone mode) ---------------------------------------------------------------


def _expand(ids: list[int], vocab: int, seed: int) -> list[list[int]]:
    """512 deterministic token ids per Mooncake hash id (splitmix64 of (id, position))."""
    import numpy as np

    phi = np.uint64(0x9E3779B97F4A7C15)
    pos = np.arange(512, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (
            np.array(ids, dtype=np.uint64)[:, None] * phi
            + pos[None, :] * np.uint64(0xD1B54A32D192ED03)
            + np.uint64(seed)
        )
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    out: list[list[int]] = (x % np.uint64(vocab)).astype(np.int64).tolist()
    return out


class Workload:
    """Prompts (token ids) and their router block hashes, from the Mooncake trace."""

    def __init__(self, path: Path, limit: int, block_size: int, vocab: int, seed: int) -> None:
        from kvmesh.router.hashing import block_hashes

        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = rows[:limit] if limit else rows
        uniq = sorted({h for r in rows for h in r["hash_ids"]})
        tokens_of: dict[int, list[int]] = {}
        for i in range(0, len(uniq), 4096):
            chunk = uniq[i : i + 4096]
            tokens_of.update(zip(chunk, _expand(chunk, vocab, seed), strict=True))
        self.prompts: list[list[int]] = []
        for r in rows:
            toks: list[int] = []
            for h in r["hash_ids"]:
                toks += tokens_of[h]
            self.prompts.append(toks[: int(r["input_length"])])
        self.block_size = block_size
        t0 = time.perf_counter()
        self.hashes = [block_hashes(p, block_size) for p in self.prompts]
        self.hash_s = time.perf_counter() - t0
        self.tokens = sum(len(p) for p in self.prompts)

    def events(self, workers: int, max_blocks: int) -> list[list[tuple[int, int, int]]]:
        """Per request: (worker, start, end) block ranges the worker stores (<= max_blocks)."""
        held: list[set[int]] = [set() for _ in range(workers)]
        out: list[list[tuple[int, int, int]]] = []
        for r, hs in enumerate(self.hashes):
            w = r % workers
            k = 0
            while k < len(hs) and hs[k] in held[w]:
                k += 1
            evs = []
            while k < len(hs):
                j = min(len(hs), k + max_blocks)
                evs.append((w, k, j))
                held[w].update(hs[k:j])
                k = j
            out.append(evs)
        return out


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_index(
    wl: Workload, workers: int, evs: list[list[tuple[int, int, int]]]
) -> dict[str, Any]:
    """The peer harness's loop: per request find_matches, then apply its events."""
    idx = _indexer.PrefixIndex(num_workers=workers)
    find, apply = idx.find_matches, idx.apply_stored
    pc = time.perf_counter_ns
    qlat: list[int] = []
    elat: list[int] = []
    blocks = 0
    gc.collect()
    gc.disable()
    try:
        for r, hs in enumerate(wl.hashes):
            t0 = pc()
            find(hs)
            qlat.append(pc() - t0)
            for w, k, j in evs[r]:
                chunk, parent = hs[k:j], hs[k - 1] if k else None
                t0 = pc()
                apply(w, chunk, parent)
                elat.append(pc() - t0)
                blocks += j - k
    finally:
        gc.enable()
    return {
        "events_per_s": len(elat) / (sum(elat) / 1e9),
        "blocks_per_s": blocks / (sum(elat) / 1e9),
        "find_matches_per_s": len(qlat) / (sum(qlat) / 1e9),
        "find_p50_us": _pct(qlat, 0.5) / 1e3,
        "find_p99_us": _pct(qlat, 0.99) / 1e3,
        "find_mean_us": statistics.fmean(qlat) / 1e3,
        "n_events": len(elat),
        "n_blocks": blocks,
    }


def bench_event_path(
    wl: Workload, workers: int, evs: list[list[tuple[int, int, int]]]
) -> dict[str, Any]:
    """KvIndexer.apply_event with engine-shaped events (token ids; the router re-hashes)."""
    from kvmesh.router.kv_state import KvIndexer
    from kvmesh.runtime.kv_events import BlocksStored, StoredBlock

    bs = wl.block_size
    indexer = KvIndexer()
    for w in range(workers):
        indexer.add_worker(f"w{w}", bs)
    prepared = []
    for r, hs in enumerate(wl.hashes):
        p = wl.prompts[r]
        for w, k, j in evs[r]:
            # Engine hashes: any per-block ids; here the bitwise complement of the router's.
            blocks = [
                StoredBlock(~hs[i] & (2**64 - 1), tuple(p[i * bs : (i + 1) * bs]))
                for i in range(k, j)
            ]
            parent = ~hs[k - 1] & (2**64 - 1) if k else None
            prepared.append((f"w{w}", BlocksStored(parent, blocks)))
    blocks_total = sum(len(ev.blocks) for _, ev in prepared)
    gc.collect()
    t0 = time.perf_counter()
    for w, ev in prepared:
        indexer.apply_event(w, ev)
    dt = time.perf_counter() - t0
    longest = max(wl.hashes, key=len)
    assert indexer.find_matches(longest), "the event path must index what it was fed"
    return {
        "event_path_blocks_per_s": blocks_total / dt,
        "event_path_events_per_s": len(prepared) / dt,
    }


def bench_select(
    wl: Workload, workers: int, evs: list[list[tuple[int, int, int]]]
) -> dict[str, Any]:
    """KvScheduler.select (hash + lookup + cost) on each prompt, index loaded with the trace."""
    from kvmesh.router.kv_scheduler import KvScheduler
    from kvmesh.runtime.kv_events import BlocksStored, StoredBlock

    bs = wl.block_size
    sched = KvScheduler()
    for w in range(workers):
        sched.add_worker(f"w{w}", block_size=bs)
    for r, hs in enumerate(wl.hashes):
        p = wl.prompts[r]
        for w, k, j in evs[r]:
            blocks = [StoredBlock(hs[i], tuple(p[i * bs : (i + 1) * bs])) for i in range(k, j)]
            sched.indexer.apply_event(f"w{w}", BlocksStored(hs[k - 1] if k else None, blocks))
    from kvmesh.router.hashing import block_hashes

    lat: list[float] = []
    hash_lat: list[float] = []
    pc = time.perf_counter
    for p in wl.prompts:
        t0 = pc()
        sched.select(p, 0.0)
        t1 = pc()
        block_hashes(p, bs)
        hash_lat.append(pc() - t1)
        lat.append(t1 - t0)
    return {
        "select_p50_us": _pct(lat, 0.5) * 1e6,
        "select_p99_us": _pct(lat, 0.99) * 1e6,
        "select_mean_us": statistics.fmean(lat) * 1e6,
        "select_hashing_mean_us": statistics.fmean(hash_lat) * 1e6,
    }


def bench_hash_100k() -> dict[str, Any]:
    from kvmesh.router.hashing import block_hashes

    tokens = [(i * 2654435761) % 150000 for i in range(100_000)]
    best = min(_timed(lambda: block_hashes(tokens, 64)) for _ in range(20))
    return {"hash_100k_tokens_ms": best * 1e3}


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_radix_bench(reps: int, limit: int) -> None:
    """Run the peer harness with Dynamo's RadixTree and this index; print a summary."""
    if not DYNAMO_PYTHON.exists() or not RADIX_BENCH.exists():
        print(f"skipped: {DYNAMO_PYTHON} or {RADIX_BENCH} is missing", file=sys.stderr)
        return
    cmd = [
        str(DYNAMO_PYTHON), str(RADIX_BENCH),
        "--impl", "dynamo-radix-native", "--impl", "dynamo-radix", "--impl", "naive-python",
        "--impl", "bench_indexer:RadixBenchIndex", "--plugin-path", str(Path(__file__).parent),
        "--pin-cpu", "0", "--reps", str(reps),
    ]  # fmt: skip
    if limit:
        cmd += ["--limit", str(limit)]
    print("$", " ".join(cmd), file=sys.stderr)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    keys = ("events_per_s", "find_matches_per_s", "find_p50_us", "find_p99_us", "find_mean_us")
    for line in out.splitlines():
        row = json.loads(line)
        medians = {k: round(row[k]["median"], 1) for k in keys}
        print(
            json.dumps(
                {
                    "impl": row["impl"],
                    "workers": row["workers"],
                    **medians,
                    "verify_mismatches": row.get("verify_mismatches"),
                }
            )
        )


class _Recording:
    """A Router wrapper that records each decision's routing overhead."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.overheads: list[float] = []

    async def route(self, *args: Any, **kw: Any) -> Any:
        decision = await self.inner.route(*args, **kw)
        self.overheads.append(decision.routing_overhead_s)
        return decision

    def first_token(self, request_id: str) -> None:
        self.inner.first_token(request_id)

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        self.inner.finished(request_id, output_tokens)


async def live(trace: Path, n: int, block_size: int) -> dict[str, Any]:
    """Routing overhead of KvRouter inside MeshBackend over 4 real mocker workers."""
    import asyncio
    import tempfile

    from kvmesh.router.backend import MeshBackend
    from kvmesh.router.kv_router import KvRouter
    from kvmesh.router.pool import WorkerPool
    from kvmesh.runtime.discovery import FileDiscovery
    from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
    from kvmesh.workers.config import WorkerConfig
    from kvmesh.workers.mocker import MockerConfig, MockerEngine
    from kvmesh.workers.server import Worker

    vocab = 4096
    wl = Workload(trace, n, block_size, vocab - 16, 0x5EED)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"file://{tmp}/registry"
        workers = [
            Worker(
                WorkerConfig(discovery=url, worker_id=f"w{i}"),
                MockerEngine(
                    MockerConfig(block_size=block_size, speedup_ratio=1e4),
                    served_model_name="m",
                    vocab_size=vocab,
                    context_length=1 << 20,
                ),
            )
            for i in range(4)
        ]
        for w in workers:
            await w.start()
        pool = WorkerPool(FileDiscovery(Path(tmp) / "registry", poll_s=0.05))
        router = KvRouter(pool)
        recording = _Recording(router)
        backend = MeshBackend(pool, recording)
        await pool.start()
        await pool.wait_for(4)
        sem = asyncio.Semaphore(8)

        async def one(i: int) -> None:
            req = EngineRequest(
                f"r{i}", wl.prompts[i], SamplingParams(temperature=0.0), StopParams(max_tokens=4)
            )
            async with sem:
                async for _ in backend.generate("m", req, None):
                    pass

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(wl.prompts)) if wl.prompts[i]))
        wall = time.perf_counter() - t0
        await router.close()
        await pool.stop()
        for w in workers:
            await w.stop()
    lat = recording.overheads
    stats = router.stats
    return {
        "bench": "live",
        "requests": len(lat),
        "mean_prompt_tokens": round(wl.tokens / max(1, len(wl.prompts))),
        "routing_overhead_p50_us": _pct(lat, 0.5) * 1e6,
        "routing_overhead_p99_us": _pct(lat, 0.99) * 1e6,
        "routing_overhead_mean_us": statistics.fmean(lat) * 1e6,
        "predicted_hit_rate": stats.overlap_blocks / max(1, stats.prompt_blocks),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--limit", type=int, default=0, help="first N requests (0: all)")
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--max-blocks-per-event", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0x5EED)
    ap.add_argument("--pin-cpu", type=int, default=None)
    ap.add_argument("--radix-bench", action="store_true", help="run the peer harness instead")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (peer harness)")
    ap.add_argument("--live", type=int, default=0, metavar="N", help="live-mesh mode, N requests")
    a = ap.parse_args()
    if a.pin_cpu is not None:
        os.sched_setaffinity(0, {a.pin_cpu})
    if a.radix_bench:
        run_radix_bench(a.reps, a.limit)
        return
    if a.live:
        import asyncio

        row = asyncio.run(live(a.trace, a.live, a.block_size))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
        return
    wl = Workload(a.trace, a.limit, a.block_size, a.vocab, a.seed)
    print(json.dumps({
        "bench": "workload", "requests": len(wl.prompts), "prompt_tokens": wl.tokens,
        "mean_query_blocks": round(sum(map(len, wl.hashes)) / len(wl.hashes), 1),
        "hash_tokens_per_s": round(wl.tokens / wl.hash_s),
    }))  # fmt: skip
    print(json.dumps({"bench": "hash", **bench_hash_100k()}))
    for workers in a.workers:
        evs = wl.events(workers, a.max_blocks_per_event)
        row = {"bench": "index", "workers": workers}
        row.update(bench_index(wl, workers, evs))
        row.update(bench_event_path(wl, workers, evs))
        row.update(bench_select(wl, workers, evs))
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
