"""The snapshot writer: a separate process that turns a rank's staged state into a durable HDF5 shard.

Why a process: the training loop must not wait for the disk, and a thread in the rank would still take the
rank's GIL for every h5py call and checksum loop. The rank copies its state into a shared-memory arena (a file
under /dev/shm that both processes map), then sends one JSON line on this process's stdin; this process
checksums and writes the entries, fsyncs and renames the shard, and answers one JSON line per phase on stdout.
It imports neither torch nor anything of TorchPass, and dies with the rank that started it.

The requests and answers are :mod:`clockworkd.snapshots.messages`: one JSON line each, a write request in, one
answer per phase out (the shard; on the finalizing rank also the manifest). A failed phase (disk full, I/O
error, a peer's shard missing) answers ``ok: false`` with the error: the snapshot does not exist, older ones
are untouched.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from clockworkd.snapshots.messages import Entry, FinalizeSpec, Phase, WriterAnswer, WriteRequest
from clockworkd.snapshots.store import (
    FAILED_PREFIX,
    NICE_INCREMENT,
    SnapshotCorrupt,
    apply_retention,
    crc32,
    durable_write,
    manifest_body,
    shard_name,
    write_manifest,
)

#: Threads that checksum entries while the writer writes them.
CRC_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))
#: Direct writes in flight at once (a device works best with more than one request queued).
IO_THREADS = 2
#: Largest single direct write.
IO_CHUNK = 64 << 20
#: Alignment of file offsets, memory and lengths for O_DIRECT (the largest logical block size in common use).
DIRECT_ALIGN = 4096
#: Written bytes after which the kernel is told to start writing them out (see :class:`_Writeback`).
WRITEBACK_EVERY = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:
        os._exit(1)


class _Writeback:
    """Starts the disk writes of what the shard has so far, without waiting for them (``sync_file_range``).

    For entries written through the page cache (see :func:`write_shard`). Why: below the dirty-page thresholds
    (10 % of RAM by default, many GiB on a training node) the kernel writes nothing back until the final
    fsync, so copying into the page cache and writing to disk would happen one after the other. Started every
    ``WRITEBACK_EVERY`` bytes, the disk works while the next entries are copied. Linux only; elsewhere (or
    when the call is refused) it does nothing and the fsync does all the work."""

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
        self.pending += nbytes
        if self._call is not None and self.pending >= WRITEBACK_EVERY:
            self.pending = 0
            if self._call(self.fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
                self._call = None  # e.g. a file system that refuses it: the final fsync still makes it durable


def _open_direct(path: Path) -> int | None:
    """A second descriptor on ``path`` with O_DIRECT, or None where the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def write_shard(arena: mmap.mmap, path: Path, entries: Sequence[Entry], *, direct: bool = True) -> int:
    """Write every entry from the arena into ``path`` durably; returns the bytes of entry data.

    The file is HDF5, one dataset per entry, the data of each large entry at a 4 KiB-aligned place allocated
    when the dataset is created. With ``direct`` (and a file system that allows it), that data goes from the
    arena to the disk with O_DIRECT writes, ``IO_THREADS`` in flight: no copy into the page cache, which on a
    fast disk is the bottleneck (measured here: 0.5-1.2 GB/s through the page cache, 2.1-3.2 GB/s direct,
    against 2.3-3.5 GB/s for ``dd oflag=direct``). HDF5 writes its own metadata and the few bytes past the
    last whole block of each entry through the page cache; the final fsync covers both. Small entries, and
    every entry where O_DIRECT is refused, go through HDF5 with early writeback (:class:`_Writeback`). The
    CRC-32s are computed on other threads meanwhile (zlib releases the GIL)."""
    total = 0
    views = [np.frombuffer(arena, dtype=np.uint8, count=e.nbytes, offset=e.offset) for e in entries]
    source = memoryview(arena)

    def write(tmp: Path) -> None:
        nonlocal total
        # Datasets of DIRECT_ALIGN bytes or more start at DIRECT_ALIGN-aligned file offsets; their space is
        # allocated at creation, never filled (we write every byte).
        with (
            ThreadPoolExecutor(max_workers=CRC_THREADS) as sums_pool,
            ThreadPoolExecutor(max_workers=IO_THREADS) as io_pool,
            h5py.File(tmp, "w", alignment_threshold=DIRECT_ALIGN, alignment_interval=DIRECT_ALIGN) as f,
        ):
            sums = [sums_pool.submit(crc32, data) for data in views]
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            fd = _open_direct(tmp) if direct else None
            dsets: list[Any] = []
            pending: list[tuple[int, int, Any]] = []  # (entry index, bytes written direct, future)
            try:
                # Each entry's direct write starts as soon as its dataset exists (the disk works while the
                # next ones are created); the attributes are set while the writes run.
                for i, entry in enumerate(entries):
                    dset = f.create_dataset(entry.name, shape=(entry.nbytes,), dtype=np.uint8, dcpl=dcpl)
                    dsets.append(dset)
                    bulk = entry.nbytes // DIRECT_ALIGN * DIRECT_ALIGN
                    at = dset.id.get_offset()
                    aligned = at is not None and at % DIRECT_ALIGN == 0 and entry.offset % DIRECT_ALIGN == 0
                    if fd is not None and bulk and aligned:
                        src = source[entry.offset : entry.offset + bulk]
                        pending.append((i, bulk, io_pool.submit(_pwrite_all, fd, src, at)))
                direct_bytes = {i: bulk for i, bulk, _future in pending}
                writeback = _Writeback(f.id.get_vfd_handle())
                for i, (data, dset) in enumerate(zip(views, dsets, strict=True)):
                    done = direct_bytes.get(i, 0)
                    if done < data.size:  # small entries and tails, through HDF5
                        dset.write_direct(data, np.s_[done:], np.s_[done:])
                        writeback.wrote(data.size - done)
                for entry, dset, crc in zip(entries, dsets, sums, strict=True):
                    dset.attrs["crc32"] = crc.result()
                    dset.attrs["dtype"] = entry.dtype
                    dset.attrs["shape"] = json.dumps(list(entry.shape))
                    total += entry.nbytes
                for i, bulk, future in pending:
                    try:
                        future.result()
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise  # disk full, I/O error: this snapshot fails
                        dsets[i].write_direct(views[i], np.s_[:bulk], np.s_[:bulk])  # refused after all
            finally:
                for _i, _bulk, future in pending:
                    future.cancel()
                if fd is not None:
                    io_pool.shutdown(wait=True)
                    os.close(fd)

    durable_write(path, write)
    return total


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    """Write all of ``data`` at file offset ``at``, in chunks of at most ``IO_CHUNK``."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + IO_CHUNK], at + done)


def finalize(folder: Path, own_error: str, spec: FinalizeSpec) -> tuple[str, ...]:
    """Wait for every rank's shard, then write the manifest and apply retention; the folders removed."""
    deadline = time.monotonic() + spec.timeout_s
    wanted = [folder / shard_name(r) for r in range(spec.world_size)]
    while True:
        if own_error:
            raise SnapshotCorrupt(f"this rank's own shard failed: {own_error}")
        failed = sorted(p.name for p in folder.glob(f"{FAILED_PREFIX}*"))
        if failed:
            raise SnapshotCorrupt(f"shard(s) failed on other ranks: {', '.join(failed)}")
        missing = [p.name for p in wanted if not p.exists()]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise SnapshotCorrupt(f"shards {missing[:4]} not written within {spec.timeout_s} s")
        time.sleep(0.05)
    body = manifest_body(
        folder, step=spec.step, world_size=spec.world_size, job=spec.job, tensors=spec.tensors, extra=spec.extra
    )
    write_manifest(folder, body)
    return tuple(str(p) for p in apply_retention(spec.directory, spec.keep))


class _Arena:
    """The rank's arena, mapped once and kept (mapping 1 GiB afresh costs a page fault per 4 KiB each time)."""

    def __init__(self) -> None:
        self.key: tuple[str, int] = ("", 0)
        self.mapping: mmap.mmap | None = None

    def map(self, path: str, arena_id: int) -> mmap.mmap:
        """The mapping of ``path`` (``/proc/PID/fd/N`` of an unlinked file); ``arena_id`` tells a new arena that
        reuses the same descriptor number from the one mapped before."""
        if (path, arena_id) != self.key or self.mapping is None:
            self.close()
            with open(path, "rb") as fh:
                self.mapping = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
            self.key = (path, arena_id)
        return self.mapping

    def close(self) -> None:
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:
                pass  # a failed write's traceback still holds a view; unmapped when it goes
        self.mapping, self.key = None, ("", 0)


_ARENA = _Arena()


def _mark_failed(folder: Path, rank: int, error: str) -> None:
    try:
        (folder / f"{FAILED_PREFIX}{rank:05d}").write_text(error[:2000])
    except OSError:
        pass  # the disk may be full: the finalizing rank then times out instead


def handle(request: WriteRequest) -> list[WriterAnswer]:
    """Serve one write request; the answers to print."""
    folder = Path(request.folder)
    answers: list[WriterAnswer] = []
    started = time.monotonic()
    shard_error = ""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        arena = _ARENA.map(request.arena, request.arena_id)
        nbytes = write_shard(arena, folder / shard_name(request.rank), request.entries)
        answers.append(WriterAnswer(request.id, Phase.SHARD, True, bytes=nbytes, seconds=time.monotonic() - started))
    except Exception as exc:  # disk full, I/O error, a bad request: this snapshot fails, the writer lives on
        shard_error = f"{type(exc).__name__}: {exc}"
        _mark_failed(folder, request.rank, shard_error)
        answers.append(WriterAnswer(request.id, Phase.SHARD, False, error=shard_error))
    if request.finalize is not None:
        try:
            removed = finalize(folder, shard_error, request.finalize)
            answers.append(
                WriterAnswer(request.id, Phase.MANIFEST, True, seconds=time.monotonic() - started, removed=removed)
            )
        except Exception as exc:
            answers.append(WriterAnswer(request.id, Phase.MANIFEST, False, error=f"{type(exc).__name__}: {exc}"))
    return answers


def main() -> int:
    """Serve requests from stdin until it closes."""
    _die_with_parent()
    try:
        os.nice(NICE_INCREMENT)
    except OSError:
        pass  # not permitted here: the writer runs at the rank's priority
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = WriteRequest.from_line(line)
        except ValueError as exc:
            print(WriterAnswer(None, Phase.REQUEST, False, error=str(exc)).to_line(), flush=True)
            continue
        for answer in handle(request):
            print(answer.to_line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
