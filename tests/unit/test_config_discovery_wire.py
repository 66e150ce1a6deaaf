"""Unit tests for config<->CLI, file discovery, gRPC status mapping and wire conversions."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.runtime import errors, wire
from kvmesh.runtime import kv_events as kv
from kvmesh.runtime.config import add_args, from_args, opt, to_argv
from kvmesh.runtime.discovery import (
    ROUTER,
    DiscoveryEvent,
    EtcdDiscovery,
    EventKind,
    FileDiscovery,
    Instance,
    Registration,
    open_discovery,
    register_in_background,
)
from kvmesh.runtime.grpcutil import error_from_rpc, error_from_status, status_for, status_of
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    ModelInfo,
    Role,
    SamplingParams,
    StopParams,
    TokenLogprob,
    Usage,
)

pytestmark = pytest.mark.unit


@dataclass
class Demo:
    """A config with every kind of field."""

    name: str = opt("x", "a string")
    count: int = opt(3, "an int")
    ratio: float = opt(0.5, "a float")
    flag: bool = opt(True, "a bool")
    role: Role = opt(Role.AGGREGATED, "an enum")
    ids: tuple[int, ...] = opt((), "a list")


def test_config_flags_roundtrip() -> None:
    parser = argparse.ArgumentParser()
    add_args(parser, Demo)
    assert from_args(Demo, parser.parse_args([])) == Demo()
    argv = ["--name", "y", "--count", "7", "--no-flag", "--role", "prefill", "--ids", "1", "2"]
    cfg = from_args(Demo, parser.parse_args(argv))
    assert cfg == Demo("y", 7, 0.5, False, Role.PREFILL, (1, 2))
    assert from_args(Demo, parser.parse_args(to_argv(cfg))) == cfg
    assert "--ratio" not in to_argv(cfg), "defaults are not repeated"
    with pytest.raises(SystemExit):
        parser.parse_args(["--role", "bogus"])


async def test_file_discovery_register_watch_expire(tmp_path: Path) -> None:
    disc = FileDiscovery(tmp_path, ttl_s=0.6, poll_s=0.05)
    events = disc.watch()
    reg = await disc.register(Instance("w1", "127.0.0.1:1", model="m"))
    ev = await asyncio.wait_for(anext(events), 2)
    assert (ev.kind, ev.instance.instance_id, ev.instance.model) == (EventKind.ADDED, "w1", "m")
    await asyncio.sleep(0.8)  # longer than the TTL: the keepalive must have refreshed it
    reg2 = await disc.register(Instance("w2", "127.0.0.1:2"))
    ev = await asyncio.wait_for(anext(events), 2)
    assert (ev.kind, ev.instance.instance_id) == (EventKind.ADDED, "w2")
    await reg.close()
    ev = await asyncio.wait_for(anext(events), 2)
    assert (ev.kind, ev.instance.instance_id) == (EventKind.REMOVED, "w1")
    # A registration whose owner died (no refresh) expires after the TTL.
    stale = next(tmp_path.glob("worker.w2.json"))  # noqa: ASYNC240 (test setup)
    await reg2.close()
    stale.write_text('{"instance_id": "w3", "address": "127.0.0.1:3"}')
    old = time.time() - 10
    os.utime(stale, (old, old))
    ev = await asyncio.wait_for(anext(events), 2)
    assert (ev.kind, ev.instance.instance_id) == (EventKind.REMOVED, "w2")
    await events.aclose()  # type: ignore[attr-defined]


def test_open_discovery_urls(tmp_path: Path) -> None:
    assert isinstance(open_discovery(f"file://{tmp_path}"), FileDiscovery)
    with pytest.raises(errors.InvalidRequest):
        open_discovery("bogus://x")
    assert isinstance(open_discovery("etcd://127.0.0.1:2379"), EtcdDiscovery)


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(
        self, code: grpc.StatusCode, details: str, trailers: grpc.aio.Metadata | None = None
    ) -> None:
        super().__init__(code, grpc.aio.Metadata(), trailers or grpc.aio.Metadata(), details)


ALL_ERRORS = [
    errors.InvalidRequest("bad", param="top_p"),
    errors.RequestTooLarge("too big", param="max_tokens"),
    errors.NotFound("nope"),
    errors.ResourceExhausted("full"),
    errors.Unavailable("down"),
    errors.Unimplemented("later"),
    errors.Cancelled("bye"),
    errors.DeadlineExceeded("slow"),
    errors.Unauthenticated("who?"),
    errors.PermissionDenied("not you"),
    errors.Aborted("busy"),
]


def _trailers(status: status_pb2.Status) -> grpc.aio.Metadata:
    return grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))


@pytest.mark.parametrize("exc", ALL_ERRORS, ids=lambda e: type(e).__name__)
def test_status_mapping_roundtrip(exc: errors.KvmeshError) -> None:
    status = status_of(exc)
    code, detail = status_for(exc)
    assert (status.code, status.message) == (code.value[0], exc.message)  # no message prefix
    back = error_from_rpc(FakeRpcError(code, detail, _trailers(status)))
    assert type(back) is type(exc)
    assert (back.message, back.param) == (exc.message, exc.param)
    # The same status sent in-band (StreamedGenerateOutput) decodes the same way.
    again = error_from_status(status.code, status.message, status.SerializeToString())
    assert (type(again), again.message, again.param) == (type(exc), exc.message, exc.param)


def test_every_error_reason_is_an_error_reason_of_the_contract() -> None:
    """errors.py reasons are the ErrorReason values the proto documents (minus the prefix)."""
    names = {
        n.removeprefix("ERROR_REASON_")
        for n in cpb.ErrorReason.keys()
        if n != "ERROR_REASON_UNSPECIFIED"
    }
    ours = {errors.KvmeshError.reason} | {type(e).reason for e in ALL_ERRORS}
    assert ours == names


def test_errors_without_details_map_by_code_alone() -> None:
    """A peer that sends no status details (an older worker) still maps by code; the kind a
    code cannot tell (too large vs invalid) falls back to the code's class."""
    assert type(error_from_rpc(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "x"))) is (
        errors.InvalidRequest
    )
    assert type(error_from_status(grpc.StatusCode.NOT_FOUND.value[0], "")) is errors.NotFound
    # A reason that does not go with the code is not trusted; foreign domains are ignored.
    too_large = status_of(errors.RequestTooLarge("big"))
    wrong = error_from_status(grpc.StatusCode.NOT_FOUND, "m", too_large.SerializeToString())
    assert type(wrong) is errors.NotFound
    foreign = status_pb2.Status(code=3, message="m")
    foreign.details.add().Pack(
        error_details_pb2.ErrorInfo(reason="CONTEXT_LENGTH_EXCEEDED", domain="example.com")
    )
    got = error_from_status(3, "m", foreign.SerializeToString())
    assert type(got) is errors.InvalidRequest
    assert type(error_from_status(3, "m", b"\xff not a status")) is errors.InvalidRequest
    # Details that contradict the call's code are ignored (grpc_status refuses them).
    mismatch = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "big", _trailers(too_large))
    assert type(error_from_rpc(mismatch)) is errors.Unavailable


def test_unexpected_exceptions_are_internal_without_their_text() -> None:
    status = status_of(RuntimeError("secret"))
    assert status.code == grpc.StatusCode.INTERNAL.value[0]
    assert "secret" not in status.message and "RuntimeError" in status.message
    back = error_from_status(status.code, status.message, status.SerializeToString())
    assert type(back) is errors.KvmeshError


def test_request_and_output_roundtrip() -> None:
    req = EngineRequest(
        "r1",
        [1, 2, 3],
        SamplingParams(temperature=0.0, top_p=0.75, seed=7, top_logprobs=2, logit_bias={5: -1.0}),
        StopParams(max_tokens=10, min_tokens=2, stop_token_ids=(9,), ignore_eos=True),
        lora_name="a",
        priority=3,
    )
    assert wire.request_from_pb(wire.request_to_pb(req), "x") == req
    default = wire.request_from_pb(wire.request_to_pb(EngineRequest("r", [1])), "x")
    assert default.sampling == SamplingParams() and default.stop == StopParams()
    out = EngineOutput(
        [4, 5],
        [TokenLogprob(4, -0.5, [(4, -0.5), (6, -1.0)]), TokenLogprob(5, -0.125)],
        FinishReason.LENGTH,
        Usage(3, 2, 1),
        None,
    )
    back = wire.output_from_pb(wire.output_to_pb(out))
    assert back == out
    mid = wire.output_from_pb(wire.output_to_pb(EngineOutput([7])))
    assert mid == EngineOutput([7])


def test_card_and_kv_roundtrip() -> None:
    info = ModelInfo(
        "m", "mocker", 16, 100, 4096, "/p", Role.DECODE, 8, (2,), ("l",), ("KV_EVENTS",)
    )
    assert wire.card_from_pb(wire.card_to_pb(info)) == info
    items: list[kv.SnapshotChunk | kv.KvEventRecord] = [
        kv.SnapshotChunk(3, [kv.BlocksStored(None, [kv.StoredBlock(1, (1, 2))])], True, True),
        kv.KvEventRecord(4, kv.BlocksStored(1, [kv.StoredBlock(2, (3, 4))], "lora")),
        kv.KvEventRecord(5, kv.BlocksRemoved([2])),
        kv.KvEventRecord(6, kv.AllCleared()),
    ]
    for item in items:
        assert wire.kv_item_from_pb(wire.kv_item_to_pb(item)) == item


async def test_a_registration_in_the_background_waits_for_discovery(tmp_path: Path) -> None:
    """register_in_background: retried while discovery refuses (etcd down), then held; closed
    before it succeeded, it stops trying."""
    inner = FileDiscovery(tmp_path, ttl_s=3.0, poll_s=0.02)
    refusals = [2]

    class Flaky:
        async def register(self, instance: Instance) -> Registration:
            if refusals[0]:
                refusals[0] -= 1
                raise errors.Unavailable("etcd is down")
            return await inner.register(instance)

        def watch(self, component: str = "worker") -> AsyncIterator[DiscoveryEvent]:
            return inner.watch(component)

    router = Instance(instance_id="r1", address="127.0.0.1:1", component=ROUTER)
    reg = register_in_background(Flaky(), router, retry_max_s=0.05)
    deadline = asyncio.get_running_loop().time() + 5
    while not (tmp_path / "router.r1.json").exists():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)
    assert refusals == [0]
    await reg.close()
    assert not (tmp_path / "router.r1.json").exists()
    refusals[0] = 1000
    never = register_in_background(Flaky(), router, retry_max_s=0.01)
    await asyncio.sleep(0.05)
    await never.close()  # no error, nothing registered
    assert not (tmp_path / "router.r1.json").exists()
