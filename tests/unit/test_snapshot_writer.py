"""The shard writer: its two ways to the disk give the same shard, its direct writes are whole and bounded, and
shards of the earlier format stay readable.

Entries of awkward sizes (empty, one byte, a block less one, whole blocks, a block and a byte, a few MiB and
odd bytes) and one at an arena offset not on a block boundary are written both ways (O_DIRECT from the arena,
and through the page cache only) from a real shared-memory arena; each shard must read back, through the
store's reader, as exactly the arena's bytes, with zlib's CRC-32s.
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from clockwork.contracts.snapshots import direct_io
from clockwork.contracts.snapshots.messages import Entry
from clockwork.contracts.snapshots.store import (
    SnapshotCorrupt,
    entry_file_offset,
    file_entries,
    read_entries,
    verify_snapshot,
    write_manifest,
)
from clockwork.contracts.snapshots.writer import write_shard

DIRECT_ALIGN = direct_io.DIRECT_ALIGN
SIZES = [0, 1, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + 1, 3 * DIRECT_ALIGN + 5, (3 << 20) + 7, 8 << 20]


@pytest.fixture
def arena() -> tuple[mmap.mmap, list[Entry]]:
    """A /dev/shm arena of random bytes and its entries; the last entry starts 8 bytes past a block."""
    entries: list[Entry] = []
    offset = 0
    for i, size in enumerate(SIZES):
        entries.append(Entry(f"t/{i:06d}", offset, size, "torch.uint8", (size,)))
        offset += (size + DIRECT_ALIGN - 1) // DIRECT_ALIGN * DIRECT_ALIGN
    entries.append(Entry("rank/00000/odd", offset + 8, 2 * DIRECT_ALIGN, "torch.uint8", (2 * DIRECT_ALIGN,)))
    size = offset + 3 * DIRECT_ALIGN
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd = os.open(folder or "/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    mapping[:] = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
    return mapping, entries


def read_back(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
    """The shard's index and every entry's bytes, read and CRC-checked by the store's reader."""
    entries = file_entries(path)
    body = {"files": {path.name: {"size": path.stat().st_size, "entries": entries}}}
    return entries, read_entries(path.parent, body)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_shard_holds_every_byte(arena: tuple[mmap.mmap, list[Entry]], tmp_path: Path, direct: bool) -> None:
    mapping, entries = arena
    path = tmp_path / "rank-00000.h5"
    total = write_shard(mapping, path, entries, direct=direct)
    assert total == sum(e.nbytes for e in entries)
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file was left behind"
    index, data = read_back(path)
    assert sorted(index) == sorted(e.name for e in entries)
    for entry in entries:
        expected = mapping[entry.offset : entry.offset + entry.nbytes]
        assert data[entry.name].tobytes() == expected, f"{entry.name}: the bytes differ"
        assert index[entry.name]["crc32"] == zlib.crc32(expected) & 0xFFFFFFFF
        assert (index[entry.name]["dtype"], index[entry.name]["shape"]) == (entry.dtype, list(entry.shape))
        if entry.nbytes:  # where a tool finds it in the file is where it is
            with path.open("rb") as f:
                f.seek(entry_file_offset(path, entry.name))
                assert f.read(entry.nbytes) == expected


def test_direct_writes_are_cut_at_the_cap_and_lose_nothing(
    arena: tuple[mmap.mmap, list[Entry]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With writes capped at three blocks, the shard's data goes out in many direct writes, none larger, and
    still every byte lands where the index says."""
    calls: list[int] = []
    real = os.pwritev

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(direct_io, "IO_CHUNK", 3 * DIRECT_ALIGN)
    monkeypatch.setattr("clockwork.contracts.snapshots.writer.IO_CHUNK", 3 * DIRECT_ALIGN)
    monkeypatch.setattr(direct_io.os, "pwritev", counting)
    mapping, entries = arena
    path = tmp_path / "rank-00000.h5"
    write_shard(mapping, path, entries, direct=True)
    monkeypatch.undo()
    assert len(calls) > 100, "the data did not go out with O_DIRECT"
    assert max(calls) <= 3 * DIRECT_ALIGN
    _index, data = read_back(path)
    for entry in entries:
        assert data[entry.name].tobytes() == mapping[entry.offset : entry.offset + entry.nbytes], entry.name


def test_back_to_back_pieces_share_one_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DirectWrites merges pieces that continue each other in the file into one pwritev (up to the cap) and
    starts a new write where one does not."""
    calls: list[tuple[int, int]] = []
    real = os.pwritev

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append((offset, len(buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(direct_io.os, "pwritev", counting)
    data = np.random.default_rng(5).integers(0, 256, 8 * DIRECT_ALIGN, dtype=np.uint8).tobytes()
    view = memoryview(data)
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with direct_io.DirectWrites(fd) as writes:
            writes.add(0, view[: 2 * DIRECT_ALIGN], 0)  # these two continue each other
            writes.add(1, view[2 * DIRECT_ALIGN : 3 * DIRECT_ALIGN], 2 * DIRECT_ALIGN)
            writes.add(2, view[5 * DIRECT_ALIGN :], 5 * DIRECT_ALIGN)  # a gap before this one
            assert writes.finish() == set()
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert sorted(calls) == [(0, 2), (5 * DIRECT_ALIGN, 1)]
    written = path.read_bytes()
    assert written[: 3 * DIRECT_ALIGN] == data[: 3 * DIRECT_ALIGN]
    assert written[5 * DIRECT_ALIGN :] == data[5 * DIRECT_ALIGN :]


def test_a_short_write_goes_on_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pwritev may write less than asked (a signal, a full queue): the rest follows, nothing twice or lost."""
    real = os.pwritev

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        total = sum(len(b) for b in buffers)
        if total <= DIRECT_ALIGN:
            return real(fd, buffers, offset)
        cut, kept = total // 2 // DIRECT_ALIGN * DIRECT_ALIGN + DIRECT_ALIGN, []
        for b in buffers:  # the first `cut` bytes only
            kept.append(b[: max(0, min(len(b), cut - sum(len(k) for k in kept)))])
        return real(fd, [k for k in kept if len(k)], offset)

    monkeypatch.setattr(direct_io.os, "pwritev", short)
    data = np.random.default_rng(3).integers(0, 256, 7 * DIRECT_ALIGN, dtype=np.uint8).tobytes()
    pieces = [memoryview(data)[: 2 * DIRECT_ALIGN], memoryview(data)[2 * DIRECT_ALIGN :]]
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        direct_io.pwritev_all(fd, pieces, DIRECT_ALIGN)
    finally:
        os.close(fd)
    assert path.read_bytes()[DIRECT_ALIGN:] == data


def write_v1_snapshot(folder: Path, blobs: dict[str, bytes]) -> None:
    """A snapshot as the first format had it: a dataset per entry with crc32/dtype/shape attributes."""
    folder.mkdir()
    shard = folder / "rank-00000.h5"
    with h5py.File(shard, "w") as f:
        for name, blob in blobs.items():
            dset = f.create_dataset(name, data=np.frombuffer(blob, dtype=np.uint8))
            dset.attrs["crc32"] = zlib.crc32(blob)
            dset.attrs["dtype"] = "torch.uint8"
            dset.attrs["shape"] = json.dumps([len(blob)])
    entries = file_entries(shard)
    body = {
        "format": "clockwork-snapshot/1",
        "step": 3,
        "world_size": 1,
        "tensors": 1,
        "files": {shard.name: {"size": shard.stat().st_size, "entries": entries}},
    }
    write_manifest(folder, body)


def test_a_snapshot_of_the_first_format_stays_readable(tmp_path: Path) -> None:
    blobs = {"t/000000": bytes(range(256)) * 40, "meta": b"description", "rank/00000/position": b"{}"}
    folder = tmp_path / "step-0000000003"
    write_v1_snapshot(folder, blobs)
    assert verify_snapshot(folder) == []
    _index, data = read_back(folder / "rank-00000.h5")
    assert {name: array.tobytes() for name, array in data.items()} == blobs
    with (folder / "rank-00000.h5").open("r+b") as f:  # and its checksums still catch damage
        f.seek(entry_file_offset(folder / "rank-00000.h5", "t/000000") + 100)
        f.write(b"\xff")
    assert any("checksum mismatch" in p for p in verify_snapshot(folder))
    with pytest.raises(SnapshotCorrupt, match="checksum mismatch"):
        read_back(folder / "rank-00000.h5")
