"""Turning one step's logits into tokens: logits processors, greedy/random sampling, logprobs.

Per row, in this order (vLLM's semantics):
  1. logprobs, if asked for, are the model's raw ones: log_softmax of the unprocessed logits
     (vLLM's default `raw_logprobs`); the chosen token and its `top_logprobs` best alternatives;
  2. guided rows (structured output, kvmesh.workers.pytorch.guided): tokens the row's grammar
     does not allow next are masked out, for all guided rows of the batch at once; other rows
     are not touched. Then `logit_bias` is added;
  3. while fewer than `min_tokens` tokens were generated, the stop token ids (EOS unless
     ignore_eos, plus stop_token_ids) are masked out (on a guided row, unless its grammar is
     complete and allows nothing else: the grammar wins);
  4. `repetition_penalty` over every token of the sequence (prompt and output): positive logits
     are divided by it, negative ones multiplied (as in transformers and vLLM);
     `frequency_penalty` * count and `presence_penalty` * (count > 0) over the output tokens are
     subtracted (OpenAI);
  5. temperature 0: argmax (the first maximal id, as torch.argmax and transformers' greedy
     search). Otherwise: divide by the temperature, keep the `top_k` best, keep the smallest set
     whose probability reaches `top_p`, drop tokens below `min_p` times the best probability,
     and draw from the renormalised distribution with the request's own torch.Generator (seeded
     once per request, so a seeded request is reproducible whatever else runs in the batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvmesh.runtime.types import SamplingParams, TokenLogprob
from kvmesh.workers.pytorch.guided import GrammarState, apply_grammars

__all__ = ["SampleSpec", "Sampled", "sample"]


@dataclass(slots=True)
class SampleSpec:
    """What the sampler needs to know about one row's request."""

    params: SamplingParams
    tokens: Sequence[int]
    """The whole sequence so far (prompt, then output); read, never modified."""
    prompt_len: int
    generator: torch.Generator | None = None
    """None for greedy requests."""
    suppress: tuple[int, ...] = ()
    """Token ids masked out in this step (stop ids before min_tokens is reached)."""
    logit_bias_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    grammar: GrammarState | None = None
    """The request's structured-output state, advanced to `tokens` (None: unconstrained)."""


@dataclass(slots=True)
class Sampled:
    """The token chosen for one row, with its logprobs when they were asked for."""

    token_id: int
    logprob: TokenLogprob | None = None


def _needs_processing(p: SamplingParams, spec: SampleSpec) -> bool:
    """Whether steps 2-4 change anything but the grammar mask (applied to the batch at once)."""
    return bool(
        spec.logit_bias_ids
        or spec.suppress
        or p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
    )


def _process_row(row: torch.Tensor, spec: SampleSpec) -> None:
    """Steps 2 (after the grammar mask) to 4 of the module docstring, in place on one row of
    float32 logits."""
    p = spec.params
    device = row.device
    vocab = row.shape[0]
    if spec.logit_bias_ids:
        ids = torch.tensor(spec.logit_bias_ids, device=device)
        row.index_add_(0, ids, torch.tensor(spec.logit_bias_values, device=device))
    if spec.suppress:
        ids = torch.tensor(spec.suppress, device=device)
        kept = row[ids] if spec.grammar is not None else None
        row[ids] = float("-inf")
        if kept is not None and not bool(torch.isfinite(row).any()):
            row[ids] = kept  # the grammar is complete and allows only a stop token
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(spec.tokens)), device=device)
        scores = row[seen]
        rp = p.repetition_penalty
        row[seen] = torch.where(scores > 0, scores / rp, scores * rp)
    if (p.frequency_penalty or p.presence_penalty) and len(spec.tokens) > spec.prompt_len:
        out = torch.tensor(list(spec.tokens[spec.prompt_len :]), device=device)
        counts = torch.bincount(out, minlength=vocab).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """Step 5 for one sampled (temperature > 0) row."""
    logits = row / p.temperature
    vocab = logits.shape[0]
    if 0 < p.top_k < vocab:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first stays).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> list[Sampled]:
    """One token per row of `logits` ([rows, vocab] float32; modified in place)."""
    raw: torch.Tensor | None = None
    if any(s.params.top_logprobs is not None for s in specs):
        raw = torch.log_softmax(logits, dim=-1)
    greedy_rows: list[int] = []
    chosen: list[int] = [0] * len(specs)
    guided = [(i, s.grammar) for i, s in enumerate(specs) if s.grammar is not None]
    if guided:
        apply_grammars(logits, guided)
    for i, spec in enumerate(specs):
        p = spec.params
        if _needs_processing(p, spec):
            _process_row(logits[i], spec)
        if p.temperature == 0.0:
            greedy_rows.append(i)
        else:
            chosen[i] = _draw(logits[i], p, spec.generator)
    if greedy_rows:
        if len(greedy_rows) == len(specs):
            picks = torch.argmax(logits, dim=-1).tolist()
        else:
            picks = torch.argmax(logits[greedy_rows], dim=-1).tolist()
        for i, t in zip(greedy_rows, picks, strict=True):
            chosen[i] = int(t)
    out: list[Sampled] = []
    for i, spec in enumerate(specs):
        k = spec.params.top_logprobs
        if k is None or raw is None:
            out.append(Sampled(chosen[i]))
            continue
        row = raw[i]
        token = chosen[i]
        top: list[tuple[int, float]] = []
        if k > 0:
            values, ids = torch.topk(row, k)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(Sampled(token, TokenLogprob(token, float(row[token].item()), top)))
    return out
