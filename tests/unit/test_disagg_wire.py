"""Disaggregation building blocks: wire conversions of the transfer contract, NIXL descriptor
arrays, pinned transfers with expiry, the gateway and `kvmesh up` configuration."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.apps.up import UpConfig
from kvmesh.router.backend import DisaggConfig
from kvmesh.runtime import wire
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    KvBlockDescriptor,
    KvLayout,
    KvTransferHandle,
    LoadInfo,
    PrefillResult,
    RemotePrefill,
    Role,
    SamplingParams,
    StopParams,
    TokenLogprob,
    Usage,
)
from kvmesh.workers.disagg.pins import PinnedTransfers

pytestmark = pytest.mark.unit

LAYOUT = KvLayout(2, 4, 16, 16, "bfloat16", 8192, chunk_bytes=2048, chunk_stride_bytes=2048 * 100)


def handle() -> KvTransferHandle:
    return KvTransferHandle(
        transfer_id="t1",
        layout=LAYOUT,
        blocks=[KvBlockDescriptor(7, 4096, 8192, 1), KvBlockDescriptor(0, 8192, 8192, 1)],
        num_computed_tokens=20,
        agent_name="agent",
        agent_metadata=b"\x00meta",
        memory_kind="VRAM",
        expires_after_ms=30000,
        prefill_worker_id="p0",
        prefill_address="127.0.0.1:1",
    )


def test_remote_prefill_round_trips_through_generate_request() -> None:
    rp = RemotePrefill(
        first_token_id=42,
        first_logprob=TokenLogprob(42, -0.5, [(42, -0.5), (3, -1.5)]),
        handle=handle(),
        engine_params_json='{"x": 1}',
        cached_tokens=16,
    )
    req = EngineRequest(
        "r", [1, 2, 3], SamplingParams(temperature=0.0), StopParams(max_tokens=4), remote_prefill=rp
    )
    back = wire.request_from_pb(wire.request_to_pb(req), "x")
    assert back.remote_prefill == rp and back.prompt == [1, 2, 3]
    assert (
        wire.request_from_pb(wire.request_to_pb(EngineRequest("a", [1])), "x").remote_prefill
        is None
    )


def test_prefill_request_and_result_round_trip() -> None:
    req = EngineRequest(
        "r",
        [5, 6],
        SamplingParams(temperature=0.5, seed=3, top_logprobs=2),
        StopParams(max_tokens=9, min_tokens=2, stop_token_ids=(7,)),
    )
    msg = wire.prefill_request_to_pb(req, "d0")
    assert msg.decode_worker_id == "d0"
    back = wire.prefill_request_from_pb(msg, "x")
    assert (back.sampling, back.stop, back.prompt) == (req.sampling, req.stop, req.prompt)
    msg.ClearField("stop")  # unset: the first token never ends the request
    assert wire.prefill_request_from_pb(msg, "x").stop == StopParams(ignore_eos=True)

    result = PrefillResult(RemotePrefill(9, handle=handle()), Usage(2, 1, 0))
    assert wire.prefill_result_from_pb(wire.prefill_result_to_pb(result)) == result
    done = PrefillResult(RemotePrefill(2), Usage(2, 1, 0), FinishReason.STOP, 2)
    assert wire.prefill_result_from_pb(wire.prefill_result_to_pb(done)) == done


def test_final_output_and_load_carry_the_transfer_fields() -> None:
    out = EngineOutput(
        [1], finish_reason=FinishReason.LENGTH, usage=Usage(3, 2, 0), kv_transfer_bytes=1 << 20
    )
    out.remote_prefill_fallback = True
    assert wire.output_from_pb(wire.output_to_pb(out)) == out
    load = wire.load_to_pb(
        LoadInfo(kv_active_blocks=5, kv_pinned_blocks=3), timestamp_ms=1, draining=False
    )
    assert load.kv_pinned_blocks == 3


def test_block_pieces_follow_the_layer_major_layout() -> None:
    np = pytest.importorskip("numpy")
    from kvmesh.workers.disagg.layout import block_pieces

    pieces = block_pieces([1000, 5000], LAYOUT, device_id=2)
    stride = LAYOUT.chunk_stride_bytes
    assert pieces.shape == (8, 3) and pieces.dtype == np.uint64
    assert pieces[:4, 0].tolist() == [1000 + k * stride for k in range(4)]
    assert pieces[4:, 0].tolist() == [5000 + k * stride for k in range(4)]
    assert set(pieces[:, 1].tolist()) == {2048} and set(pieces[:, 2].tolist()) == {2}
    whole = KvLayout(2, 4, 16, 16, "bfloat16", 8192)
    assert block_pieces([1, 2], whole).tolist() == [[1, 8192, 0], [2, 8192, 0]]


async def test_pinned_transfers_release_once_and_expire() -> None:
    freed: list[str] = []
    pins: PinnedTransfers[str] = PinnedTransfers(freed.append, default_ttl_s=0.05)
    a, b = pins.new_id(), pins.new_id()
    assert pins.pin(a, "ka") == 50 and pins.pin(b, "kb", ttl_s=10) == 10000
    with pytest.raises(ValueError):
        pins.pin(a, "again")
    assert len(pins) == 2 and a in pins
    await asyncio.sleep(0.1)
    assert freed == ["ka"] and pins.num_expired == 1 and pins.release(a) is False
    assert pins.release(b) is True and pins.release(b) is False and freed == ["ka", "kb"]
    pins.pin(pins.new_id(), "kc")
    assert pins.release_all() == 1 and freed[-1] == "kc" and len(pins) == 0


def test_configuration() -> None:
    assert UpConfig().pool_sizes() == {Role.AGGREGATED: 2}
    assert UpConfig(workers=3).pool_sizes() == {Role.AGGREGATED: 3}
    disagg = UpConfig(prefill_workers=1, decode_workers=2)
    assert disagg.pool_sizes() == {Role.PREFILL: 1, Role.DECODE: 2}
    assert UpConfig(workers=1, decode_workers=1).pool_sizes() == {
        Role.AGGREGATED: 1,
        Role.PREFILL: 0,
        Role.DECODE: 1,
    }
    with pytest.raises(ValueError):
        UpConfig(prefill_workers=1)  # nobody would decode
    with pytest.raises(ValueError):
        DisaggConfig(disagg_local_prefill_tokens=-1)
    with pytest.raises(ValueError):
        DisaggConfig(disagg_prefill_timeout_s=0)
