"""The torch engine's KV tiers on the tiny random-weight Llama, in-process: a prompt whose blocks
were evicted from a small device pool is served from the host tier, from the disk tier, and from
the disk tier after a restart (block files persist); cached tokens and the tier's hit counter
count it, and greedy output equals a run without tiers and transformers' generate(). Bad disks
(full, unwritable, read-only, corrupted files) cost recomputation and a log line, never a wrong
token."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")


from kvmesh.runtime.kv_events import KvTier
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.types import EngineRequest, KvTierStats, SamplingParams, StopParams, Usage
from kvmesh.workers.batching.block_files import BlockFiles
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.kv_tiers import fingerprint
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from tests.conftest import generate_reference
from tests.devices import DEVICE

pytestmark = pytest.mark.unit

BS = 16
DEVICE_BLOCKS = 12
PROMPT = [20 + (i * 37) % 3000 for i in range(70)]  # 4 full blocks before its last token
PREFIX_TOKENS = (len(PROMPT) - 1) // BS * BS
OTHERS = [[100 + k * 13 + (i * 53) % 3000 for i in range(90)] for k in range(4)]
N_OUT = 8


@pytest.fixture(scope="module")
def loaded(torch_model_dir: Path) -> LoadedModel:
    return load_model(torch_model_dir, DEVICE, TorchDType.FLOAT32)


@pytest.fixture(scope="module")
def reference(torch_model_dir: Path, loaded: LoadedModel) -> list[int]:
    """transformers generate() of PROMPT, greedy."""
    eos = ModelDirInfo.load(torch_model_dir).eos_token_ids
    return generate_reference(loaded, eos, PROMPT, N_OUT)


def _engine(torch_model_dir: Path, loaded: LoadedModel, tiers: KvTierConfig | None) -> TorchEngine:
    return TorchEngine(
        TorchConfig(device=DEVICE, num_gpu_blocks=DEVICE_BLOCKS, max_model_len=512),
        model_dir=torch_model_dir,
        served_model_name="tiny",
        eos_token_ids=ModelDirInfo.load(torch_model_dir).eos_token_ids,
        loaded=loaded,
        tiers=tiers,
    )


async def _generate(engine: TorchEngine, prompt: list[int]) -> tuple[list[int], Usage]:
    request = EngineRequest(
        f"r{id(prompt)}-{engine.load().requests_finished_total}",
        prompt,
        SamplingParams(temperature=0.0),
        StopParams(max_tokens=N_OUT),
    )
    outs = [o async for o in engine.generate(request)]
    assert outs[-1].usage is not None
    return [t for o in outs for t in o.token_ids], outs[-1].usage


def _tier(engine: TorchEngine, tier: KvTier) -> KvTierStats:
    return next(t for t in engine.load().kv_tiers if t.tier is tier)


async def _evict_prompt(engine: TorchEngine) -> None:
    """Serve PROMPT, then other prompts until its blocks left the device pool."""
    for other in OTHERS:
        await _generate(engine, other)
    hashes = engine.scheduler.prefix_hashes(PROMPT)
    assert not set(hashes) & set(engine.cached_blocks()), "PROMPT is still on the device"
    await engine._tier_moves_done()


def _count_block_files(root: Path) -> int:
    return len(list(root.rglob("*.kvb")))


def _check_consistent(engine: TorchEngine) -> None:
    engine.scheduler.check_invariants()
    log = engine.kv_events
    assert log is not None
    for tier in KvTier:
        assert log.cached(tier) == engine.cached_blocks(tier), tier


async def test_host_tier_serves_evicted_prefix(
    torch_model_dir: Path, loaded: LoadedModel, reference: list[int]
) -> None:
    plain = _engine(torch_model_dir, loaded, None)
    await plain.start()
    try:
        tokens, _ = await _generate(plain, PROMPT)
        assert tokens == reference
        await _evict_prompt(plain)
        tokens, usage = await _generate(plain, PROMPT)
        assert tokens == reference and usage.cached_tokens == 0  # recomputed: nothing below
    finally:
        await plain.stop()

    engine = _engine(torch_model_dir, loaded, KvTierConfig(kv_host_blocks=64))
    await engine.start()
    try:
        tokens, usage = await _generate(engine, PROMPT)
        assert tokens == reference and usage.cached_tokens == 0
        await _evict_prompt(engine)
        hashes = engine.scheduler.prefix_hashes(PROMPT)
        assert set(hashes) <= set(engine.cached_blocks(KvTier.HOST))
        before = _tier(engine, KvTier.HOST)
        tokens, usage = await _generate(engine, PROMPT)
        assert tokens == reference
        assert usage.cached_tokens == PREFIX_TOKENS
        host = _tier(engine, KvTier.HOST)
        assert host.hit_tokens - before.hit_tokens == PREFIX_TOKENS
        assert host.onboard_blocks - before.onboard_blocks == PREFIX_TOKENS // BS
        assert host.onboard_bytes == host.onboard_blocks * engine.kv_spec.block_bytes
        assert host.offload_blocks >= len(hashes) and host.errors == 0
        assert _tier(engine, KvTier.DEVICE).hit_tokens == 0
        _check_consistent(engine)
    finally:
        await engine.stop()


async def test_disk_tier_serves_and_persists_across_restart(
    torch_model_dir: Path, loaded: LoadedModel, reference: list[int], tmp_path: Path
) -> None:
    tiers = KvTierConfig(kv_host_blocks=8, kv_disk_blocks=64, kv_disk_dir=str(tmp_path))
    engine = _engine(torch_model_dir, loaded, tiers)
    await engine.start()
    try:
        await _generate(engine, PROMPT)
        await _evict_prompt(engine)
        hashes = engine.scheduler.prefix_hashes(PROMPT)
        assert not set(hashes) & set(engine.cached_blocks(KvTier.HOST))
        assert set(hashes) <= set(engine.cached_blocks(KvTier.DISK))
        tokens, usage = await _generate(engine, PROMPT)
        assert tokens == reference and usage.cached_tokens == PREFIX_TOKENS
        disk = _tier(engine, KvTier.DISK)
        assert disk.hit_tokens == PREFIX_TOKENS and disk.onboard_blocks == PREFIX_TOKENS // BS
        _check_consistent(engine)
    finally:
        await engine.stop()
    assert _count_block_files(tmp_path) >= len(hashes)

    restarted = _engine(torch_model_dir, loaded, tiers)
    await restarted.start()
    try:
        assert set(hashes) <= set(restarted.cached_blocks(KvTier.DISK))
        log = restarted.kv_events
        assert log is not None and set(hashes) <= set(log.cached(KvTier.DISK))
        tokens, usage = await _generate(restarted, PROMPT)
        assert tokens == reference and usage.cached_tokens == PREFIX_TOKENS
        assert _tier(restarted, KvTier.DISK).hit_tokens == PREFIX_TOKENS
        _check_consistent(restarted)
    finally:
        await restarted.stop()


async def test_corrupted_block_file_is_recomputed(
    torch_model_dir: Path,
    loaded: LoadedModel,
    reference: list[int],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tiers = KvTierConfig(kv_host_blocks=8, kv_disk_blocks=64, kv_disk_dir=str(tmp_path))
    engine = _engine(torch_model_dir, loaded, tiers)
    await engine.start()
    try:
        await _generate(engine, PROMPT)
        await _evict_prompt(engine)
        hashes = engine.scheduler.prefix_hashes(PROMPT)
        files = BlockFiles(tmp_path, fingerprint(torch_model_dir, engine.kv_spec), 1)
        bad = files.path(hashes[2])
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte in the KV payload
        bad.write_bytes(bytes(data))
        caplog.set_level(logging.WARNING, logger="kvmesh.workers.pytorch.kv_tiers")
        tokens, usage = await _generate(engine, PROMPT)
        assert tokens == reference  # blocks 2, 3 recomputed
        assert usage.cached_tokens == 2 * BS
        assert any(
            "cannot be read" in r.getMessage() and "checksum mismatch" in r.getMessage()
            for r in caplog.records
        )
        assert _tier(engine, KvTier.DISK).errors == 1
        await engine._tier_moves_done()
        assert not bad.exists()  # the corrupted file was dropped
        _check_consistent(engine)
    finally:
        await engine.stop()


@contextlib.contextmanager
def _tmpfs(path: Path, options: str) -> Iterator[None]:
    """A tmpfs mounted on `path` (skips the test where this process may not mount)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


async def test_full_disk_keeps_what_fits_and_recomputes_the_rest(
    torch_model_dir: Path,
    loaded: LoadedModel,
    reference: list[int],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    disk_dir = tmp_path / "small"
    with _tmpfs(disk_dir, "size=24k"):  # two 8 KiB blocks (plus headers) fit
        tiers = KvTierConfig(kv_host_blocks=8, kv_disk_blocks=64, kv_disk_dir=str(disk_dir))
        engine = _engine(torch_model_dir, loaded, tiers)
        await engine.start()
        caplog.set_level(logging.WARNING, logger="kvmesh.workers.pytorch.kv_tiers")
        try:
            await _generate(engine, PROMPT)
            await _evict_prompt(engine)
            disk = _tier(engine, KvTier.DISK)
            assert disk.errors > 0 and disk.offload_blocks <= 2, disk
            assert any("No space left on device" in r.getMessage() for r in caplog.records)
            tokens, usage = await _generate(engine, PROMPT)
            assert tokens == reference
            assert usage.cached_tokens < PREFIX_TOKENS  # what did not fit was recomputed
            _check_consistent(engine)
        finally:
            await engine.stop()


@pytest.mark.parametrize("kind", ["under-a-file", "read-only"])
async def test_unusable_disk_dir_runs_without_the_disk_tier(
    kind: str,
    torch_model_dir: Path,
    loaded: LoadedModel,
    reference: list[int],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with contextlib.ExitStack() as stack:
        if kind == "under-a-file":
            (tmp_path / "file").write_text("not a directory")
            disk_dir = tmp_path / "file" / "kv"
        else:
            disk_dir = tmp_path / "ro"
            stack.enter_context(_tmpfs(disk_dir, "ro,size=64k"))
        tiers = KvTierConfig(kv_host_blocks=64, kv_disk_blocks=64, kv_disk_dir=str(disk_dir))
        caplog.set_level(logging.ERROR, logger="kvmesh.workers.pytorch.engine")
        engine = _engine(torch_model_dir, loaded, tiers)
        await engine.start()
        try:
            assert any("disk KV tier disabled" in r.getMessage() for r in caplog.records)
            assert [t.tier for t in engine.load().kv_tiers] == [KvTier.DEVICE, KvTier.HOST]
            await _generate(engine, PROMPT)
            await _evict_prompt(engine)
            tokens, usage = await _generate(engine, PROMPT)  # the host tier still serves it
            assert tokens == reference and usage.cached_tokens == PREFIX_TOKENS
        finally:
            await engine.stop()
