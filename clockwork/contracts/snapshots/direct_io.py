"""Getting a shard's bytes from the arena to the disk at the disk's own sequential speed.

Two ways, both ending in the shard's fsync:

- :class:`DirectWrites`: whole 4 KiB blocks straight from the arena with O_DIRECT (no copy into the page
  cache, which on a fast disk is the bottleneck), in writes of up to :data:`IO_CHUNK` bytes; pieces that lie
  back to back in the file are merged into one ``pwritev``. The size of each write matters: a file system
  such as ext4 runs one block-allocating O_DIRECT write per file at a time, so what keeps the device busy is
  how much one write hands it (a 64 MiB write is 16 requests of 4 MiB in flight), as with ``dd bs=64M
  oflag=direct``, the bandwidth the writer is measured against;
- :class:`Writeback`: what goes through the page cache (HDF5's metadata and the index, the bytes past the
  last whole block, all of it where O_DIRECT is refused) is handed to the disk as it accumulates
  instead of all at the final fsync.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DIRECT_ALIGN", "IO_CHUNK", "DirectWrites", "Writeback", "open_direct"]

#: Alignment of file offsets, memory and lengths for O_DIRECT (the largest logical block size in common use).
DIRECT_ALIGN = 4096
#: Largest single write: what ``dd bs=64M`` issues, the disk's sequential bandwidth as bench/snapshot.py
#: measures it.
IO_CHUNK = 64 << 20
#: Writes in flight at once (file systems that run O_DIRECT writes of one file in parallel use both).
IO_THREADS = 2
#: Written bytes after which the kernel is told to start writing them out (see :class:`Writeback`).
WRITEBACK_EVERY = 64 << 20
_IOV_MAX = 1024
_SYNC_FILE_RANGE_WRITE = 2


def open_direct(path: Path) -> int | None:
    """A second descriptor on ``path`` with O_DIRECT, or None where the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def pwritev_all(fd: int, pieces: list[memoryview], at: int) -> None:
    """Write ``pieces`` back to back from file offset ``at``: up to :data:`IO_CHUNK` bytes per system call,
    and on until every byte is written (a short write goes on where it stopped)."""
    queue: list[memoryview] = []
    for piece in pieces:  # pieces larger than one write are cut at IO_CHUNK (a multiple of DIRECT_ALIGN)
        queue += [piece[start : start + IO_CHUNK] for start in range(0, len(piece), IO_CHUNK)]
    queue.reverse()  # popped from the end
    while queue:
        batch: list[memoryview] = []
        size = 0
        while queue and len(batch) < _IOV_MAX and size + len(queue[-1]) <= IO_CHUNK:
            batch.append(queue.pop())
            size += len(batch[-1])
        written = os.pwritev(fd, batch, at)
        if written <= 0:
            raise OSError(errno.EIO, "a direct write wrote nothing")
        at += written
        if written < size:  # put back what was not written, the cut piece first
            left = written
            for index, piece in enumerate(batch):
                if left < len(piece):
                    queue += reversed([piece[left:], *batch[index + 1 :]])
                    break
                left -= len(piece)


@dataclass
class _Run:
    """Pieces of entries that lie back to back in the file, written with one ``pwritev`` call or a few."""

    at: int  # file offset of the first byte
    pieces: list[memoryview] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)  # index of the entry each piece belongs to
    size: int = 0
    future: Future[None] | None = None


class DirectWrites:
    """Collects whole-block pieces of entries (:meth:`add`) and writes them with O_DIRECT on
    :data:`IO_THREADS` threads, a run of back-to-back pieces at a time, each run started as soon as it
    reaches :data:`IO_CHUNK` or the next piece does not continue it (the disk works while the caller goes on).

    Use as a context manager: leaving it waits for every write still running (even on error), so that the
    arena and the descriptor outlive them."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="shard-io")
        self._open: _Run | None = None
        self._runs: list[_Run] = []

    def __enter__(self) -> DirectWrites:
        return self

    def __exit__(self, *exc: object) -> None:
        for run in self._runs:
            if run.future is not None:
                run.future.cancel()
        self._pool.shutdown(wait=True)

    def add(self, entry: int, piece: memoryview, at: int) -> None:
        """Write ``piece`` (whole DIRECT_ALIGN blocks of aligned memory) at file offset ``at`` (aligned)."""
        run = self._open
        if run is None or run.at + run.size != at or run.size + len(piece) > IO_CHUNK:
            self.flush()
            run = self._open = _Run(at)
        run.pieces.append(piece)
        run.entries.append(entry)
        run.size += len(piece)
        if run.size >= IO_CHUNK:
            self.flush()

    def flush(self) -> None:
        """Start writing the run being collected."""
        run, self._open = self._open, None
        if run is not None:
            run.future = self._pool.submit(pwritev_all, self.fd, run.pieces, run.at)
            self._runs.append(run)

    def finish(self) -> set[int]:
        """Wait for every write; the entries whose direct write the file system refused (EINVAL: written
        through the page cache instead by the caller). Any other error (disk full, I/O error) is raised."""
        self.flush()
        refused: set[int] = set()
        for run in self._runs:
            assert run.future is not None
            try:
                run.future.result()
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                refused.update(run.entries)
        return refused


class Writeback:
    """Starts the disk writes of what the file has in the page cache so far, without waiting for them
    (``sync_file_range``).

    Why: below the dirty-page thresholds (10 % of RAM by default, many GiB on a training node) the kernel
    writes nothing back until the final fsync, so copying into the page cache and writing to disk would
    happen one after the other. Started every ``WRITEBACK_EVERY`` bytes, the disk works while the next
    entries are copied. Linux only; elsewhere (or when the call is refused) it does nothing and the fsync
    does all the work."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = 0
        self._call: Callable[[int, int, int, int], int] | None = None
        try:
            call = ctypes.CDLL(None, use_errno=True).sync_file_range
            call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        except (OSError, AttributeError):
            return
        self._call = call

    def wrote(self, nbytes: int) -> None:
        """``nbytes`` more went into the page cache."""
        self.pending += nbytes
        if self._call is not None and self.pending >= WRITEBACK_EVERY:
            self.pending = 0
            if self._call(self.fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
                self._call = None  # e.g. a file system that refuses it: the final fsync still makes it durable
