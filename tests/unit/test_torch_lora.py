"""LoRA on the torch engine against peft: adapters built locally with peft on the tiny
random-weight Llama; the engine's greedy text under an adapter equals peft's merged model's
generate(); two adapters and the base model share one batch, each with its own answer; the
LRU bound, load/unload errors and the model card's adapter list."""

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
pytest.importorskip("peft", reason="peft is not installed (the dev extra has it)")

import torch

from kvmesh.runtime.errors import InvalidRequest, NotFound
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from tests.devices import DEVICE

pytestmark = [
    pytest.mark.unit,
    # peft (as of 0.21) reads transformers' deprecated is_gradient_checkpointing
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
]

N = 10
PROMPTS = [[(11 + s * 97 + i * 31) % 3900 + 20 for i in range(n)] for s, n in enumerate((7, 23))]

ADAPTERS: dict[str, dict[str, Any]] = {
    # every projection the runner drives, plain scaling
    "all": {
        "r": 4,
        "lora_alpha": 16,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    },
    # attention only, rsLoRA scaling, another rank
    "qv": {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
}


@pytest.fixture(scope="module")
def model_dir(torch_model_dir: Path) -> Path:
    return torch_model_dir


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, DEVICE, TorchDType.FLOAT32)


@pytest.fixture(scope="module")
def eos(model_dir: Path) -> tuple[int, ...]:
    return ModelDirInfo.load(model_dir).eos_token_ids


def _generate(model: Any, prompt: list[int], eos: tuple[int, ...]) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=N,
        eos_token_id=list(eos),
        pad_token_id=eos[0],
    )
    return list(out[0, len(prompt) :].tolist())


@pytest.fixture(scope="module")
def adapters(
    model_dir: Path, eos: tuple[int, ...], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, list[list[int]]]]:
    """name -> (peft adapter directory, peft merged model's greedy output per prompt)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    out: dict[str, tuple[Path, list[list[int]]]] = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kwargs))
        path = root / name
        peft_model.save_pretrained(str(path))
        merged = peft_model.merge_and_unload().eval()
        with torch.inference_mode():
            out[name] = (path, [_generate(merged, p, eos) for p in PROMPTS])
    return out


@pytest.fixture
async def engine(
    model_dir: Path, loaded: LoadedModel, eos: tuple[int, ...]
) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(
        TorchConfig(device=DEVICE, num_gpu_blocks=128, max_loras=2),
        model_dir=model_dir,
        served_model_name="tiny",
        eos_token_ids=eos,
        loaded=loaded,
    )
    await eng.start()
    yield eng
    await eng.stop()


_ids = iter(range(1 << 30))


async def run(engine: TorchEngine, prompt: list[int], lora: str = "") -> list[int]:
    request = EngineRequest(
        f"l-{next(_ids)}",
        prompt,
        SamplingParams(temperature=0.0),
        StopParams(max_tokens=N),
        lora_name=lora,
    )
    return [t async for o in engine.generate(request) for t in o.token_ids]


async def test_adapter_output_equals_peft_merged_generate(
    engine: TorchEngine,
    loaded: LoadedModel,
    eos: tuple[int, ...],
    adapters: dict[str, tuple[Path, list[list[int]]]],
) -> None:
    assert "LORA" in engine.info.capabilities
    base = [_generate(loaded.model, p, eos) for p in PROMPTS]
    for name, (path, expected) in adapters.items():
        card = await engine.load_lora(name, str(path))
        assert name in card.lora_adapters
        for prompt, want, plain in zip(PROMPTS, expected, base, strict=True):
            assert want != plain  # the adapter changes the answer: the test can fail
            assert await run(engine, prompt, name) == want
    # the base model is untouched
    for prompt, plain in zip(PROMPTS, base, strict=True):
        assert await run(engine, prompt) == plain


async def test_two_adapters_and_base_in_one_batch(
    engine: TorchEngine,
    loaded: LoadedModel,
    eos: tuple[int, ...],
    adapters: dict[str, tuple[Path, list[list[int]]]],
) -> None:
    for name, (path, _) in adapters.items():
        await engine.load_lora(name, str(path))
    base = [_generate(loaded.model, p, eos) for p in PROMPTS]
    jobs: list[tuple[str, int]] = [(lora, i) for lora in ("", "all", "qv") for i in range(2)]
    steps_before = engine.scheduler.num_steps
    got = await asyncio.gather(*(run(engine, PROMPTS[i], lora) for lora, i in jobs))
    for (lora, i), tokens in zip(jobs, got, strict=True):
        assert tokens == (adapters[lora][1][i] if lora else base[i]), (lora, i)
    # all six ran together: one prefill step and N - 1 decode steps (not one batch each)
    assert engine.scheduler.num_steps - steps_before <= N + 1


async def test_lru_bound_and_errors(
    engine: TorchEngine, adapters: dict[str, tuple[Path, list[list[int]]]], tmp_path: Path
) -> None:
    path_all, want_all = adapters["all"]
    path_qv, _ = adapters["qv"]
    await engine.load_lora("a", str(path_all))
    await engine.load_lora("b", str(path_qv))
    assert await run(engine, PROMPTS[0], "a") == want_all[0]  # "a" is now the most recent
    card = await engine.load_lora("c", str(path_qv))  # max_loras=2: "b" goes
    assert card.lora_adapters == ("a", "c")
    assert engine.scheduler.loras.num_evicted == 1
    with pytest.raises(NotFound, match="'b' is not loaded"):
        await run(engine, PROMPTS[0], "b")
    with pytest.raises(InvalidRequest, match="already loaded"):
        await engine.load_lora("a", str(path_all))
    with pytest.raises(InvalidRequest, match="served model"):
        await engine.load_lora("tiny", str(path_all))
    with pytest.raises(NotFound):
        await engine.unload_lora("b")
    with pytest.raises(InvalidRequest, match=r"adapter_config\.json"):
        await engine.load_lora("d", str(tmp_path))
    # an adapter of another model (a projection of another width) is refused, not loaded
    bad = tmp_path / "bad"
    shutil.copytree(path_all, bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequest, match="do not fit"):
        await engine.load_lora("d", str(bad))
    dora = tmp_path / "dora"
    shutil.copytree(path_all, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(InvalidRequest, match="DoRA"):
        await engine.load_lora("d", str(dora))
    card = await engine.unload_lora("a")
    assert card.lora_adapters == ("c",)
    with pytest.raises(NotFound):
        await run(engine, PROMPTS[0], "a")
