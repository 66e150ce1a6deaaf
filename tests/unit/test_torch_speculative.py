"""Speculative decoding (prompt-lookup n-gram drafts) on the torch engine: greedy output equal to
plain decoding and to transformers' generate(), drafts accepted on a repetitive prompt, the
counters, and requests that do not qualify (sampled, penalties, logprobs) sharing the batch."""

from __future__ import annotations

import asyncio
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
from kvmesh.workers.pytorch.speculative import accept, propose_ngram
from tests.conftest import generate_reference

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


@pytest.fixture(scope="module")
def model_dir(torch_model_dir: Path) -> Path:
    return torch_model_dir


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, "cpu", TorchDType.FLOAT32)


@pytest.fixture(scope="module")
def eos(model_dir: Path) -> tuple[int, ...]:
    return ModelDirInfo.load(model_dir).eos_token_ids


async def _engine(
    model_dir: Path, loaded: LoadedModel, eos: tuple[int, ...], **cfg: Any
) -> TorchEngine:
    eng = TorchEngine(
        TorchConfig(**{"device": "cpu", "num_gpu_blocks": 256, **cfg}),
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
