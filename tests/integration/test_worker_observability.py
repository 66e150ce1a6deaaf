"""A worker's observability over real sockets: its /metrics endpoint (vLLM's names under
`kvmesh_worker_`, values that follow the requests it served, `promtool check metrics` clean),
and its spans (queue, prefill, decode under the caller's span; PrefillRemote and, on the decode
side, kv_transfer) exported to a real OTLP receiver."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.router.session import WorkerSession
from kvmesh.runtime.grpcutil import insecure_channel
from kvmesh.runtime.telemetry import (
    Protocol,
    TracingConfig,
    setup_tracing,
    shutdown_tracing,
    tracer,
)
from kvmesh.runtime.tracing import TraceContext
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.server import Worker
from tests.integration.test_worker_contract import gen_request, make_engine
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.integration

PROMTOOL = shutil.which("promtool")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return str(r.read().decode())


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def promtool_check(text: str) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool not installed (Debian's prometheus package)")
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    setup_tracing(
        TracingConfig(otel_endpoint=r.endpoint, otel_protocol=Protocol.GRPC),
        "worker",
        role="aggregated",
        worker_id="w-obs",
    )
    yield r
    shutdown_tracing()
    setup_tracing(TracingConfig(), "worker")
    r.stop()


@pytest.fixture
async def worker(tiny_model: Path) -> AsyncIterator[Worker]:
    w = Worker(
        WorkerConfig(worker_id="w-obs", metrics_port=0),
        make_engine(tiny_model, num_gpu_blocks=64, block_size=4),
    )
    await w.start()
    yield w
    await w.stop()


async def test_metrics_follow_the_requests_and_pass_promtool(
    worker: Worker, receiver: OtlpReceiver
) -> None:
    assert worker.metrics is not None and worker.metrics.port > 0
    labels = (("model", "tiny"), ("role", "aggregated"), ("worker_id", "w-obs"))
    before = samples(await asyncio.to_thread(scrape, worker.metrics.port))
    assert before[("kvmesh_worker_num_requests_running", labels)] == 0
    assert before[("kvmesh_worker_kv_cache_total_blocks", labels)] == 64

    caller = TraceContext.new()
    channel = insecure_channel(worker.address)
    session = WorkerSession(wpb_grpc.WorkerServiceStub(channel), worker.address)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks of 4
    try:
        for i in range(2):  # the second request finds the prompt's blocks cached
            req = gen_request(prompt, max_tokens=5)
            req.request_id = f"r{i}"
            outs = [o async for o in session.generate(req, caller)]
            assert outs[-1].finish_reason and outs[-1].usage.completion_tokens == 5
    finally:
        await session.close()
        await channel.close()

    text = await asyncio.to_thread(scrape, worker.metrics.port)
    await asyncio.to_thread(promtool_check, text)
    after = samples(text)
    assert after[("kvmesh_worker_generation_tokens_total", labels)] == 10
    assert after[("kvmesh_worker_prompt_tokens_total", labels)] == 34
    assert after[("kvmesh_worker_prefix_cache_queries_total", labels)] == 34
    assert after[("kvmesh_worker_prefix_cache_hits_total", labels)] == 16
    length = tuple(sorted((*labels, ("finished_reason", "length"))))
    assert after[("kvmesh_worker_request_success_total", length)] == 2
    assert after[("kvmesh_worker_time_to_first_token_seconds_count", labels)] == 2
    assert after[("kvmesh_worker_inter_token_latency_seconds_count", labels)] == 8
    assert after[("kvmesh_worker_request_queue_time_seconds_count", labels)] == 2
    assert after[("kvmesh_worker_num_requests_running", labels)] == 0

    # The engine's spans: children of the caller's span, one set per request.
    assert tracer().flush()
    spans = await asyncio.to_thread(
        receiver.wait_for, caller.trace_id, {"queue", "prefill", "decode"}
    )
    names = sorted(s.name for s in spans)
    assert names == ["decode", "decode", "prefill", "prefill", "queue", "queue"]
    assert {s.parent_span_id for s in spans} == {caller.span_id}
    by_name = {(s.name, s.attributes["kvmesh.request_id"]): s for s in spans}
    decode = by_name["decode", "r1"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == 5
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert decode.attributes["gen_ai.server.time_to_first_token"] > 0
    prefill = by_name["prefill", "r1"]
    assert prefill.attributes["kvmesh.cached_tokens"] == 16
    assert prefill.end_ns <= decode.start_ns + 1000  # decode starts at the first token
    assert spans[0].resource["kvmesh.worker_id"] == "w-obs"
