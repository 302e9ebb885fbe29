"""The rank's end of its snapshot writer process (:mod:`clockwork.contracts.snapshots.writer`): start it, send it a
request, read the answers to that request.

Why a process and not a thread: the checksums, h5py calls and disk waits would otherwise take the rank's GIL
from the training loop. It is started early (Python and h5py take a moment to load) and kept for the job.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

from clockwork.contracts.snapshots.messages import Phase, PieceReady, WriterAnswer, WriteRequest

__all__ = ["WriterProcess"]


class WriterProcess:
    """One writer process, serving one request at a time (the snapshot thread is its only user)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None

    def ensure_started(self) -> None:
        """Start the process unless it is running."""
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "clockwork.contracts.snapshots.writer"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )

    def submit(self, request: WriteRequest) -> Iterator[WriterAnswer]:
        """Send ``request`` and yield its answers as they come (one per phase); RuntimeError if the process
        dies first."""
        self.send(request)
        yield from self.answers(request, set(request.phases))

    def send(self, request: WriteRequest) -> None:
        """Send ``request`` (a windowed one then takes its pieces, :meth:`piece`, before its answers)."""
        self._line(request.to_line())

    def piece(self, request: WriteRequest, index: int) -> WriterAnswer:
        """Tell the writer the arena holds piece ``index``; its answer: ``PIECE`` once written (the arena may be
        filled again), or the failed ``SHARD`` (no more pieces are read)."""
        self._line(PieceReady(request.id, index).to_line())
        return next(self.answers(request, {Phase.PIECE, Phase.SHARD}, first_only=True))

    def answers(self, request: WriteRequest, phases: set[Phase], first_only: bool = False) -> Iterator[WriterAnswer]:
        """Yield the answers of ``request`` in ``phases`` until each came once (``first_only``: stop after one)."""
        process = self._process
        assert process is not None and process.stdout is not None
        phases = set(phases)
        while phases:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"the snapshot writer exited (status {process.wait()})")
            answer = WriterAnswer.from_line(line)
            if answer.id != request.id or answer.phase not in phases:
                continue  # an answer to an abandoned request
            phases.discard(answer.phase)
            yield answer
            if first_only:
                return

    def _line(self, line: str) -> None:
        self.ensure_started()
        process = self._process
        assert process is not None and process.stdin is not None
        process.stdin.write(line + "\n")
        process.stdin.flush()

    def close(self) -> None:
        """Close its input (it exits when done) and wait for it, briefly; then kill it."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            try:
                process.stdin.close()
            except OSError:
                pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
