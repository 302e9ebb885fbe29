"""Taking snapshots: when one is due, staging it at the step boundary, and the background thread that hands
it to the writer process while training goes on.

At a step boundary right after a commit, on every rank at the same step, :meth:`Snapshotter.capture` lays
the state out in the shared-memory arena and starts the copies (:mod:`torchpass.snapshot.staging`); the
snapshot thread finishes the CPU copies during the next forward and backward pass, waits for the GPU copies,
and sends the arena to the writer process, which checksums, writes and fsyncs the shard; rank 0's writer
then writes the manifest and applies retention. If the writer is still busy with the previous snapshot when
the next is due, the new one is skipped (``torchpass.snapshot_skipped``): training never waits for the disk.
A write error fails that snapshot only (``torchpass.snapshot_failed``); older snapshots stay.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from clockwork.contracts.config.snapshots import parse_size
from clockwork.contracts.snapshots.messages import FinalizeSpec, Phase, WriterAnswer, WriteRequest
from clockwork.contracts.snapshots.store import FAILED_PREFIX, NICE_INCREMENT, snapshot_path
from torchpass.config import TorchPassConfig
from torchpass.events import EventSink, emit, emit_at
from torchpass.rank.state import StateParts
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.snapshot.arena import ALIGN, SharedArena
from torchpass.snapshot.staging import Staged, lay_out, stage
from torchpass.snapshot.windowed import WindowedStaging
from torchpass.snapshot.writer_client import WriterProcess
from torchpass.snapshot_location import snapshot_directory

__all__ = ["Snapshotter"]


@dataclass
class PendingSnapshot:
    """A staged snapshot on its way to the writer (the snapshot thread's queue item)."""

    request: WriteRequest
    staged: Staged
    copied: threading.Event | None  # set once the CPU copies are done (the next optimizer step waits for it)
    step: int
    started: float  # time.time() at capture
    windowed: WindowedStaging | None = None  # the share is larger than the arena: staged a window at a time
    arena: SharedArena | None = None


class Snapshotter:
    """One rank's snapshot machinery: due-ness, staging, and the writer process (started on first use)."""

    def __init__(
        self,
        config: TorchPassConfig,
        log: logging.LoggerAdapter,  # type: ignore[type-arg]
        event_sink: EventSink | None,
    ) -> None:
        self.config = config
        self.log = log
        self.event_sink = event_sink
        self.directory = snapshot_directory(config)
        self.job = os.environ.get("SLURM_JOB_ID", "") or "local"
        self._arena: SharedArena | None = None
        self._writer = WriterProcess()
        self._busy = threading.Event()
        self._jobs: queue.Queue[PendingSnapshot | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending_event: torch.cuda.Event | None = None  # the next optimizer step waits for it
        self._copied: threading.Event | None = None  # set once the snapshot thread copied the CPU tensors
        self._ids = 0
        self.taken = 0
        self.skipped = 0
        self.failed = 0
        self.last_stall_s = 0.0  # the last capture() call
        self.last_wait_s = 0.0  # what the optimizer step after it waited for the CPU copies
        self.shard_seconds: list[float] = []  # the writer's time per shard (checksums, HDF5 write, fsync)
        self.off = ""  # why snapshots are switched off for the job (budget_policy = degrade), '' while on
        #: The staging arena's cap (snapshot_arena_max, whole pages; 0: the rank's whole share).
        self.arena_cap = parse_size(config.snapshot_arena_max, "snapshot_arena_max") // ALIGN * ALIGN

    # ----- when -----------------------------------------------------------------------------

    def due(self, step: int, requested: set[int]) -> bool:
        """Whether a snapshot is taken after ``step`` commits (every N steps, or asked for this step)."""
        if step in requested:
            requested.discard(step)
            return not self.off
        every = self.config.snapshot_every_steps
        return every > 0 and (step + 1) % every == 0 and not self.off

    @property
    def periodic(self) -> bool:
        """Whether snapshots are taken on a schedule (what the job's budgets count)."""
        return self.config.snapshot_every_steps > 0 or self.config.snapshot_interval_s > 0

    def switch_off(self, reason: str) -> None:
        """No snapshot from now on (the job's budgets do not fit them, :mod:`torchpass.rank.budget_gate`)."""
        self.off = reason

    @property
    def busy(self) -> bool:
        """A snapshot is still being staged or written."""
        return self._busy.is_set()

    def prepare(self) -> None:
        """Start the writer process ahead of the first snapshot (Python and h5py take a moment to load)."""
        if self.periodic and not self.off:
            self._start()

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

    def capture(
        self, parts: StateParts, committed: int, slot: int, world_size: int, mesh: ShardedReplicas | None = None
    ) -> bool:
        """Stage the state of step ``committed`` and hand it to the writer; False when skipped (still busy).
        ``mesh``: the shape a sharded model is cut into (``parts`` is then this rank's shard, which it writes
        with the other replicas of that shard, :func:`torchpass.snapshot.staging.plan_entries`)."""
        started = time.perf_counter()
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
        layout = lay_out(parts, committed, slot, world_size, self.config.seed, mesh)
        window = self.arena_cap if 0 < self.arena_cap < layout.size else 0
        try:
            arena = self._ensure_arena(window or layout.size, layout.cuda)
        except OSError as exc:  # /dev/shm cannot hold it: this snapshot fails, training goes on
            why = "failed: its staging arena does not fit /dev/shm"
            threading.Thread(target=_mark_skipped, args=(snapshot_path(self.directory, committed), slot, why)).start()
            self._failed(committed, error=f"staging arena of {window or layout.size} bytes: {exc}")
            return False
        windowed = WindowedStaging.of(layout, window) if window else None
        staged = Staged() if windowed else stage(arena, layout)
        self._pending_event = staged.update_waits
        self._busy.set()
        self._ids += 1
        finalize = None
        if slot == 0:
            finalize = FinalizeSpec(
                world_size=world_size,
                step=committed,
                job=self.job,
                tensors=layout.tensors,
                keep=self.config.snapshot_keep,
                directory=str(self.directory),
                timeout_s=self.config.snapshot_timeout_s,
                mesh=None if mesh is None else (mesh.replicas, mesh.shards),
                extra=_mesh_extra(mesh),
            )
        request = WriteRequest(
            id=self._ids,
            arena=arena.path,
            arena_id=id(arena),
            folder=str(snapshot_path(self.directory, committed)),
            rank=slot,
            entries=tuple(e.wire() for e in layout.entries),
            finalize=finalize,
            window=window,
        )
        self._start()
        self._copied = threading.Event() if staged.deferred or windowed else None
        self._jobs.put(PendingSnapshot(request, staged, self._copied, committed, time.time(), windowed, arena))
        self.taken += 1
        self.last_stall_s = time.perf_counter() - started
        return True

    @property
    def arena_bytes(self) -> int:
        """Bytes of /dev/shm the staging arena holds now (0 before the first snapshot)."""
        return self._arena.size if self._arena is not None else 0

    def _ensure_arena(self, size: int, cuda: bool) -> SharedArena:
        if self._arena is None or self._arena.size < size or (cuda and not self._arena.cuda):
            if self._arena is not None:
                self._arena.close()
                self._arena = None
            self._arena = SharedArena(size, cuda)
        return self._arena

    # ----- the background side ---------------------------------------------------------------

    def _start(self) -> None:
        self._writer.ensure_started()
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
                if job.windowed is not None:
                    self._serve_windowed(job)
                    continue
                try:
                    job.staged.copy_deferred()  # releases the GIL: the next forward pass runs meanwhile
                finally:
                    if job.copied is not None:
                        job.copied.set()  # even on failure: the optimizer step must never hang on us
                job.staged.wait_for_gpu()
                self._serve(job)
            except Exception as exc:
                self._failed(job.step, error=f"{type(exc).__name__}: {exc}")
            finally:
                self._busy.clear()

    def _failed(self, step: int, **fields: object) -> None:
        """Count and report a failed snapshot (older ones stay; training goes on)."""
        self.failed += 1
        emit_at(logging.ERROR, self.event_sink, self.log, "torchpass.snapshot_failed", step=step, **fields)

    def _serve_windowed(self, job: PendingSnapshot) -> None:
        """Stage and send a share larger than the arena a piece at a time (:mod:`torchpass.snapshot.windowed`);
        the optimizer step waiting on ``job.copied`` goes on once the last piece is in the arena."""
        windowed, arena, request = job.windowed, job.arena, job.request
        assert windowed is not None and arena is not None and job.copied is not None
        expected = set(request.phases)
        try:
            self._writer.send(request)
            for index in range(len(windowed.cuts)):
                windowed.copy(arena, index)
                if index == len(windowed.cuts) - 1:
                    windowed.release()
                    job.copied.set()
                answer = self._writer.piece(request, index)
                if answer.phase is not Phase.PIECE:  # the shard failed: no more pieces are read
                    expected.discard(answer.phase)
                    self._report(job, answer)
                    break
        finally:
            windowed.release()
            job.copied.set()  # even on failure: the optimizer step must never hang on us
        for answer in self._writer.answers(request, expected):
            self._report(job, answer)

    def _serve(self, job: PendingSnapshot) -> None:
        for answer in self._writer.submit(job.request):
            self._report(job, answer)

    def _report(self, job: PendingSnapshot, answer: WriterAnswer) -> None:
        """One answer of the writer: a failure counted and reported, a snapshot or a shard written."""
        request = job.request
        if not answer.ok:
            self._failed(job.step, phase=answer.phase.value, folder=request.folder, error=answer.error[:500])
        elif answer.phase is Phase.MANIFEST:
            emit(
                self.event_sink,
                self.log,
                "torchpass.snapshot_written",
                step=job.step,
                folder=request.folder,
                seconds=round(time.time() - job.started, 3),
                removed=list(answer.removed),
            )
        else:
            self.shard_seconds.append(answer.seconds)
            self.log.info(
                "snapshot shard of step %d written (%d bytes, %.3f s)", job.step, answer.bytes, answer.seconds
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
        self._writer.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None


def _mark_skipped(folder: Path, slot: int, why: str = "skipped: this rank's writer was still busy") -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{FAILED_PREFIX}{slot:05d}").write_text(f"{why}\n")
    except OSError:
        pass  # rank 0's writer then gives up at snapshot_timeout_s


def _mesh_extra(mesh: ShardedReplicas | None) -> dict[str, int]:
    """What a manifest records beyond the mesh's [R, S]: how its parts split (tensor parallelism's (shard, tp)
    pairs; expert parallelism's ep coordinates, whose parts hold experts): a restore checks it."""
    if mesh is None:
        return {}
    return ({"mesh_tp": mesh.tp} if mesh.tp > 1 else {}) | ({"mesh_ep": mesh.ep} if mesh.ep > 1 else {})
