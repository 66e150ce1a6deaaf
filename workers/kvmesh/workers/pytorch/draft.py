"""Speculative decoding with a draft model (`--torch-draft-model`) on the torch engine.

A smaller model with the main model's vocabulary proposes the draft tokens; the main model
verifies them exactly as prompt-lookup drafts are verified (kvmesh.workers.pytorch.speculative:
the scheduler keeps the leading drafts equal to the main model's greedy tokens, plus the main
model's token after them), so greedy output is plain greedy decoding's whatever the draft says.

The draft model has its own paged KV cache with the main cache's block count and block size,
addressed by the same block tables: both models cache the same token positions, so a sequence's
blocks hold its KV in both caches, prefix-cache hits and eviction included. Every step the draft
model runs over every chunk's known tokens (prefill chunks, decodes, the last known token of a
drafting chunk), which keeps its cache in step with the main one; then it proposes the drafts
of the drafting chunks autoregressively, one batched single-token forward per draft after the
first, writing them into the chunks' placeholder positions (the scheduler reserved the slots and
the token budget). Rejected drafts are rolled back as in the main cache: their slots lie past
the sequence's computed length and are overwritten by the next step. When the main model
accepts all k drafts, the draft model has not yet cached the last one; the scheduler passes it
as the chunk's `draft_prefix` the next step. KV moved in from elsewhere (KV tiers, a remote
prefill) carries no draft-model KV: the draft then sees zeros there, which lowers acceptance
but cannot change the output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from kvmesh.workers.pytorch.kv_cache import PagedKvCache
from kvmesh.workers.pytorch.model_runner import LoadedModel, ModelRunner, SeqChunk

__all__ = ["DraftModel", "check_draft_vocab"]


def _tokenizer_vocab(path: Path) -> dict[str, int] | None:
    """The token -> id map of a directory's tokenizer.json (None: none readable)."""
    try:
        data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return vocab if isinstance(vocab, dict) else None


def check_draft_vocab(main: LoadedModel, draft: LoadedModel) -> None:
    """Raise ValueError unless `draft` can draft for `main`: the same vocabulary size and, when
    both directories have a tokenizer.json, the same tokens."""
    if draft.vocab_size != main.vocab_size:
        raise ValueError(
            f"the draft model {draft.path} has a vocabulary of {draft.vocab_size} tokens, the "
            f"model {main.path} {main.vocab_size}: a draft model must share the tokenizer"
        )
    if draft.image_token_id is not None:
        raise ValueError(f"the draft model {draft.path} must be a text-only model")
    ours, theirs = _tokenizer_vocab(main.path), _tokenizer_vocab(draft.path)
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(
            f"the draft model {draft.path} has another tokenizer than the model {main.path}: "
            "a draft model must share the tokenizer"
        )


class DraftModel:
    """The draft model's runner over its own KV cache of `num_blocks` blocks of `block_size`
    tokens (see the module docstring). Used on the engine's forward thread only."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int) -> None:
        with torch.inference_mode():
            cache = PagedKvCache(loaded.kv_spec(block_size), num_blocks, loaded.device)
        self.runner = ModelRunner(loaded, cache)

    def propose(self, chunks: Sequence[SeqChunk]) -> None:
        """Bring the draft cache up to the chunks' known tokens and write the drafts into the
        `verify` chunks' token ids (positions 1..k, placeholders until now)."""
        first = []
        for c in chunks:
            known = c.token_ids[:1] if c.verify else c.token_ids
            tokens = c.draft_prefix + known
            first.append(
                SeqChunk(tokens, c.start - len(c.draft_prefix), c.block_table, verify=c.verify)
            )
        self.runner.execute(first)
        drafting = [(c, d) for c, d in zip(chunks, first, strict=True) if c.verify]
        for c, d in drafting:
            assert d.greedy is not None
            c.token_ids[1] = d.greedy[-1]
        j = 2  # the next draft to propose: the one after token_ids[j - 1]
        while True:
            active = [c for c, _ in drafting if len(c.token_ids) > j]
            if not active:
                return
            step = [
                SeqChunk([c.token_ids[j - 1]], c.start + j - 1, c.block_table, verify=True)
                for c in active
            ]
            self.runner.execute(step)
            for c, d in zip(active, step, strict=True):
                assert d.greedy is not None
                c.token_ids[j] = d.greedy[0]
            j += 1
