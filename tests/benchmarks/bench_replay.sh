#!/usr/bin/env bash
# `kvmesh replay` on the Mooncake synthetic trace beside Dynamo's own offline replay (same mocker
# timing model, block size 64, 16,384 blocks per worker): 4 workers at 2x arrival speed and
# 8 workers at 4x (Dynamo's replay_bench.py "moderate" load: speedup = 0.5 x workers).
#
# Usage: bash tests/benchmarks/bench_replay.sh            (from anywhere; about 2-3 min here)
#   LIMIT=1000 bash tests/benchmarks/bench_replay.sh      (the first 1000 requests, both sides)
#   TRACE=... PY=... DYN_PY=... OUT=... override the trace, kvmesh's and Dynamo's Python, the
#   output folder (default .cache/bench_replay). Dynamo (../shared/peers/install_dynamo.sh) is
#   optional: without it only kvmesh runs.
# Simulated latencies do not depend on this machine; only the wall times do.
set -euo pipefail
cd "$(dirname "$0")/../.."
TRACE=${TRACE:-../shared/ref/traces/mooncake_synthetic_trace.jsonl}
PEERS=${PEERS:-../shared/peers}
PY=${PY:-.venv/bin/python}
DYN_PY=${DYN_PY:-/tmp/dynamo_peer/venv/bin/python}
OUT=${OUT:-.cache/bench_replay}
LIMIT=${LIMIT:-0}
mkdir -p "$OUT"

for cfg in "4 2" "8 4"; do
  read -r workers speedup <<<"$cfg"
  echo "== kvmesh replay: $workers workers, arrivals x$speedup" >&2
  "$PY" -m kvmesh replay --trace "$TRACE" --workers "$workers" --speedup "$speedup" \
    --block-size 64 --num-gpu-blocks 16384 --limit "$LIMIT" \
    --router kv round-robin random least-loaded --json >"$OUT/kvmesh_w${workers}.jsonl"
done

if [ -x "$DYN_PY" ]; then
  echo "== Dynamo offline replay (replay_bench.py, 3 reps)" >&2
  "$DYN_PY" "$PEERS/replay_bench.py" --workers 4 8 --modes kv_router round_robin \
    --loads moderate --reps 3 --limit "$LIMIT" --block-size 64 >"$OUT/dynamo.jsonl"
else
  echo "Dynamo not installed at $DYN_PY: kvmesh only" >&2
  : >"$OUT/dynamo.jsonl"
fi

"$PY" - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []
for workers in (4, 8):
    for line in (out / f"kvmesh_w{workers}.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.append((workers, r["speedup"], "kvmesh " + r["mode"], r["ttft_ms"]["mean"],
                     r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["itl_ms"]["mean"],
                     r["e2e_ms"]["mean"], r["prefix_hit_rate"], r["prefix_hit_rate_bound"],
                     r["wall_s"]))
for line in (out / "dynamo.jsonl").read_text().splitlines():
    d = json.loads(line)
    if "unsupported" in d:
        continue
    m = lambda k: d[k]["median"]  # noqa: E731
    rows.append((d["workers"], d["arrival_speedup_ratio"], "dynamo " + d["mode"],
                 m("mean_ttft_ms"), m("median_ttft_ms"), m("p99_ttft_ms"), m("mean_itl_ms"),
                 m("mean_e2e_latency_ms"), m("prefix_cache_reused_ratio"), None,
                 m("outer_wall_s")))
ORDER = {"kv": 0, "kv_router": 0, "round-robin": 1, "round_robin": 1, "least-loaded": 2,
         "random": 3}
rows.sort(key=lambda r: (r[0], ORDER[r[2].split()[1]], r[2]))
print(f"{'W':>2} {'x':>3} {'mode':24} {'TTFT mean':>9} {'p50':>7} {'p99':>7} {'ITL':>6} "
      f"{'E2E':>7} {'hit':>6} {'bound':>6} {'wall s':>6}")
for w, x, mode, mean, p50, p99, itl, e2e, hit, bound, wall in rows:
    b = f"{100 * bound:5.1f}%" if bound is not None else "     -"
    print(f"{w:>2} {x:>3g} {mode:24} {mean:9.1f} {p50:7.1f} {p99:7.1f} {itl:6.2f} {e2e:7.0f} "
          f"{100 * hit:5.1f}% {b} {wall:6.1f}")
EOF
