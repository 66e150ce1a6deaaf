"""LoRA adapters for the torch engine: peft checkpoints applied per request inside one batch.

A peft LoRA directory (`adapter_config.json` + `adapter_model.safetensors` or
`adapter_model.bin`) adds, to each targeted linear layer `W` of the base model,
`y = W x + scale * B (A x)` with `A` [r, in], `B` [out, r] and `scale = lora_alpha / r`
(`lora_alpha / sqrt(r)` with rsLoRA). The base weights are never modified: each step the
model runner computes every linear layer once for the whole batch and then adds, for each
adapter present in the step, its low-rank delta to the rows of that adapter's requests
(`LoraBatch.apply`). So requests of several adapters and of the base model share a step, and
an adapter costs two thin matmuls per targeted layer for its rows only (the grouped form of
punica/S-LoRA's gather-matmul, without custom kernels).

Supported: the projections the runner drives itself (q/k/v/o_proj, gate/up/down_proj),
per-module ranks (`rank_pattern`), rsLoRA. Refused with a clear error: DoRA, trained biases,
`modules_to_save`, `alpha_pattern`, `fan_in_fan_out`, other target modules (embeddings,
lm_head), shapes that do not fit the base model.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvmesh.runtime.errors import InvalidRequest

__all__ = ["LORA_MODULES", "LoraAdapter", "LoraBatch", "load_adapter"]

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear layers an adapter may target (the ones the model runner calls itself)."""

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass(slots=True)
class LoraAdapter:
    """One loaded adapter: per (layer, module) its (A [r, in], B [out, r] * scale) on the
    model's device and dtype (the scale is folded into B)."""

    name: str
    path: Path
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() * 2 for a, _ in self.weights.values())


def _fail(path: Path, why: str) -> InvalidRequest:
    return InvalidRequest(f"LoRA adapter at {path}: {why}", param="lora_path")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = load_file(str(st))
        return tensors
    binary = path / "adapter_model.bin"
    if binary.is_file():
        loaded: Any = torch.load(binary, map_location="cpu", weights_only=True)
        return dict(loaded)
    raise _fail(path, "no adapter_model.safetensors or adapter_model.bin")


def load_adapter(
    name: str,
    path: str | Path,
    *,
    num_layers: int,
    shapes: dict[str, tuple[int, int]],
    device: torch.device,
    dtype: torch.dtype,
) -> LoraAdapter:
    """Read the peft LoRA checkpoint in `path` for a base model of `num_layers` layers whose
    module `m` has weight shape `shapes[m]` (out, in). Raises InvalidRequest (param lora_path)
    for anything missing, unsupported or not fitting the base model."""
    root = Path(path)
    try:
        config = json.loads((root / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise _fail(root, "no adapter_config.json (not a peft adapter directory)") from None
    except (OSError, ValueError) as exc:
        raise _fail(root, f"unreadable adapter_config.json ({exc})") from None
    if not isinstance(config, dict):
        raise _fail(root, "adapter_config.json is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(root, f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, why in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("alpha_pattern", "alpha_pattern"),
        ("fan_in_fan_out", "fan_in_fan_out"),
    ):
        if config.get(key):
            raise _fail(root, f"{why} is not supported")
    if config.get("bias", "none") != "none":
        raise _fail(root, "trained biases (bias != 'none') are not supported")
    try:
        alpha = float(config.get("lora_alpha", 8))
    except (TypeError, ValueError):
        raise _fail(root, "lora_alpha is not a number") from None
    rslora = bool(config.get("use_rslora", False))
    tensors = _read_tensors(root)
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _fail(root, f"weight {key!r} is not a LoRA weight of a supported module")
        layer, module, ab = int(m[1]), m[3], m[4]
        if module not in LORA_MODULES:
            raise _fail(
                root, f"target module {module!r} is not supported ({', '.join(LORA_MODULES)})"
            )
        if not 0 <= layer < num_layers:
            raise _fail(root, f"layer {layer} is out of range (the base model has {num_layers})")
        pieces.setdefault((layer, module), {})[ab] = tensor
    if not pieces:
        raise _fail(root, "no LoRA weights")
    adapter = LoraAdapter(name, root)
    for (layer, module), ab in sorted(pieces.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise _fail(root, f"layer {layer} {module} lacks lora_A or lora_B")
        out_f, in_f = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, r) or r < 1:
            raise _fail(
                root,
                f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                f"not fit the base model's ({out_f}, {in_f}) weight",
            )
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        adapter.weights[layer, module] = (
            a.to(device=device, dtype=dtype).contiguous(),
            (b.float() * scale).to(device=device, dtype=dtype).contiguous(),
        )
    return adapter


class LoraBatch:
    """Which rows of a step's packed tokens use which adapter (built once per step)."""

    __slots__ = ("_groups",)

    def __init__(
        self,
        row_adapters: Sequence[tuple[LoraAdapter, int, int]],
        device: torch.device,
    ) -> None:
        """`row_adapters`: (adapter, first row, row count) per chunk using an adapter."""
        rows: OrderedDict[int, tuple[LoraAdapter, list[int]]] = OrderedDict()
        for adapter, first, n in row_adapters:
            entry = rows.setdefault(id(adapter), (adapter, []))
            entry[1].extend(range(first, first + n))
        self._groups = [
            (adapter, torch.tensor(r, dtype=torch.long, device=device))
            for adapter, r in rows.values()
        ]

    def __bool__(self) -> bool:
        return bool(self._groups)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base layer's output for input `x`, all rows) plus each adapter's delta on
        its rows."""
        for adapter, rows in self._groups:
            ab = adapter.weights.get((layer, module))
            if ab is None:
                continue
            a, b = ab
            y = y.index_add(0, rows, (x[rows] @ a.t()) @ b.t())
        return y
