"""The torch engine's bytes of the KV tiers (kvmesh.workers.batching.tiers decides what moves).

`TorchTierStore` holds the host tier (one CPU tensor of `host_slots` blocks, each block
contiguous: `[layers, 2, block_size, kv_heads, head_dim]`; pinned when the device is CUDA) and
the disk tier's block files (kvmesh.workers.batching.block_files), and runs TierJobs: `run(job)`
is called on the job's lane thread (the engine keeps one thread per lane), so copies run beside
the forward passes, never inside a step. On CUDA each lane copies on its own stream and waits
for it before reporting the job done. A file that cannot be written or read is logged (with the
reason: a full or unwritable disk, a corrupted file) and ends the job there; the scheduler
recomputes what did not arrive.

`fingerprint(...)` names what a block file's bytes mean (model config, weight files, dtype,
block layout), so a restarted worker only ever reads blocks of the same model.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from hashlib import blake2b
from pathlib import Path

import torch

from kvmesh.runtime.kv_events import KvTier
from kvmesh.workers.batching.block_files import BlockFileError, BlockFiles
from kvmesh.workers.batching.tiers import Lane, TierJob, TierOp
from kvmesh.workers.pytorch.kv_cache import KvCacheSpec, PagedKvCache

__all__ = ["TorchTierStore", "fingerprint"]

log = logging.getLogger(__name__)


def fingerprint(model_dir: Path, spec: KvCacheSpec) -> str:
    """16 hex digits naming the KV bytes of this model: its config.json, the names, sizes and
    modification times of its weight files, the KV dtype and the block layout."""
    h = blake2b(digest_size=8)
    config = model_dir / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for f in sorted(model_dir.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".pt") and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(
        f"{spec.num_layers}:{spec.num_kv_heads}:{spec.head_dim}:{spec.block_size}:"
        f"{spec.dtype}".encode()
    )
    return h.hexdigest()


class TorchTierStore:
    """Host-tier tensor + disk block files of one torch engine (see the module docstring)."""

    def __init__(self, cache: PagedKvCache, host_slots: int, files: BlockFiles | None) -> None:
        spec = cache.spec
        self.cache = cache
        self.files = files
        self.block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        cuda = cache.device.type == "cuda"
        self.host = torch.zeros((host_slots, *self.block_shape), dtype=spec.dtype, pin_memory=cuda)
        self._streams: dict[Lane, torch.cuda.Stream] = (
            {
                lane: torch.cuda.Stream(cache.device)  # type: ignore[no-untyped-call]
                for lane in Lane
            }
            if cuda
            else {}
        )

    @contextlib.contextmanager
    def _on_lane(self, lane: Lane) -> Iterator[None]:
        stream = self._streams.get(lane)
        with torch.inference_mode():
            if stream is None:
                yield
                return
            with torch.cuda.stream(stream):
                yield
            stream.synchronize()

    def run(self, job: TierJob) -> int:
        """Move `job`'s blocks; returns how many leading blocks moved (lane thread)."""
        with self._on_lane(job.lane):
            if job.op is TierOp.OFFLOAD:
                data, host = self.cache.data, self.host
                for block, slot in zip(job.device_blocks, job.host_slots, strict=True):
                    host[slot].copy_(data[:, :, block], non_blocking=True)
                return len(job)
            if job.op is TierOp.ONBOARD and job.source is KvTier.HOST:
                data, host = self.cache.data, self.host
                for block, slot in zip(job.device_blocks, job.host_slots, strict=True):
                    data[:, :, block].copy_(host[slot], non_blocking=True)
                return len(job)
            if job.op is TierOp.DEMOTE:
                return self._demote(job)
            if job.op is TierOp.ONBOARD:
                return self._onboard_from_disk(job)
            if self.files is not None:
                self.files.delete(job.block_hashes)
            return len(job)

    def _demote(self, job: TierJob) -> int:
        files = self.files
        assert files is not None
        for i, (h, meta, slot) in enumerate(
            zip(job.block_hashes, job.metas, job.host_slots, strict=True)
        ):
            payload = self.host[slot].view(torch.uint8).reshape(-1).numpy().tobytes()
            try:
                files.write(h, meta, payload)
            except OSError as exc:
                log.warning(
                    "disk KV tier: writing block %016x to %s failed: %s; the block is not kept "
                    "on disk%s",
                    h,
                    files.dir,
                    exc,
                    f" (nor the {len(job) - i - 1} after it)" if i + 1 < len(job) else "",
                )
                return i
        return len(job)

    def _onboard_from_disk(self, job: TierJob) -> int:
        files = self.files
        assert files is not None
        data = self.cache.data
        dtype = self.cache.spec.dtype
        for i, (h, block) in enumerate(zip(job.block_hashes, job.device_blocks, strict=True)):
            try:
                payload = files.read(h)
            except (OSError, BlockFileError) as exc:
                log.warning(
                    "disk KV tier: block %016x cannot be read: %s; recomputing it%s",
                    h,
                    exc,
                    " and the rest of the prompt" if i + 1 < len(job) else "",
                )
                return i
            kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)
            data[:, :, block].copy_(kv.view(self.block_shape), non_blocking=True)
        return len(job)
