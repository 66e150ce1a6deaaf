"""Speculative decoding with a draft model (`--torch-draft-model`) on the torch engine.

A smaller model with the main model's vocabulary proposes the draft tokens; the main model
verifies them exactly as prompt-lookup drafts are verified (kvmesh.workers.pytorch.speculative:
the scheduler keeps the leading drafts equal to the main model's greedy tokens, plus the main
model's token after them), so greedy output is plain greedy decoding's whatever the draft says.

The draft model has its own paged KV cache with the main cache's block count and block size,
addressed by the same block tables: both models cache the same token positions in the same
slots. The draft model runs only for the chunks that draft this step (requests that do not
qualify, or back off, cost it nothing): the scheduler tracks per request how many leading
positions the draft cache holds (`draft_len`) and hands a drafting chunk the known tokens after
them (`SeqChunk.draft_prefix`: the whole prompt the first time, as a draft-model prefill; then
usually nothing, or the last draft when the main model accepted all of them, or what was
decoded while the request backed off). One batched forward computes those plus the chunk's last
known token and gives the first draft; each further draft is one batched single-token forward,
written into the chunk's placeholder positions (the scheduler reserved the slots and the token
budget). Rejected drafts are rolled back as in the main cache: `draft_len` is cut back to the
main model's computed length before each step, so their slots are overwritten. A preempted
request starts over at 0 (its blocks may come back from the prefix cache, where the draft cache
of a shared block holds what the draft model computed for those same tokens, if anything). The
draft cache's contents only steer acceptance: the output is the main model's whatever the draft
model proposes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from kvmesh.runtime.types import SamplingParams
from kvmesh.workers.pytorch.kv_cache import PagedKvCache
from kvmesh.workers.pytorch.model_runner import LoadedModel, ModelRunner, SeqChunk
from kvmesh.workers.pytorch.sampler import SampleSpec

__all__ = ["DraftModel", "check_draft_vocab"]

_GREEDY = SampleSpec(SamplingParams(temperature=0.0), (), 0)
"""The draft model's sampling: its argmax after a chunk's last token."""


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
        """Write the drafts into the `verify` chunks' token ids (positions 1..k, placeholders
        until now), computing the draft KV of their `draft_prefix` first."""
        drafting = [c for c in chunks if c.verify]
        if not drafting:
            return
        first = [
            SeqChunk(
                c.draft_prefix + c.token_ids[:1],
                c.start - len(c.draft_prefix),
                c.block_table,
                _GREEDY,
            )
            for c in drafting
        ]
        for c, t in zip(drafting, self.runner.execute(first), strict=True):
            c.token_ids[1] = t.token_id
        j = 2  # the next draft to propose: the one after token_ids[j - 1]
        while True:
            active = [c for c in drafting if len(c.token_ids) > j]
            if not active:
                return
            step = [
                SeqChunk([c.token_ids[j - 1]], c.start + j - 1, c.block_table, _GREEDY)
                for c in active
            ]
            for c, t in zip(active, self.runner.execute(step), strict=True):
                c.token_ids[j] = t.token_id
            j += 1
