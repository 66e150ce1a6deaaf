#!/usr/bin/env bash
# Tracing overhead at the gateway: streaming chat throughput and server CPU per request of
# `kvmesh up` (2 instant mocker workers, 200 clients, 8 tokens), in three modes, rounds
# interleaved so the machine's noise hits each mode alike (round r starts at the r-th mode of
# MODES and goes round: no mode always runs first, or right after the same one):
#   base : the code of BASE (default main: `git archive`, no tracing code at all)
#   off  : this tree, tracing off (no OTEL endpoint)
#   on   : this tree, every process tracing at 100 % sampling (parentbased_always_on), OTLP/gRPC
#          to a span sink on this machine (tests/otlp_receiver.py, counting spans)
#   on-grpc, on-http: as `on`, over OTLP/gRPC and OTLP http/protobuf (both in one run: their
#          rounds interleave with `off`'s, so the two protocols meet the same machine)
#   base-on: the code of BASE tracing as `on` does (has the cost of tracing itself moved?)
#   on-grpc-py, on-http-py: as on-grpc / on-http with spans recorded and encoded in Python
#          (KVMESH_OTLP_ENCODER=python) rather than by kvmesh.runtime._otlpc
#   bash tests/benchmarks/bench_tracing.sh            # N=4000 C=200 ROUNDS=3
#   PROTOCOL=http/protobuf bash ...                   # the OTLP protocol of `on` (default grpc)
#   MODES="off on-grpc on-http" ROUNDS=12 bash ...   # both protocols against off
#   PIN=1 bash ...   # the mesh on CPU 0, the load generator and the span sinks on the others:
#                    # the serving processes' own capacity, without the client's and the
#                    # sink's CPU in the way (on 2 cores the client takes a third of it)
# Ends with each mode's medians over the rounds and their ratios to `off`, and the median of
# the per-round ratios to the `off` run beside it (each round's modes ran back to back: the
# machine's slower drifts cancel in those).
# Server CPU counts the frontend and worker processes only (not the client, not the sink).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$PWD/.venv/bin/python}
N=${N:-4000}; C=${C:-200}; ROUNDS=${ROUNDS:-3}; BASE=${BASE:-main}; MODES=${MODES:-"base off on"}
PROTOCOL=${PROTOCOL:-grpc}
free_port() { "$PY" -c "from kvmesh.runtime.ports import free_port; print(free_port())"; }
PORT=${PORT:-$(free_port)}
WORK=$(mktemp -d /tmp/kvmesh-bench-tracing.XXXXXX)
git archive "$BASE" | tar -x -C "$WORK"
BASE_PATH=$(printf "$WORK/%s:" gen runtime frontend router workers planner sim apps)

cpu_of() { # CPU ticks of the children of `kvmesh up` $1 (its frontend and workers)
  local t=0; for p in $(pgrep -P "$1" || true); do
  t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done; echo $t; }

MESH=()
if [ "${PIN:-0}" = 1 ]; then
  [ "$(nproc)" -ge 2 ] || { echo "PIN=1 needs 2 CPUs or more" >&2; exit 2; }
  taskset -c -p "1-$(( $(nproc) - 1 ))" $$ >/dev/null  # this script, its client and sinks
  MESH=(taskset -c 0)
fi
source tests/benchmarks/otlp_sinks.sh
if [ "$PROTOCOL" = http/protobuf ]; then ON_PORT=$HTTP_SINK_PORT; else ON_PORT=$SINK_PORT; fi

run_mode() { # mode round
  local mode=$1 env=(env -u OTEL_EXPORTER_OTLP_ENDPOINT -u OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
  case $mode in
    base) env+=(PYTHONPATH="$BASE_PATH") ;;
    on) env+=(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$ON_PORT"
              OTEL_EXPORTER_OTLP_PROTOCOL="$PROTOCOL") ;;
    base-on) env+=(PYTHONPATH="$BASE_PATH" OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$ON_PORT"
                   OTEL_EXPORTER_OTLP_PROTOCOL="$PROTOCOL") ;;
    off|base) ;;
    *) sink_env env "$mode" || { echo "unknown mode $mode (base, off, on, on-grpc, on-http," \
                                      "on-grpc-py, on-http-py, base-on)" >&2; exit 2; } ;;
  esac
  "${env[@]}" "${MESH[@]}" "$PY" -m kvmesh --log-level warning up --workers 2 --speedup-ratio 1e9 \
    --http-port "$PORT" --kserve-grpc-port -1 >"$WORK/up-$mode.log" 2>&1 &
  local up=$!
  for _ in $(seq 150); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.2; done
  local before; before=$(cpu_of $up)
  local out; out=$("$PY" -m kvmesh bench --url "http://127.0.0.1:$PORT" -n "$N" -c "$C" --sequential 0)
  local ticks=$(( $(cpu_of $up) - before ))
  kill -INT $up; wait $up || true
  echo "$out" | "$PY" -c "import sys,json
c=json.loads(sys.stdin.readline())
print(f'$mode round $2: {c[\"req_per_s\"]:7.1f} req/s  p50 {c[\"lat_ms_p50\"]:6.1f} ms  p99 {c[\"lat_ms_p99\"]:6.1f} ms | server CPU {$ticks*10000/($N+100):.0f} us/request', flush=True)" | tee -a "$WORK/rounds.txt"
}

uptime
read -ra modes <<<"$MODES"
for r in $(seq 1 "$ROUNDS"); do
  for i in "${!modes[@]}"; do run_mode "${modes[(r - 1 + i) % ${#modes[@]}]}" "$r"; done
done
uptime
"$PY" - "$WORK/rounds.txt" <<'PYEOF'
import re, statistics, sys
rows: dict[str, list[tuple[float, float, float]]] = {}
by_round: dict[tuple[str, str], tuple[float, float, float]] = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) round (\d+): +([\d.]+) req/s .* p99 +([\d.]+) ms .* CPU (\d+) us", line)
    if m:
        row = (float(m[3]), float(m[4]), float(m[5]))
        rows.setdefault(m[1], []).append(row)
        by_round[m[1], m[2]] = row
med = {k: [statistics.median(c) for c in zip(*v)] for k, v in rows.items()}
off = med.get("off")
for k, (rps, p99, cpu) in med.items():
    rel = f"  vs off: {rps / off[0]:.3f}x req/s, {cpu / off[2]:.3f}x CPU" if off else ""
    print(f"median {k}: {rps:7.1f} req/s  p99 {p99:6.1f} ms  CPU {cpu:5.0f} us/request{rel}")
for k in med:
    pairs = [(v, by_round["off", r]) for (m, r), v in by_round.items() if m == k and ("off", r) in by_round]
    if k == "off" or not pairs:
        continue
    rps = [v[0] / o[0] for v, o in pairs]
    cpu = [v[2] / o[2] for v, o in pairs]
    print(f"per-round ratio {k}/off (median of {len(pairs)}): {statistics.median(rps):.3f}x req/s "
          f"(quartiles {statistics.quantiles(rps, n=4)[0]:.3f}-{statistics.quantiles(rps, n=4)[2]:.3f}), "
          f"{statistics.median(cpu):.3f}x CPU" if len(pairs) > 1 else
          f"per-round ratio {k}/off: {rps[0]:.3f}x req/s, {cpu[0]:.3f}x CPU")
PYEOF
