"""The acceptance of the KV tiers through the whole mesh (`kvmesh up --engine torch`, real
processes, the official `openai` client): a torch worker with a small device pool serves a
prompt whose blocks were evicted from it out of its host tier, out of its disk tier, and out of
the disk tier after the mesh restarts; `usage.prompt_tokens_details.cached_tokens` counts them,
the frontend's /metrics shows the worker's tier hit counter move, and greedy output equals
transformers' generate() every time."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")

from tokenizers import Tokenizer

from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from tests.conftest import generate_reference
from tests.devices import DEVICE
from tests.integration.test_up_openai import Mesh, start_mesh, stop_mesh

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [20 + (i * 37) % 3000 for i in range(70)]
CACHED = (len(PROMPT) - 1) // 16 * 16  # its full blocks before the last token
OTHERS = [[100 + k * 13 + (i * 53) % 3000 for i in range(90)] for k in range(4)]
N_OUT = 8


@pytest.fixture(scope="module")
def expected(torch_model_dir: Path) -> str:
    """transformers generate() of PROMPT, greedy, decoded."""
    loaded: LoadedModel = load_model(torch_model_dir, DEVICE, TorchDType.FLOAT32)
    eos = ModelDirInfo.load(torch_model_dir).eos_token_ids
    out = generate_reference(loaded, eos, PROMPT, N_OUT)
    tok = Tokenizer.from_file(str(torch_model_dir / "tokenizer.json"))
    return tok.decode(out, skip_special_tokens=True)


def _start(tmp: Path, torch_model_dir: Path, *tiers: str) -> Mesh:
    return start_mesh(
        tmp,
        "--engine",
        "torch",
        "--model",
        str(torch_model_dir),
        "--workers",
        "1",
        "--device",
        DEVICE,
        "--dtype",
        "float32",
        "--torch-num-gpu-blocks",
        "12",
        *tiers,
    )


def _complete(mesh: Mesh, prompt: list[int]) -> tuple[str, int]:
    res = mesh.client().completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=N_OUT, temperature=0
    )
    assert res.usage is not None
    details = res.usage.prompt_tokens_details
    return res.choices[0].text, (details.cached_tokens or 0) if details is not None else 0


def _hit_tokens(mesh: Mesh, tier: str) -> float:
    """The worker's hit counter of `tier` on the frontend's /metrics (0 until reported)."""
    with urllib.request.urlopen(mesh.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf'kvmesh_worker_kv_hit_tokens_total{{tier="{tier}",worker="[^"]+"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def _wait_hits(mesh: Mesh, tier: str, value: float) -> None:
    deadline = time.monotonic() + 10
    while _hit_tokens(mesh, tier) != value:
        assert time.monotonic() < deadline, f"{tier} hit tokens never reached {value}"
        time.sleep(0.1)


def _serve_evicted(mesh: Mesh, expected: str, tier: str) -> None:
    text, cached = _complete(mesh, PROMPT)
    assert text == expected
    for other in OTHERS:  # push PROMPT's blocks out of the 12-block device pool
        _complete(mesh, other)
    text, cached = _complete(mesh, PROMPT)
    assert text == expected and cached == CACHED
    _wait_hits(mesh, tier, float(CACHED))


def test_host_tier_through_the_mesh(
    torch_model_dir: Path, expected: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    mesh = _start(tmp_path_factory.mktemp("host"), torch_model_dir, "--kv-host-blocks", "64")
    try:
        _serve_evicted(mesh, expected, "host")
    finally:
        assert stop_mesh(mesh) == 0, mesh.log.read_text()


def test_disk_tier_through_the_mesh_and_a_restart(
    torch_model_dir: Path, expected: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    disk = tmp_path_factory.mktemp("disk")
    flags = ("--kv-host-blocks", "8", "--kv-disk-blocks", "64", "--kv-disk-dir", str(disk))
    mesh = _start(tmp_path_factory.mktemp("disk-1"), torch_model_dir, *flags)
    try:
        _serve_evicted(mesh, expected, "disk")
    finally:
        assert stop_mesh(mesh) == 0, mesh.log.read_text()
    assert list((disk / "worker-0").rglob("*.kvb"))  # each worker has its own directory
    mesh = _start(tmp_path_factory.mktemp("disk-2"), torch_model_dir, *flags)
    try:  # the first request after the restart is served from the block files
        text, cached = _complete(mesh, PROMPT)
        assert text == expected and cached == CACHED
        _wait_hits(mesh, "disk", float(CACHED))
    finally:
        assert stop_mesh(mesh) == 0, mesh.log.read_text()
