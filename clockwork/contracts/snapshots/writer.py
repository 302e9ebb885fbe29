"""The snapshot writer: a separate process that turns a rank's staged state into a durable HDF5 shard.

Why a process: the training loop must not wait for the disk, and a thread in the rank would still take the
rank's GIL for every h5py call and checksum loop. The rank copies its state into a shared-memory arena (a file
under /dev/shm that both processes map), then sends one JSON line on this process's stdin; this process
checksums and writes the entries, fsyncs and renames the shard, and answers one JSON line per phase on stdout.
It imports neither torch nor anything of TorchPass, and dies with the rank that started it.

The requests and answers are :mod:`clockwork.contracts.snapshots.messages`: one JSON line each, a write request in, one
answer per phase out (the shard; on the finalizing rank also the manifest). A failed phase (disk full, I/O
error, a peer's shard missing) answers ``ok: false`` with the error: the snapshot does not exist, older ones
are untouched.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np

from clockwork.contracts import atomic_file
from clockwork.contracts.snapshots.direct_io import DIRECT_ALIGN, IO_CHUNK, DirectWrites, Writeback, open_direct
from clockwork.contracts.snapshots.messages import (
    Entry,
    FinalizeSpec,
    Phase,
    PieceReady,
    WriterAnswer,
    WriteRequest,
    pieces,
)
from clockwork.contracts.snapshots.store import (
    DATA,
    FAILED_PREFIX,
    FORMAT,
    INDEX,
    NICE_INCREMENT,
    SnapshotCorrupt,
    apply_retention,
    crc32,
    manifest_body,
    shard_name,
    write_manifest,
)

#: Threads that checksum entries while the writer writes them (one checksums several GB/s: see store.crc32).
CRC_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:
        os._exit(1)


def write_shard(arena: mmap.mmap, path: Path, entries: Sequence[Entry], *, direct: bool = True) -> int:
    """Write every entry from the arena into ``path`` durably (format ``clockwork-snapshot/2``, see
    :mod:`clockwork.contracts.snapshots.store`); returns the bytes of entry data.

    The arena's bytes from the first entry to the end of the last go into one dataset, byte for byte (the
    entries keep their 4 KiB-aligned places), its space allocated when it is created: with ``direct`` (and a
    file system that allows it) its whole blocks go from the arena to the disk with O_DIRECT, in writes of up
    to 64 MiB (:class:`~clockwork.contracts.snapshots.direct_io.DirectWrites`), the same sequential stream as the
    ``dd`` it is measured against; the last partial block, the index and HDF5's metadata go through the page
    cache, which the final fsync covers. Elsewhere everything goes through the page cache with early
    writeback. The CRC-32s are computed on other threads meanwhile."""
    if not entries:
        raise ValueError("a shard needs at least one entry")
    base = min(e.offset for e in entries) // DIRECT_ALIGN * DIRECT_ALIGN
    end = max(e.offset + e.nbytes for e in entries)
    views = [np.frombuffer(arena, dtype=np.uint8, count=e.nbytes, offset=e.offset) for e in entries]
    source = memoryview(arena)[base:end]
    data = np.frombuffer(arena, dtype=np.uint8, count=end - base, offset=base)

    def write(tmp: Path) -> None:
        with (
            ThreadPoolExecutor(max_workers=CRC_THREADS, thread_name_prefix="shard-crc") as sums_pool,
            h5py.File(tmp, "w", alignment_threshold=DIRECT_ALIGN, alignment_interval=DIRECT_ALIGN) as f,
        ):
            sums = [sums_pool.submit(crc32, view) for view in views]
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # its place is known now; never filled: we write it all
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            dset = f.create_dataset(DATA, shape=(end - base,), dtype=np.uint8, dcpl=dcpl)
            at = dset.id.get_offset()
            bulk = (end - base) // DIRECT_ALIGN * DIRECT_ALIGN
            fd = open_direct(tmp) if direct and bulk and at is not None and at % DIRECT_ALIGN == 0 else None
            if fd is None:
                _write_buffered(f, dset, data, 0)
                _write_index(f, entries, base, sums)
                return
            try:
                with DirectWrites(fd) as writes:  # leaving it waits for every write, even on error
                    for start in range(0, bulk, IO_CHUNK):
                        writes.add(0, source[start : min(bulk, start + IO_CHUNK)], at + start)
                    writes.flush()
                    _write_buffered(f, dset, data, bulk)  # the last partial block
                    _write_index(f, entries, base, sums)
                    if writes.finish():  # refused after all (EINVAL): through the page cache
                        _write_buffered(f, dset, data[:bulk], 0)
            finally:
                os.close(fd)

    atomic_file.write_with(path, write)
    return sum(e.nbytes for e in entries)


def write_shard_windowed(
    arena: mmap.mmap,
    path: Path,
    entries: Sequence[Entry],
    window: int,
    ready: Callable[[int], None],
    written: Callable[[int], None],
) -> int:
    """:func:`write_shard` through an arena of ``window`` bytes: the same file, byte for byte, written a piece at
    a time. ``ready(i)`` returns once the rank has put piece ``i`` at the arena's start, ``written(i)`` tells it
    the arena may be filled again. Each entry's CRC-32 is carried from piece to piece. Written through the
    page cache (early writeback every few MiB), not O_DIRECT: the bulk path wants the whole shard mapped."""
    if not entries:
        raise ValueError("a shard needs at least one entry")
    cuts = pieces(list(entries), window)
    base, end = cuts[0][0], cuts[-1][1]
    if max(hi - lo for lo, hi in cuts) > len(arena):
        raise ValueError(f"a piece of {window} bytes does not fit the {len(arena)}-byte arena")
    crcs = [0] * len(entries)

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w", alignment_threshold=DIRECT_ALIGN, alignment_interval=DIRECT_ALIGN) as f:
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            dset = f.create_dataset(DATA, shape=(end - base,), dtype=np.uint8, dcpl=dcpl)
            writeback = Writeback(f.id.get_vfd_handle())
            for index, (lo, hi) in enumerate(cuts):
                ready(index)
                data = np.frombuffer(arena, dtype=np.uint8, count=hi - lo)
                for at in range(0, hi - lo, IO_CHUNK):
                    upto = min(hi - lo, at + IO_CHUNK)
                    dset.write_direct(data, np.s_[at:upto], np.s_[lo - base + at : lo - base + upto])
                    writeback.wrote(upto - at)
                for k, e in enumerate(entries):
                    first, last = max(lo, e.offset), min(hi, e.offset + e.nbytes)
                    if first < last:
                        crcs[k] = crc32(memoryview(arena)[first - lo : last - lo], crcs[k])
                del data
                written(index)
            done: list[Future[int]] = []
            for value in crcs:
                future: Future[int] = Future()
                future.set_result(value)
                done.append(future)
            _write_index(f, entries, base, done)

    atomic_file.write_with(path, write)
    return sum(e.nbytes for e in entries)


def _write_buffered(f: h5py.File, dset: h5py.Dataset, data: np.ndarray, start: int) -> None:
    """Write ``data[start:]`` into ``dset`` at the same place through HDF5 and the page cache, telling the
    kernel to start writing every WRITEBACK_EVERY bytes."""
    writeback = Writeback(f.id.get_vfd_handle())
    for lo in range(start, data.size, IO_CHUNK):
        hi = min(data.size, lo + IO_CHUNK)
        dset.write_direct(data, np.s_[lo:hi], np.s_[lo:hi])
        writeback.wrote(hi - lo)


def _write_index(f: h5py.File, entries: Sequence[Entry], base: int, sums: list[Future[int]]) -> None:
    """The shard's list of entries (their places in the data, sizes, checksums, dtypes, shapes) and format."""
    index = [
        {
            "name": e.name,
            "offset": e.offset - base,
            "nbytes": e.nbytes,
            "crc32": crc.result(),
            "dtype": e.dtype,
            "shape": list(e.shape),
        }
        for e, crc in zip(entries, sums, strict=True)
    ]
    f.create_dataset(INDEX, data=np.frombuffer(json.dumps(index).encode(), dtype=np.uint8))
    f.attrs["format"] = FORMAT


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
        folder,
        step=spec.step,
        world_size=spec.world_size,
        job=spec.job,
        tensors=spec.tensors,
        mesh=spec.mesh,
        extra=spec.extra,
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


class PieceChannel:
    """The rank's side of a windowed request, over this process's stdin and stdout."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id

    def ready(self, index: int) -> None:
        """Wait for the rank's word that piece ``index`` is in the arena (ValueError for anything else)."""
        line = sys.stdin.readline()
        if not line:
            raise ValueError(f"the rank went away before piece {index}")
        piece = PieceReady.from_line(line)
        if (piece.id, piece.index) != (self.request_id, index):
            raise ValueError(f"expected piece {index} of request {self.request_id}, got {line.strip()[:200]!r}")

    def written(self, index: int) -> None:
        print(WriterAnswer(self.request_id, Phase.PIECE, True, index=index).to_line(), flush=True)


def handle(request: WriteRequest, channel: PieceChannel | None = None) -> list[WriterAnswer]:
    """Serve one write request; the answers to print. A windowed request (``window``) reads its pieces through
    ``channel`` (:class:`PieceChannel` over stdin and stdout unless a test gives another)."""
    folder = Path(request.folder)
    answers: list[WriterAnswer] = []
    started = time.monotonic()
    shard_error = ""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        arena = _ARENA.map(request.arena, request.arena_id)
        path = folder / shard_name(request.rank)
        if request.window:
            channel = channel or PieceChannel(request.id)
            nbytes = write_shard_windowed(arena, path, request.entries, request.window, channel.ready, channel.written)
        else:
            nbytes = write_shard(arena, path, request.entries)
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
        if '"op": "piece"' in line:
            continue  # a piece of a request that already failed: its answer was sent
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
