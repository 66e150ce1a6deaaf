#!/usr/bin/env bash
# Gateway throughput and latency, kvmesh (and optionally Dynamo) side by side on this machine.
#
#   bash tests/benchmarks/bench_gateway.sh            # kvmesh only
#   PEER=1 bash tests/benchmarks/bench_gateway.sh     # also Dynamo 1.6.1 (installed by
#                                                     # ../shared/peers/install_dynamo.sh)
# Workload: streaming chat, 8 output tokens, 200 concurrent clients, 2 effectively instant mocker
# workers; then sequential single requests on one keep-alive connection. Both systems are measured
# by the same client (`kvmesh bench`, aiohttp), and each run reports the CPU seconds every server
# process used, so per-request cost can be compared even on a noisy machine.
# SPEEDUP=R runs both systems' mockers at --speedup-ratio R instead (e.g. 5: ~1.1 ms decode
# steps, so each token reaches the gateway on its own, as from a real engine; Dynamo's instant
# mocker hands a request's tokens to its frontend in one burst, kvmesh's one step at a time).
# PEER_NODELAY=1 runs Dynamo's frontend with TCP_NODELAY forced on its sockets (the peers'
# nodelay.c shim, LD_PRELOAD), as kvmesh's gateway sets it: without it, Nagle's algorithm
# batches Dynamo's small writes (fewer segments for its client to read under load) and stalls a
# single request ~40 ms on the client's delayed ACK (its sequential p50 of ~44 ms).
# PROCS=N runs kvmesh's gateway as N processes on its port (`--gateway-processes N`; default 1:
# one Python process, which serves about one core's worth of requests).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
N=${N:-6000}; C=${C:-200}; ROUNDS=${ROUNDS:-3}
KV_PORT=${KV_PORT:-8100}; PEER_PORT=${PEER_PORT:-8200}

cpu_of() { # total utime+stime ticks of processes matching $1
  local t=0; for p in $(pgrep -f "$1" || true); do
    t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done; echo $t; }

measure() { # name port pattern
  local name=$1 port=$2 pat=$3
  for r in $(seq 1 "$ROUNDS"); do
    local before; before=$(cpu_of "$pat")
    # the client's CPU as well: it shares the machine's cores with the servers, and a server
    # that streams a response in more pieces costs its client more reads (its start-up, about
    # 0.7 CPU seconds, ~110 us a request at the default N, is included: the same for both)
    local out; out=$($PY -c 'import json, resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True)
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"client_cpu_s": ru.ru_utime + ru.ru_stime}))' \
      $PY -m kvmesh bench --url "http://127.0.0.1:$port" -n "$N" -c "$C" --sequential 300)
    local after; after=$(cpu_of "$pat")
    local ticks=$((after - before))
    echo "$out" | $PY -c "import sys,json
rows=[json.loads(l) for l in sys.stdin if l.strip()]
c,s,u=rows[0],rows[1],rows[-1]
n=$N+20+300+100
print(f'$name round $r: {c[\"req_per_s\"]:7.1f} req/s  p50 {c[\"lat_ms_p50\"]:6.1f} ms  p99 {c[\"lat_ms_p99\"]:6.1f} ms | sequential p50 {s[\"lat_ms_p50\"]:5.2f} ms p99 {s[\"lat_ms_p99\"]:5.2f} ms, >35ms: {s[\"over_35ms\"]} | server CPU {$ticks*10000/n:.0f} us/request, client {u[\"client_cpu_s\"]*1e6/n:.0f}')"
  done
}

cleanup() { kill "$KV_PID" 2>/dev/null || true; wait "$KV_PID" 2>/dev/null || true
            [ "${PEER:-0}" = 1 ] && bash /tmp/dynamo_peer/scripts/stop_dynamo.sh >/dev/null 2>&1 || true; }
trap cleanup EXIT

$PY -m kvmesh --log-level warning up --workers 2 --speedup-ratio "${SPEEDUP:-1e9}" --http-port "$KV_PORT" \
  --gateway-processes "${PROCS:-1}" >/tmp/kvmesh-bench-up.log 2>&1 &
KV_PID=$!
for _ in $(seq 100); do curl -sf "127.0.0.1:$KV_PORT/health" >/dev/null && break; sleep 0.2; done
if [ "${PEER:-0}" = 1 ]; then
  mkdir -p /tmp/dynamo_peer/scripts && cp ../shared/peers/* /tmp/dynamo_peer/scripts/
  if [ "${PEER_NODELAY:-0}" = 1 ]; then
    mkdir -p /tmp/dynamo_peer/shim
    gcc -O2 -shared -fPIC -o /tmp/dynamo_peer/shim/libnodelay.so \
      /tmp/dynamo_peer/scripts/nodelay.c -ldl
    export FE_PRELOAD=/tmp/dynamo_peer/shim/libnodelay.so
  fi
  PORT=$PEER_PORT WORKERS=2 SPEEDUP="${SPEEDUP:-1000000}" bash /tmp/dynamo_peer/scripts/launch_dynamo.sh
fi
for r in 1; do
  measure kvmesh "$KV_PORT" "\-m kvmesh .*(frontend|worker) "
  [ "${PEER:-0}" = 1 ] && measure dynamo "$PEER_PORT" "dynamo\.(frontend|mocker)"
done
