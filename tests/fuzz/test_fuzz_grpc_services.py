"""Hypothesis-generated messages against every kvmesh gRPC service, each served by its real
process: WorkerService (`kvmesh worker`, mocker), RouterService (`kvmesh router` over that
worker) and ScalingService (`kvmesh up --max-workers 1`). Messages are built from the services'
protobuf descriptors (any field, any value, nested messages, repeated fields, unknown enum
numbers); every method is called, unary ones once per example, streaming ones read for a few
messages. Whatever arrives: a proper status (never INTERNAL or UNKNOWN), and every process keeps
serving with no traceback in its log. (KServe's GRPCInferenceService: test_fuzz_kserve.py.)

`Drain` is left out: it takes the worker out of service on purpose (tested in the worker
contract tests). The fast smoke runs by default; `-m slow` runs many more examples.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as d
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.api.router.v1 import router_service_pb2
from kvmesh.api.scaling.v1 import scaling_service_pb2
from kvmesh.api.worker.v1 import worker_service_pb2
from kvmesh.runtime.ports import free_port
from tests.procs import poll

pytestmark = pytest.mark.integration

SERVICES = {
    "worker": worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"],
    "router": router_service_pb2.DESCRIPTOR.services_by_name["RouterService"],
    "scaling": scaling_service_pb2.DESCRIPTOR.services_by_name["ScalingService"],
}
SKIPPED = {"Drain"}
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a stream read for a while, then left
    grpc.StatusCode.CANCELLED,
}

_INT_RANGES = {
    d.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: d.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        return st.one_of(st.integers(max(lo, -3), 300), st.integers(lo, hi))
    if t in (d.FieldDescriptor.TYPE_FLOAT, d.FieldDescriptor.TYPE_DOUBLE):
        width = 32 if t == d.FieldDescriptor.TYPE_FLOAT else 64
        return st.floats(width=width, allow_nan=True, allow_infinity=True)
    if t == d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == d.FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(["", "tiny", "tiny-llama", "w0"]), st.text(max_size=20))
    if t == d.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=32)
    if t == d.FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 50))
    assert field.message_type is not None
    return messages(field.message_type, depth + 1)


def messages(desc: d.Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of type `desc` (nested messages up to depth 3)."""
    cls = GetMessageClass(desc)
    fields = [
        f
        for f in desc.fields
        if depth < 3 or f.type != d.FieldDescriptor.TYPE_MESSAGE
    ]  # fmt: skip
    if not fields:
        return st.just(cls())

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for f in draw(st.lists(st.sampled_from(fields), max_size=min(6, len(fields)), unique=True)):
            is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
            if is_map:
                key_f, value_f = (
                    f.message_type.fields_by_name["key"],
                    f.message_type.fields_by_name["value"],
                )
                entries = draw(
                    st.dictionaries(_scalar(key_f, depth), _scalar(value_f, depth), max_size=2)
                )
                target = getattr(msg, f.name)
                for k, v in entries.items():
                    if value_f.type == d.FieldDescriptor.TYPE_MESSAGE:
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif f.is_repeated:
                values = draw(st.lists(_scalar(f, depth), max_size=3))
                if f.type == d.FieldDescriptor.TYPE_MESSAGE:
                    getattr(msg, f.name).extend(values)
                else:
                    getattr(msg, f.name).extend(values)
            elif f.type == d.FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, f.name).CopyFrom(draw(_scalar(f, depth)))
            else:
                setattr(msg, f.name, draw(_scalar(f, depth)))
        return msg

    return build()


@dataclass
class Served:
    procs: dict[str, subprocess.Popen[bytes]]
    logs: list[Path]
    channels: dict[str, grpc.Channel]


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvmesh", "--log-level", "warning", *argv],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            grpc.channel_ready_future(ch).result(timeout=0.5)
            return True
        except grpc.FutureTimeoutError:
            return False


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("fuzz-grpc")
    registry = f"file://{tmp / 'registry'}"
    ports = {name: free_port() for name in SERVICES}
    logs = [tmp / f"{name}.log" for name in SERVICES]
    procs = {
        "worker": _start(
            ["worker", "--model", str(tiny_model), "--discovery", registry, "--worker-id", "w0",
             "--port", str(ports["worker"]), "--speedup-ratio", "1e6", "--num-gpu-blocks", "128"],
            logs[0],
        ),
        "router": _start(
            ["router", "--discovery", registry, "--port", str(ports["router"])], logs[1]
        ),
        "scaling": _start(
            ["up", "--model", str(tiny_model), "--workers", "1", "--max-workers", "1",
             "--control-port", str(ports["scaling"]), "--speedup-ratio", "1e6",
             "--http-port", str(free_port())],
            logs[2],
        ),
    }  # fmt: skip
    try:
        for name, port in ports.items():
            poll(lambda p=port: _serving(f"127.0.0.1:{p}"), 60, f"the {name} to serve", 0.2)  # type: ignore[misc]
        channels = {name: grpc.insecure_channel(f"127.0.0.1:{p}") for name, p in ports.items()}
        yield Served(procs, logs, channels)
        for name, proc in procs.items():
            assert proc.poll() is None, (
                f"the {name} died:\n{logs[list(procs).index(name)].read_text()}"
            )
        for ch in channels.values():
            ch.close()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    for log in logs:
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "internal error" not in text, text[-4000:]


STREAM_S = 0.75
"""Deadline of a streaming call (DEADLINE_EXCEEDED is a proper status)."""


def _call(channel: grpc.Channel, service: d.ServiceDescriptor, method: d.MethodDescriptor,
          requests: list[Message]) -> grpc.StatusCode:  # fmt: skip
    path = f"/{service.full_name}/{method.name}"
    out_cls = GetMessageClass(method.output_type)
    ser, de = (lambda m: m.SerializeToString()), out_cls.FromString
    try:
        if not method.client_streaming and not method.server_streaming:
            channel.unary_unary(path, ser, de)(requests[0], timeout=10)
            return grpc.StatusCode.OK
        # A subscription that accepted its request streams until the deadline: short, or
        # each example waits it out (a refusal comes at once, within it).
        if method.client_streaming:
            call = channel.stream_stream(path, ser, de)(iter(requests), timeout=STREAM_S)
        else:
            call = channel.unary_stream(path, ser, de)(requests[0], timeout=STREAM_S)
        for i, _ in enumerate(call):
            if i >= 4:
                call.cancel()
                break
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined, no-any-return]


def _methods() -> list[tuple[str, d.MethodDescriptor]]:
    return [(name, m) for name, s in SERVICES.items() for m in s.methods if m.name not in SKIPPED]


def _examples(slow: bool) -> int:
    return 60 if slow else 12


@pytest.mark.parametrize(("name", "method"), _methods(), ids=lambda v: getattr(v, "name", v))
def test_any_message_gets_a_proper_status(
    served: Served, name: str, method: d.MethodDescriptor, request: pytest.FixtureRequest
) -> None:
    service = SERVICES[name]
    slow = "slow" in (request.config.getoption("-m") or "")

    @settings(
        max_examples=_examples(slow),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(st.lists(messages(method.input_type), min_size=1, max_size=3))
    def check(requests: list[Message]) -> None:
        code = _call(served.channels[name], service, method, requests)
        assert code in ALLOWED, (method.full_name, code, requests)

    check()
    for other, proc in served.procs.items():
        assert proc.poll() is None, f"the {other} died"
