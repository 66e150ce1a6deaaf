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

Adaptive drafting (`DraftGate`, one per request): a request whose drafts the model rejected
(acceptance below `spec_min_acceptance` over its last `GATE_WINDOW` verified steps) stops
drafting for `spec_backoff_steps` decode steps, doubled at each consecutive failure up to
`GATE_MAX_BACKOFF` times; then it drafts again and is judged afresh, so a request that turns
repetitive later still gains. Skipping never changes the output, only which steps verify drafts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["GATE_MAX_BACKOFF", "GATE_WINDOW", "DraftGate", "SpecStats", "accept", "propose_ngram"]

GATE_WINDOW = 4
"""Verified steps a request's acceptance is judged over (see DraftGate)."""
GATE_MAX_BACKOFF = 8
"""The longest back-off, in multiples of the configured one."""


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
class DraftGate:
    """Whether one request drafts this step, from its recent acceptance (see the module
    docstring). `min_acceptance` 0 never skips."""

    min_acceptance: float
    backoff_steps: int
    window: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=GATE_WINDOW))
    """(drafted, accepted) of the request's last verified steps."""
    skip: int = 0
    """Decode steps left to run without drafts."""
    backoff: int = 0
    """The back-off the next failure starts from (0: none failed in a row)."""

    def allow(self) -> bool:
        """Called once per step the request could draft: False while it backs off."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        """The outcome of one verified step."""
        window = self.window
        window.append((drafted, accepted))
        if len(window) < GATE_WINDOW:
            return
        total = sum(d for d, _ in window)
        if sum(a for _, a in window) >= self.min_acceptance * total:
            self.backoff = 0
            return
        base = self.backoff_steps
        self.backoff = min(2 * self.backoff, GATE_MAX_BACKOFF * base) if self.backoff else base
        self.skip = self.backoff
        window.clear()


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
    skipped_steps: int = 0
    """Decode steps a request that could draft did not, backing off after low acceptance."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a drafting request gets from one step (1.0 without speculation)."""
        return self.emitted_tokens / self.steps if self.steps else 0.0
