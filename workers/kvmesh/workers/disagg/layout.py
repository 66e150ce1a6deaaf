"""NIXL descriptor arrays for KV blocks, from block addresses and a KvLayout.

A block is either one contiguous region (`chunk_bytes` 0) or `block_bytes // chunk_bytes`
pieces `chunk_stride_bytes` apart (the torch engine's layer-major cache: for each layer, the
block's keys then its values). A transfer pairs the i-th piece of a remote block with the i-th
piece of a local block, so both sides list their pieces in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.runtime.types import KvLayout

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["block_pieces"]


def block_pieces(
    addresses: Sequence[int], layout: KvLayout, device_id: int = 0
) -> npt.NDArray[np.uint64]:
    """An N x 3 array of (address, length, device id) rows: every piece of every block, block by
    block. `addresses` are the blocks' (first pieces') start addresses."""
    import numpy as np

    base = np.asarray(addresses, dtype=np.uint64)
    if layout.chunk_bytes and layout.chunk_bytes != layout.block_bytes:
        if layout.block_bytes % layout.chunk_bytes:
            raise ValueError("block_bytes must be a multiple of chunk_bytes")
        pieces = layout.block_bytes // layout.chunk_bytes
        offsets = np.arange(pieces, dtype=np.uint64) * np.uint64(layout.chunk_stride_bytes)
        starts = (base[:, None] + offsets[None, :]).reshape(-1)
        length = layout.chunk_bytes
    else:
        starts = base
        length = layout.block_bytes
    out = np.empty((len(starts), 3), dtype=np.uint64)
    out[:, 0] = starts
    out[:, 1] = length
    out[:, 2] = device_id
    return out
