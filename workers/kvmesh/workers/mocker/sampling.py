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

from kvmesh.runtime.types import TokenLogprob

__all__ = ["TokenSampler", "splitmix64"]

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_LOGPROB_SALT = 0xD1B54A32D192ED03
_LN2 = math.log(2.0)


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
        """Synthetic logprob of `token` plus `top` alternatives (the chosen one among them).

        Alternative i has logprob -0.8 - ln(2) * i - 0.2 * jitter (jitter in [0, 1)): strictly
        descending, probabilities summing below 0.9. The chosen token is the most likely one for
        greedy requests and a deterministic pick among the top ones otherwise.
        """
        x = splitmix64(key ^ ((position * _LOGPROB_SALT) & _M))
        k = min(top, self.vocab_size - len(self.excluded))
        values: list[float] = []
        bits = 0
        for i in range(max(k, 1)):
            if i % 4 == 0:
                x = splitmix64(x)
                bits = x
            values.append(-0.8 - _LN2 * i - 0.2 * ((bits & 0xFFFF) / 65536.0))
            bits >>= 16
        rank = 0 if greedy or k <= 1 else splitmix64(x) % k
        if k == 0:
            return TokenLogprob(token, values[0], [])
        ids: list[int] = []
        seen = {token}
        excluded = self.excluded
        vocab = self.vocab_size
        while len(ids) < k - 1:
            x = splitmix64(x)
            t = x % vocab
            if t in seen or t in excluded:
                continue
            seen.add(t)
            ids.append(t)
        ids.insert(rank, token)
        return TokenLogprob(token, values[rank], list(zip(ids, values, strict=True)))
