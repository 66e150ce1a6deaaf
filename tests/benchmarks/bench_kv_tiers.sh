#!/usr/bin/env bash
# KV tiers in `kvmesh replay` on the Mooncake synthetic trace: a device pool too small for the
# working set (4 workers, 4,096 blocks of 64 tokens each, about a sixth of what bench_replay.sh
# gives them) with no tier, a host tier, and a host tier over a disk tier, all with the KV
# router crediting the tiers (--router-host-hit-weight / --router-disk-hit-weight defaults) and
# the default transfer model (host 25 GB/s, disk 5 GB/s, Llama-3-8B bf16 KV bytes per token).
#
# Usage: bash tests/benchmarks/bench_kv_tiers.sh          (from anywhere; about 1 min per row)
#   LIMIT=1000 ... the first 1000 requests; TRACE=... PY=... OUT=... WORKERS=... SPEEDUP=...
#   DEVICE=... HOST=... DISK=... override the trace, Python, output folder and the sizes.
# Simulated latencies do not depend on this machine; only the wall times do.
set -euo pipefail
cd "$(dirname "$0")/../.."
TRACE=${TRACE:-../shared/ref/traces/mooncake_synthetic_trace.jsonl}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-.cache/bench_kv_tiers}
LIMIT=${LIMIT:-0}
WORKERS=${WORKERS:-4}
SPEEDUP=${SPEEDUP:-2}
DEVICE=${DEVICE:-4096}
HOST=${HOST:-16384}
DISK=${DISK:-65536}
mkdir -p "$OUT"
: >"$OUT/rows.jsonl"

for cfg in "0 0" "$HOST 0" "$HOST $DISK"; do
  read -r host disk <<<"$cfg"
  echo "== kvmesh replay: device $DEVICE, host $host, disk $disk blocks per worker" >&2
  "$PY" -m kvmesh replay --trace "$TRACE" --workers "$WORKERS" --speedup "$SPEEDUP" \
    --block-size 64 --num-gpu-blocks "$DEVICE" --kv-host-blocks "$host" \
    --kv-disk-blocks "$disk" --limit "$LIMIT" --router kv --json >>"$OUT/rows.jsonl"
done

"$PY" - "$OUT/rows.jsonl" <<'PYEOF'
import json
import sys

print(f"{'tiers':10} {'host':>6} {'disk':>6} {'TTFT mean':>9} {'p50':>7} {'p90':>7} {'p99':>7} "
      f"{'E2E':>7} {'hit':>6} {'device':>6} {'host':>6} {'disk':>6} {'bound':>6} {'wall s':>6}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    h, d = r["kv_host_blocks"], r["kv_disk_blocks"]
    name = "host+disk" if d else "host" if h else "none"
    t = r["ttft_ms"]
    by = r["tier_hit_rates"]
    pct = lambda v: f"{100 * v:5.1f}%"  # noqa: E731
    print(f"{name:10} {h:6} {d:6} {t['mean']:9.1f} {t['p50']:7.1f} {t['p90']:7.1f} "
          f"{t['p99']:7.1f} {r['e2e_ms']['mean']:7.0f} {pct(r['prefix_hit_rate'])} "
          f"{pct(by.get('device', 0))} {pct(by.get('host', 0))} {pct(by.get('disk', 0))} "
          f"{pct(r['prefix_hit_rate_bound'])} {r['wall_s']:6.1f}")
PYEOF
