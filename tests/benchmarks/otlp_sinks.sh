# Sourced by the tracing benchmarks: one OTLP span sink per protocol on this machine
# (tests/otlp_receiver.py, counting spans; an idle one costs nothing), stopped on exit, when
# they print their counts and $WORK is removed. Needs PY, WORK and free_port; sets SINK_PORT
# (OTLP/gRPC) and HTTP_SINK_PORT (http/protobuf) unless given; defines sink_env.
SINK_PORT=${SINK_PORT:-$(free_port)}; HTTP_SINK_PORT=${HTTP_SINK_PORT:-$(free_port)}
"$PY" -m tests.otlp_receiver "$SINK_PORT" >"$WORK/sink.log" 2>&1 &
SINK=$!
"$PY" -m tests.otlp_receiver "$HTTP_SINK_PORT" --http >"$WORK/sink-http.log" 2>&1 &
HTTP_SINK=$!
trap 'kill $SINK $HTTP_SINK 2>/dev/null || true; wait $SINK $HTTP_SINK 2>/dev/null || true
      cat "$WORK/sink.log" "$WORK/sink-http.log"; rm -rf "$WORK"' EXIT

# sink_env ARRAY MODE: appends to the array named ARRAY the environment of the tracing modes the
# benchmarks share: on-grpc / on-http (100 % sampling, to the sink of that protocol) and
# on-grpc-py / on-http-py (the same, spans recorded and encoded in Python:
# KVMESH_OTLP_ENCODER=python, not by kvmesh.runtime._otlpc). Fails for any other mode.
sink_env() {
  local -n _env=$1
  case $2 in
    on-grpc|on-grpc-py) _env+=(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$SINK_PORT"
                               OTEL_EXPORTER_OTLP_PROTOCOL=grpc) ;;
    on-http|on-http-py) _env+=(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$HTTP_SINK_PORT"
                               OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf) ;;
    *) return 1 ;;
  esac
  if [[ $2 == *-py ]]; then _env+=(KVMESH_OTLP_ENCODER=python); fi
}
