"""dcgm-exporter's HPC job mapping: which job holds which GPU, so every DCGM metric carries the job.

dcgm-exporter started with ``--hpc-job-mapping-dir DIR`` reads, at every scrape, each regular file in DIR whose
name is an integer (a GPU index; any other name is skipped) and labels that GPU's metrics with each line of the
file as a job ID (``hpc_job``). Several jobs may share a GPU (sharding, MPS, oversubscription), so a file holds
one line per job.

The Prolog adds the job to the file of every GPU index it holds; the Epilog takes the job out of every file (it
needs no GPU list, so an Epilog whose environment lacks one still cleans up) and removes a file left empty. Two
jobs' hooks on one node may update the same file at once: each update is a read-modify-write under an exclusive
lock on a file in DIR (``.clockwork.lock``, which dcgm-exporter skips), written with
:mod:`clockwork.contracts.atomic_file`, so dcgm-exporter never reads half a file and no job's line is lost.

Off unless ``[hooks] gpu_job_map_dir`` is set. Failures are logged by the caller and never fail a hook.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from clockwork.contracts.atomic_file import write_text

__all__ = ["LOCK_NAME", "add_job", "jobs_on", "parse_gpu_indices", "remove_job"]

log = logging.getLogger("clockwork.hooks")

#: The lock every update of the folder takes; not an integer, so dcgm-exporter never reads it as a GPU.
LOCK_NAME = ".clockwork.lock"
#: Where Slurm names a job's GPUs in the Prolog, best first: SLURM_JOB_GPUS (the node's GPU indices of the
#: allocation), then CUDA_VISIBLE_DEVICES (set from the same indices where gres.conf has no AutoDetect quirk).
GPU_ENV = ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")


def parse_gpu_indices(env: Mapping[str, str]) -> tuple[int, ...]:
    """The GPU indices the job holds on this node, from the first of :data:`GPU_ENV` that is set.

    Comma-separated indices or ranges (``0,2-3``). An entry that is no index (a ``GPU-...``/``MIG-...`` UUID, or
    ``NoDevFiles``) is skipped with a warning: dcgm-exporter reads only files named by an index.
    """
    for name in GPU_ENV:
        value = env.get(name, "").strip()
        if not value:
            continue
        found: list[int] = []
        for entry in (e.strip() for e in value.split(",")):
            first, _, last = entry.partition("-")
            if first.isdigit() and (not last or last.isdigit()):
                found.extend(range(int(first), int(last or first) + 1))
            elif entry:
                log.warning("%s entry %r is not a GPU index; dcgm-exporter's job mapping skips it", name, entry)
        return tuple(sorted(set(found)))
    return ()


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def jobs_on(path: Path) -> list[str]:
    """The job IDs in one GPU's file (none when it is missing), in file order."""
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _store(path: Path, jobs: Sequence[str]) -> None:
    if jobs:
        write_text(path, "".join(f"{job}\n" for job in jobs), mode=0o644)
    else:
        path.unlink(missing_ok=True)


def add_job(folder: Path, job_id: int, gpus: Sequence[int]) -> list[Path]:
    """Add ``job_id`` to the file of each GPU index in ``gpus`` (created as needed); returns the files
    changed. A job already listed is not added twice (a Prolog run again after a requeue)."""
    changed: list[Path] = []
    if not gpus:
        return changed
    with _locked(folder):
        for gpu in gpus:
            path = folder / str(gpu)
            jobs = jobs_on(path)
            if str(job_id) not in jobs:
                _store(path, [*jobs, str(job_id)])
                changed.append(path)
    return changed


def remove_job(folder: Path, job_id: int) -> list[Path]:
    """Take ``job_id`` out of every GPU file in ``folder``; a file left empty is removed. Returns the files
    changed (none when the folder does not exist: the Prolog never wrote one)."""
    changed: list[Path] = []
    if not folder.is_dir():
        return changed
    with _locked(folder):
        for path in sorted(folder.iterdir()):
            if not path.name.isdigit() or not path.is_file():
                continue
            jobs = jobs_on(path)
            if str(job_id) in jobs:
                _store(path, [job for job in jobs if job != str(job_id)])
                changed.append(path)
    return changed
