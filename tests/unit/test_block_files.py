"""The disk KV tier's block files: round trip, checksums, crash leftovers, locking."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import IO

import pytest

from kvmesh.workers.batching.block_files import BlockFileError, BlockFiles

pytestmark = pytest.mark.unit

PAYLOAD = 64
META = (7, (1, 2, 3, 4), "")


def _payload(seed: int) -> bytes:
    return bytes((seed * 31 + i) % 256 for i in range(PAYLOAD))


def test_round_trip_and_listing(tmp_path: Path) -> None:
    files = BlockFiles(tmp_path, "fp", PAYLOAD)
    assert files.open() == []
    files.write(11, META, _payload(1))
    files.write(12, (11, (5, 6, 7, 8), "lora"), _payload(2))
    os.utime(files.path(11), (1, 1))  # oldest first
    assert files.read(11) == _payload(1) and files.read(12) == _payload(2)
    files.close()
    again = BlockFiles(tmp_path, "fp", PAYLOAD)
    assert again.open() == [(11, META), (12, (11, (5, 6, 7, 8), "lora"))]
    again.delete([11, 99])
    again.close()
    third = BlockFiles(tmp_path, "fp", PAYLOAD)
    assert third.open() == [(12, (11, (5, 6, 7, 8), "lora"))]
    third.close()


def test_corruption_is_detected(tmp_path: Path) -> None:
    files = BlockFiles(tmp_path, "fp", PAYLOAD)
    files.open()
    files.write(5, META, _payload(5))
    path = files.path(5)
    data = bytearray(path.read_bytes())
    data[-PAYLOAD // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BlockFileError, match="checksum mismatch"):
        files.read(5)
    with pytest.raises(BlockFileError, match="missing"):
        files.read(6)
    files.write(6, META, _payload(6))
    os.replace(files.path(6), files.path(8))  # a file under another block's name
    with pytest.raises(BlockFileError, match="holds block"):
        files.read(8)
    with pytest.raises(ValueError, match="payload"):
        files.write(9, META, b"short")
    files.close()


def test_open_cleans_up_after_a_crash(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = BlockFiles(tmp_path, "fp", PAYLOAD)
    files.open()
    files.write(1, META, _payload(1))
    files.write(2, META, _payload(2))
    files.write(3, META, _payload(3))
    files.close()
    d = tmp_path / "fp"
    (d / ".0000000000000004.123.tmp").write_bytes(b"KVMB half written")  # killed mid-write
    torn = d / f"{2:016x}.kvb"
    torn.write_bytes(torn.read_bytes()[:-10])  # power loss: a truncated file
    (d / f"{3:016x}.kvb").write_bytes(b"garbage")
    caplog.set_level(logging.WARNING)
    files = BlockFiles(tmp_path, "fp", PAYLOAD)
    assert [h for h, _ in files.open()] == [1]
    assert sorted(p.name for p in d.iterdir()) == [".lock", f"{1:016x}.kvb"]
    assert sum("deleting unusable block file" in r.getMessage() for r in caplog.records) == 2
    files.close()


def test_a_directory_serves_one_process(tmp_path: Path) -> None:
    first = BlockFiles(tmp_path, "fp", PAYLOAD)
    first.open()
    second = BlockFiles(tmp_path, "fp", PAYLOAD)
    with pytest.raises(OSError, match="in use by another process"):
        second.open()
    first.close()
    assert second.open() == []
    second.close()
    other = BlockFiles(tmp_path, "another-model", PAYLOAD)  # another fingerprint: its own dir
    assert other.open() == []
    other.close()


def test_unwritable_directory_raises(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        BlockFiles(tmp_path / "file" / "kv", "fp", PAYLOAD).open()


def test_a_full_disk_mid_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC after part of a file is written (injected: the file's writes stop after 100
    bytes): the write raises, neither the block's file nor its temporary file stays, and the
    blocks written before are intact. Works without root, unlike the tmpfs test of the torch
    engine's full disk."""
    import builtins
    import errno

    from kvmesh.workers.batching import block_files

    files = BlockFiles(tmp_path, "fp", PAYLOAD)
    files.open()
    files.write(1, META, _payload(1))

    class Full:
        def __init__(self, f: IO[bytes]) -> None:
            self.f, self.left = f, 100

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def write(self, data: bytes) -> int:
            if len(data) > self.left:
                self.f.write(data[: self.left])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(data)
            return self.f.write(data)

    real_open = builtins.open
    monkeypatch.setattr(
        block_files, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False
    )
    with pytest.raises(OSError, match="No space left"):
        files.write(2, META, _payload(2))
    monkeypatch.undo()
    assert sorted(p.name for p in files.dir.iterdir() if p.name != ".lock") == [files.path(1).name]
    assert files.read(1) == _payload(1)
    files.close()
