"""Embeddings served by the torch engine through the mesh (gateway -> router -> worker over
gRPC), through the official `openai` client, equal to transformers' own computation.

Reference: transformers' AutoModel (loaded separately from the same directory) on the prompt's
tokens from transformers' AutoTokenizer, pooled (mean or last token) and L2-normalized here.
Tolerance: 1e-5 absolute per component (float32 on CPU; the engine runs the same modules one
prompt at a time, so the only differences are kernel-level float noise).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")

import openai
import torch

from kvmesh.frontend.app import build_app, serve_http
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.router.backend import MeshBackend
from kvmesh.router.pool import WorkerPool
from kvmesh.router.routing import SimpleRouter
from kvmesh.runtime.discovery import FileDiscovery
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.pytorch.config import EmbeddingNormalize, Pooling, TorchConfig, TorchDType
from kvmesh.workers.pytorch.embedding import EmbeddingHead
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.server import Worker
from tests.devices import DEVICE

pytestmark = pytest.mark.integration

TOL = 1e-5
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a"]


def _sentence_transformers(path: Path, mode: str) -> None:
    """Make `path` a sentence-transformers model: Transformer -> Pooling(mode) -> Normalize."""
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, f"pooling_mode_{mode}": True})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))


@pytest.fixture(scope="module", params=["mean", "last"])
def embed_model(
    request: pytest.FixtureRequest, torch_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """The tiny model as a sentence-transformers embedding model (mean), or as a plain decoder
    (no sentence-transformers config: last-token pooling, normalized)."""
    mode: str = request.param
    path = tmp_path_factory.mktemp(f"embed-{mode}") / "tiny"
    shutil.copytree(torch_model_dir, path)
    if mode == "mean":
        _sentence_transformers(path, "mean_tokens")
    return path, mode


def reference(path: Path, mode: str, texts: list[str]) -> list[list[float]]:
    from transformers import AutoModel, AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids
            hidden = model(input_ids=ids).last_hidden_state[0]
            vector = hidden.mean(0) if mode == "mean" else hidden[-1]
            out.append(torch.nn.functional.normalize(vector, dim=0).tolist())
    return out


@pytest.fixture
async def client(
    embed_model: tuple[Path, str], tmp_path: Path
) -> AsyncIterator[tuple[openai.AsyncOpenAI, OpenAIService]]:
    path, _mode = embed_model
    url = f"file://{tmp_path / 'registry'}"
    engine = TorchEngine(
        TorchConfig(device=DEVICE, dtype=TorchDType.FLOAT32, num_gpu_blocks=64),
        model_dir=path,
        served_model_name="tiny",
        eos_token_ids=ModelDirInfo.load(path).eos_token_ids,
    )
    worker = Worker(WorkerConfig(discovery=url, worker_id="w0"), engine)
    await worker.start()
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
    await pool.start()
    await pool.wait_for(1, timeout_s=10)
    service = OpenAIService(
        MeshBackend(pool, SimpleRouter(pool)), {"tiny": Tokenizer.from_pretrained(path)}
    )
    runner, port = await serve_http(build_app(service), "127.0.0.1", 0)
    oai = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        yield oai, service
    finally:
        await oai.close()
        await runner.cleanup()
        await pool.stop()
        await worker.stop()


async def test_embeddings_equal_transformers(
    client: tuple[openai.AsyncOpenAI, OpenAIService], embed_model: tuple[Path, str]
) -> None:
    path, mode = embed_model
    oai, service = client
    info = service.model_info("tiny")
    assert info is not None and "EMBEDDINGS" in info.capabilities  # advertised on the card
    expected = reference(path, mode, TEXTS)
    resp = await oai.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1, 2]
    for got, want in zip(resp.data, expected, strict=True):
        assert len(got.embedding) == len(want) == 64
        assert max(abs(a - b) for a, b in zip(got.embedding, want, strict=True)) < TOL
    # batched (above) equals one at a time, and base64 equals float
    alone = await oai.embeddings.create(model="tiny", input=TEXTS[1])
    assert max(abs(a - b) for a, b in zip(alone.data[0].embedding, expected[1], strict=True)) < TOL
    # dimensions: the first 16 components, re-normalized
    short = await oai.embeddings.create(
        model="tiny", input=TEXTS[0], dimensions=16, encoding_format="float"
    )
    head = torch.tensor(expected[0][:16])
    want16 = (head / head.norm()).tolist()
    assert max(abs(a - b) for a, b in zip(short.data[0].embedding, want16, strict=True)) < TOL


def test_embedding_head_resolution(tmp_path: Path) -> None:
    plain = EmbeddingHead.resolve(tmp_path, Pooling.AUTO, EmbeddingNormalize.AUTO)
    assert plain == EmbeddingHead(Pooling.LAST, True)
    _sentence_transformers(tmp_path, "cls_token")
    assert EmbeddingHead.resolve(tmp_path, Pooling.AUTO, EmbeddingNormalize.AUTO) == (
        EmbeddingHead(Pooling.CLS, True)
    )
    assert EmbeddingHead.resolve(tmp_path, Pooling.MEAN, EmbeddingNormalize.NO) == (
        EmbeddingHead(Pooling.MEAN, False)
    )
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    ]))  # fmt: skip
    assert EmbeddingHead.resolve(tmp_path, Pooling.AUTO, EmbeddingNormalize.AUTO) == (
        EmbeddingHead(Pooling.CLS, False)  # a sentence-transformers model without Normalize
    )


async def test_kserve_infer_on_the_embedding_model(
    client: tuple[openai.AsyncOpenAI, OpenAIService], embed_model: tuple[Path, str]
) -> None:
    """The `embedding` output of KServe v2 REST infer (the real tritonclient.http, binary
    tensors): text_input batches and input_ids, as the OpenAI door computes them."""
    import numpy as np
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    path, mode = embed_model
    oai, _service = client
    host = str(oai.base_url).removeprefix("http://").removesuffix("/v1/")
    expected = reference(path, mode, TEXTS)

    def infer(inputs: list[Any], outputs: list[str]) -> Any:
        c = httpclient.InferenceServerClient(host)
        try:
            return c.infer(
                "tiny", inputs, outputs=[httpclient.InferRequestedOutput(o) for o in outputs]
            )
        finally:
            c.close()

    texts = httpclient.InferInput("text_input", [len(TEXTS)], "BYTES")
    texts.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_))
    result = await asyncio.to_thread(infer, [texts], ["embedding"])
    got = result.as_numpy("embedding")
    assert got.shape == (3, 64) and got.dtype == np.float32
    assert float(np.abs(got - np.array(expected)).max()) < TOL

    ids = Tokenizer.from_pretrained(path).encode(TEXTS[1], add_special_tokens=True)
    tokens = httpclient.InferInput("input_ids", [1, len(ids)], "INT64")
    tokens.set_data_from_numpy(np.array([ids], dtype=np.int64))
    by_ids = (await asyncio.to_thread(infer, [tokens], ["embedding"])).as_numpy("embedding")
    assert float(np.abs(by_ids[0] - np.array(expected[1])).max()) < TOL

    with pytest.raises(InferenceServerException, match="one output"):
        await asyncio.to_thread(infer, [texts], ["embedding", "text_output"])
