"""Engine KV cache events -> the worker's KvEventLog, with the engine's own block hashes.

Every engine names a cached block by its own hash (vLLM: sha256 bytes or their low 64 bits;
SGLang: a signed 64-bit int; TensorRT-LLM: an unsigned 64-bit int). kvmesh events carry that
hash (as an unsigned 64-bit int), the block's token ids and the parent's hash; the router
re-hashes the tokens itself (kvmesh.router.kv_state), so the engine's hash function never
matters, only that store and remove events name a block the same way.

What the translator adds on top of a one-to-one mapping:
  * Only blocks the router can reproduce from token ids are published. A block is *opaque* when
    its engine hash covers more than its tokens and LoRA adapter (multimodal inputs, a cache
    salt, prompt embeddings, extra token ids) or when it is not a full block; opaque blocks and
    every block chained after them are withheld, because a request with the same tokens would
    not hit them.
  * Stores of blocks already held (engines re-announce reused prefixes) are dropped, and
    removals of blocks never published are dropped, so the log stays a faithful, minimal stream.
  * `resync()` publishes AllCleared when the engine's event stream had a gap that could not be
    replayed: the router then knows nothing of this worker's cache, which only costs cache hits
    (never a wrong route), until new events arrive.
  * Tiers: `stored` and `removed` take the tier the engine named (its GPU pool, a host or disk
    offloading tier; kvmesh.workers.adapters.kv_tiers maps the engines' names); each tier keeps
    its own published set.
  * `cached_prefix_tokens(prompt)`: the prompt's leading tokens the device tier holds, found by
    walking the published blocks by (LoRA, parent, token ids), so without the engine's hash
    function. The adapters report a request's pending prefill as its prompt less that prefix
    (what the router books for it), not the whole prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.runtime.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventLog,
    KvTier,
    StoredBlock,
)

__all__ = ["MASK64", "KvEventTranslator", "StoredChain", "engine_hash"]

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1

_ChainKey = tuple[str, int | None, tuple[int, ...]]


def engine_hash(value: int | bytes) -> int:
    """An engine's block hash as the unsigned 64-bit int kvmesh events carry.

    Ints are taken modulo 2**64 (so SGLang's signed hashes map one-to-one); bytes (vLLM's sha256
    block hashes) keep their low 64 bits, which is exactly what vLLM itself publishes when
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is set, so both settings give the same kvmesh hashes.
    """
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & MASK64
    return value & MASK64


@dataclass(slots=True)
class StoredChain:
    """An engine's "blocks stored" event, engine-neutral: a chain of blocks after `parent`."""

    parent: int | None
    """kvmesh hash (engine_hash) of the first block's parent; None: the chain starts at the
    root."""
    hashes: list[int]
    """kvmesh hashes of the blocks, in order."""
    tokens: list[Sequence[int]]
    """Token ids of each block."""
    lora_name: str = ""
    opaque: list[bool] = field(default_factory=list)
    """Per block: the engine hash covers more than tokens and LoRA; empty: none is."""


class KvEventTranslator:
    """Feeds a KvEventLog from engine events (see the module docstring)."""

    def __init__(self, log_: KvEventLog, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.log = log_
        self.block_size = block_size
        self._held: dict[KvTier, set[int]] = {t: set() for t in KvTier}
        """Per tier, hashes published as stored and not removed since."""
        self._opaque: set[int] = set()
        """Hashes the engine holds that were withheld (and whose children are withheld)."""
        self.withheld_total = 0
        """Blocks withheld so far (opaque, partial or chained after one)."""
        self._chains: dict[_ChainKey, int] = {}
        """Device blocks published, by (LoRA name, parent hash, token ids): the index
        `cached_prefix_tokens` walks (the log holds the same blocks by hash)."""

    @property
    def num_held(self) -> int:
        """Device blocks published and not removed."""
        return len(self._held[KvTier.DEVICE])

    def stored(self, chain: StoredChain, tier: KvTier = KvTier.DEVICE) -> None:
        """Blocks entered the engine's cache on `tier`."""
        held, opaque, size = self._held[tier], self._opaque, self.block_size
        parent = chain.parent
        withhold = parent is not None and parent in opaque
        run: list[StoredBlock] = []
        run_parent = parent
        chains = self._chains if tier is KvTier.DEVICE else None
        lora = chain.lora_name or ""
        for i, h in enumerate(chain.hashes):
            tokens = chain.tokens[i]
            block_parent = parent if i == 0 else chain.hashes[i - 1]
            if not withhold and (
                (chain.opaque and chain.opaque[i])
                or len(tokens) != size
                or not all(isinstance(t, int) for t in tokens)
            ):
                withhold = True
            if withhold:
                self._flush(run_parent, run, chain.lora_name, tier)
                run = []
                opaque.add(h)
                self.withheld_total += 1
                continue
            if h in held:  # re-announced (a reused prefix): already published
                self._flush(run_parent, run, chain.lora_name, tier)
                run = []
                run_parent = h
                continue
            block = StoredBlock(h, tuple(tokens))
            run.append(block)
            held.add(h)
            if chains is not None:
                chains[(lora, block_parent, block.token_ids)] = h
        self._flush(run_parent, run, chain.lora_name, tier)

    def cached_prefix_tokens(self, prompt: Sequence[int], lora_name: str = "") -> int:
        """How many of `prompt`'s leading tokens the engine's device tier holds (published
        blocks only, so a prefix after an opaque block counts as not cached), at most all but
        the last token (an engine computes the last prompt token even on a full hit). O(blocks
        of the prefix)."""
        size = self.block_size
        chains = self._chains
        if not chains:
            return 0
        parent: int | None = None
        n = 0
        end = len(prompt) - size
        while n <= end:
            h = chains.get((lora_name, parent, tuple(prompt[n : n + size])))
            if h is None:
                break
            parent = h
            n += size
        return min(n, max(len(prompt) - 1, 0))

    def _flush(
        self, parent: int | None, run: list[StoredBlock], lora_name: str, tier: KvTier
    ) -> None:
        if run:
            self.log.publish(BlocksStored(parent, run, lora_name, tier))

    def removed(self, hashes: Iterable[int], tier: KvTier = KvTier.DEVICE) -> None:
        """Blocks left `tier` of the engine's cache."""
        held = self._held[tier]
        gone: list[int] = []
        device = tier is KvTier.DEVICE
        for h in hashes:
            if h in held:
                held.discard(h)
                gone.append(h)
                if device:  # before the log forgets the block
                    self._unchain(h)
            elif not any(h in s for s in self._held.values()):
                self._opaque.discard(h)
        if gone:
            self.log.publish(BlocksRemoved(gone, tier))

    def _unchain(self, h: int) -> None:
        block = self.log.block(h)
        if block is not None:
            parent, tokens, lora = block
            key = (lora or "", parent, tokens)
            if self._chains.get(key) == h:
                del self._chains[key]

    def cleared(self) -> None:
        """The engine dropped its whole cache."""
        for held in self._held.values():
            held.clear()
        self._chains.clear()
        self._opaque.clear()
        self.log.publish(AllCleared())

    def resync(self, why: str) -> None:
        """Events were lost: forget everything (see the module docstring)."""
        log.warning("KV events lost (%s): publishing AllCleared until new events arrive", why)
        self.cleared()
