# Sourced by the tracing benchmarks: one OTLP span sink per protocol on this machine
# (tests/otlp_receiver.py, counting spans; an idle one costs nothing), stopped on exit, when
# they print their counts and $WORK is removed. Needs PY, WORK and free_port; sets SINK_PORT
# (OTLP/gRPC) and HTTP_SINK_PORT (http/protobuf) unless given.
SINK_PORT=${SINK_PORT:-$(free_port)}; HTTP_SINK_PORT=${HTTP_SINK_PORT:-$(free_port)}
"$PY" -m tests.otlp_receiver "$SINK_PORT" >"$WORK/sink.log" 2>&1 &
SINK=$!
"$PY" -m tests.otlp_receiver "$HTTP_SINK_PORT" --http >"$WORK/sink-http.log" 2>&1 &
HTTP_SINK=$!
trap 'kill $SINK $HTTP_SINK 2>/dev/null || true; wait $SINK $HTTP_SINK 2>/dev/null || true
      cat "$WORK/sink.log" "$WORK/sink-http.log"; rm -rf "$WORK"' EXIT
