#!/usr/bin/env python3
"""Router CPU per request by KV policy (not collected by pytest): the whole booking cycle of
`KvScheduler` as the live router runs it, with a live index.

Per request: select + book + first token + the chosen worker's KV stored event for the prompt
(what its engine would publish) + free (32 requests in flight). 4 workers, block 16, prompts
of PROMPT tokens: one of 8 shared prefixes with a last block of their own, so the index answers
hits and misses. Prints microseconds per request (best of 3 passes).

    .venv/bin/python tests/benchmarks/bench_route_cpu.py --policy ttft --prompt 100
    # load-independent: instructions per request = difference of two runs / (3 x 1000)
    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python \\
        tests/benchmarks/bench_route_cpu.py --policy ttft --requests 200     # then 1200
"""

from __future__ import annotations

import argparse
import random
import time

from kvmesh.router.kv_policy import KvPolicyKind
from kvmesh.router.kv_scheduler import KvRouterConfig, KvScheduler
from kvmesh.runtime.kv_events import BlocksStored, StoredBlock
from kvmesh.workers.mocker import block_hash as engine_hash

BS = 16


def stored(tokens: list[int]) -> BlocksStored:
    blocks, parent = [], None
    for i in range(len(tokens) // BS):
        b = tuple(tokens[i * BS : (i + 1) * BS])
        parent = engine_hash(parent, b)
        blocks.append(StoredBlock(parent, b))
    return BlocksStored(None, blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--policy", default="ttft", choices=[k.value for k in KvPolicyKind])
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens (>= 16)")
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    sched = KvScheduler(KvRouterConfig(policy=KvPolicyKind(args.policy)), router_id="bench")
    for i in range(4):
        sched.add_worker(f"w{i}", block_size=BS, kv_total_blocks=65536, max_num_seqs=256)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 30000) for _ in range(args.prompt)] for _ in range(8)]
    prompts = []
    for k in range(args.requests):
        p = list(prefixes[k % 8])
        p[-BS:] = [rng.randrange(1, 30000) for _ in range(BS)]
        prompts.append(p)
    events = [stored(p) for p in prompts]
    best = []
    for rep in range(3):
        t0 = time.perf_counter()
        live: list[str] = []
        for k, p in enumerate(prompts):
            now = k * 1e-3
            sel = sched.select(p, now, expected_output_tokens=100)
            rid = f"r{rep}-{k}"
            sched.book(rid, sel, now, expected_output_tokens=100)
            sched.first_token(rid)
            sched.indexer.apply_event(sel.worker_id, events[k])
            live.append(rid)
            if len(live) > 32:
                sched.free(live.pop(0))
        for rid in live:
            sched.free(rid)
        best.append((time.perf_counter() - t0) / args.requests * 1e6)
    print(f"policy {args.policy}, {args.prompt}-token prompts: {min(best):.1f} us/request")


if __name__ == "__main__":
    main()
