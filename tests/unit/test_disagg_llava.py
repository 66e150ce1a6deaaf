"""Images with disaggregated prefill/decode on the torch engine, in one process (two engines on
the tiny LLaVA, each with its NIXL agent, as tests/unit/test_disagg_torch.py): the prefill
engine gets the images, computes their features and the KV; the decode engine continues from the
pulled KV without computing the prompt (so no image features); greedy output equals aggregated
serving and transformers' generate(); both engines' block hashes are salted by the images and
equal the router's; a failed pull recomputes the prompt with the images on the decode side."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("nixl", reason="NIXL is not installed (pip install kvmesh[nixl])")

from kvmesh.router.hashing import block_hashes
from kvmesh.runtime.multimodal import salt_placeholders
from kvmesh.runtime.types import MediaInput, Role
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.engine import DisaggSettings
from kvmesh.workers.pytorch.engine import TorchEngine
from tests.unit.test_disagg_torch import Pair, baseline, collect
from tests.unit.test_torch_llava import (
    BLUE,
    BS,
    CASES,
    RED,
    SYSTEM,
    Llava,
    llava,  # noqa: F401  (fixture)
    llava_dir,  # noqa: F401  (fixture)
    loaded,  # noqa: F401  (fixture)
    req,
    router_hashes,
)

pytestmark = pytest.mark.unit


class LlavaRoles:
    """Engines on the tiny LLaVA in a disaggregated role (what Pair builds its two from)."""

    def __init__(self, models: Llava) -> None:
        self.llava = models

    def engine(self, role: Role, tiers: KvTierConfig | None = None, **cfg: object) -> TorchEngine:
        assert tiers is None
        e = self.llava.engine(**cfg)
        e.configure_disaggregation(DisaggSettings(role=role))
        return e


@pytest.fixture
async def pair(llava: Llava) -> AsyncIterator[Pair]:  # noqa: F811
    p = Pair(LlavaRoles(llava))  # type: ignore[arg-type]
    await p.p.start()
    await p.d.start()
    yield p
    await p.p.stop()
    await p.d.stop()


async def test_both_roles_take_images(pair: Pair, llava: Llava) -> None:  # noqa: F811
    for e in (pair.p, pair.d):
        assert "MULTIMODAL" in e.info.capabilities and "DISAGGREGATION" in e.info.capabilities
        assert e.info.image_token_id == llava.processor.image_token_id
        assert e.info.tokens_per_image == 16


async def test_greedy_equals_aggregated_and_transformers(pair: Pair, llava: Llava) -> None:  # noqa: F811
    aggregated = llava.engine()
    await aggregated.start()
    try:
        for text, images in CASES:
            prompt = llava.prompt(text, images)
            computed = pair.d.scheduler.num_computed_tokens
            got, last = await pair.run(req(prompt, images, 10))
            want = llava.image_reference(text, images, 10)
            assert got == want, text
            agg, _ = await collect(aggregated, req(prompt, images, 10))
            assert agg == want, text
            assert not last.remote_prefill_fallback
            assert last.kv_transfer_bytes == -(-len(prompt) // BS) * pair.d.kv_layout.block_bytes
            # The decode engine computed only the tokens after the first: not the prompt, so
            # none of its image placeholders (features are computed for prefill chunks only).
            assert pair.d.scheduler.num_computed_tokens - computed == len(got) - 1
            baseline(pair.p, pair.d)
    finally:
        await aggregated.stop()
    assert all(pair.releases)


async def test_block_hashes_are_salted_alike_on_both_sides_and_in_the_router(
    pair: Pair,
    llava: Llava,  # noqa: F811
) -> None:
    prompt = llava.prompt("What is it?", [RED], SYSTEM)
    image_id = llava.processor.image_token_id
    full = len(prompt) // BS  # the blocks the pull moves whole
    for image in (RED, BLUE):
        await pair.run(req(prompt, [image], 4))
        media = (MediaInput("image/png", image),)
        routed = block_hashes(salt_placeholders(prompt, image_id, media, 16), BS)[:full]
        assert set(routed) <= router_hashes(pair.p)
        assert set(routed) <= router_hashes(pair.d)
    # Same text, two images: the blocks from the image's first placeholder on differ.
    red = block_hashes(salt_placeholders(prompt, image_id, (MediaInput("image/png", RED),), 16), BS)
    blue = block_hashes(
        salt_placeholders(prompt, image_id, (MediaInput("image/png", BLUE),), 16), BS
    )
    first = prompt.index(image_id) // BS
    assert red[:first] == blue[:first] and red[first] != blue[first]
    # Another turn with the same image: the decode engine holds its blocks (pulls none again).
    _, last = await pair.run(req(prompt, [RED], 4))
    assert last.kv_transfer_bytes == (-(-len(prompt) // BS) - full) * pair.d.kv_layout.block_bytes
    baseline(pair.p, pair.d)


async def test_a_failed_pull_recomputes_with_the_images(llava: Llava) -> None:  # noqa: F811
    pair = Pair(LlavaRoles(llava))  # type: ignore[arg-type]
    await pair.p.start()
    await pair.d.start()
    try:
        text, images = CASES[1]
        prompt = llava.prompt(text, images)
        request = req(prompt, images, 10)
        result = await pair.p.prefill_remote(request)
        await pair.p.stop()  # frees the pins: the decode engine's release answers False
        tokens, last = await collect(
            pair.d, dataclasses.replace(request, remote_prefill=result.remote)
        )
        assert [result.remote.first_token_id, *tokens] == llava.image_reference(text, images, 10)
        assert last.remote_prefill_fallback and pair.releases == [False]
        baseline(pair.d)
    finally:
        await pair.p.stop()
        await pair.d.stop()
