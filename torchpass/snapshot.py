"""Snapshots of the training state that cost the training loop a memory copy, and restores that never load a
bad one.

Taking one (:class:`Snapshotter`, at a step boundary right after a commit, on every rank at the same step):

1. the state TorchPass already moves between ranks (:func:`torchpass.state.describe`: model parameters and
   buffers, optimizers, registered objects, the committed step, which is also the data position) is laid out
   in a shared-memory arena (a file under /dev/shm, mapped by the rank and by its writer process). Tensors
   are spread over the data-parallel replicas, which all hold the same values: each tensor is staged and
   written by one replica only (greedy by size, the same plan on every rank), and rank 0 also stages the
   state's description. Each rank adds its own state (RNG generators, slot, data position);
2. parameters and optimizer state, which only an optimizer step changes, are copied while the next
   forward and backward pass run, and the next optimizer step waits for that copy (:meth:`before_update`):
   on the GPU with non-blocking copies on a side stream (the arena page-locked with ``cudaHostRegister``;
   the GPU waits, not the host), on the CPU by the snapshot thread (``Tensor.copy_`` releases the GIL).
   Anything a forward pass may change (buffers) and the rank's own small state are copied at the boundary
   (on the compute stream for GPU tensors). A recovery that may overwrite the state waits for the copies
   first. Then the snapshot thread hands the arena to the writer process
   (:mod:`clockworkd.snapshots.writer`), which checksums, writes and fsyncs the shard while training goes on.
   Parameters and optimizer state must therefore change only inside the wrapped ``optimizer.step()``;
3. rank 0's writer waits for every shard, writes the manifest (the snapshot now exists) and applies
   retention. If the writer is still busy with the previous snapshot when the next is due, the new one is
   skipped (logged, ``torchpass.snapshot_skipped``): training never waits for the disk. A write error fails
   that snapshot only (logged, ``torchpass.snapshot_failed``); older snapshots stay.

Restoring (:func:`restore`): the newest snapshot in the folder whose manifest and every checksum verify on
every rank is loaded (ranks agree with one all-reduce per candidate); a damaged or partial one is reported
(``torchpass.snapshot_rejected``) and the previous one is tried. None good is an error, never a silent fresh
start. Loading gives back every byte of the state, so training resumed at (snapshot step + 1) ends bitwise
equal to a run that never stopped: batches and RNG streams are functions of the step (:mod:`torchpass.data`,
:mod:`torchpass.rng`); the saved RNG states are restored too, for randomness drawn outside ``ctx.steps``.

The state description is pickled into the snapshot, like ``torch.load(weights_only=False)``: load only
snapshots your own jobs wrote.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clockworkd.snapshots.store import (
    FAILED_PREFIX,
    NICE_INCREMENT,
    SnapshotCorrupt,
    list_snapshots,
    load_manifest,
    read_entries,
    shard_name,
    snapshot_path,
)
from torchpass.config import TorchPassConfig
from torchpass.events import EventSink, emit, emit_at
from torchpass.state import StateParts, _apply, _as_bytes, _destinations, describe

__all__ = ["RestoreError", "Snapshotter", "restore", "restore_target", "snapshot_directory"]

ALIGN = 4096
# What Slurm sets in a requeued job's environment (sbatch(1), "SLURM_RESTART_COUNT"); the longer spelling is
# accepted too, as some site wrappers and documents use it.
ENV_RESTART_COUNTS = ("SLURM_RESTART_COUNT", "SLURM_JOB_RESTART_COUNT")


class RestoreError(RuntimeError):
    """No snapshot could be restored where one was required (the message lists what was tried)."""


def snapshot_directory(config: TorchPassConfig, environ: Mapping[str, str] | None = None) -> Path:
    """The job's snapshot folder: ``snapshot_dir`` with ``{job}`` replaced by the Slurm job id (or ``local``)."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID", "") or "local"
    return Path(config.snapshot_dir.replace("{job}", job)).expanduser().absolute()


def restore_target(config: TorchPassConfig, environ: Mapping[str, str] | None = None) -> tuple[Path | None, bool]:
    """Where to restore from, and whether restoring is required (an explicit request) or only implied.

    ``restore = "auto"`` restores after a Slurm requeue (``SLURM_RESTART_COUNT`` > 0) and is not required:
    a job requeued before its first snapshot was written starts fresh, with a warning (there is nothing it
    could have resumed). ``"latest"`` or a path is required: nothing good there is an error."""
    env = os.environ if environ is None else environ
    choice = config.restore
    if choice == "never":
        return None, False
    if choice == "auto":
        restarts = 0
        for name in ENV_RESTART_COUNTS:
            try:
                restarts = max(restarts, int(env.get(name, "0") or 0))
            except ValueError:
                pass
        return (snapshot_directory(config, env), False) if restarts > 0 else (None, False)
    if choice == "latest":
        return snapshot_directory(config, env), True
    return Path(choice).expanduser().absolute(), True


# ===== taking snapshots =============================================================================


@dataclass
class _Entry:
    name: str
    tensor: torch.Tensor  # the live tensor (or a CPU uint8 tensor of bytes)
    offset: int
    nbytes: int
    side_stream: bool  # parameters and optimizer state: changed only by the optimizer step


def _plan(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each tensor: largest first to the least-loaded rank (the same on every rank)."""
    loads = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += sizes[i]
    return owner


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _rank_state(slot: int, committed: int, seed: int) -> dict[str, torch.Tensor]:
    """This rank's own state: RNG generators and data position (entries ``rank/SSSSS/...``)."""
    prefix = f"rank/{slot:05d}"
    out = {
        f"{prefix}/position": _bytes_tensor(
            json.dumps({"slot": slot, "committed": committed, "next_step": committed + 1, "seed": seed}).encode()
        ),
        f"{prefix}/torch_cpu_rng": torch.get_rng_state(),
        f"{prefix}/python_rng": _bytes_tensor(pickle.dumps(random.getstate())),
        f"{prefix}/numpy_rng": _bytes_tensor(pickle.dumps(np.random.get_state())),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"{prefix}/cuda_rng/{index}"] = state
    return out


class _Arena:
    """A shared-memory file mapped here (as a uint8 tensor) and by the writer; page-locked when CUDA is used.

    The file is unlinked as soon as it exists: the writer opens it through this process's descriptor
    (``/proc/PID/fd/N``), so a job killed with SIGKILL leaves nothing behind in /dev/shm."""

    def __init__(self, size: int, cuda: bool) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, name = tempfile.mkstemp(prefix=f"torchpass-snapshot-{os.getpid()}-", dir=folder)
        os.unlink(name)
        self.fd = fd
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.size = size
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.registered = False
        self.cuda = cuda  # registration was attempted (if it failed, GPU copies into it are synchronous)
        if cuda:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0)
            self.registered = int(rc) == 0
            if not self.registered:
                logging.getLogger("clockwork.torchpass.snapshot").warning(
                    "cudaHostRegister of the %d-byte snapshot arena failed (%s): GPU copies will block", size, rc
                )

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        os.close(self.fd)


class Snapshotter:
    """One rank's snapshot machinery: due-ness, staging, and the writer process (started on first use)."""

    def __init__(
        self,
        config: TorchPassConfig,
        log: logging.LoggerAdapter,
        event_sink: EventSink | None,  # type: ignore[type-arg]
    ) -> None:
        self.config = config
        self.log = log
        self.event_sink = event_sink
        self.directory = snapshot_directory(config)
        self.job = os.environ.get("SLURM_JOB_ID", "") or "local"
        self._arena: _Arena | None = None
        self._writer: subprocess.Popen[str] | None = None
        self._busy = threading.Event()
        self._jobs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending_event: Any = None  # CUDA event the next optimizer step waits for
        self._copied: threading.Event | None = None  # set once the snapshot thread copied the CPU tensors
        self._ids = 0
        self.taken = 0
        self.skipped = 0
        self.failed = 0
        self.last_stall_s = 0.0  # the last capture() call
        self.last_wait_s = 0.0  # what the optimizer step after it waited for the CPU copies
        self.shard_seconds: list[float] = []  # the writer's time per shard (checksums, HDF5 write, fsync)

    # ----- when -----------------------------------------------------------------------------

    def due(self, step: int, requested: set[int]) -> bool:
        """Whether a snapshot is taken after ``step`` commits (every N steps, or asked for this step)."""
        if step in requested:
            requested.discard(step)
            return True
        every = self.config.snapshot_every_steps
        return every > 0 and (step + 1) % every == 0

    @property
    def busy(self) -> bool:
        """A snapshot is still being staged or written."""
        return self._busy.is_set()

    def prepare(self) -> None:
        """Start the writer process ahead of the first snapshot (Python and h5py take a moment to load)."""
        if self.config.snapshot_every_steps > 0 or self.config.snapshot_interval_s > 0:
            self._start_thread()

    # ----- taking one -----------------------------------------------------------------------

    def before_update(self) -> None:
        """Called before each optimizer step, and before a recovery may overwrite the state: the copies still
        reading the parameters and optimizer state come first (the GPU waits for its side stream, the host
        for the snapshot thread's CPU copies, which normally finished during the forward and backward pass)."""
        event, self._pending_event = self._pending_event, None
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        copied, self._copied = self._copied, None
        if copied is not None:
            started = time.perf_counter()
            copied.wait()
            self.last_wait_s = time.perf_counter() - started

    def capture(self, parts: StateParts, committed: int, slot: int, world_size: int) -> bool:
        """Stage the state of step ``committed`` and hand it to the writer; False when skipped (still busy)."""
        started = time.perf_counter()
        if parts.label:  # a sharded model: its replicas do not hold the same tensors, which this layout assumes
            emit(
                self.event_sink,
                self.log,
                "torchpass.snapshot_failed",
                step=committed,
                error=f"snapshots of a sharded model ({parts.label}) are not supported yet",
            )
            return True
        if self._busy.is_set():
            self.skipped += 1
            # Tell rank 0's writer at once that this shard will not come (else it waits snapshot_timeout_s);
            # on a thread, so that not even this small write is the training loop's.
            threading.Thread(
                target=_mark_skipped, args=(snapshot_path(self.directory, committed), slot), daemon=True
            ).start()
            emit(
                self.event_sink,
                self.log,
                "torchpass.snapshot_skipped",
                step=committed,
                reason="the previous snapshot is still being written",
            )
            return False
        meta, tensors = describe(parts, committed)
        owner = _plan([t.numel() * t.element_size() for t in tensors], world_size)
        side = self._side_stream_tensors(parts)
        entries: list[_Entry] = []
        offset = 0

        def add(name: str, tensor: torch.Tensor, on_side: bool) -> None:
            nonlocal offset
            entries.append(_Entry(name, tensor, offset, tensor.numel(), on_side))
            offset += (tensor.numel() + ALIGN - 1) // ALIGN * ALIGN

        for i, live in enumerate(tensors):
            if owner[i] == slot:
                add(f"t/{i:06d}", _as_bytes(live.contiguous()), live.data_ptr() in side)
        if slot == 0:
            add("meta", _bytes_tensor(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)), False)
        for name, tensor in _rank_state(slot, committed, self.config.seed).items():
            add(name, _as_bytes(tensor.contiguous()), False)
        cuda = any(e.tensor.is_cuda for e in entries)
        arena = self._ensure_arena(max(offset, ALIGN), cuda)
        events, deferred = self._stage(arena, entries, cuda)
        self._busy.set()
        self._ids += 1
        folder = snapshot_path(self.directory, committed)
        request: dict[str, Any] = {
            "op": "write",
            "id": self._ids,
            "arena": arena.path,
            "arena_id": id(arena),
            "folder": str(folder),
            "rank": slot,
            "entries": [
                [e.name, e.offset, e.nbytes, _dtype_of(e.name, tensors), _shape_of(e.name, e.nbytes, tensors)]
                for e in entries
            ],
            "finalize": None,
        }
        if slot == 0:
            request["finalize"] = {
                "world_size": world_size,
                "step": committed,
                "job": self.job,
                "tensors": len(tensors),
                "keep": self.config.snapshot_keep,
                "directory": str(self.directory),
                "timeout_s": self.config.snapshot_timeout_s,
            }
        self._start_thread()
        self._copied = threading.Event() if deferred else None
        self._jobs.put(
            {
                "request": request,
                "events": events,
                "deferred": [(arena.tensor[e.offset : e.offset + e.nbytes], e.tensor) for e in deferred],
                "copied": self._copied,
                "step": committed,
                "started": time.time(),
            }
        )
        self.taken += 1
        self.last_stall_s = time.perf_counter() - started
        return True

    def _side_stream_tensors(self, parts: StateParts) -> set[int]:
        """data_ptrs of tensors only an optimizer step changes (parameters and optimizer state)."""
        ptrs: set[int] = set()
        if parts.model is not None:
            ptrs.update(p.data_ptr() for p in parts.model.parameters())
        for optimizer in parts.optimizers:
            for state in optimizer.state.values():
                ptrs.update(v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _ensure_arena(self, size: int, cuda: bool) -> _Arena:
        if self._arena is None or self._arena.size < size or (cuda and not self._arena.cuda):
            if self._arena is not None:
                self._arena.close()
            self._arena = _Arena(size, cuda)
        return self._arena

    def _stage(self, arena: _Arena, entries: list[_Entry], cuda: bool) -> tuple[list[Any], list[_Entry]]:
        """Copy or start copying every entry into the arena; returns the CUDA events the writer must wait for
        and the CPU entries left for the snapshot thread to copy."""
        events: list[Any] = []
        side_entries = [e for e in entries if e.tensor.is_cuda and e.side_stream]
        deferred = [e for e in entries if not e.tensor.is_cuda and e.side_stream]
        main_entries = [e for e in entries if not e.side_stream]
        with torch.no_grad():
            if side_entries:
                compute = torch.cuda.current_stream()
                stream = torch.cuda.Stream()
                stream.wait_stream(compute)  # the committed step's update must be complete before we read
                with torch.cuda.stream(stream):
                    for e in side_entries:
                        arena.tensor[e.offset : e.offset + e.nbytes].copy_(e.tensor, non_blocking=True)
                        e.tensor.record_stream(stream)
                    done = torch.cuda.Event()
                    done.record(stream)
                events.append(done)
                self._pending_event = done
            for e in main_entries:
                arena.tensor[e.offset : e.offset + e.nbytes].copy_(e.tensor, non_blocking=e.tensor.is_cuda)
            if cuda and main_entries:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream())
                events.append(done)
        return events, deferred

    # ----- the background side ---------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._writer is None or self._writer.poll() is not None:
            self._writer = subprocess.Popen(
                [sys.executable, "-m", "clockworkd.snapshots.writer"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="torchpass-snapshot", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:  # this thread only: when cores are short, the training loop's threads go first
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICE_INCREMENT)
        except OSError:
            pass
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                try:
                    with torch.no_grad():
                        for into, tensor in job["deferred"]:
                            into.copy_(tensor)  # releases the GIL: the next forward pass runs meanwhile
                finally:
                    if job["copied"] is not None:
                        job["copied"].set()  # even on failure: the optimizer step must never hang on us
                    job["deferred"] = None
                self._serve(job)
            except Exception as exc:
                self.failed += 1
                emit_at(
                    logging.ERROR,
                    self.event_sink,
                    self.log,
                    "torchpass.snapshot_failed",
                    step=job["step"],
                    error=f"{type(exc).__name__}: {exc}",
                )
            finally:
                self._busy.clear()

    def _serve(self, job: dict[str, Any]) -> None:
        for event in job["events"]:
            event.synchronize()  # releases the GIL while the GPU copies finish
        writer = self._writer
        assert writer is not None and writer.stdin is not None and writer.stdout is not None
        request = job["request"]
        writer.stdin.write(json.dumps(request) + "\n")
        writer.stdin.flush()
        phases = {"shard", "manifest"} if request["finalize"] else {"shard"}
        while phases:
            line = writer.stdout.readline()
            if not line:
                raise RuntimeError(f"the snapshot writer exited (status {writer.wait()})")
            answer = json.loads(line)
            if answer.get("id") != request["id"]:
                continue
            phases.discard(answer.get("phase"))
            if not answer.get("ok"):
                self.failed += 1
                emit_at(
                    logging.ERROR,
                    self.event_sink,
                    self.log,
                    "torchpass.snapshot_failed",
                    step=job["step"],
                    phase=answer.get("phase"),
                    folder=request["folder"],
                    error=str(answer.get("error", ""))[:500],
                )
                if answer.get("phase") == "shard" and not request["finalize"]:
                    return
            elif answer.get("phase") == "manifest":
                emit(
                    self.event_sink,
                    self.log,
                    "torchpass.snapshot_written",
                    step=job["step"],
                    folder=request["folder"],
                    seconds=round(time.time() - job["started"], 3),
                    removed=answer.get("removed", []),
                )
            else:
                self.shard_seconds.append(float(answer.get("seconds", 0.0)))
                self.log.info(
                    "snapshot shard of step %d written (%d bytes, %.3f s)",
                    job["step"],
                    answer.get("bytes", 0),
                    answer.get("seconds", 0.0),
                )

    def wait(self, timeout_s: float) -> bool:
        """Wait until no snapshot is in flight; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._busy.is_set():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Let the snapshot in flight finish (bounded), then stop the thread and the writer."""
        if self._thread is not None and self._thread.is_alive():
            if not self.wait(self.config.snapshot_timeout_s if timeout_s is None else timeout_s):
                self.log.warning("a snapshot was still being written at exit: it is abandoned")
            self._jobs.put(None)
            self._thread.join(timeout=5)
        if self._writer is not None:
            if self._writer.stdin is not None:
                try:
                    self._writer.stdin.close()
                except OSError:
                    pass
            try:
                self._writer.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._writer.kill()
                self._writer.wait()
            self._writer = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None


def _mark_skipped(folder: Path, slot: int) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{FAILED_PREFIX}{slot:05d}").write_text("skipped: this rank's writer was still busy\n")
    except OSError:
        pass  # rank 0's writer then gives up at snapshot_timeout_s


def _dtype_of(name: str, tensors: list[torch.Tensor]) -> str:
    return str(tensors[int(name[2:])].dtype) if name.startswith("t/") else "torch.uint8"


def _shape_of(name: str, nbytes: int, tensors: list[torch.Tensor]) -> list[int]:
    return [int(v) for v in tensors[int(name[2:])].shape] if name.startswith("t/") else [nbytes]


# ===== restoring ====================================================================================


def _candidates(target: Path) -> list[Path]:
    """Snapshots to try, newest first: one named folder, or every ``step-*`` folder of a directory."""
    if (target / "manifest.json").exists() or target.name.startswith("step-"):
        return [target]
    return [info.path for info in reversed(list_snapshots(target))]


def _load_one(
    folder: Path, parts: StateParts, slot: int
) -> tuple[dict[str, Any], list[torch.Tensor], dict[str, np.ndarray]]:
    """Read and verify one snapshot into fresh tensors (model tensors: straight into the live ones)."""
    body = load_manifest(folder)
    meta_entry = {f: d for f, d in body["files"].items() if "meta" in d["entries"]}
    if len(meta_entry) != 1:
        raise SnapshotCorrupt(f"{folder}: the state description is in {len(meta_entry)} shards")
    fname, fdesc = next(iter(meta_entry.items()))
    blob = read_entries(folder, {"files": {fname: {"entries": {"meta": fdesc["entries"]["meta"]}}}})["meta"]
    meta = pickle.loads(blob.tobytes())
    layout = [(name, tuple(shape)) for name, shape in meta["layout"]]
    if len(layout) != int(body["tensors"]):
        raise SnapshotCorrupt(f"{folder}: {len(layout)} tensors described, manifest lists {body['tensors']}")
    with torch.no_grad():
        destinations = _destinations(parts, meta, layout, torch.device("cpu"))
    mine = f"rank/{slot:05d}/"

    def target(name: str, entry: dict[str, Any]) -> np.ndarray | None:
        if not name.startswith("t/"):
            return None if name.startswith(mine) or name == "meta" else _scratch(int(entry["nbytes"]))
        tensor = destinations[int(name[2:])]
        if tensor.is_cuda:
            return None
        return _as_bytes(tensor).numpy()

    loaded = read_entries(folder, body, target)
    cuda_tensors = {name: array for name, array in loaded.items() if name.startswith("t/")}
    for name, array in cuda_tensors.items():
        dest = destinations[int(name[2:])]
        _as_bytes(dest).copy_(torch.from_numpy(array).to(dest.device))
    for i, (dtype_name, _) in enumerate(layout):
        if str(destinations[i].dtype) != dtype_name:
            raise SnapshotCorrupt(f"{folder}: tensor {i} is {dtype_name}, here {destinations[i].dtype}")
    # Optimizer and registered tensors stay on the host: load_state_dict moves them where their parameters
    # live (and keeps Adam's step counts on the CPU, as it wants them).
    return meta, destinations, {k: v for k, v in loaded.items() if k.startswith(mine)}


_SCRATCH: dict[str, np.ndarray] = {}


def _scratch(nbytes: int) -> np.ndarray:
    held = _SCRATCH.get("b")
    if held is None or held.nbytes < nbytes:
        held = _SCRATCH["b"] = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
    return held[:nbytes]


def _restore_rng(own: dict[str, np.ndarray], slot: int) -> None:
    prefix = f"rank/{slot:05d}/"
    if f"{prefix}torch_cpu_rng" in own:
        torch.set_rng_state(torch.from_numpy(own[f"{prefix}torch_cpu_rng"].copy()))
    if f"{prefix}python_rng" in own:
        random.setstate(pickle.loads(own[f"{prefix}python_rng"].tobytes()))
    if f"{prefix}numpy_rng" in own:
        np.random.set_state(pickle.loads(own[f"{prefix}numpy_rng"].tobytes()))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            state = own.get(f"{prefix}cuda_rng/{index}")
            if state is not None:
                torch.cuda.set_rng_state(torch.from_numpy(state.copy()), index)


def restore(
    parts: StateParts,
    target: Path,
    *,
    required: bool,
    slot: int,
    device: torch.device,
    agree: Callable[[bool], bool],
    log: logging.LoggerAdapter,  # type: ignore[type-arg]
    event_sink: EventSink | None,
) -> int | None:
    """Load the newest snapshot under ``target`` that verifies on every rank; returns its step.

    Tensors are read and checked on the host; model tensors on ``device`` are then copied there, optimizer
    and registered state is moved by their own ``load_state_dict``.

    ``agree(ok)`` is True only when every rank's ``ok`` is (an all-reduce). Returns None when restoring was
    not required and there is no snapshot at all; raises :class:`RestoreError` when none is good."""
    candidates = _candidates(target)
    if not candidates:
        if required:
            raise RestoreError(f"no snapshot to restore in {target}")
        emit_at(logging.WARNING, event_sink, log, "torchpass.restore_none", directory=str(target))
        return None
    rejected: list[str] = []
    for folder in candidates:
        started = time.perf_counter()
        ok, problem = False, ""
        try:
            meta, tensors, own = _load_one(folder, parts, slot)
            ok = True
        except (SnapshotCorrupt, OSError) as exc:
            problem = str(exc)
        except Exception as exc:  # a state that does not fit this model: as bad as a damaged one
            problem = f"{type(exc).__name__}: {exc}"
        everyone = agree(ok)
        if not everyone:
            why = problem or "another rank could not load it"
            rejected.append(f"{folder.name}: {why}")
            emit_at(logging.ERROR, event_sink, log, "torchpass.snapshot_rejected", folder=str(folder), error=why)
            continue
        _apply(parts, meta, tensors)
        _restore_rng(own, slot)
        committed = int(meta["committed"])
        emit(
            event_sink,
            log,
            "torchpass.restored",
            folder=str(folder),
            step=committed,
            seconds=round(time.perf_counter() - started, 3),
            rejected=len(rejected),
        )
        return committed
    raise RestoreError(f"no good snapshot in {target}; tried: " + "; ".join(rejected))


def shard_of(rank: int) -> str:
    """File name of a rank's shard (re-exported for tests and tools)."""
    return shard_name(rank)
