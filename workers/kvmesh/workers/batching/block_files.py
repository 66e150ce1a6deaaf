"""The disk KV tier's files: one file per block, named by the block's hash, written atomically and
checksummed, engine-agnostic (bytes in, bytes out; the torch engine turns KV tensors into them).

Layout: `DIR/<fingerprint>/<block hash as 16 hex digits>.kvb`. The fingerprint names what the
bytes mean (the engine derives it from the model, its weights, dtype and block layout), so a
worker only ever reads blocks another run of the same model wrote, and two models can share DIR.
One process uses a fingerprint directory at a time (an exclusive lock on its `.lock` file).

File format:
    b"KVMB" | version u16 | header length u32 | header | payload | digest
  header: JSON {"hash", "parent" (null at the root), "lora", "tokens", "payload_bytes"}
  digest: blake2b-128 of header + payload
The integers are little-endian. `read` checks the size, the header and the digest: a torn,
truncated, foreign or corrupted file raises BlockFileError (the caller recomputes the block).

Crash safety: a file is written under a temporary name in the same directory and renamed into
place (atomic on POSIX), so a crash mid-write leaves no file under a block's name, only a
temporary file that the next `open` deletes. Files are not fsync'ed: after a power loss a file
may be torn, which its digest reveals. Persistence: the blocks survive the process; `open`
lists the valid ones (oldest first, by modification time) so a restarted worker serves them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import struct
from collections.abc import Iterable
from hashlib import blake2b
from pathlib import Path
from typing import IO

from kvmesh.runtime.kv_events import CachedBlock

__all__ = ["BlockFileError", "BlockFiles"]

log = logging.getLogger(__name__)

_MAGIC = b"KVMB"
_VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_DIGEST = 16
_SUFFIX = ".kvb"
_TMP = ".tmp"


class BlockFileError(Exception):
    """A block file that cannot be used: missing, truncated, foreign or corrupted."""


def _digest(header: bytes, payload: bytes | memoryview) -> bytes:
    h = blake2b(digest_size=_DIGEST)
    h.update(header)
    h.update(payload)
    return h.digest()


class BlockFiles:
    """The block files of one fingerprint under `root` (see the module docstring); every block's
    payload is `payload_bytes` long. Call `open` first; thread-safe for distinct blocks."""

    def __init__(self, root: str | Path, fingerprint: str, payload_bytes: int) -> None:
        if payload_bytes < 1:
            raise ValueError("payload_bytes must be >= 1")
        self.dir = Path(root) / fingerprint
        self.payload_bytes = payload_bytes
        self._lock: IO[bytes] | None = None

    def path(self, block_hash: int) -> Path:
        """Where the file of `block_hash` lives."""
        return self.dir / f"{block_hash & ((1 << 64) - 1):016x}{_SUFFIX}"

    def open(self) -> list[tuple[int, CachedBlock]]:
        """Create the directory, lock it, delete temporary files left by a crash, and return the
        blocks of the valid files, oldest first (files with a bad header or size are deleted,
        each logged). Raises OSError when the directory cannot be created, locked or written."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.dir / ".lock", "wb")  # held until close()
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            lock.close()
            raise OSError(exc.errno, f"{self.dir} is in use by another process") from exc
        self._lock = lock
        probe = self.dir / f".probe{_TMP}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError:
            self.close()
            raise
        found: list[tuple[float, int, CachedBlock]] = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(_TMP):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            if not name.endswith(_SUFFIX):
                continue
            try:
                block_hash, meta = self._check(Path(entry.path))
                found.append((entry.stat().st_mtime, block_hash, meta))
            except (OSError, BlockFileError) as exc:
                log.warning("disk KV tier: deleting unusable block file %s: %s", entry.path, exc)
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        found.sort(key=lambda f: f[0])
        return [(h, meta) for _, h, meta in found]

    def close(self) -> None:
        """Release the directory's lock."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()

    def write(self, block_hash: int, meta: CachedBlock, payload: bytes | memoryview) -> None:
        """Write the block's file atomically (OSError: not written, nothing left behind)."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a block payload is {self.payload_bytes} bytes, got {len(payload)}")
        parent, tokens, lora = meta
        header = json.dumps(
            {
                "hash": block_hash,
                "parent": parent,
                "lora": lora,
                "tokens": list(tokens),
                "payload_bytes": len(payload),
            },
            separators=(",", ":"),
        ).encode()
        final = self.path(block_hash)
        tmp = final.with_name(f".{final.stem}.{os.getpid()}{_TMP}")
        try:
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(_MAGIC, _VERSION, len(header)))
                f.write(header)
                f.write(payload)
                f.write(_digest(header, payload))
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(self, block_hash: int) -> bytes:
        """The block's payload, checked (BlockFileError: unusable; OSError: unreadable)."""
        path = self.path(block_hash)
        if not path.exists():
            raise BlockFileError(f"{path} is missing")
        found, _, payload = self._load(path)
        if found != block_hash:
            raise BlockFileError(f"{path} holds block {found:#x}, not {block_hash:#x}")
        return payload

    def delete(self, block_hashes: Iterable[int]) -> None:
        """Delete the files of these blocks (missing ones are fine)."""
        for h in block_hashes:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(h))

    # -- internals -----------------------------------------------------------------------------

    def _load(self, path: Path) -> tuple[int, CachedBlock, bytes]:
        data = path.read_bytes()
        block_hash, meta, start = self._header(path, data[: _PREFIX.size + 65536], len(data))
        payload = data[start : start + self.payload_bytes]
        header = data[_PREFIX.size : start]
        if _digest(header, payload) != data[start + self.payload_bytes :]:
            raise BlockFileError(f"{path} is corrupted (checksum mismatch)")
        return block_hash, meta, payload

    def _check(self, path: Path) -> tuple[int, CachedBlock]:
        """The block a file's header names (its size checked; the digest is checked on read)."""
        with open(path, "rb") as f:
            head = f.read(_PREFIX.size + 65536)
        h, meta, _ = self._header(path, head, path.stat().st_size)
        return h, meta

    def _header(self, path: Path, head: bytes, size: int) -> tuple[int, CachedBlock, int]:
        """Parse the prefix and header; returns (hash, meta, payload offset)."""
        if len(head) < _PREFIX.size:
            raise BlockFileError(f"{path} is truncated")
        magic, version, hlen = _PREFIX.unpack_from(head)
        if magic != _MAGIC or version != _VERSION:
            raise BlockFileError(f"{path} is not a version {_VERSION} KV block file")
        start = _PREFIX.size + hlen
        if size != start + self.payload_bytes + _DIGEST or len(head) < start:
            raise BlockFileError(f"{path} has the wrong size (truncated or another layout)")
        try:
            fields = json.loads(head[_PREFIX.size : start])
            block_hash = int(fields["hash"])
            parent = fields["parent"]
            meta: CachedBlock = (
                None if parent is None else int(parent),
                tuple(int(t) for t in fields["tokens"]),
                str(fields["lora"]),
            )
            if int(fields["payload_bytes"]) != self.payload_bytes:
                raise ValueError("payload size")
        except (ValueError, KeyError, TypeError) as exc:
            raise BlockFileError(f"{path} has a malformed header: {exc}") from exc
        return block_hash, meta, start
