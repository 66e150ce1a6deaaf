"""Images with disaggregated prefill/decode through the whole mesh (`kvmesh up --engine torch
--prefill-workers 1 --decode-workers 1` on the tiny LLaVA, real processes, NIXL between them,
the official `openai` client): the gateway sends the images to the prefill worker
(`PrefillRemote.media`), which computes their features and the KV; the decode worker continues
from the pulled KV. Greedy output equals transformers' generate() (and so the aggregated mesh
of test_llava_mesh.py); the same image again hits the prefill worker's prefix cache (routed by
the salted block hashes), another image with the same text does not past the image."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("nixl", reason="NIXL is not installed (pip install kvmesh[nixl])")

from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.model_runner import load_model
from kvmesh.workers.pytorch.weights import create_tiny_llava
from tests.integration.test_llava_mesh import MODEL, N_OUT, TEXT, chat
from tests.integration.test_up_openai import Mesh, start_mesh, stop_mesh
from tests.unit.test_torch_llava import BLUE, BS, RED, SYSTEM, Llava

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Llava:
    path = create_tiny_llava(tmp_path_factory.mktemp("llava-disagg") / MODEL)
    return Llava(path, load_model(path, "cpu", TorchDType.FLOAT32))


@pytest.fixture(scope="module")
def mesh(llava: Llava, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(
        tmp_path_factory.mktemp("up-llava-disagg"),
        "--engine",
        "torch",
        "--model",
        str(llava.model_dir),
        "--workers",
        "0",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--disagg-local-prefill-tokens",
        "0",
        "--device",
        "cpu",
        "--torch-num-gpu-blocks",
        "64",
        "--torch-block-size",
        str(BS),
        ready_timeout_s=120.0,
    )
    m.wait_workers(prefill=1, decode=1)
    yield m
    assert stop_mesh(m) == 0, m.log.read_text()


def _counts(mesh: Mesh) -> dict[str, float]:
    return mesh.metrics("kvmesh_remote_prefill_total", "kvmesh_local_prefill_total")


def test_chat_with_an_image_prefilled_remotely_equals_transformers(
    mesh: Mesh, llava: Llava
) -> None:
    tok = llava.processor.tokenizer
    prompt = llava.prompt(TEXT, [RED], SYSTEM)
    want_red = tok.decode(
        llava.image_reference(TEXT, [RED], N_OUT, SYSTEM), skip_special_tokens=True
    )
    want_blue = tok.decode(
        llava.image_reference(TEXT, [BLUE], N_OUT, SYSTEM), skip_special_tokens=True
    )
    assert want_red != want_blue
    before = _counts(mesh)
    assert chat(mesh, RED) == (want_red, 0)
    # Same image and prompt: the prefill worker serves the prompt's full blocks from its cache.
    text, cached = chat(mesh, RED)
    assert text == want_red
    assert cached == (len(prompt) - 1) // BS * BS
    # Same text, another image: at most the blocks before the image's first placeholder.
    before_image = prompt.index(llava.processor.image_token_id) // BS * BS
    text, cached = chat(mesh, BLUE)
    assert text == want_blue
    assert cached in (0, before_image)
    after = _counts(mesh)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert delta == {"kvmesh_remote_prefill_total": 3.0}, delta
