"""CPU cost of one request's spans, tracing on, in isolation: the six spans an aggregated chat
request records (gateway: server, preprocess, route; worker: queue, prefill, decode) with their
real names and attribute sets, started and ended through `kvmesh.runtime.telemetry` and exported
over OTLP (gRPC, or http/protobuf) to a sink in another process (tests/otlp_receiver.py).
Reports this process's CPU (every thread: the request path and the exporter's) per request, on
and off.

    python tests/benchmarks/bench_span_cost.py [--requests 20000] [--rounds 3] \
        [--protocol http/protobuf]

Run it from another checkout (`PYTHONPATH=<its dirs>`) to compare commits; the mesh-level
number is tests/benchmarks/bench_tracing.sh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from kvmesh.runtime.ports import free_port
from kvmesh.runtime.telemetry import (
    AttributeValue,
    Protocol,
    SpanKind,
    Step,
    TracingConfig,
    setup_tracing,
    shutdown_tracing,
    tracer,
    wall_ns,
)
from kvmesh.runtime.tracing import TraceContext


def one_request(i: int) -> None:
    """One aggregated chat request's spans, recorded as the gateway and the engine record them."""
    t = tracer()
    client = TraceContext.new()
    rid = f"req-{i}"
    attributes: dict[str, AttributeValue] = {
        "http.request.method": "POST",
        "http.route": "/v1/chat/completions",
        "url.path": "/v1/chat/completions",
    }
    server = t.start(
        "POST /v1/chat/completions",
        client,
        kind=SpanKind.SERVER,
        remote=True,
        attributes=attributes,
    )
    ctx = server.context
    if server.recording:  # the gateway writes its server span's attributes as they come
        attributes["gen_ai.operation.name"] = "chat"
        attributes["gen_ai.request.model"] = "mock-model"
        attributes["gen_ai.request.temperature"] = 1.0
        attributes["gen_ai.request.top_p"] = 1.0
    began = time.time_ns()
    preprocess = {
        "kvmesh.preprocess.template_ms": 0.05 + i % 7 * 1e-3,
        "kvmesh.preprocess.tokenize_ms": 0.02 + i % 5 * 1e-3,
        "gen_ai.usage.input_tokens": 24,
    }
    t.record(ctx, (Step("preprocess", began, time.time_ns(), preprocess),))
    began = time.time_ns()
    route = {
        "kvmesh.request_id": rid,
        "kvmesh.route.worker_id": f"w-{i % 2}",
        "kvmesh.route.role": "aggregated",
        "kvmesh.route.overlap_blocks": 0,
        "kvmesh.route.prompt_blocks": 1,
        "kvmesh.route.cost": 1.5 + i % 11 * 0.1,
        "kvmesh.route.policy": "kv-cost",
        "kvmesh.route.overhead_us": 14.2 + i % 13,
    }
    t.record(ctx, (Step("route", began, time.time_ns(), route),))
    now = time.monotonic()  # the worker: its spans are children of the gateway's server span
    t.record(
        ctx,
        [
            Step("queue", wall_ns(now - 0.002), wall_ns(now - 0.0019), {"kvmesh.request_id": rid}),
            Step(
                "prefill",
                wall_ns(now - 0.0019),
                wall_ns(now - 0.001),
                {
                    "kvmesh.request_id": rid,
                    "gen_ai.usage.input_tokens": 24,
                    "kvmesh.cached_tokens": 0,
                },
            ),
            Step(
                "decode",
                wall_ns(now - 0.001),
                wall_ns(now),
                {
                    "kvmesh.request_id": rid,
                    "gen_ai.usage.output_tokens": 8,
                    "gen_ai.server.time_per_output_token": 0.0001,
                    "gen_ai.server.time_to_first_token": 0.001,
                    "gen_ai.response.finish_reasons": ("length",),
                },
            ),
        ],
        remote=True,
    )
    if server.recording:
        attributes["gen_ai.response.id"] = f"chatcmpl-{rid}"
        attributes["gen_ai.response.model"] = "mock-model"
        attributes["gen_ai.usage.input_tokens"] = 24
        attributes["gen_ai.usage.output_tokens"] = 8
        attributes["gen_ai.response.finish_reasons"] = ("length",)
        attributes["http.response.status_code"] = 200
    server.end()


def measure(requests: int) -> float:
    """CPU µs per request (all threads), export of everything included."""
    cpu = time.process_time()
    for i in range(requests):
        one_request(i)
    assert tracer().flush(60.0) or not tracer().enabled
    return (time.process_time() - cpu) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--protocol", type=Protocol, default=Protocol.GRPC)
    args = parser.parse_args()
    # Spans come faster here than in any serving process: queue them all (none dropped).
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(6 * args.requests)
    port = free_port()
    http = ["--http"] if args.protocol is Protocol.HTTP_PROTOBUF else []
    sink = subprocess.Popen([sys.executable, "-m", "tests.otlp_receiver", str(port), *http])
    on_config = TracingConfig(otel_endpoint=f"http://127.0.0.1:{port}", otel_protocol=args.protocol)
    results: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for _ in range(args.rounds):
            for mode, config in (("off", TracingConfig()), ("on", on_config)):
                setup_tracing(config, "bench")
                results[mode].append(measure(args.requests))
                shutdown_tracing()
    finally:
        sink.terminate()
        sink.wait()  # it prints the spans it received: 6 per request and round, on
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(
        f"CPU per request (median of {args.rounds}): off {off:.1f} us, on {on:.1f} us, "
        f"spans cost {on - off:.1f} us/request (6 spans: {(on - off) / 6:.1f} us each); "
        f"rounds on: {', '.join(f'{v:.1f}' for v in results['on'])}; {args.protocol.value}"
    )


if __name__ == "__main__":
    main()
