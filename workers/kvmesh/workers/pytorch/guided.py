"""Structured output for the torch engine: grammar-constrained sampling with llguidance.

`GrammarCompiler` is built once per engine from the model directory's tokenizer (any Hugging
Face fast tokenizer: the tiny byte-level BPE here, Llama / Qwen / Mistral ones alike) and turns
a request's `GuidedDecoding` (JSON Schema, any JSON object, regex, EBNF/GBNF or Lark grammar,
choice) into a `GrammarState`: that request's matcher, which knows which tokens may come next.
A schema or grammar llguidance cannot compile (or a JSON Schema keyword it does not implement)
is refused when the request is added, never ignored.

Per step, the sampler (kvmesh.workers.pytorch.sampler) calls `apply_grammars` once for the
batch: each guided row's matcher fills its row of one int32 bitmask, and tokens outside the
grammar get -inf on those rows only. Once a token is chosen, the scheduler advances the row's
matcher past it before the next step (`GrammarState.advance`). Rows without a constraint are not
touched, so the mask never serializes the batch and a batch without guided rows runs as before.

The grammar ends where the request stops: when the matcher may end, the row allows the
request's stop ids (EOS unless ignore_eos, plus stop_token_ids) instead of the tokenizer's EOS.

Why llguidance (measured against xgrammar 0.2.8 on this CPU, tiny tokenizer, 8 guided rows per
step; tests/benchmarks/bench_guided.py): both fill a row's mask in well under a millisecond
(~0.05-0.5 ms at 4k-32k vocabularies) and compile a schema in ~1 ms (xgrammar 20-140 ms on a
first compile), but xgrammar 0.2.8 lets a `maxLength` string contain raw control characters
(its generated grammar is `[^"\\\r\n]`), so its output did not always parse; llguidance's did.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.types import GuidedDecoding, GuidedKind

__all__ = ["GrammarCompiler", "GrammarState", "apply_grammars"]

_BITS = torch.arange(32, dtype=torch.int32)


def _set_bit(words: torch.Tensor, token: int, on: bool) -> None:
    """Set or clear bit `token` of a 1-D int32 bitmask (bit t of word t // 32, LSB first)."""
    index, bit = divmod(token, 32)
    if index >= words.shape[0]:
        return
    word = int(words[index].item()) & 0xFFFFFFFF
    word = word | (1 << bit) if on else word & ~(1 << bit)
    words[index] = word - (1 << 32) if word >= 1 << 31 else word


class GrammarState:
    """One request's position in its grammar. Used by one thread at a time: the scheduler
    advances it (event loop) before the step that samples, the sampler fills its mask (executor
    thread) during that step."""

    __slots__ = ("_eos", "_matcher", "_stop", "consumed", "ended")

    def __init__(self, matcher: Any, eos: Sequence[int], stop: Sequence[int]) -> None:
        self._matcher = matcher
        self._eos = tuple(eos)
        self._stop = tuple(stop)
        self.consumed = 0
        """How many output tokens were accepted."""
        self.ended = False
        """A stop token was accepted (only min_tokens makes a request go on after one)."""

    def advance(self, output: Sequence[int]) -> bool:
        """Accept the output tokens not accepted yet (`output`: every output token so far, e.g.
        the first token a prefill worker sampled, then this engine's). False, and the matcher
        stays before it, if one is outside the grammar (only a token this engine did not
        sample under the grammar can be)."""
        for token in output[self.consumed :]:
            if token in self._stop and (self.ended or self._matcher.is_accepting()):
                self.ended = True
            elif self.ended or not self._matcher.consume_token(token):
                return False
            self.consumed += 1
        return True

    def fill(self, words: torch.Tensor) -> None:
        """Write the allowed next tokens into the 1-D int32 bitmask `words` (a contiguous CPU
        tensor): the grammar's tokens, with the request's stop ids in place of the tokenizer's
        EOS once the grammar may end."""
        accepting = self.ended or self._matcher.is_accepting()
        if self.ended:
            words.zero_()
        else:
            self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        for token in self._eos:
            _set_bit(words, token, False)
        if accepting:
            for token in self._stop:
                _set_bit(words, token, True)


class GrammarCompiler:
    """Builds `GrammarState`s for one tokenizer (see the module docstring).

    `vocab_size` is the model's logits width (it may exceed the tokenizer's: padded embedding
    rows are never allowed).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._eos = tuple(self._tokenizer.eos_tokens)

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int) -> GrammarCompiler:
        """For the tokenizer of a Hugging Face model directory."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)), vocab_size)

    def grammar(self, guided: GuidedDecoding) -> str:
        """llguidance's grammar for `guided` (not compiled yet)."""
        m = self._ll.LLMatcher
        kind = guided.kind
        try:
            if kind is GuidedKind.JSON_SCHEMA:
                return str(
                    m.grammar_from_json_schema(
                        guided.value, defaults={"whitespace_flexible": False}
                    )
                )
            if kind is GuidedKind.JSON_OBJECT:
                return str(
                    m.grammar_from_json_schema(
                        '{"type": "object"}', defaults={"whitespace_flexible": False}
                    )
                )
            if kind is GuidedKind.REGEX:
                return str(m.grammar_from_regex(guided.value))
            if kind is GuidedKind.GRAMMAR:
                return str(self._ll.grammar_from("grammar", guided.value))
        except ValueError as exc:
            raise InvalidRequest(
                f"invalid {kind.value} constraint: {exc}", param="response_format"
            ) from exc
        if not guided.choices:
            raise InvalidRequest("guided choice needs at least one choice", param="guided_choice")
        lark = "start: " + " | ".join(json.dumps(choice) for choice in guided.choices)
        return str(m.grammar_from_lark(lark))

    def state(self, guided: GuidedDecoding, stop_token_ids: Sequence[int]) -> GrammarState:
        """A fresh matcher for `guided` that ends on `stop_token_ids` (not empty); InvalidRequest
        (naming `response_format`) when the constraint cannot be compiled."""
        if not stop_token_ids:
            raise InvalidRequest(
                "guided decoding needs a stop token: ignore_eos without stop_token_ids would "
                "leave a completed grammar nothing to generate",
                param="ignore_eos",
            )
        matcher = self._ll.LLMatcher(self._tokenizer, self.grammar(guided), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"cannot compile the {guided.kind.value} constraint: {matcher.get_error()}",
                param="response_format",
            )
        return GrammarState(matcher, self._eos, stop_token_ids)


def apply_grammars(logits: torch.Tensor, rows: Sequence[tuple[int, GrammarState]]) -> None:
    """Set the logits of tokens outside each listed row's grammar to -inf (in place); rows not
    listed are left as they are. `rows`: (row of `logits`, that row's grammar state)."""
    vocab = logits.shape[1]
    words = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
    for k, (_, state) in enumerate(rows):
        state.fill(words[k])
    allowed = ((words.unsqueeze(-1) >> _BITS) & 1).view(len(rows), -1)[:, :vocab]
    index = torch.tensor([row for row, _ in rows], device=logits.device)
    picked = logits.index_select(0, index)
    picked.masked_fill_(allowed.to(logits.device) == 0, float("-inf"))
    logits.index_copy_(0, index, picked)
