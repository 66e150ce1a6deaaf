"""Facts about a local Hugging Face model directory, read from its JSON files only.

Workers need the vocabulary size, special and EOS token ids and the context length; reading
them must not import transformers or load weights (the mocker has none).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.runtime.errors import InvalidRequest

DEFAULT_CONTEXT_LENGTH = 8192


@dataclass(frozen=True, slots=True)
class ModelDirInfo:
    """What kvmesh reads from a model directory."""

    path: Path
    name: str
    """Directory name; the default served model name."""
    vocab_size: int
    special_token_ids: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    context_length: int

    @classmethod
    def load(cls, path: str | Path) -> ModelDirInfo:
        """Read config.json, generation_config.json and tokenizer.json/tokenizer_config.json."""
        root = Path(path).expanduser().resolve()
        if not root.is_dir():
            raise InvalidRequest(f"model directory {root} does not exist")
        config = _json(root / "config.json")
        gen = _json(root / "generation_config.json")
        tok = _json(root / "tokenizer.json")
        tok_cfg = _json(root / "tokenizer_config.json")
        if not config and not tok:
            raise InvalidRequest(f"{root} has neither config.json nor tokenizer.json")

        added = tok.get("added_tokens", []) if isinstance(tok.get("added_tokens"), list) else []
        specials = tuple(sorted(int(t["id"]) for t in added if t.get("special")))
        vocab = int(config.get("vocab_size") or 0)
        if not vocab:
            model_vocab = tok.get("model", {}).get("vocab", {})
            ids = [int(v) for v in (model_vocab.values() if isinstance(model_vocab, dict) else [])]
            ids += [int(t["id"]) for t in added]
            vocab = max(ids, default=-1) + 1
        eos = _ids(gen.get("eos_token_id")) or _ids(config.get("eos_token_id"))
        if not eos:
            eos_text = tok_cfg.get("eos_token")
            if isinstance(eos_text, dict):
                eos_text = eos_text.get("content")
            eos = tuple(int(t["id"]) for t in added if t.get("content") == eos_text)
        context = int(
            config.get("max_position_embeddings")
            or config.get("max_sequence_length")
            or _reasonable(tok_cfg.get("model_max_length"))
            or DEFAULT_CONTEXT_LENGTH
        )
        return cls(root, root.name, vocab, specials, eos, context)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value if isinstance(v, int))
    return ()


def _reasonable(value: Any) -> int | None:
    # tokenizer_config's model_max_length is often a huge sentinel (1e30) meaning "unknown".
    return int(value) if isinstance(value, (int, float)) and 0 < value < 10_000_000 else None


def default_model_dir() -> Path:
    """Where the built-in tiny model lives: $KVMESH_HOME/models/tiny-llama (~/.cache/kvmesh)."""
    home = Path(os.environ.get("KVMESH_HOME") or Path.home() / ".cache" / "kvmesh")
    return home / "models" / "tiny-llama"


def resolve_model_dir(model: str) -> Path:
    """The model directory to use: `model` if given, else the tiny model (created offline)."""
    if model:
        return Path(model).expanduser().resolve()
    from kvmesh.runtime.tinymodel import create_tiny_model  # only when no model was given

    return create_tiny_model(default_model_dir())
