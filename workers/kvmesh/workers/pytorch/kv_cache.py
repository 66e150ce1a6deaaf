"""The paged KV cache storage: one tensor holding every layer's keys and values in blocks.

Layout: `data[layer, 0 | 1, block, slot, kv_head, head_dim]` (0: keys, 1: values), contiguous.
Block b holds the KV of `block_size` consecutive token positions of whichever sequence owns it
(bookkeeping lives in the scheduler's BlockPool; this class only stores). A token at position p
of a sequence with block table `t` lives in block `t[p // block_size]`, slot `p % block_size`.

The storage starts zeroed, so padded reads of never-written slots are finite (masked attention
weights are exactly 0, and 0 * NaN would poison the output).

Export/import move whole blocks: `read_blocks(ids)` returns a copy shaped
`[layers, 2, len(ids), block_size, kv_heads, head_dim]`; `write_blocks(ids, kv)` is its inverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["KvCacheSpec", "PagedKvCache"]


@dataclass(frozen=True, slots=True)
class KvCacheSpec:
    """The shape of a model's KV cache, per block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes (keys and values of every layer)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of `num_blocks` exported blocks."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class PagedKvCache:
    """`num_blocks` KV blocks of `spec` on `device` (see the module docstring)."""

    def __init__(self, spec: KvCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = device
        self.data = torch.zeros(spec.block_shape(num_blocks), dtype=spec.dtype, device=device)
        slots = num_blocks * spec.block_size
        # Per-layer views: [num_blocks, block_size, kv_heads, head_dim] and the flat slot view.
        self._blocks = [(self.data[i, 0], self.data[i, 1]) for i in range(spec.num_layers)]
        self._flat = [
            (
                k.view(slots, spec.num_kv_heads, spec.head_dim),
                v.view(slots, spec.num_kv_heads, spec.head_dim),
            )
            for k, v in self._blocks
        ]

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of `layer`, each [num_blocks, block_size, kv_heads, head_dim]."""
        return self._blocks[layer]

    def write_tokens(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store `keys`/`values` ([tokens, kv_heads, head_dim]) at flat slot indices `slots`."""
        k, v = self._flat[layer]
        k.index_copy_(0, slots, keys)
        v.index_copy_(0, slots, values)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks' KV: [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return self.data.index_select(2, index)

    def write_blocks(self, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Overwrite the blocks with `kv` (shaped like read_blocks' result; any device/dtype)."""
        expected = self.spec.block_shape(len(block_ids))
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV blocks must have shape {expected}, got {tuple(kv.shape)}")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.data.index_copy_(2, index, kv.to(device=self.device, dtype=self.spec.dtype))
