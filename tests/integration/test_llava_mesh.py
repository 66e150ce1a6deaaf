"""Images through the whole mesh (`kvmesh up --engine torch` on the tiny LLaVA, real processes,
the official `openai` client): greedy output of a chat with a data-URI image equals
transformers' generate() on the same model, processor output and image; the same image and
prompt again hit the prefix cache (routed by the same salted block hashes the worker reports),
another image with the same text does not past the image; the same with disaggregated
prefill/decode (images sent to the prefill worker, KV pulled by the decode worker over NIXL);
bad images get 400s; text-only embeddings (OpenAI and KServe gRPC) equal transformers'."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")

from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.model_runner import load_model
from kvmesh.workers.pytorch.weights import create_tiny_llava
from tests.devices import DEVICE
from tests.integration.test_up_openai import Mesh, start_mesh, stop_mesh
from tests.unit.test_torch_llava import BLUE, BS, RED, SYSTEM, Llava

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny-llava"
N_OUT = 10
TEXT = "What is in this picture?"


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Llava:
    path = create_tiny_llava(tmp_path_factory.mktemp("llava-mesh") / MODEL)
    return Llava(path, load_model(path, DEVICE, TorchDType.FLOAT32))


def _start(llava: Llava, tmp: Path, *topology: str) -> Mesh:
    return start_mesh(
        tmp,
        "--engine",
        "torch",
        "--model",
        str(llava.model_dir),
        *topology,
        "--device",
        DEVICE,
        "--dtype",
        "float32",
        "--torch-num-gpu-blocks",
        "64",
        "--torch-block-size",
        str(BS),
        ready_timeout_s=120.0,
    )


@pytest.fixture(scope="module")
def mesh(llava: Llava, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = _start(llava, tmp_path_factory.mktemp("up-llava"), "--workers", "2")
    m.wait_workers(aggregated=2)
    yield m
    assert stop_mesh(m) == 0, m.log.read_text()


@pytest.fixture(scope="module")
def disagg_mesh(llava: Llava, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One prefill and one decode worker, every prompt prefilled remotely (KV over NIXL)."""
    pytest.importorskip("nixl", reason="NIXL is not installed (pip install kvmesh[nixl])")
    m = _start(
        llava,
        tmp_path_factory.mktemp("up-llava-disagg"),
        *("--workers", "0", "--prefill-workers", "1", "--decode-workers", "1"),
        *("--disagg-local-prefill-tokens", "0"),
    )
    m.wait_workers(prefill=1, decode=1)
    yield m
    assert stop_mesh(m) == 0, m.log.read_text()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat(mesh: Mesh, png: bytes, text: str = TEXT, system: str = SYSTEM) -> tuple[str, int]:
    messages: list[Any] = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(png)}},
                {"type": "text", "text": text},
            ],
        },
    ]
    res = mesh.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=N_OUT, temperature=0
    )
    assert res.usage is not None
    details = res.usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return res.choices[0].message.content or "", cached


def _chats_equal_transformers_and_hit_the_cache(mesh: Mesh, llava: Llava) -> None:
    tok = llava.processor.tokenizer
    prompt = llava.prompt(TEXT, [RED], SYSTEM)
    want_red = tok.decode(
        llava.image_reference(TEXT, [RED], N_OUT, SYSTEM), skip_special_tokens=True
    )
    want_blue = tok.decode(
        llava.image_reference(TEXT, [BLUE], N_OUT, SYSTEM), skip_special_tokens=True
    )
    assert want_red != want_blue
    text, cached = chat(mesh, RED)
    assert (text, cached) == (want_red, 0)
    # Same image and prompt: routed to the worker holding its blocks, which serves them.
    text, cached = chat(mesh, RED)
    assert text == want_red
    assert cached == (len(prompt) - 1) // BS * BS
    # Same text, another image: at most the blocks before the image's first placeholder.
    before_image = prompt.index(llava.processor.image_token_id) // BS * BS
    text, cached = chat(mesh, BLUE)
    assert text == want_blue
    assert cached in (0, before_image)


def test_chat_with_an_image_equals_transformers_and_hits_the_cache(
    mesh: Mesh, llava: Llava
) -> None:
    _chats_equal_transformers_and_hit_the_cache(mesh, llava)


def test_disaggregated_chat_with_an_image_equals_transformers(
    disagg_mesh: Mesh, llava: Llava
) -> None:
    """The gateway sends the images to the prefill worker (`PrefillRemote.media`), which computes
    their features and the KV; the decode worker continues from the pulled KV. Output and prefix
    caching (on the prefill worker, routed by the salted hashes) as aggregated."""
    counters = ("kvmesh_remote_prefill_total", "kvmesh_local_prefill_total")
    before = disagg_mesh.metrics(*counters)
    _chats_equal_transformers_and_hit_the_cache(disagg_mesh, llava)
    after = disagg_mesh.metrics(*counters)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert delta == {"kvmesh_remote_prefill_total": 3.0}, delta


def test_bad_images_get_400(mesh: Mesh) -> None:
    with pytest.raises(openai.BadRequestError, match="image"):
        chat(mesh, b"\x89PNG\r\n\x1a\n broken")
    with pytest.raises(openai.BadRequestError, match="allowed-local-media-path"):
        mesh.client().chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}},
                        {"type": "text", "text": "hi"},
                    ],
                }
            ],
            max_tokens=2,
        )


EMBED_TEXTS = ["hello world", "What is in this picture?", "a"]
EMBED_TOL = 1e-5  # as tests/integration/test_torch_embeddings.py: float32 kernel noise


def embedding_reference(llava: Llava, texts: list[str]) -> list[list[float]]:
    """transformers' own LlavaModel (AutoModel, loaded separately) on the text's tokens, no
    image: the last token's final state (no sentence-transformers config: last-token pooling),
    L2-normalized."""
    import torch
    from transformers import AutoModel

    model: Any = AutoModel.from_pretrained(llava.model_dir, dtype=torch.float32).eval()
    tok = llava.processor.tokenizer
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids
            hidden = model(input_ids=ids).last_hidden_state[0]
            out.append(torch.nn.functional.normalize(hidden[-1], dim=0).tolist())
    return out


def test_text_embeddings_on_the_llava_model(mesh: Mesh, llava: Llava) -> None:
    """/v1/embeddings on a LLaVA model embeds text (its language model's states), equal to
    transformers'; an input holding the image token is refused (no images in embeddings)."""
    expected = embedding_reference(llava, EMBED_TEXTS)
    resp = mesh.client().embeddings.create(model=MODEL, input=EMBED_TEXTS, encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1, 2]
    for got, want in zip(resp.data, expected, strict=True):
        assert len(got.embedding) == len(want)
        assert max(abs(a - b) for a, b in zip(got.embedding, want, strict=True)) < EMBED_TOL
    with pytest.raises(openai.BadRequestError, match="image token") as info:
        mesh.client().embeddings.create(model=MODEL, input="look: <image> here")
    assert info.value.param == "input"  # type: ignore[attr-defined]


def test_kserve_grpc_infer_on_the_embedding_model(mesh: Mesh, llava: Llava) -> None:
    """The `embedding` output of KServe v2 gRPC infer (the real tritonclient.grpc): a batch of
    text_input and input_ids, as the OpenAI door computes them; an error is a gRPC status."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from tests.integration.test_kserve_up import kserve_grpc_address

    expected = np.array(embedding_reference(llava, EMBED_TEXTS), dtype=np.float32)
    client = grpcclient.InferenceServerClient(kserve_grpc_address(mesh))
    try:
        texts = grpcclient.InferInput("text_input", [len(EMBED_TEXTS)], "BYTES")
        texts.set_data_from_numpy(np.array([t.encode() for t in EMBED_TEXTS], dtype=np.object_))
        wanted = [grpcclient.InferRequestedOutput("embedding")]
        got = client.infer(MODEL, [texts], outputs=wanted).as_numpy("embedding")
        assert got.shape == expected.shape and got.dtype == np.float32
        assert float(np.abs(got - expected).max()) < EMBED_TOL

        ids = llava.processor.tokenizer(EMBED_TEXTS[1]).input_ids
        tokens = grpcclient.InferInput("input_ids", [1, len(ids)], "INT64")
        tokens.set_data_from_numpy(np.array([ids], dtype=np.int64))
        by_ids = client.infer(MODEL, [tokens], outputs=wanted).as_numpy("embedding")
        assert float(np.abs(by_ids[0] - expected[1]).max()) < EMBED_TOL

        image = grpcclient.InferInput("input_ids", [1, 2], "INT64")
        image.set_data_from_numpy(
            np.array([[ids[0], llava.processor.image_token_id]], dtype=np.int64)
        )
        with pytest.raises(InferenceServerException, match="image token") as info:
            client.infer(MODEL, [image], outputs=wanted)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()
