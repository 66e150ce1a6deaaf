"""Speculative decoding on the torch engine, by prompt lookup (n-gram) and by a draft model:
greedy output equal to plain decoding and to transformers' generate(), drafts accepted on a
repetitive prompt, the counters, requests that do not qualify (sampled, penalties, logprobs)
sharing the batch, adaptive drafting backing off, and a draft model with another vocabulary
refused at start."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")

from kvmesh.runtime import wire
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.metrics import WorkerCollector
from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from kvmesh.workers.pytorch.speculative import GATE_MAX_BACKOFF, DraftGate, accept, propose_ngram
from kvmesh.workers.pytorch.weights import create_tiny_weights
from tests.conftest import generate_reference
from tests.devices import DEVICE

pytestmark = pytest.mark.unit

PATTERN = [101, 202, 303, 404, 505, 606, 707]
REPETITIVE = PATTERN * 6
OTHERS = [[(13 + s * 61 + i * 29) % 3900 + 20 for i in range(n)] for s, n in enumerate((9, 30))]


def test_propose_and_accept() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2], 3, 1, 4) == [3, 9, 1]
    assert propose_ngram([1, 2, 3, 1, 2, 5, 1, 2], 2, 1, 4) == [5, 1]  # the latest match
    assert propose_ngram([1, 2, 3], 3, 1, 4) == []  # no earlier occurrence
    assert propose_ngram([7, 7], 3, 2, 4) == []  # shorter than min_n + 1
    assert accept([5, 6, 7], [5, 6, 8, 9]) == [5, 6, 8]
    assert accept([5, 6], [5, 6, 4]) == [5, 6, 4]
    assert accept([1], [2, 3]) == [2]


def test_draft_gate_backs_off_and_resumes() -> None:
    gate = DraftGate(min_acceptance=0.5, backoff_steps=3)
    for _ in range(3):
        assert gate.allow()
        gate.record(4, 1)  # 25 %: judged only once the window is full
    assert gate.allow()
    gate.record(4, 1)
    assert [gate.allow() for _ in range(4)] == [False, False, False, True]
    for _ in range(4):  # fails again: twice as long
        gate.record(4, 0)
    assert [gate.allow() for _ in range(7)] == [False] * 6 + [True]
    for _ in range(8):  # a failure streak caps the back-off
        for _ in range(4):
            gate.record(4, 0)
        while not gate.allow():
            pass
    assert gate.backoff == GATE_MAX_BACKOFF * 3
    for _ in range(4):  # a good window resets it
        gate.record(4, 3)
    assert gate.backoff == 0 and gate.allow()
    never = DraftGate(min_acceptance=0.0, backoff_steps=3)
    for _ in range(8):
        never.record(4, 0)
        assert never.allow()


@pytest.fixture(scope="module")
def model_dir(torch_model_dir: Path) -> Path:
    return torch_model_dir


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, DEVICE, TorchDType.FLOAT32)


@pytest.fixture(scope="module")
def eos(model_dir: Path) -> tuple[int, ...]:
    return ModelDirInfo.load(model_dir).eos_token_ids


async def _engine(
    model_dir: Path, loaded: LoadedModel, eos: tuple[int, ...], **cfg: Any
) -> TorchEngine:
    eng = TorchEngine(
        TorchConfig(**{"device": DEVICE, "num_gpu_blocks": 256, **cfg}),
        model_dir=model_dir,
        served_model_name="tiny",
        eos_token_ids=eos,
        loaded=loaded,
    )
    await eng.start()
    return eng


@pytest.fixture
async def spec(
    model_dir: Path, loaded: LoadedModel, eos: tuple[int, ...]
) -> AsyncIterator[TorchEngine]:
    eng = await _engine(model_dir, loaded, eos, num_speculative_tokens=4)
    yield eng
    await eng.stop()


_ids = iter(range(1 << 30))


async def run(engine: TorchEngine, prompt: list[int], n: int, **sampling: Any) -> list[int]:
    sampling.setdefault("temperature", 0.0)
    request = EngineRequest(
        f"s-{next(_ids)}", prompt, SamplingParams(**sampling), StopParams(max_tokens=n)
    )
    return [t async for o in engine.generate(request) for t in o.token_ids]


async def test_greedy_output_identical_and_drafts_accepted(
    spec: TorchEngine, loaded: LoadedModel, eos: tuple[int, ...]
) -> None:
    for prompt, n in [(REPETITIVE, 40), *((p, 24) for p in OTHERS)]:
        assert await run(spec, prompt, n) == generate_reference(loaded, eos, prompt, n)
    stats = spec.scheduler.spec
    assert stats.steps > 0 and stats.accepted_tokens > 0
    assert stats.tokens_per_step > 1.0
    assert 0.0 < stats.acceptance_rate <= 1.0
    assert stats.emitted_tokens <= stats.steps + stats.accepted_tokens
    spec.scheduler.check_invariants()
    # the counters reach the load metrics, across the wire
    load = wire.load_from_pb(wire.load_to_pb(spec.load(), timestamp_ms=0, draining=False))
    assert (load.spec_steps_total, load.spec_draft_tokens_total) == (
        stats.steps,
        stats.draft_tokens,
    )
    assert (load.spec_accepted_tokens_total, load.spec_emitted_tokens_total) == (
        stats.accepted_tokens,
        stats.emitted_tokens,
    )
    # ... and the worker's /metrics, under vLLM's names
    collector = WorkerCollector("w", lambda: spec.info, spec.load, None)
    values = {m.name: m.samples[0].value for m in collector.collect()}
    assert values["kvmesh_worker_spec_decode_num_draft_tokens"] == stats.draft_tokens
    assert values["kvmesh_worker_spec_decode_num_accepted_tokens"] == stats.accepted_tokens


async def test_mixed_batch_and_budget_cuts(
    model_dir: Path, loaded: LoadedModel, eos: tuple[int, ...]
) -> None:
    """Drafting and non-drafting requests in one batch; a small token budget cuts drafts off;
    max_tokens falls inside an accepted run of drafts."""
    eng = await _engine(model_dir, loaded, eos, num_speculative_tokens=6, max_num_batched_tokens=8)
    try:
        jobs = [
            run(eng, REPETITIVE, 33),
            run(eng, REPETITIVE[3:], 7),
            run(eng, OTHERS[0], 12, temperature=0.8, seed=5),
            run(eng, OTHERS[1], 12, repetition_penalty=1.3),
            run(eng, PATTERN * 3, 20, top_logprobs=2),
        ]
        got = await asyncio.gather(*jobs)
        assert got[0] == generate_reference(loaded, eos, REPETITIVE, 33)
        assert got[1] == generate_reference(loaded, eos, REPETITIVE[3:], 7)
        assert len(got[1]) == 7
        assert eng.scheduler.spec.accepted_tokens > 0
        eng.scheduler.check_invariants()
        # the non-drafting requests match a plain engine's answers
        plain = await _engine(model_dir, loaded, eos, max_num_batched_tokens=8)
        try:
            assert await run(plain, OTHERS[0], 12, temperature=0.8, seed=5) == got[2]
            assert await run(plain, OTHERS[1], 12, repetition_penalty=1.3) == got[3]
            assert await run(plain, PATTERN * 3, 20, top_logprobs=2) == got[4]
        finally:
            await plain.stop()
    finally:
        await eng.stop()


async def test_adaptive_drafting_skips_and_keeps_output(
    model_dir: Path, small_draft_dir: Path, loaded: LoadedModel, eos: tuple[int, ...]
) -> None:
    """A threshold the (smaller) draft model does not reach makes the request back off and
    draft again later; the output is unchanged."""
    eng = await _engine(
        model_dir,
        loaded,
        eos,
        num_speculative_tokens=4,
        draft_model=str(small_draft_dir),
        spec_min_acceptance=1.0,
        spec_backoff_steps=4,
    )
    try:
        prompt = OTHERS[1]
        assert await run(eng, prompt, 60) == generate_reference(loaded, eos, prompt, 60)
        stats = eng.scheduler.spec
        assert stats.skipped_steps >= 4 and stats.steps > 4, stats
        load = wire.load_from_pb(wire.load_to_pb(eng.load(), timestamp_ms=0, draining=False))
        assert load.spec_skipped_steps_total == stats.skipped_steps
        collector = WorkerCollector("w", lambda: eng.info, eng.load, None)
        values = {m.name: m.samples[0].value for m in collector.collect()}
        assert values["kvmesh_worker_spec_decode_num_skipped_steps"] == stats.skipped_steps
    finally:
        await eng.stop()


@pytest.fixture(scope="module")
def small_draft_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model cut to one layer: the same tokenizer, other answers."""
    path = tmp_path_factory.mktemp("draft") / "tiny-draft"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    create_tiny_weights(path)
    return path


async def test_draft_model_equal_to_main_accepts_everything(
    model_dir: Path, loaded: LoadedModel, eos: tuple[int, ...]
) -> None:
    # The main model is preloaded in float32; the configured dtype says bfloat16 (as `auto` does
    # on CUDA): the draft must still run in the main model's dtype, or near-ties of the random
    # model flip its proposals (a GPU run found 5 of 73 rejected).
    eng = await _engine(
        model_dir,
        loaded,
        eos,
        num_speculative_tokens=4,
        draft_model=str(model_dir),
        dtype=TorchDType.BFLOAT16,
    )
    try:
        prompts = [OTHERS[0], OTHERS[1], REPETITIVE]
        got = await asyncio.gather(*(run(eng, p, 30) for p in prompts))
        for p, out in zip(prompts, got, strict=True):
            assert out == generate_reference(loaded, eos, p, 30)
        stats = eng.scheduler.spec
        assert stats.draft_tokens > 40
        assert stats.acceptance_rate >= 0.95, stats
        assert stats.tokens_per_step > 3.5
        eng.scheduler.check_invariants()
    finally:
        await eng.stop()


async def test_draft_model_mixed_batch_equals_generate(
    model_dir: Path, small_draft_dir: Path, loaded: LoadedModel, eos: tuple[int, ...]
) -> None:
    """A smaller draft model; random prompts, greedy ones (drafting) and others (not) in one
    batch, a token budget that cuts drafts off and a pool small enough to preempt."""
    rng = random.Random(16)
    prompts = [[rng.randrange(20, 4000) for _ in range(rng.randrange(3, 40))] for _ in range(6)] + [
        REPETITIVE
    ]
    news = [rng.randrange(8, 40) for _ in prompts]
    eng = await _engine(
        model_dir,
        loaded,
        eos,
        num_speculative_tokens=3,
        draft_model=str(small_draft_dir),
        max_num_batched_tokens=24,
        num_gpu_blocks=10,
        spec_min_acceptance=0.0,
    )
    plain = await _engine(model_dir, loaded, eos, max_num_batched_tokens=24, num_gpu_blocks=10)
    try:
        greedy = [run(eng, p, n) for p, n in zip(prompts, news, strict=True)]
        others = [
            run(eng, OTHERS[0], 12, temperature=0.8, seed=5),
            run(eng, OTHERS[1], 12, repetition_penalty=1.3),
        ]
        got = await asyncio.gather(*greedy, *others)
        for p, n, out in zip(prompts, news, got[: len(prompts)], strict=True):
            assert out == generate_reference(loaded, eos, p, n)
        assert await run(plain, OTHERS[0], 12, temperature=0.8, seed=5) == got[-2]
        assert await run(plain, OTHERS[1], 12, repetition_penalty=1.3) == got[-1]
        stats = eng.scheduler.spec
        assert stats.steps > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
        assert eng.scheduler.num_preemptions > 0
        eng.scheduler.check_invariants()
    finally:
        await eng.stop()
        await plain.stop()


async def test_draft_model_with_another_vocabulary_is_refused(
    model_dir: Path, loaded: LoadedModel, eos: tuple[int, ...], tmp_path: Path
) -> None:
    path = tmp_path / "other-vocab"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = 5000
    (path / "config.json").write_text(json.dumps(config))
    create_tiny_weights(path)
    with pytest.raises(ValueError, match=r"vocabulary of 5000 tokens.*must share the tokenizer"):
        await _engine(model_dir, loaded, eos, num_speculative_tokens=2, draft_model=str(path))
    with pytest.raises(ValueError, match="needs --torch-num-speculative-tokens"):
        await _engine(model_dir, loaded, eos, draft_model=str(model_dir))
