"""Embeddings with the torch engine's model: pooled, optionally normalized final hidden states.

The vector of a prompt is computed by the model's own decoder stack (transformers' base model,
`model.model`, with its final norm), one prompt at a time (no padding, so a vector does not
depend on the other prompts of the batch), without the KV cache: it is what transformers
computes for that prompt, pooled by the configured method:

- MEAN: the mean over the prompt's tokens; LAST: the last token's state; CLS: the first's;
- AUTO: the model directory's sentence-transformers pooling config (`modules.json` naming a
  Pooling module, whose `config.json` sets `pooling_mode_mean_tokens` / `_cls_token` /
  `_lasttoken`), else LAST (what decoder embedding models use).

Normalization (unit L2 length): AUTO follows `modules.json` (a Normalize module), and
normalizes when the model has no sentence-transformers config. The caller truncates to fewer
`dimensions` (the gateway re-normalizes then).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvmesh.runtime.errors import InvalidRequest
from kvmesh.workers.pytorch.config import EmbeddingNormalize, Pooling

__all__ = ["EmbeddingHead", "embed_prompts"]

log = logging.getLogger(__name__)

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_MODES = (
    ("pooling_mode_lasttoken", Pooling.LAST),
    ("pooling_mode_cls_token", Pooling.CLS),
    ("pooling_mode_mean_tokens", Pooling.MEAN),
)


@dataclass(frozen=True, slots=True)
class EmbeddingHead:
    """How hidden states become an embedding vector."""

    pooling: Pooling
    """MEAN, LAST or CLS (never AUTO)."""
    normalize: bool

    @classmethod
    def resolve(
        cls, model_dir: Path, pooling: Pooling, normalize: EmbeddingNormalize
    ) -> EmbeddingHead:
        """The head for a model directory and the engine's settings (AUTO read from the
        directory's sentence-transformers config)."""
        modules = _modules(model_dir)
        if pooling is Pooling.AUTO:
            pooling = Pooling.LAST
            for module in modules:
                if module.get("type") == _ST_POOLING:
                    pooling = _pooling_config(model_dir / str(module.get("path", "")))
        if normalize is EmbeddingNormalize.AUTO:
            norm = not modules or any(m.get("type") == _ST_NORMALIZE for m in modules)
        else:
            norm = normalize is EmbeddingNormalize.YES
        return cls(pooling, norm)


def _modules(model_dir: Path) -> list[dict[str, Any]]:
    path = model_dir / "modules.json"
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return []
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def _pooling_config(directory: Path) -> Pooling:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        log.warning("no pooling config in %s (%s): last-token pooling", directory, exc)
        return Pooling.LAST
    for key, mode in _MODES:
        if config.get(key):
            return mode
    log.warning("pooling config in %s names no supported mode: last-token pooling", directory)
    return Pooling.LAST


@torch.inference_mode()
def embed_prompts(
    model: Any, head: EmbeddingHead, prompts: list[list[int]], device: torch.device, vocab: int
) -> list[list[float]]:
    """One vector per prompt: `model` is a transformers causal LM (its `.model` is run)."""
    out: list[list[float]] = []
    for i, ids in enumerate(prompts):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"input {i}: token id {bad} is out of the vocabulary ({vocab})")
        tokens = torch.tensor([ids], dtype=torch.long, device=device)
        hidden = model.model(input_ids=tokens).last_hidden_state[0].float()  # [T, hidden]
        if head.pooling is Pooling.MEAN:
            vector = hidden.mean(dim=0)
        elif head.pooling is Pooling.CLS:
            vector = hidden[0]
        else:
            vector = hidden[-1]
        if head.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        out.append(vector.cpu().tolist())
    return out
