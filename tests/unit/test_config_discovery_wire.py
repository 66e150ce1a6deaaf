"""Unit tests for config<->CLI, file discovery, gRPC status mapping and wire conversions."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvmesh.runtime import errors, wire
from kvmesh.runtime import kv_events as kv
from kvmesh.runtime.config import add_args, from_args, opt, to_argv
from kvmesh.runtime.discovery import (
    EtcdDiscovery,
    EventKind,
    FileDiscovery,
    Instance,
    open_discovery,
)
from kvmesh.runtime.grpcutil import error_from_rpc, status_for
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
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    "exc",
    [
        errors.InvalidRequest("bad"),
        errors.RequestTooLarge("too big"),
        errors.NotFound("nope"),
        errors.ResourceExhausted("full"),
        errors.Unavailable("down"),
        errors.Unimplemented("later"),
        errors.Cancelled("bye"),
        errors.DeadlineExceeded("slow"),
    ],
)
def test_status_mapping_roundtrip(exc: errors.KvmeshError) -> None:
    code, detail = status_for(exc)
    back = error_from_rpc(FakeRpcError(code, detail))
    assert type(back) is type(exc)
    assert back.message == exc.message


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
