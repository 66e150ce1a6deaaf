"""The torch engine's sampler on hand-made logits: each processor's exact effect, the filters'
support, per-request generators, logprobs."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")

import torch

from kvmesh.runtime.types import SamplingParams
from kvmesh.workers.pytorch.sampler import SampleSpec, sample

pytestmark = pytest.mark.unit

LOGITS = [2.0, 1.0, 0.5, -1.0, 3.0, 0.0]  # probability order: 4, 0, 1, 2, 5, 3


def spec(tokens: tuple[int, ...] = (0,), prompt_len: int = 1, **params: object) -> SampleSpec:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    gen = None
    if p.temperature > 0:
        gen = torch.Generator().manual_seed(p.seed or 0)
    bias = sorted(p.logit_bias.items())
    return SampleSpec(p, tokens, prompt_len, gen, (), [t for t, _ in bias], [b for _, b in bias])


def draws(n: int = 300, **params: object) -> set[int]:
    s = spec(**params)
    seen = set()
    for _ in range(n):
        seen.add(sample(torch.tensor([LOGITS]), [s])[0].token_id)
    return seen


def test_greedy_and_bias() -> None:
    assert sample(torch.tensor([LOGITS]), [spec(temperature=0.0)])[0].token_id == 4
    s = spec(temperature=0.0, logit_bias={3: 4.5})  # -1 + 4.5 = 3.5 > 3
    assert sample(torch.tensor([LOGITS]), [s])[0].token_id == 3
    # Ties go to the first id, like torch.argmax / transformers.
    assert sample(torch.tensor([[1.0, 5.0, 5.0]]), [spec(temperature=0.0)])[0].token_id == 1


def test_filters_restrict_the_support() -> None:
    assert draws(temperature=1.0, top_k=2) == {4, 0}
    probs = torch.softmax(torch.tensor(LOGITS), 0)
    # top_p just above p(4) keeps {4, 0}; top_p below p(4) keeps only 4.
    assert draws(temperature=1.0, top_p=float(probs[4]) + 1e-3) == {4, 0}
    assert draws(temperature=1.0, top_p=float(probs[4]) - 1e-3) == {4}
    # min_p keeps tokens with p >= min_p * p_max: p(0)/p(4) = e^-1 ~ 0.37, p(1)/p(4) = e^-2.
    assert draws(temperature=1.0, min_p=0.3) == {4, 0}
    assert draws(temperature=1.0) == set(range(6))
    assert draws(temperature=100.0, top_k=3) == {4, 0, 1}


def test_penalties_exact() -> None:
    logits = torch.tensor([LOGITS])
    s = spec(
        tokens=(1, 4, 4, 3),
        prompt_len=1,
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    sample(logits, [s])
    # repetition over prompt+output {1, 3, 4}: positive / 2, negative * 2; then output counts
    # {4: 2, 3: 1}: - 0.5 * count - 0.25.
    expected = [2.0, 0.5, 0.5, -2.0 - 0.75, 1.5 - 1.25, 0.0]
    assert logits[0].tolist() == pytest.approx(expected)


def test_suppressed_ids_are_never_chosen() -> None:
    s = spec(temperature=0.0)
    s.suppress = (4, 0)
    assert sample(torch.tensor([LOGITS]), [s])[0].token_id == 1


def test_seeded_generators_and_mixed_rows() -> None:
    def run(seed: int) -> list[int]:
        rows = [spec(temperature=0.0), spec(temperature=1.0, seed=seed), spec(temperature=0.0)]
        out = []
        for _ in range(20):
            got = sample(torch.tensor([LOGITS] * 3), rows)
            assert got[0].token_id == got[2].token_id == 4
            out.append(got[1].token_id)
        return out

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_logprobs_are_raw_log_softmax() -> None:
    s = spec(temperature=0.0, top_logprobs=3, logit_bias={3: 10.0})
    got = sample(torch.tensor([LOGITS]), [s])[0]
    assert got.token_id == 3 and got.logprob is not None
    norm = math.log(sum(math.exp(x) for x in LOGITS))
    assert got.logprob.logprob == pytest.approx(-1.0 - norm, abs=1e-6)
    assert [t for t, _ in got.logprob.top] == [4, 0, 1]
    assert [v for _, v in got.logprob.top] == pytest.approx([x - norm for x in (3.0, 2.0, 1.0)])
    plain = sample(torch.tensor([LOGITS]), [spec(temperature=0.0)])[0]
    assert plain.logprob is None
