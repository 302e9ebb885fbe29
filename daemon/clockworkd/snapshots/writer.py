"""The snapshot writer: a separate process that turns a rank's staged state into a durable HDF5 shard.

Why a process: the training loop must not wait for the disk, and a thread in the rank would still take the
rank's GIL for every h5py call and checksum loop. The rank copies its state into a shared-memory arena (a file
under /dev/shm that both processes map), then sends one JSON line on this process's stdin; this process
checksums and writes the entries, fsyncs and renames the shard, and answers one JSON line per phase on stdout.
It imports neither torch nor anything of TorchPass, and dies with the rank that started it.

Request (one line)::

    {"op": "write", "id": 7, "arena": "/proc/PID/fd/N", "arena_id": 1234, "folder": ".../step-0000000123", "rank": 0,
     "entries": [[name, offset, nbytes, dtype, shape], ...],
     "finalize": null | {"world_size": 4, "step": 123, "job": "42", "tensors": 310, "keep": 3,
                          "directory": "...", "timeout_s": 600}}

Answers: ``{"id": 7, "phase": "shard", "ok": true, "bytes": N, "seconds": S}`` and, on the finalizing rank,
``{"id": 7, "phase": "manifest", "ok": true, ...}``; ``ok: false`` with ``error`` when a phase failed (disk
full, I/O error, a peer's shard missing): the snapshot does not exist, older ones are untouched.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np

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

#: Threads that checksum entries while the writer copies them into the shard.
CRC_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))
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

    Why: below the dirty-page thresholds (10 % of RAM by default, many GiB on a training node) the kernel
    writes nothing back until the final fsync, so copying the shard into the page cache and writing it to disk
    would happen one after the other. Started every ``WRITEBACK_EVERY`` bytes, the disk works while the next
    entries are copied, and the fsync only waits for the tail. Linux only; elsewhere (or when the call is
    refused) it does nothing and the fsync does all the work, as before."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = 0
        try:
            self._call = ctypes.CDLL(None, use_errno=True).sync_file_range
            self._call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        except (OSError, AttributeError):
            self._call = None

    def wrote(self, nbytes: int) -> None:
        self.pending += nbytes
        if self._call is not None and self.pending >= WRITEBACK_EVERY:
            self.pending = 0
            if self._call(self.fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
                self._call = None  # e.g. a file system that refuses it: the final fsync still makes it durable


def write_shard(arena: mmap.mmap, path: Path, entries: list[list[Any]]) -> int:
    """Write every entry from the arena into ``path`` durably; returns the bytes of entry data."""
    total = 0

    views = [np.frombuffer(arena, dtype=np.uint8, count=int(e[2]), offset=int(e[1])) for e in entries]

    def write(tmp: Path) -> None:
        nonlocal total
        # The checksums run on other cores while the entries are copied into the file: zlib releases the GIL,
        # so writing is not held up by checksumming one entry after another (measured on an H200 machine: CRC
        # then write in series reached 0.54 of the disk's bandwidth).
        with ThreadPoolExecutor(max_workers=CRC_THREADS) as pool, h5py.File(tmp, "w") as f:
            sums = [pool.submit(crc32, data) for data in views]
            writeback = _Writeback(f.id.get_vfd_handle())
            for (name, _offset, nbytes, dtype, shape), data, crc in zip(entries, views, sums, strict=True):
                dset = f.create_dataset(name, data=data) if nbytes else f.create_dataset(name, (0,), dtype=np.uint8)
                writeback.wrote(int(nbytes))
                dset.attrs["crc32"] = crc.result()
                dset.attrs["dtype"] = str(dtype)
                dset.attrs["shape"] = json.dumps([int(v) for v in shape])
                total += int(nbytes)

    durable_write(path, write)
    return total


def finalize(folder: Path, own_error: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Wait for every rank's shard, then write the manifest and apply retention."""
    world = int(spec["world_size"])
    deadline = time.monotonic() + float(spec["timeout_s"])
    wanted = [folder / shard_name(r) for r in range(world)]
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
            raise SnapshotCorrupt(f"shards {missing[:4]} not written within {spec['timeout_s']} s")
        time.sleep(0.05)
    body = manifest_body(
        folder,
        step=int(spec["step"]),
        world_size=world,
        job=str(spec.get("job", "")),
        tensors=int(spec["tensors"]),
        extra=spec.get("extra"),
    )
    write_manifest(folder, body)
    removed = apply_retention(spec["directory"], int(spec["keep"]))
    return {"removed": [str(p) for p in removed]}


class _Arena:
    """The rank's arena, mapped once and kept (mapping 1 GiB afresh costs a page fault per 4 KiB each time)."""

    def __init__(self) -> None:
        self.key: tuple[str, Any] = ("", None)
        self.mapping: mmap.mmap | None = None

    def map(self, path: str, arena_id: Any) -> mmap.mmap:
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
        self.mapping, self.key = None, ("", None)


_ARENA = _Arena()


def _mark_failed(folder: Path, rank: int, error: str) -> None:
    try:
        (folder / f"{FAILED_PREFIX}{rank:05d}").write_text(error[:2000])
    except OSError:
        pass  # the disk may be full: the finalizing rank then times out instead


def handle(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Serve one write request; the answers to print."""
    req_id, rank = request["id"], int(request["rank"])
    folder = Path(request["folder"])
    answers: list[dict[str, Any]] = []
    started = time.monotonic()
    shard_error = ""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        arena = _ARENA.map(request["arena"], request.get("arena_id"))
        nbytes = write_shard(arena, folder / shard_name(rank), request["entries"])
        answers.append(
            {"id": req_id, "phase": "shard", "ok": True, "bytes": nbytes, "seconds": time.monotonic() - started}
        )
    except Exception as exc:  # disk full, I/O error, a bad request: this snapshot fails, the writer lives on
        error = f"{type(exc).__name__}: {exc}"
        shard_error = error
        _mark_failed(folder, rank, error)
        answers.append({"id": req_id, "phase": "shard", "ok": False, "error": error})
    spec = request.get("finalize")
    if spec:
        try:
            extra = finalize(folder, shard_error, spec)
            answers.append(
                {"id": req_id, "phase": "manifest", "ok": True, "seconds": time.monotonic() - started, **extra}
            )
        except Exception as exc:
            answers.append({"id": req_id, "phase": "manifest", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
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
            request = json.loads(line)
        except ValueError as exc:
            print(json.dumps({"id": None, "phase": "request", "ok": False, "error": str(exc)}), flush=True)
            continue
        for answer in handle(request):
            print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
