"""Router block hashes: chained 64-bit hashes of full `block_size`-token blocks.

The router hashes token ids itself, on the request side (a prompt) and on the event side (the
token ids a worker's KV event carries), with the same function, so its index never depends on
how an engine hashes blocks.

Definition (stable across processes, machines and Python versions; never Python's `hash()`):

    root(lora)      = xxh3_64(b"kvmesh-kv-root\\0" + utf8(lora_name))
    hash(block 0)   = xxh3_64(tokens_0 as little-endian uint32, seed=root(lora))
    hash(block i)   = xxh3_64(tokens_i as little-endian uint32, seed=hash(block i-1))

So a block's hash covers every token before it and the LoRA adapter name: equal hashes mean
equal prefixes (up to 64-bit collisions), and the parent of a block is implied by its hash.
Only full blocks are hashed; a trailing partial block is ignored. Token ids must fit uint32
(the wire type); others raise ValueError.

Cost: one `array('I', tokens)` conversion (about 5 ns per token, most of the time) plus one xxh3
call per block (about 0.1 us for 64 tokens): a 100k-token prompt hashes in about 1 ms
(tests/benchmarks/bench_indexer.py), a few percent of what tokenizing it costs.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from itertools import chain

from xxhash import xxh3_64_intdigest

__all__ = ["BlockHasher", "block_hashes", "chain_hashes", "root_seed"]

_BIG_ENDIAN = sys.byteorder == "big"
_ROOT_TAG = b"kvmesh-kv-root\0"
_roots: dict[str, int] = {}


def root_seed(lora_name: str = "") -> int:
    """The seed of a chain's first block: salts every hash of the chain by the adapter name."""
    seed = _roots.get(lora_name)
    if seed is None:
        seed = xxh3_64_intdigest(_ROOT_TAG + lora_name.encode())
        if len(_roots) < 4096:  # adapters are few; never grow without bound
            _roots[lora_name] = seed
    return seed


def _as_bytes(tokens: Iterable[int]) -> bytes:
    try:
        arr = array("I", tokens)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32)") from None
    except TypeError:
        raise ValueError("token ids must be integers") from None
    if _BIG_ENDIAN:  # pragma: no cover - hashes must not depend on the machine
        arr.byteswap()
    return arr.tobytes()


def block_hashes(
    tokens: Sequence[int], block_size: int, lora_name: str = "", *, limit: int | None = None
) -> list[int]:
    """Hashes of the full blocks of `tokens` (len(tokens) // block_size of them), in order.

    `limit`: hash at most this many leading blocks (None: all).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, max(0, limit))
    if n == 0:
        return []
    data = _as_bytes(tokens[: n * block_size] if len(tokens) != n * block_size else tokens)
    step = block_size * 4
    h = root_seed(lora_name)
    return [h := xxh3_64_intdigest(data[i : i + step], h) for i in range(0, n * step, step)]


def chain_hashes(
    parent: int | None, blocks: Sequence[Sequence[int]], block_size: int, lora_name: str = ""
) -> list[int]:
    """Hashes of a chain of full blocks that follows the block hashed `parent` (None: the chain
    starts at the root, salted by `lora_name`). The event-side twin of `block_hashes`:
    `chain_hashes(None, [t[0:bs], t[bs:2bs], ...], bs)` == `block_hashes(t, bs)`.

    Raises ValueError when a block does not hold exactly `block_size` tokens.
    """
    if not blocks:
        return []
    for b in blocks:
        if len(b) != block_size:
            raise ValueError(f"a block holds {len(b)} tokens, expected {block_size}")
    data = _as_bytes(list(chain.from_iterable(blocks)))  # array() is fastest from a list
    step = block_size * 4
    h = root_seed(lora_name) if parent is None else parent
    return [h := xxh3_64_intdigest(data[i : i + step], h) for i in range(0, len(data), step)]


class BlockHasher:
    """`block_hashes` with a fixed block size (what a router keeps per model)."""

    __slots__ = ("block_size",)

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size

    def __call__(self, tokens: Sequence[int], lora_name: str = "") -> list[int]:
        """Hashes of the full blocks of `tokens`."""
        return block_hashes(tokens, self.block_size, lora_name)
