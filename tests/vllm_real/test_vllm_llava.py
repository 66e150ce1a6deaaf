"""Images through the vLLM adapter on the real engine: `kvmesh up --engine vllm` on the tiny LLaVA
(kvmesh.workers.pytorch.weights.create_tiny_llava with 32-dim attention heads), one worker, the
official openai client, and an in-process KV router following the worker's KV events.

- greedy output of a chat with a data-URI image through gateway -> router -> vLLM worker equals
  transformers' generate() on the same model, processor output and image, and kvmesh's torch
  engine on the same directory;
- the same image and prompt again: vLLM serves every full block but the last token's from its
  prefix cache (cached_tokens), and the router's index (fed by vLLM's own KV events, the image
  blocks' placeholders salted from vLLM's extra keys) holds the request's salted blocks;
- another image with the same text: vLLM serves only the blocks before the image's first
  placeholder, and the router's index never claimed more for it (neither under the other image's
  salted ids nor under the raw placeholder ids).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from kvmesh.router.hashing import block_hashes
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.pool import WorkerPool
from kvmesh.runtime.multimodal import salt_placeholders
from kvmesh.runtime.types import EngineRequest, MediaInput, SamplingParams, StopParams
from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.model_runner import load_model
from kvmesh.workers.pytorch.weights import create_tiny_llava
from tests.integration.test_llava_mesh import N_OUT, TEXT, chat
from tests.integration.test_up_openai import Mesh, stop_mesh
from tests.unit.test_torch_llava import BLUE, RED, SYSTEM, Llava
from tests.vllm_real.env import (
    BLOCK_SIZE,
    ENGINE_ARGS,
    SKIP_REASON,
    start_vllm_mesh,
    vllm_cpu_version,
)
from tests.vllm_real.test_vllm_mesh import following, until

pytestmark = [
    pytest.mark.vllm_real,
    pytest.mark.integration,
    pytest.mark.skipif(vllm_cpu_version() is None, reason=SKIP_REASON),
]

MODEL = "tiny-llava"
"""test_llava_mesh.chat's model name."""
BS = BLOCK_SIZE


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Llava:
    path = create_tiny_llava(tmp_path_factory.mktemp("vllm-llava") / MODEL, head_dim=32)
    return Llava(path, load_model(path, "cpu", TorchDType.FLOAT32))


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("registry")


@pytest.fixture(scope="module")
def mesh(llava: Llava, registry: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_vllm_mesh(
        tmp_path_factory.mktemp("up-vllm-llava"),
        llava.model_dir,
        ENGINE_ARGS,
        "--discovery",
        f"file://{registry}",
    )
    yield m
    assert stop_mesh(m) == 0, m.log.read_text()[-5000:]


@pytest_asyncio.fixture
async def router(mesh: Mesh, registry: Path) -> AsyncIterator[tuple[WorkerPool, KvRouter]]:
    """An in-process KV router following the vLLM worker's KV events."""
    async with following(registry, 1) as pair:
        yield pair


async def torch_engine_greedy(llava: Llava, prompt: list[int], image: bytes) -> list[int]:
    """kvmesh's torch engine on the same directory and image."""
    engine = llava.engine()
    await engine.start()
    try:
        req = EngineRequest(
            "t0",
            prompt,
            SamplingParams(temperature=0.0),
            StopParams(max_tokens=N_OUT),
            media=(MediaInput("image/png", image),),
        )
        return [t async for o in engine.generate(req) for t in o.token_ids]
    finally:
        await engine.stop()


async def test_chat_with_an_image_equals_transformers_and_is_cached_per_image(
    mesh: Mesh, llava: Llava, router: tuple[WorkerPool, KvRouter]
) -> None:
    pool, kv = router
    (worker,) = pool.workers(MODEL)
    info = worker.info
    assert "MULTIMODAL" in info.capabilities
    assert info.image_token_id == llava.processor.image_token_id
    assert info.tokens_per_image == 16
    tok = llava.processor.tokenizer
    prompt = llava.prompt(TEXT, [RED], SYSTEM)
    image_id = info.image_token_id
    assert prompt.count(image_id) == 16 and len(prompt) > 2 * BS
    want_red = llava.image_reference(TEXT, [RED], N_OUT, SYSTEM)
    want_blue = llava.image_reference(TEXT, [BLUE], N_OUT, SYSTEM)
    assert want_red != want_blue
    assert await torch_engine_greedy(llava, prompt, RED) == want_red

    def salted(image: bytes) -> list[int]:
        media = [MediaInput("image/png", image)]
        return salt_placeholders(prompt, image_id, media, info.tokens_per_image)

    def held(tokens: list[int]) -> int:
        """Leading full blocks of `tokens` the router's index says the worker holds."""
        return kv.scheduler.indexer.find_matches(block_hashes(tokens, BS)).get(worker.worker_id, 0)

    before_image = prompt.index(image_id) // BS  # full blocks before the first placeholder
    full = (len(prompt) - 1) // BS  # what a repeat can hit (vLLM computes the last token)
    assert 0 < before_image < full

    text, cached = await asyncio.to_thread(chat, mesh, RED)
    assert (text, cached) == (tok.decode(want_red, skip_special_tokens=True), 0)
    # vLLM's events for the image blocks carry its uuid: the router holds the salted blocks.
    await until(lambda: held(salted(RED)) == len(prompt) // BS)
    assert held(salted(BLUE)) == before_image  # no cross-image claim
    assert held(prompt) == before_image  # the raw placeholders hash as no image

    text, cached = await asyncio.to_thread(chat, mesh, RED)
    assert text == tok.decode(want_red, skip_special_tokens=True)
    assert cached == full * BS

    text, cached = await asyncio.to_thread(chat, mesh, BLUE)
    assert text == tok.decode(want_blue, skip_special_tokens=True)
    assert cached == before_image * BS
    await until(lambda: held(salted(BLUE)) == len(prompt) // BS)
    assert held(salted(RED)) == len(prompt) // BS  # both images' blocks, side by side
