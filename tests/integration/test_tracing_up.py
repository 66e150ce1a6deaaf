"""One trace per request through every hop of `kvmesh up`, exported over OTLP/gRPC to a real
receiver (opentelemetry-proto's TraceService, in this process): a disaggregated chat request
(frontend, router, prefill worker, decode worker), an aggregated one, and a KServe v2 gRPC one.
Each request carries a client `traceparent`: its spans form exactly one trace under the
client's span, every parent is inside the trace, and the hops are named for what they are."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from kvmesh.runtime.tracing import TraceContext
from tests.integration.test_kserve_up import kserve_grpc_address
from tests.integration.test_up_openai import MODEL, Mesh, start_mesh, stop_mesh
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.integration

CHAT = "POST /v1/chat/completions"
SPAN_KIND_SERVER = 2  # OTLP's SPAN_KIND_SERVER


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s
    r = OtlpReceiver().start()
    yield r
    r.stop()


def _up(tmp: Path, receiver: OtlpReceiver, *args: str) -> Mesh:
    return start_mesh(tmp, "--otel-endpoint", receiver.endpoint, "--otel-protocol", "grpc", *args)


def _one_trace(
    receiver: OtlpReceiver, client: TraceContext, request_id: str, names: set[str]
) -> list[ReceivedSpan]:
    """The request's spans, checked: one trace (the client's), every parent inside it or the
    client's span, the server span a child of the client's, `request_id` recorded."""
    spans = receiver.wait_for(client.trace_id, names)
    tagged = [s for s in receiver.received if s.attributes.get("kvmesh.request_id") == request_id]
    assert tagged and {s.trace_id for s in tagged} == {client.trace_id}
    ids = {s.span_id for s in spans}
    assert len(ids) == len(spans), "span ids are unique"
    for s in spans:
        assert s.parent_span_id in ids | {client.span_id}, (s.service, s.name)
        assert s.end_ns >= s.start_ns > 0, s.name
    servers = [s for s in spans if s.parent_span_id == client.span_id]
    assert len(servers) == 1 and servers[0].kind == SPAN_KIND_SERVER
    assert servers[0].attributes["kvmesh.request_id"] == request_id
    return spans


def _named(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def test_disaggregated_request_is_one_trace_across_frontend_prefill_and_decode(
    tiny_model: Path, tmp_path: Path, receiver: OtlpReceiver
) -> None:
    mesh = _up(
        tmp_path,
        receiver,
        "--workers",
        "0",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--disagg-local-prefill-tokens",
        "0",
        "--kv-transfer-gbps",
        "1000",
    )
    try:
        mesh.wait_workers(prefill=1, decode=1)
        client = TraceContext.new()
        resp = mesh.client().chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me about tracing. " * 8}],
            max_tokens=6,
            extra_headers={"traceparent": client.traceparent, "x-request-id": "disagg-1"},
        )
        assert resp.headers["x-request-id"] == "disagg-1"
        completion = resp.parse()
        names = {CHAT, "preprocess", "route", "PrefillRemote", "prefill", "kv_transfer", "decode"}
        spans = _one_trace(receiver, client, "disagg-1", names)
    finally:
        assert stop_mesh(mesh) == 0, mesh.log.read_text()
    server = _named(spans, CHAT)
    assert server.service == "kvmesh-frontend"
    attrs = server.attributes
    assert attrs["http.request.method"] == "POST"
    assert attrs["http.route"] == "/v1/chat/completions"
    assert attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    assert attrs["gen_ai.response.finish_reasons"] == [completion.choices[0].finish_reason]
    assert attrs["gen_ai.response.id"] == completion.id
    # The hops, by process and role.
    roles = {(s.name, s.service, s.resource.get("kvmesh.role")) for s in spans}
    assert ("PrefillRemote", "kvmesh-worker", "prefill") in roles
    assert ("prefill", "kvmesh-worker", "prefill") in roles
    assert ("kv_transfer", "kvmesh-worker", "decode") in roles
    assert ("decode", "kvmesh-worker", "decode") in roles
    instances = {s.resource["service.instance.id"] for s in spans}
    assert len(instances) == 3  # frontend, prefill worker, decode worker
    route = [s for s in spans if s.name == "route"]
    assert {s.attributes["kvmesh.route.role"] for s in route} >= {"prefill"}
    for s in route:
        assert s.parent_span_id == server.span_id
        assert {"kvmesh.route.worker_id", "kvmesh.route.overlap_blocks", "kvmesh.route.cost"} <= (
            s.attributes.keys()
        )
        assert s.attributes["kvmesh.route.policy"]
    transfer = _named(spans, "kv_transfer").attributes
    assert transfer["kvmesh.kv_transfer.bytes"] > 0
    assert transfer["kvmesh.kv_transfer.blocks"] > 0
    assert transfer["kvmesh.kv_transfer.backend"]
    assert transfer["kvmesh.kv_transfer.duration_ms"] >= 0
    decode = _named(spans, "decode").attributes
    # The prefill worker produced the first token; the decode worker the rest.
    assert decode["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens - 1


def test_aggregated_and_kserve_grpc_requests_are_one_trace_each(
    tiny_model: Path, tmp_path: Path, receiver: OtlpReceiver
) -> None:
    mesh = _up(tmp_path, receiver)
    try:
        chat = TraceContext.new()
        mesh.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            extra_headers={"traceparent": chat.traceparent, "x-request-id": "agg-1"},
        )
        chat_spans = _one_trace(
            receiver, chat, "agg-1", {CHAT, "preprocess", "route", "queue", "prefill", "decode"}
        )

        infer = TraceContext.new()
        client = grpcclient.InferenceServerClient(kserve_grpc_address(mesh))
        try:
            text = grpcclient.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([b"The quick brown fox"], dtype=object))
            limit = grpcclient.InferInput("max_tokens", [1], "INT32")
            limit.set_data_from_numpy(np.array([4], dtype=np.int32))
            client.infer(
                MODEL,
                [text, limit],
                headers={"traceparent": infer.traceparent, "x-request-id": "kserve-1"},
            )
        finally:
            client.close()
        rpc = "inference.GRPCInferenceService/ModelInfer"
        grpc_spans = _one_trace(
            receiver, infer, "kserve-1", {rpc, "preprocess", "route", "queue", "prefill", "decode"}
        )
    finally:
        assert stop_mesh(mesh) == 0, mesh.log.read_text()
    assert not {"kv_transfer", "PrefillRemote"} & {s.name for s in chat_spans}
    assert {s.service for s in chat_spans} == {"kvmesh-frontend", "kvmesh-worker"}
    server = _named(grpc_spans, rpc).attributes
    assert server["rpc.system"] == "grpc"
    assert server["rpc.method"] == "ModelInfer"
    assert server["rpc.grpc.status_code"] == 0
    assert server["gen_ai.operation.name"] == "text_completion"
    assert server["gen_ai.usage.output_tokens"] > 0
