"""`kvmesh profile --worker HOST:PORT`: the performance profile (kvmesh.planner.profile) of a
running worker of any engine, measured by timing real requests over its WorkerService.

The worker's model card says its role, KV cache size, context length and batch limit:

  * prefill (aggregated and prefill workers), per prompt length: TTFT of one request alone
    (median of `repeats`; `Generate` with max_tokens 1 on an aggregated worker,
    `PrefillRemote` then `ReleaseKvBlocks` on a prefill worker), and the throughput of a batch
    of such prompts sent at once (prompt tokens / wall time until the last first token);
  * decode (aggregated and decode workers), per (context length, concurrency): that many
    requests of that prompt length at once, each asking for `decode_tokens` tokens; ITL is
    the mean over requests of (last token - first token) / (tokens - 1), throughput the
    output tokens after the first ones over the time they took. Loads over the KV cache or
    the batch limit are left null.

Prompts are random token ids (no prefix sharing), sampling greedy, EOS ignored. The worker
should be idle: other traffic skews what is measured.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.planner.profile import DecodeGrid, PerfProfile, PrefillCurve, RoleProfile
from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.grpcutil import error_from_rpc, insecure_channel
from kvmesh.runtime.types import Role
from kvmesh.runtime.wire import role_from_pb

__all__ = ["LiveProfileSettings", "profile_worker"]

TOKEN_RANGE = (10, 250)
"""Prompt token ids are drawn from here: inside any model's vocabulary, past special ids."""


@dataclass(frozen=True)
class LiveProfileSettings:
    """What `profile_worker` measures."""

    isl: tuple[int, ...] = (128, 512, 2048, 8192)
    contexts: tuple[int, ...] = (512, 2048, 8192)
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    decode_tokens: int = 16
    repeats: int = 3
    batch_tokens: int = 16384
    """Prompt tokens sent at once to measure prefill throughput."""
    timeout_s: float = 600.0


class _Client:
    def __init__(self, address: str, seed: int) -> None:
        self.channel = insecure_channel(address)
        self.stub = wpb_grpc.WorkerServiceStub(self.channel)
        self.rng = random.Random(seed)

    def prompt(self, n: int) -> list[int]:
        lo, hi = TOKEN_RANGE
        return [self.rng.randrange(lo, hi) for _ in range(n)]

    def request(self, n: int, max_tokens: int) -> wpb.GenerateRequest:
        return wpb.GenerateRequest(
            request_id=f"profile-{uuid.uuid4().hex[:12]}",
            token_ids=self.prompt(n),
            sampling=cpb.SamplingOptions(temperature=0.0),
            stop=cpb.StopConditions(max_tokens=max_tokens, ignore_eos=True),
        )

    async def generate(self, n: int, max_tokens: int, timeout_s: float) -> list[float]:
        """Times (perf_counter) at which each token arrived."""
        times: list[float] = []
        try:
            async for msg in self.stub.Generate(self.request(n, max_tokens), timeout=timeout_s):
                now = time.perf_counter()
                times.extend([now] * len(msg.token_ids))
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        return times

    async def prefill_remote(self, n: int, timeout_s: float) -> None:
        req = self.request(n, 2)
        try:
            reply = await self.stub.PrefillRemote(
                wpb.PrefillRemoteRequest(
                    request_id=req.request_id,
                    token_ids=req.token_ids,
                    sampling=req.sampling,
                    stop=req.stop,
                ),
                timeout=timeout_s,
            )
            if reply.result.HasField("handle"):
                await self.stub.ReleaseKvBlocks(
                    wpb.ReleaseKvBlocksRequest(transfer_id=reply.result.handle.transfer_id),
                    timeout=timeout_s,
                )
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None


async def _prefill_curve(
    client: _Client, role: Role, limit: int, s: LiveProfileSettings
) -> PrefillCurve:
    isl = [n for n in s.isl if n + 2 <= limit]
    if not isl:
        raise InvalidRequest(f"the worker's context ({limit} tokens) is below every prompt length")
    ttft: list[float] = []
    thpt: list[float] = []

    async def one(n: int) -> float:
        t0 = time.perf_counter()
        if role is Role.PREFILL:
            await client.prefill_remote(n, s.timeout_s)
            return time.perf_counter() - t0
        times = await client.generate(n, 1, s.timeout_s)
        return times[0] - t0

    for n in isl:
        ttft.append(1e3 * statistics.median([await one(n) for _ in range(s.repeats)]))
        count = max(1, s.batch_tokens // n)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(n) for _ in range(count)))
        thpt.append(count * n / (time.perf_counter() - t0))
    return PrefillCurve([float(n) for n in isl], ttft, thpt)


async def _decode_grid(
    client: _Client, limit: int, capacity: int, max_seqs: int, s: LiveProfileSettings
) -> DecodeGrid:
    tokens = s.decode_tokens + 1
    contexts = [c for c in s.contexts if c + tokens <= limit]
    if not contexts:
        raise InvalidRequest(f"the worker's context ({limit} tokens) is below every context length")
    itl: list[list[float | None]] = []
    thpt: list[list[float | None]] = []
    for ctx in contexts:
        row: list[float | None] = []
        trow: list[float | None] = []
        for conc in s.concurrency:
            fits = (not capacity or conc * (ctx + tokens) <= capacity) and (
                not max_seqs or conc <= max_seqs
            )
            if not fits or (row and row[-1] is None):
                row.append(None)
                trow.append(None)
                continue
            runs = await asyncio.gather(
                *(client.generate(ctx, tokens, s.timeout_s) for _ in range(conc))
            )
            gaps = [(t[-1] - t[0]) / (len(t) - 1) for t in runs if len(t) > 1]
            start = max(t[0] for t in runs)
            end = max(t[-1] for t in runs)
            row.append(1e3 * statistics.fmean(gaps) if gaps else None)
            decoded = sum(len(t) - 1 for t in runs)
            trow.append(decoded / (end - min(t[0] for t in runs)) if end > start else None)
        itl.append(row)
        thpt.append(trow)
    return DecodeGrid([float(c) for c in contexts], [float(c) for c in s.concurrency], itl, thpt)


async def profile_worker(
    address: str, settings: LiveProfileSettings | None = None, *, seed: int = 0
) -> PerfProfile:
    """Measure the worker at `address` (see the module doc)."""
    s = settings or LiveProfileSettings()
    client = _Client(address, seed)
    t0 = time.perf_counter()
    try:
        try:
            reply = await client.stub.GetModelCard(wpb.GetModelCardRequest(), timeout=10.0)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        card = reply.card
        role = role_from_pb(card.role) or Role.AGGREGATED
        limit = card.context_length_tokens or max(max(s.isl), max(s.contexts)) + 64
        capacity = card.kv_total_blocks * card.kv_block_size_tokens
        prefill = None
        decode = None
        if role is not Role.DECODE:
            prefill = await _prefill_curve(client, role, limit, s)
        if role is not Role.PREFILL:
            decode = await _decode_grid(client, limit, capacity, card.max_num_seqs, s)
    finally:
        await client.channel.close()
    return PerfProfile(
        engine=card.engine,
        model=card.served_model_name,
        source=f"grpc {address}",
        roles={role: RoleProfile(prefill, decode)},
        kv_capacity_tokens=capacity,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        extra={
            "block_size": card.kv_block_size_tokens,
            "num_gpu_blocks": card.kv_total_blocks,
            "max_num_seqs": card.max_num_seqs,
            "decode_tokens": s.decode_tokens,
            "repeats": s.repeats,
            "measure_wall_s": round(time.perf_counter() - t0, 3),
        },
    )
