"""TorchEngine on the tiny random-weight LLaVA (transformers' LlavaForConditionalGeneration),
in-process: greedy output with images token-identical to transformers' generate() on the same
processor output (one and two images, chunked prefill across an image, preemption), block
hashes salted by the images (same image: prefix-cache hit; different image: none from its first
placeholder on) and equal to the router's, and bad images refused."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")

import torch
from PIL import Image

from kvmesh.router.hashing import block_hashes, chain_hashes
from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.multimodal import salt_placeholders
from kvmesh.runtime.types import EngineRequest, MediaInput, SamplingParams, StopParams
from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from kvmesh.workers.pytorch.weights import create_tiny_llava
from tests.devices import DEVICE
from tests.unit.test_torch_engine import Env, assert_idle, run

pytestmark = pytest.mark.unit

BS = 16


def png(color: tuple[int, int, int], size: tuple[int, int] = (24, 20)) -> bytes:
    img = Image.new("RGB", size, color)
    for x in range(0, size[0], 3):  # some structure, so the features vary across patches
        img.putpixel((x, x % size[1]), (255 - color[0], x * 9 % 256, color[2]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE, GREEN = png((200, 10, 10)), png((10, 10, 200)), png((10, 180, 40), (40, 16))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="module")
def loaded(llava_dir: Path) -> LoadedModel:
    return load_model(llava_dir, DEVICE, TorchDType.FLOAT32)


class Llava(Env):
    """Engines on the tiny LLaVA, prompts from the model's own processor, transformers
    references with images."""

    def __init__(self, path: Path, loaded: LoadedModel) -> None:
        from transformers import AutoProcessor

        super().__init__(path, loaded)
        self.processor: Any = AutoProcessor.from_pretrained(path)

    def inputs(self, text: str, images: list[bytes], system: str = "") -> dict[str, Any]:
        content: list[dict[str, str]] = [{"type": "image"} for _ in images]
        content.append({"type": "text", "text": text})
        messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        prompt = self.processor.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        out: dict[str, Any] = self.processor(
            text=prompt, images=pil or None, return_tensors="pt", add_special_tokens=False
        )
        return out

    def prompt(self, text: str, images: list[bytes], system: str = "") -> list[int]:
        ids: list[int] = self.inputs(text, images, system)["input_ids"][0].tolist()
        return ids

    def image_reference(
        self, text: str, images: list[bytes], n: int, system: str = ""
    ) -> list[int]:
        inputs = self.inputs(text, images, system)
        out = self.loaded.model.generate(
            **{k: v.to(self.loaded.device) for k, v in inputs.items()},
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=list(self.eos),
            pad_token_id=self.eos[0],
        )
        return list(out[0, inputs["input_ids"].shape[1] :].tolist())

    def engine(self, **cfg: Any) -> TorchEngine:
        return super().engine(**{"block_size": BS, **cfg})


@pytest.fixture(scope="module")
def llava(llava_dir: Path, loaded: LoadedModel) -> Llava:
    return Llava(llava_dir, loaded)


@pytest.fixture
async def engine(llava: Llava) -> AsyncIterator[TorchEngine]:
    eng = llava.engine()
    await eng.start()
    yield eng
    await eng.stop()


_ids = iter(range(1 << 30))


def req(prompt: list[int], images: list[bytes], max_tokens: int = 10, **stop: Any) -> EngineRequest:
    return EngineRequest(
        f"v-{next(_ids)}",
        prompt,
        SamplingParams(temperature=0.0),
        StopParams(max_tokens=max_tokens, **stop),
        media=tuple(MediaInput("image/png", b) for b in images),
    )


async def test_model_card_and_capability(engine: TorchEngine, llava: Llava) -> None:
    info = engine.info
    assert "MULTIMODAL" in info.capabilities
    assert info.image_token_id == llava.processor.image_token_id
    assert info.tokens_per_image == 16  # 4x4 patches, CLS dropped
    prompt = llava.prompt("hi", [RED])
    assert prompt.count(info.image_token_id) == 16


CASES = [
    ("What is in this picture?", [RED]),
    ("Compare the two.", [BLUE, GREEN]),
    ("Describe it in detail, please, with many words and more.", [GREEN]),
]


async def test_greedy_matches_transformers_generate(engine: TorchEngine, llava: Llava) -> None:
    for text, images in CASES:
        tokens, last = await run(engine, req(llava.prompt(text, images), images, 10))
        assert tokens == llava.image_reference(text, images, 10), text
        assert last.usage is not None and last.usage.completion_tokens == len(tokens)
    assert_idle(engine)


async def test_images_change_the_output(engine: TorchEngine, llava: Llava) -> None:
    """The features really reach the model: different images, different greedy output."""
    red = await run(engine, req(llava.prompt("Which color?", [RED]), [RED], 8))
    blue = await run(engine, req(llava.prompt("Which color?", [BLUE]), [BLUE], 8))
    assert red[0] != blue[0]


@pytest.mark.parametrize("budget", [7, 24])
async def test_chunked_prefill_and_concurrency_match(llava: Llava, budget: int) -> None:
    """Chunks that start and end inside an image's placeholders, batched with other requests."""
    eng = llava.engine(max_num_batched_tokens=budget)
    await eng.start()
    try:
        prompts = [llava.prompt(text, images) for text, images in CASES]
        results = await asyncio.gather(
            *(run(eng, req(p, images, 10)) for p, (_, images) in zip(prompts, CASES, strict=True))
        )
        for (text, images), (tokens, _) in zip(CASES, results, strict=True):
            assert tokens == llava.image_reference(text, images, 10), text
        assert_idle(eng)
    finally:
        await eng.stop()


async def test_preemption_recomputes_with_the_same_features(llava: Llava) -> None:
    eng = llava.engine(num_gpu_blocks=9)
    await eng.start()
    try:
        cases = [(f"Tell me {i}", [RED if i % 2 else BLUE]) for i in range(4)]
        results = await asyncio.gather(
            *(run(eng, req(llava.prompt(t, im), im, 24, ignore_eos=True)) for t, im in cases)
        )
        assert eng.load().preemptions_total > 0
        for (text, images), (tokens, _) in zip(cases, results, strict=True):
            ref = llava.image_reference(text, images, 24)
            assert tokens[: len(ref)] == ref
        assert_idle(eng)
    finally:
        await eng.stop()


SYSTEM = "You are a careful assistant who looks at pictures and answers briefly and exactly."


async def test_prefix_cache_is_salted_by_the_image(engine: TorchEngine, llava: Llava) -> None:
    prompt = llava.prompt("What is it?", [RED], SYSTEM)
    image_id = engine.info.image_token_id
    first_placeholder = prompt.index(image_id)
    shared = first_placeholder // BS * BS  # full blocks before the image's first placeholder
    assert shared >= BS
    first, last = await run(engine, req(prompt, [RED]))
    assert last.usage is not None and last.usage.cached_tokens == 0
    again, last = await run(engine, req(prompt, [RED]))
    assert again == first
    assert last.usage is not None
    assert last.usage.cached_tokens == (len(prompt) - 1) // BS * BS > shared
    # Same text, another image: only the blocks before the image are shared.
    other, last = await run(engine, req(prompt, [BLUE]))
    assert last.usage is not None and last.usage.cached_tokens == shared
    assert other == llava.image_reference("What is it?", [BLUE], 10, SYSTEM)
    # The same pixels in other bytes count as another image (hashes cover the bytes).
    assert_idle(engine)


def router_hashes(engine: TorchEngine) -> set[int]:
    """The hashes the router's index holds for `engine`'s cached blocks: chain_hashes over the
    token ids its KV events carry, chained along each block's parent."""
    cached = engine.cached_blocks()
    out: dict[int, int] = {}

    def resolve(h: int) -> int:
        if h not in out:
            parent, tokens, _ = cached[h]
            above = None if parent is None else resolve(parent)
            out[h] = chain_hashes(above, [tokens], BS)[0]
        return out[h]

    return {resolve(h) for h in cached}


async def test_engine_and_router_hashes_agree(engine: TorchEngine, llava: Llava) -> None:
    """The router hashes a request's salted ids; the engine's KV events carry the same salted
    ids, so the router's index (chain_hashes over event tokens) holds exactly those hashes."""
    prompt = llava.prompt("Hash me", [GREEN], SYSTEM)
    await run(engine, req(prompt, [GREEN]))
    info = engine.info
    assert info.image_token_id is not None
    media = (MediaInput("image/png", GREEN),)
    routed = block_hashes(salt_placeholders(prompt, info.image_token_id, media, 16), BS)
    full = (len(prompt) - 1) // BS  # the blocks the prompt filled (the last token's is partial)
    assert router_hashes(engine) == set(routed[:full])
    plain = block_hashes(prompt, BS)
    first = prompt.index(info.image_token_id) // BS
    assert routed[:first] == plain[:first] and routed[first] != plain[first]


async def test_bad_images_are_refused(engine: TorchEngine, llava: Llava) -> None:
    prompt = llava.prompt("x", [RED])
    with pytest.raises(InvalidRequest, match=r"media\[0\].*not a decodable image") as err:
        await run(engine, req(prompt, [b"\x89PNG not really"]))
    assert err.value.param == "media"
    with pytest.raises(InvalidRequest, match="16 each"):
        await run(engine, req(prompt, [RED, BLUE]))  # placeholders for one image only
    assert_idle(engine)


def test_features_are_the_models_own(loaded: LoadedModel, llava: Llava) -> None:
    encoder = loaded.image_encoder()
    assert encoder is not None
    pixels = encoder.pixels([MediaInput("image/png", RED)])
    ref = llava.inputs("x", [RED])["pixel_values"]
    assert torch.equal(pixels.cpu(), ref)
