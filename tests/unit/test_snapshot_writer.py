"""The shard writer's two ways to the disk give the same file: direct (O_DIRECT from the arena, the tails and
small entries through HDF5) and through the page cache only.

Entries of awkward sizes (empty, one byte, a block less one, whole blocks, a block and a byte, a few MiB and
odd bytes) and one at an arena offset O_DIRECT cannot use are written both ways from a real shared-memory
arena; each file must read back, through h5py, as exactly the arena's bytes, with their CRC-32s.
"""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from clockworkd.snapshots import direct_io
from clockworkd.snapshots.messages import Entry
from clockworkd.snapshots.writer import write_shard

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


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_shard_holds_every_byte(arena: tuple[mmap.mmap, list[Entry]], tmp_path: Path, direct: bool) -> None:
    mapping, entries = arena
    path = tmp_path / "rank-00000.h5"
    total = write_shard(mapping, path, entries, direct=direct)
    assert total == sum(e.nbytes for e in entries)
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file was left behind"
    with h5py.File(path, "r") as f:
        for entry in entries:
            expected = mapping[entry.offset : entry.offset + entry.nbytes]
            dset = f[entry.name]
            got = dset[...].tobytes() if entry.nbytes else b""  # type: ignore[union-attr]
            assert got == expected, f"{entry.name}: the bytes differ"
            assert int(dset.attrs["crc32"]) == zlib.crc32(expected) & 0xFFFFFFFF


def test_back_to_back_entries_share_writes_and_big_ones_are_cut(
    arena: tuple[mmap.mmap, list[Entry]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With writes capped at three blocks, runs of datasets that lie back to back in the file are merged up to
    the cap, larger entries are cut into several writes, and the file still holds every byte (a merged run
    that put one entry's bytes at another's place would show here)."""
    calls: list[tuple[int, int]] = []
    real = os.pwritev

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append((len(buffers), sum(len(b) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(direct_io, "IO_CHUNK", 3 * DIRECT_ALIGN)
    monkeypatch.setattr(direct_io.os, "pwritev", counting)
    mapping, entries = arena
    path = tmp_path / "rank-00000.h5"
    write_shard(mapping, path, entries, direct=True)
    assert calls, "nothing was written with O_DIRECT"
    assert max(size for _n, size in calls) <= 3 * DIRECT_ALIGN
    assert any(n > 1 for n, _size in calls), "no two back-to-back entries were merged into one write"
    with h5py.File(path, "r") as f:
        for entry in entries:
            dset = f[entry.name]
            got = dset[...].tobytes() if entry.nbytes else b""  # type: ignore[union-attr]
            assert got == mapping[entry.offset : entry.offset + entry.nbytes], f"{entry.name}: the bytes differ"


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
