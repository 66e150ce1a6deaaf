"""KV transfer benchmark: NIXL READ between two processes vs a plain in-memory copy (not
collected by pytest).

Usage:
  .venv/bin/python tests/benchmarks/bench_kv_transfer.py [--block-sizes 16 32 64 128 256]
      [--blocks 1 10 100 1000] [--layers 4] [--kv-heads 4] [--head-dim 64] [--dtype bfloat16]
      [--repeat 5] [--device cpu] [--json out.json]

A "prefill" process allocates a KV cache in the torch engine's layout
(`[layers, K|V, blocks, block_size, kv_heads, head_dim]`, so a block is 2 x layers pieces) and
registers it with its NIXL agent, exactly as the torch engine does; this process (the "decode"
side) allocates its own cache, loads the peer's agent metadata and pulls N blocks with the code
the engine uses (`NixlKvAgent.read` over `block_pieces` descriptors), into the same block ids
("contiguous": blocks 0..N-1, so NIXL can merge neighbouring pieces) and into shuffled block ids
("scattered": every piece its own descriptor). The baseline is one `copy_` of the same number
of bytes between two contiguous tensors in this process, on one thread: what a memcpy reaches
on this machine.
Each point is the best of `--repeat` runs (more for small transfers, until 0.1 s) after one
warm-up; bandwidth = bytes / seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvmesh.runtime.types import KvLayout
from kvmesh.workers.disagg.layout import block_pieces
from kvmesh.workers.disagg.nixl_agent import NixlKvAgent

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MIN_TIME_S = 0.1
"""Small transfers are repeated until they took this long in all (best of many)."""
MAX_RUNS = 500


def layout_of(shape: tuple[int, ...], dtype: torch.dtype) -> KvLayout:
    layers, _, num_blocks, bs, heads, dim = shape
    chunk = bs * heads * dim * torch.empty((), dtype=dtype).element_size()
    return KvLayout(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        block_size=bs,
        dtype=str(dtype).removeprefix("torch."),
        block_bytes=2 * layers * chunk,
        chunk_bytes=chunk,
        chunk_stride_bytes=num_blocks * chunk,
    )


def holder(conn: Connection, device: str, poll_s: float) -> None:
    """The prefill side: one registered cache per request, kept until the next one."""
    agent = NixlKvAgent("bench-prefill")
    cache = None
    while True:
        while not conn.poll(poll_s):  # the side being read makes progress, as an engine does
            agent.progress()
        msg = conn.recv()
        if msg is None:
            break
        shape, dtype_name = msg
        agent.close()
        agent = NixlKvAgent(f"bench-prefill-{shape[3]}")
        cache = torch.randn(shape, dtype=DTYPES[dtype_name], device=device)
        agent.register(cache)
        conn.send((agent.name, agent.metadata, cache.data_ptr(), agent.memory_kind))
    agent.close()
    del cache


async def pull(
    agent: NixlKvAgent,
    peer: tuple[str, bytes, int, str],
    remote_layout: KvLayout,
    local: torch.Tensor,
    local_layout: KvLayout,
    src_ids: list[int],
    dst_ids: list[int],
) -> float:
    name, metadata, base, kind = peer
    chunk = local_layout.chunk_bytes
    remote = block_pieces([base + b * chunk for b in src_ids], remote_layout)
    mine = block_pieces([local.data_ptr() + b * chunk for b in dst_ids], local_layout)
    t0 = time.perf_counter()
    await agent.read(name, metadata, mine, remote, remote_kind=kind, timeout_s=120)
    return time.perf_counter() - t0


def memcpy_s(src: torch.Tensor, dst: torch.Tensor, nbytes: int, repeat: int) -> float:
    """Best time of `dst[:nbytes].copy_(src[:nbytes])` (after a warm-up)."""
    a, b = src[:nbytes], dst[:nbytes]
    b.copy_(a)
    times: list[float] = []
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    while len(times) < repeat or (sum(times) < MIN_TIME_S and len(times) < MAX_RUNS):
        sync()
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    poll_s = args.holder_poll_ms / 1e3
    proc = ctx.Process(target=holder, args=(child, args.device, poll_s), daemon=True)
    proc.start()
    dtype = DTYPES[args.dtype]
    rows: list[dict[str, Any]] = []
    max_blocks = max(args.blocks)
    agent: NixlKvAgent | None = None
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * dtype.itemsize
    most = max(args.block_sizes) * max_blocks * per_token
    copy_src = torch.empty(most, dtype=torch.uint8, device=args.device).random_()
    copy_dst = torch.zeros(most, dtype=torch.uint8, device=args.device)
    try:
        for bs in args.block_sizes:
            shape = (args.layers, 2, max_blocks, bs, args.kv_heads, args.head_dim)
            parent.send((shape, args.dtype))
            peer = parent.recv()
            layout = layout_of(shape, dtype)
            local = torch.zeros(shape, dtype=dtype, device=args.device)
            if agent is not None:
                agent.close()
            agent = NixlKvAgent(f"bench-decode-{bs}")
            agent.register(local)
            for n in args.blocks:
                nbytes = n * layout.block_bytes
                for mode in ("contiguous", "scattered"):
                    src = list(range(n))
                    dst = list(range(n))
                    if mode == "scattered":
                        rng = random.Random(n)
                        src = rng.sample(range(max_blocks), n)
                        dst = rng.sample(range(max_blocks), n)
                    await pull(agent, peer, layout, local, layout, src, dst)  # warm-up
                    times: list[float] = []
                    while len(times) < args.repeat or (
                        sum(times) < MIN_TIME_S and len(times) < MAX_RUNS
                    ):
                        times.append(await pull(agent, peer, layout, local, layout, src, dst))
                    best = min(times)
                    base = (
                        memcpy_s(copy_src, copy_dst, nbytes, args.repeat)
                        if mode == "contiguous"
                        else None
                    )
                    row = {
                        "block_size": bs,
                        "blocks": n,
                        "mode": mode,
                        "bytes": nbytes,
                        "descriptors": n * 2 * args.layers,
                        "nixl_s": best,
                        "nixl_gbps": nbytes / best / 1e9,
                        "memcpy_gbps": nbytes / base / 1e9 if base else None,
                    }
                    rows.append(row)
                    print(_fmt(row), flush=True)
            del local
    finally:
        parent.send(None)
        proc.join(30)
        if agent is not None:
            agent.close()
    return rows


def _fmt(row: dict[str, Any]) -> str:
    memcpy = f"{row['memcpy_gbps']:8.2f}" if row["memcpy_gbps"] else "       -"
    return (
        f"{row['block_size']:6d} {row['blocks']:6d} {row['mode']:>10s} "
        f"{row['bytes'] / 2**20:10.2f} {row['descriptors']:7d} "
        f"{row['nixl_s'] * 1e3:9.3f} {row['nixl_gbps']:8.2f} {memcpy}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 10, 100, 1000])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument(
        "--holder-poll-ms",
        type=float,
        default=1.0,
        help="the read side's progress interval (1 ms: what a prefill engine's pump does)",
    )
    args = parser.parse_args()
    # One thread: UCX copies in the calling thread too, and an OpenMP team on a busy machine
    # measures its own scheduling rather than memory bandwidth.
    torch.set_num_threads(1)
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * DTYPES[args.dtype].itemsize
    print(
        f"KV layout: {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} dims, "
        f"{args.dtype}: {per_token} bytes/token\n"
        "    bs blocks       mode        MiB   descs    nixl ms nixl GB/s memcpy GB/s"
    )
    rows = asyncio.run(bench(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
