#!/usr/bin/env python3
"""Measure NVIDIA Dynamo's own mocker step timings, for tests/unit/test_mocker_timing.py.

Runs Dynamo's offline mocker replay (`dynamo._core.run_mocker_trace_replay`: its scheduler and
its default, built-in polynomial timing model, on a virtual clock) on one request at a time, so
that each step's duration is visible in the per-request report:
  * time to first token = the duration of the one prefill step of an `input_length`-token prompt
    (input_length <= max_num_batched_tokens, nothing cached);
  * time to second token = the duration of the one decode step that follows, with the prompt
    plus the first token in the KV cache of a pool of `num_gpu_blocks` blocks of `block_size`.

and on a few small batches (`BATCHES`: requests that prefill together, a prefill that joins a
running decode, a prompt served mostly from the cache, a chunked prefill beside a decode), whose
per-request first-token and finish times show how a step that mixes requests is timed.

Writes tests/fixtures/dynamo_mocker_timing.json: the cases, the values Dynamo reported, the
Dynamo version and the command. Nothing here is kvmesh code; it runs in Dynamo's own venv (see
../shared/peers/README: install_dynamo.sh puts ai-dynamo 1.6.1 in /tmp/dynamo_peer/venv):

    /tmp/dynamo_peer/venv/bin/python tests/benchmarks/dynamo_mocker_timing.py
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DYN_LOG", "error")

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "dynamo_mocker_timing.json"
BLOCK_SIZE = 64
TRACE_BLOCK = 512  # Mooncake hash ids stand for 512-token blocks
# (input_length, num_gpu_blocks): prompts from 1 token to a full step budget, and pool sizes
# that put the decode step's KV usage from ~0 to ~0.94.
CASES = [
    (1, 100),
    (63, 100),
    (64, 100),
    (65, 100),
    (500, 16384),
    (1000, 100),
    (1000, 20),
    (1023, 100),
    (1024, 100),
    (2048, 40),
    (4000, 100),
    (6000, 100),
    (8192, 200),
]


# (name, num_gpu_blocks, [(timestamp_ms, input_length, output_length, hash_ids)])
BATCHES = [
    ("prefill-together", 100, [(0, 1000, 6, [1, 2]), (0, 300, 6, [3])]),
    ("prefill-joins-decode", 100, [(0, 1000, 3, [1, 2]), (40, 3000, 2, [3, 4, 5, 6, 7, 8])]),
    ("cached-prefix", 100, [(0, 1024, 4, [1, 2]), (50, 1024, 4, [1, 2])]),
    ("chunked-beside-decode", 300, [(0, 1000, 8, [1, 2]), (10, 9000, 3, list(range(3, 21)))]),
]


def measure_batch(num_gpu_blocks: int, rows: list[tuple[int, int, int, list[int]]]) -> list[dict]:
    """Per-request times of one replay of `rows` on one worker, in trace order."""
    from dynamo._core import run_mocker_trace_replay  # Dynamo's venv only

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp, "trace.jsonl")
        lines = [
            json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h})
            for t, n, o, h in rows
        ]
        trace.write_text("\n".join(lines) + "\n")
        result = run_mocker_trace_replay(
            [str(trace)],
            extra_engine_args={
                "engine": {"num_gpu_blocks": num_gpu_blocks, "block_size": BLOCK_SIZE}
            },
            trace_block_size=TRACE_BLOCK,
            capture_per_request=True,
        )
    # Requests in these batches differ in (arrival, input_length): that restores trace order.
    order = {(t, n): i for i, (t, n, _, _) in enumerate(rows)}
    got = sorted(result.per_request, key=lambda p: order[(p["arrival_time_ms"], p["input_length"])])
    return [
        {
            "first_token_ms": p["first_token_ms"],
            "finish_ms": p["terminal_time_ms"],
            "reused_input_tokens": p["reused_input_tokens"],
        }
        for p in got
    ]


def measure(input_length: int, num_gpu_blocks: int) -> dict[str, float]:
    from dynamo._core import run_mocker_trace_replay  # Dynamo's venv only

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp, "trace.jsonl")
        report = Path(tmp, "report.jsonl")
        hash_ids = list(range(1, (input_length + TRACE_BLOCK - 1) // TRACE_BLOCK + 1))
        record = {
            "timestamp": 0,
            "input_length": input_length,
            "output_length": 2,
            "hash_ids": hash_ids,
        }
        trace.write_text(json.dumps(record) + "\n")
        run_mocker_trace_replay(
            [str(trace)],
            extra_engine_args={
                "engine": {"num_gpu_blocks": num_gpu_blocks, "block_size": BLOCK_SIZE}
            },
            report_jsonl_path=str(report),
            trace_block_size=TRACE_BLOCK,
        )
        (line,) = report.read_text().splitlines()
    row = json.loads(line)
    return {"ttft_ms": row["ttft_ms"], "ttst_ms": row["ttst_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cases = []
    for input_length, num_gpu_blocks in CASES:
        got = measure(input_length, num_gpu_blocks)
        cases.append({"input_length": input_length, "num_gpu_blocks": num_gpu_blocks, **got})
        print(input_length, num_gpu_blocks, got, file=sys.stderr)
    batches = []
    for name, num_gpu_blocks, rows in BATCHES:
        got_batch = measure_batch(num_gpu_blocks, rows)
        requests = [
            {"timestamp_ms": t, "input_length": n, "output_length": o, "hash_ids": h, **g}
            for (t, n, o, h), g in zip(rows, got_batch, strict=True)
        ]
        batches.append({"name": name, "num_gpu_blocks": num_gpu_blocks, "requests": requests})
        print(name, got_batch, file=sys.stderr)
    fixture = {
        "source": (
            "NVIDIA Dynamo's mocker (dynamo._core.run_mocker_trace_replay, offline, default "
            "engine and built-in polynomial timing), one request per run, output_length 2"
        ),
        "dynamo_version": importlib.metadata.version("ai-dynamo"),
        "command": "/tmp/dynamo_peer/venv/bin/python tests/benchmarks/dynamo_mocker_timing.py",
        "measured_on": datetime.date.today().isoformat(),
        "block_size": BLOCK_SIZE,
        "cases": cases,
        "trace_block_size": TRACE_BLOCK,
        "batches": batches,
    }
    args.out.write_text(json.dumps(fixture, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
