"""Disaggregated serving with the torch engine in one process: two engines, each with its own
NIXL agent (UCX over host memory), the prefill engine's pinned blocks READ straight into the
decode engine's KV cache. Greedy output is token-identical to transformers' generate() and to
aggregated serving; the pulled KV is bit-identical to the prefill side's; faults fall back to
recomputing and leave no block pinned or referenced."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("nixl", reason="NIXL is not installed (pip install kvmesh[nixl])")

import torch

from kvmesh.runtime.kv_events import KvTier
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    KvTransferHandle,
    Role,
    SamplingParams,
    StopParams,
)
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.engine import DisaggSettings
from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from kvmesh.workers.pytorch.weights import create_tiny_weights
from tests.conftest import generate_reference
from tests.devices import DEVICE

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch") / "tiny-llama"
    shutil.copytree(tiny_model, path)
    create_tiny_weights(path)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, DEVICE, TorchDType.FLOAT32)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(11 + salt * 97 + i * 53) % 3900 + 20 for i in range(n)]


class Env:
    def __init__(self, model_dir: Path, loaded: LoadedModel) -> None:
        self.model_dir, self.loaded = model_dir, loaded
        self.eos = ModelDirInfo.load(model_dir).eos_token_ids

    def engine(self, role: Role, tiers: KvTierConfig | None = None, **cfg: object) -> TorchEngine:
        settings: dict[str, object] = {"device": DEVICE, "num_gpu_blocks": 128, **cfg}
        e = TorchEngine(
            TorchConfig(**settings),  # type: ignore[arg-type]
            model_dir=self.model_dir,
            served_model_name="tiny",
            eos_token_ids=self.eos,
            loaded=self.loaded,
            tiers=tiers,
        )
        e.configure_disaggregation(DisaggSettings(role=role))
        return e

    def reference(self, ids: list[int], n: int) -> list[int]:
        return generate_reference(self.loaded, self.eos, ids, n)


class Pair:
    def __init__(self, env: Env, prefill: TorchEngine | None = None, **decode_cfg: object) -> None:
        self.p = prefill if prefill is not None else env.engine(Role.PREFILL)
        self.d = env.engine(Role.DECODE, **decode_cfg)
        self.releases: list[bool] = []

        async def release(handle: KvTransferHandle) -> bool:
            released = await self.p.release_kv(handle.transfer_id)
            self.releases.append(released)
            return released

        self.d.configure_disaggregation(DisaggSettings(role=Role.DECODE, release_remote=release))

    async def run(self, req: EngineRequest) -> tuple[list[int], EngineOutput]:
        result = await self.p.prefill_remote(req)
        first = result.remote.first_token_id
        assert result.finish_reason is None
        tokens, last = await collect(self.d, dataclasses.replace(req, remote_prefill=result.remote))
        return [first, *tokens], last


async def collect(engine: TorchEngine, req: EngineRequest) -> tuple[list[int], EngineOutput]:
    tokens: list[int] = []
    last = None
    async for out in engine.generate(req):
        tokens += out.token_ids
        last = out
    assert last is not None and last.finish_reason is not None
    return tokens, last


def greedy(rid: str, ids: list[int], n: int = 10) -> EngineRequest:
    return EngineRequest(rid, ids, SamplingParams(temperature=0.0), StopParams(max_tokens=n))


def baseline(*engines: TorchEngine) -> None:
    for e in engines:
        load = e.load()
        assert (load.kv_active_blocks, load.kv_pinned_blocks, load.num_running) == (0, 0, 0)
        e.scheduler.check_invariants()


@pytest.fixture(scope="module")
def env(model_dir: Path, loaded: LoadedModel) -> Env:
    return Env(model_dir, loaded)


@pytest.fixture
async def pair(env: Env) -> AsyncIterator[Pair]:
    p = Pair(env)
    await p.p.start()
    await p.d.start()
    yield p
    await p.p.stop()
    await p.d.stop()


async def test_greedy_is_token_identical_and_the_kv_is_bit_identical(pair: Pair, env: Env) -> None:
    assert pair.p.info.role is Role.PREFILL and "DISAGGREGATION" in pair.d.info.capabilities
    for n in (1, 9, 16, 33, 70, 250):  # up to 16 blocks
        ids = prompt(n, salt=n)
        got, last = await pair.run(greedy(f"r{n}", ids))
        assert got == env.reference(ids, 10), n
        assert not last.remote_prefill_fallback
        assert last.kv_transfer_bytes == -(-n // 16) * pair.d.kv_layout.block_bytes
        baseline(pair.p, pair.d)
        full = n // 16
        if full:  # both caches now hold the prompt's full blocks with the same KV
            np_, kv_p = await pair.p.export_blocks(ids)
            nd, kv_d = await pair.d.export_blocks(ids)
            assert np_ == nd == full and torch.equal(kv_p, kv_d)
    assert all(pair.releases)


async def test_concurrent_requests_and_a_prefix_cached_on_the_decode_side(
    pair: Pair, env: Env
) -> None:
    prompts = [prompt(n, salt=s) for s, n in enumerate((20, 47, 64, 90, 130))]
    results = await asyncio.gather(*(pair.run(greedy(f"c{i}", p)) for i, p in enumerate(prompts)))
    for ids, (got, _) in zip(prompts, results, strict=True):
        assert got == env.reference(ids, 10)
    # The decode engine computed this prompt itself; a longer one pulls only the new blocks.
    base = prompt(48, salt=9)
    await collect(pair.d, greedy("local", base))
    longer = [*base, *prompt(40, salt=10)]  # 88 tokens: 3 blocks cached on D, 3 to pull
    got, last = await pair.run(greedy("longer", longer))
    assert got == env.reference(longer, 10)
    assert last.kv_transfer_bytes == 3 * pair.d.kv_layout.block_bytes
    baseline(pair.p, pair.d)


async def test_prefill_stopped_before_the_pull_falls_back_to_recompute(env: Env) -> None:
    pair = Pair(env)
    await pair.p.start()
    await pair.d.start()
    try:
        ids = prompt(75, salt=3)
        result = await pair.p.prefill_remote(greedy("gone", ids))
        assert pair.p.load().kv_pinned_blocks == 5
        await pair.p.stop()  # frees the pins, deregisters the memory
        req = dataclasses.replace(greedy("gone", ids), remote_prefill=result.remote)
        tokens, last = await collect(pair.d, req)
        assert [result.remote.first_token_id, *tokens] == env.reference(ids, 10)
        assert last.remote_prefill_fallback and pair.releases == [False]
        baseline(pair.d)
    finally:
        await pair.p.stop()
        await pair.d.stop()


async def test_cancelling_a_long_prefill_frees_its_blocks(env: Env) -> None:
    p = env.engine(Role.PREFILL, max_num_batched_tokens=32, num_gpu_blocks=256)
    await p.start()
    try:
        task = asyncio.create_task(p.prefill_remote(greedy("long", prompt(2000))))
        for _ in range(200):
            if p.load().kv_active_blocks:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the forward in flight finishes; nothing stays referenced
            if not p.load().kv_active_blocks:
                break
            await asyncio.sleep(0.01)
        baseline(p)
    finally:
        await p.stop()


async def test_first_token_that_ends_the_request_pins_nothing(pair: Pair, env: Env) -> None:
    ids = prompt(40)
    result = await pair.p.prefill_remote(greedy("one", ids, n=1))
    assert result.finish_reason is FinishReason.LENGTH and result.remote.handle is None
    assert result.remote.first_token_id == env.reference(ids, 1)[0]
    baseline(pair.p)


async def test_a_prefill_worker_serves_a_pull_from_its_host_tier(env: Env) -> None:
    """Both device pools are too small to keep the prompt; the prefill worker's host tier keeps
    it: the second prefill onboards the prefix instead of recomputing it, the decode worker
    pulls the blocks over NIXL, and the tokens are generate()'s."""

    def host_hits(e: TorchEngine) -> int:
        return next(t.hit_tokens for t in e.load().kv_tiers if t.tier is KvTier.HOST)

    tiered = env.engine(Role.PREFILL, KvTierConfig(kv_host_blocks=64), num_gpu_blocks=12)
    pair = Pair(env, prefill=tiered, num_gpu_blocks=12)
    await pair.p.start()
    await pair.d.start()
    try:
        ids = prompt(70, salt=5)
        want = env.reference(ids, 10)
        got, _ = await pair.run(greedy("a", ids))
        assert got == want
        for k in range(4):  # push the prompt's blocks out of both device pools
            await pair.run(greedy(f"other{k}", prompt(90, salt=20 + k)))
        before = host_hits(pair.p)
        got, _ = await pair.run(greedy("b", ids))
        assert got == want
        bs = pair.p.kv_spec.block_size
        assert host_hits(pair.p) - before == (len(ids) - 1) // bs * bs
        baseline(pair.p, pair.d)
    finally:
        await pair.p.stop()
        await pair.d.stop()
