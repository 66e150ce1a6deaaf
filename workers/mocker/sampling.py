"""Deterministic fake sampling: output tokens (and logprobs) as pure functions of the request.

A request gets a 64-bit stream key once: blake2b of its prompt (greedy requests), or of its seed
and prompt (sampled requests; an unseeded request gets a seed drawn by the scheduler). The token at
sequence position p is then splitmix64(key + p * golden) reduced to the vocabulary, re-mixed
until it is not a special/EOS id. So the same request produces the same tokens in every process,
and a preempted request that recomputes produces exactly the tokens it produced before.

Logprobs are synthetic: plausible-looking, deterministic, descending, normalised to sum below 1,
with the chosen token among the top alternatives. They carry no information about any model.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterable, Sequence
from hashlib import blake2b

from ..engine import TokenLogprob

__all__ = ["TokenSampler", "splitmix64"]

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_LOGPROB_SALT = 0xD1B54A32D192ED03


def splitmix64(x: int) -> int:
    """One splitmix64 output for state `x` (64-bit)."""
    z = (x + _GOLDEN) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


class TokenSampler:
    """Maps (stream key, position) to a token id in [0, vocab_size) outside `excluded`."""

    __slots__ = ("excluded", "vocab_size")

    def __init__(self, vocab_size: int, excluded: Iterable[int] = ()) -> None:
        if vocab_size < 1:
            raise ValueError("vocab_size must be >= 1")
        self.vocab_size = vocab_size
        self.excluded = frozenset(t for t in excluded if 0 <= t < vocab_size)
        if len(self.excluded) >= vocab_size:
            raise ValueError("every token id is special: nothing left to generate")

    @staticmethod
    def stream_key(prompt: Sequence[int], seed: int | None) -> int:
        """The request's stream key: greedy (seed None) depends on the prompt only."""
        h = blake2b(digest_size=8)
        if seed is None:
            h.update(b"G")
        else:
            h.update(b"S")
            h.update((seed & _M).to_bytes(8, "little"))
        tok = array("q", prompt)
        if sys.byteorder == "big":  # pragma: no cover
            tok.byteswap()
        h.update(tok.tobytes())
        return int.from_bytes(h.digest(), "little")

    def token(self, key: int, position: int) -> int:
        """The token at sequence `position` of the stream `key`."""
        z = (key + position * _GOLDEN) & _M
        while True:
            z = (z + _GOLDEN) & _M
            x = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M
            t = (x ^ (x >> 31)) % self.vocab_size
            if t not in self.excluded:
                return t

    def logprob(self, key: int, position: int, token: int, top: int, greedy: bool) -> TokenLogprob:
        """Synthetic logprob of `token` plus `top` alternatives (the chosen one among them)."""
        x = splitmix64(key ^ ((position * _LOGPROB_SALT) & _M))
        allowed = self.vocab_size - len(self.excluded)
        k = min(top, allowed)
        # Descending probabilities: p_i = 0.45 * 0.5**i * (1 - 0.2 * jitter_i), sum < 0.9.
        probs: list[float] = []
        for i in range(max(k, 1)):
            x = splitmix64(x)
            probs.append(0.45 * 0.5**i * (1.0 - 0.2 * ((x >> 11) / 9007199254740992.0)))
        rank = 0 if greedy or k <= 1 else x % k
        chosen_lp = math.log(probs[rank])
        if k == 0:
            return TokenLogprob(token, chosen_lp, [])
        ids: list[int] = []
        seen = {token}
        while len(ids) < k - 1:
            x = splitmix64(x)
            t = x % self.vocab_size
            if t in seen or t in self.excluded:
                continue
            seen.add(t)
            ids.append(t)
        ids.insert(rank, token)
        return TokenLogprob(
            token, chosen_lp, [(t, math.log(p)) for t, p in zip(ids, probs, strict=True)]
        )
