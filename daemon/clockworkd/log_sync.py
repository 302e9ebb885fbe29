"""Event logs made durable on a thread of their own: the daemon's loop writes, this thread fsyncs.

Why: an event is appended with one ``write`` of an O_APPEND file, which lands in the page cache at once; the
``fsync`` that makes it durable waits for the disk, and a slow or busy disk makes that wait seconds. Done on the
daemon's loop, every event a rank posts would stall everything else the loop does: LinkPass's route decisions,
the node watch, other requests. Here the loop returns as soon as the write is in the page cache, which a crash of
the daemon cannot lose (the kernel holds it), and this thread fsyncs every log written since its last round,
each once however many events it took (a group commit), plus the folder of a log just created. Only a crash of
the node itself can lose the events of the last round, which the daemon had also published already.

:meth:`LogSync.flush` waits until everything written so far is durable (a clean shutdown, tests).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from clockwork.contracts import atomic_file

log = logging.getLogger("clockwork.daemon")

__all__ = ["LogSync"]


class LogSync:
    """fsyncs the files :meth:`dirty` names (and the folders of new ones) on a daemon thread, started at the first.

    ``fsync``: how a file is made durable (``os.fsync``; a test's slow disk is a seam here, nothing else is)."""

    def __init__(self, fsync: Callable[[int], None] = os.fsync) -> None:
        self._fsync = fsync
        self._cond = threading.Condition()
        self._pending: dict[Path, bool] = {}  # path -> whether its folder needs an fsync too (a new file)
        self._written = 0  # dirty() calls so far
        self._synced = 0  # of which durable
        self._closed = False
        self._thread: threading.Thread | None = None
        self.errors = 0

    def dirty(self, path: Path, created: bool) -> None:
        """``path`` was written (``created``: it did not exist before): make it durable soon."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the event log syncer is closed")
            self._pending[path] = self._pending.get(path, False) or created
            self._written += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="event-log-sync", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write so far is durable; False when ``timeout`` ran out first."""
        with self._cond:
            target = self._written
            return self._cond.wait_for(lambda: self._synced >= target, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Make everything durable, then stop the thread (waits at most ``timeout``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending) or self._closed)
                if not self._pending and self._closed:
                    return
                batch, self._pending = self._pending, {}
                upto = self._written
            for path, created in batch.items():
                self._sync(path, created)
            with self._cond:
                self._synced = upto
                self._cond.notify_all()

    def _sync(self, path: Path, created: bool) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                self._fsync(fd)
            finally:
                os.close(fd)
            if created:
                atomic_file.fsync_dir(path.parent)
        except OSError as exc:  # the write is in the page cache: only a node crash could still lose it
            self.errors += 1
            log.error("event log %s: fsync failed: %s", path, exc)
