"""Speculative decoding on the torch engine: prompt-lookup (n-gram) drafting, greedy verification.

Each step, a decoding request that qualifies (greedy, no penalties, logit bias, logprobs or
pending min_tokens, not handed off to a decode worker) gets up to `num_speculative_tokens`
draft tokens: the tokens that followed the most recent earlier occurrence of its last n tokens
(n from `prompt_lookup_max` down to `prompt_lookup_min`) in its prompt and output so far, as
vLLM's `ngram` method does. The drafts ride in the request's chunk of the step as if they were
known tokens (the scheduler allocates their KV slots and counts them in the token budget); the
model runner returns the greedy token at every position of such a chunk, and the scheduler
keeps the drafts up to the first one that differs from the model's own choice, plus the model's
token after them (`accept`). So every step still emits at least one token, and the emitted
tokens are exactly the ones plain greedy decoding produces (up to float rounding between a
one-token and a multi-token forward). Rejected drafts are dropped before the step completes:
their KV slots are overwritten later and they never reach the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SpecStats", "accept", "propose_ngram"]


def propose_ngram(
    tokens: Sequence[int], k: int, min_n: int, max_n: int, window: int = 4096
) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (between `max_n` and `min_n` tokens long) within the last `window` tokens."""
    total = len(tokens)
    if k <= 0 or total < min_n + 1:
        return []
    lo = max(0, total - window)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = list(tokens[total - n :])
        first = pattern[0]
        # the latest start i < total - n with tokens[i : i + n] == pattern
        for i in range(total - n - 1, lo - 1, -1):
            if tokens[i] == first and list(tokens[i : i + n]) == pattern:
                return list(tokens[i + n : min(i + n + k, total)])
    return []


def accept(drafts: Sequence[int], greedy: Sequence[int]) -> list[int]:
    """The tokens a verified step emits: the leading drafts that equal the model's greedy token
    at their position (`greedy[i]` follows the chunk's i-th token), then the model's token
    after them. `greedy` has one more entry than `drafts`."""
    out: list[int] = []
    for d, g in zip(drafts, greedy, strict=False):
        if d != g:
            break
        out.append(d)
    out.append(greedy[len(out)])
    return out


@dataclass(slots=True)
class SpecStats:
    """Counters of speculative decoding (monotonic)."""

    steps: int = 0
    """Verification chunks run (one per drafting request per step)."""
    draft_tokens: int = 0
    """Draft tokens proposed and verified."""
    accepted_tokens: int = 0
    """Draft tokens the model agreed with."""
    emitted_tokens: int = 0
    """Tokens the verification chunks produced (accepted drafts + one model token each)."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a drafting request gets from one step (1.0 without speculation)."""
        return self.emitted_tokens / self.steps if self.steps else 0.0
