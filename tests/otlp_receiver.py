"""Real OTLP trace receivers for tests, in this process on a free loopback port, keeping every
span they are sent (with its resource's attributes): `OtlpReceiver` serves opentelemetry-proto's
TraceService over gRPC, `OtlpHttpReceiver` the http/protobuf transport (POST /v1/traces with an
ExportTraceServiceRequest body).
"""

from __future__ import annotations

import http.server
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    """One exported span, ids as lowercase hex."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))


@dataclass
class OtlpReceiver:
    """Collects spans; `spans(trace_id)` returns those of one trace."""

    port: int = 0
    received: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: Any = None

    def start(self) -> OtlpReceiver:
        receiver = self

        class Servicer(tpb_grpc.TraceServiceServicer):
            def Export(
                self, request: tpb.ExportTraceServiceRequest, context: Any
            ) -> tpb.ExportTraceServiceResponse:
                receiver._add(request)
                return tpb.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tpb_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait(5)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _add(self, request: tpb.ExportTraceServiceRequest) -> None:
        spans: list[ReceivedSpan] = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            resource=resource,
                            status_code=s.status.code,
                        )
                    )
        with self._lock:
            self.requests += 1
            self.received.extend(spans)

    def spans(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.received if s.trace_id == trace_id]

    def wait_for(
        self, trace_id: str, names: set[str], timeout_s: float = 20.0
    ) -> list[ReceivedSpan]:
        """The spans of `trace_id` once every name in `names` has arrived (AssertionError if
        not in time)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            if time.monotonic() > deadline:
                got = sorted((s.service, s.name) for s in spans)
                raise AssertionError(f"spans {sorted(names)} not all received; got {got}")
            time.sleep(0.05)


class OtlpHttpReceiver(OtlpReceiver):
    """The same store, fed over OTLP http/protobuf (POST /v1/traces)."""

    def start(self) -> OtlpHttpReceiver:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            # Keep-alive, as collectors serve OTLP/HTTP (HTTP/1.0 would make an exporter open a
            # connection per export: a cost no real deployment has).
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                receiver._add(tpb.ExportTraceServiceRequest.FromString(body))
                out = tpb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = int(server.server_address[1])
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def main() -> None:
    """`python -m tests.otlp_receiver PORT [--http]`: an OTLP sink for benchmarks, gRPC (or
    http/protobuf), counting spans and keeping none; prints the count when stopped."""
    import signal
    import sys

    count = [0]

    def add(request: tpb.ExportTraceServiceRequest) -> None:
        count[0] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)

    port = int(sys.argv[1])
    if "--http" in sys.argv[2:]:
        sink = OtlpHttpReceiver(port=port)
        sink._add = add  # type: ignore[method-assign]  # count, keep nothing
        sink.start()
        stop_sink = sink.stop
    else:

        class Servicer(tpb_grpc.TraceServiceServicer):
            def Export(
                self, request: tpb.ExportTraceServiceRequest, context: Any
            ) -> tpb.ExportTraceServiceResponse:
                add(request)
                return tpb.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        tpb_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()

        def stop_sink() -> None:
            server.stop(0)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    stop_sink()
    print(f"otlp receiver: {count[0]} spans", flush=True)


if __name__ == "__main__":
    main()
