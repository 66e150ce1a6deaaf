#!/usr/bin/env bash
# Tracing's cost in CPU instructions per request, process by process, counted by valgrind's
# callgrind: load-independent, where bench_tracing.sh's throughput on a shared 2-core machine
# spreads by +-15 % a round. Not exact either: the same tree's `off` has measured 2.44-2.48 M
# (frontend) and 1.80-1.88 M (workers) instructions a request from run to run (which worker a
# request meets, when collections run), so a ratio from one run is good to ~+-2 %; repeat it.
# Same mesh as bench_tracing.sh (`kvmesh up`, 2 instant mocker workers, streamed chat, 8
# tokens), run under callgrind (~50x slower: start-up ~1-2 min a mode); counters zeroed after a
# warm-up, N requests at 8 concurrent, then dumped.
# Modes: off, on-grpc, on-http (100 % sampling, OTLP to a sink outside callgrind); on-grpc-py,
# on-http-py: the same with spans recorded and encoded in Python (KVMESH_OTLP_ENCODER=python).
# The batch processor exports full batches only (OTEL_BSP_SCHEDULE_DELAY 10 min), as at a busy
# gateway: at callgrind's ~30 requests/s its 5 s schedule would export small batches instead.
#   bash tests/benchmarks/bench_tracing_cpu.sh            # N=1100 MODES="off on-grpc on-http"
# Prints instructions per request for the frontend, the workers (together) and all of them, and
# each mode's ratio to off.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$PWD/.venv/bin/python}
N=${N:-1100}; MODES=${MODES:-"off on-grpc on-http"}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 2; }
free_port() { "$PY" -c "from kvmesh.runtime.ports import free_port; print(free_port())"; }
WORK=$(mktemp -d /tmp/kvmesh-bench-tracing-cpu.XXXXXX)
source tests/benchmarks/otlp_sinks.sh

run_mode() { # mode -> "mode frontend workers" (instructions per request)
  local mode=$1 env=(env -u OTEL_EXPORTER_OTLP_ENDPOINT -u OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
                     OTEL_BSP_SCHEDULE_DELAY=600000)
  case $mode in
    off) ;;
    *) sink_env env "$mode" || { echo "unknown mode $mode (off, on-grpc, on-http, on-grpc-py," \
                                      "on-http-py)" >&2; exit 2; } ;;
  esac
  local dir="$WORK/$mode" port; port=$(free_port); mkdir -p "$dir"
  "${env[@]}" valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$dir/cg.%p" \
    "$PY" -m kvmesh --log-level warning up --workers 2 --speedup-ratio 1e9 --http-port "$port" \
    --kserve-grpc-port -1 --startup-timeout-s 900 >"$dir/up.log" 2>&1 &
  local up=$!
  until curl -sf "127.0.0.1:$port/health" >/dev/null; do
    kill -0 $up 2>/dev/null || { echo "kvmesh up ($mode) exited:" >&2; cat "$dir/up.log" >&2; exit 1; }
    sleep 1
  done
  "$PY" -m kvmesh bench --url "http://127.0.0.1:$port" -n 100 -c 8 --sequential 0 >/dev/null
  callgrind_control -z >/dev/null 2>&1
  # kvmesh bench sends 100 warm-up requests of its own before the N it times: N + 100 counted
  "$PY" -m kvmesh bench --url "http://127.0.0.1:$port" -n "$N" -c 8 --sequential 0 >/dev/null
  callgrind_control -d >/dev/null 2>&1
  sleep 2
  local fe=0 w=0 f ir
  for f in "$dir"/cg.*.*; do
    ir=$(awk '/^(summary|totals):/ {print $2; exit}' "$f")
    if grep -q "^cmd:.* frontend " "$f"; then fe=$((fe + ir))
    elif grep -q "^cmd:.* worker " "$f"; then w=$((w + ir)); fi
  done
  kill -INT $up; wait $up || true
  echo "$mode $((fe / (N + 100))) $((w / (N + 100)))" | tee -a "$WORK/rows.txt"
}

for mode in $MODES; do run_mode "$mode"; done
"$PY" - "$WORK/rows.txt" <<'PYEOF'
import sys
rows = {m: (int(f), int(w)) for m, f, w in (line.split() for line in open(sys.argv[1]))}
off = rows.get("off")
for m, (f, w) in rows.items():
    rel = (f"  vs off: frontend {f / off[0]:.3f}x, workers {w / off[1]:.3f}x, "
           f"all {(f + w) / sum(off):.3f}x") if off else ""
    print(f"{m:8} instructions/request: frontend {f:>9,}  workers {w:>9,}  all {f + w:>9,}{rel}")
PYEOF
