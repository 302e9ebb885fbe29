"""One daemon per node: a pid file held under an exclusive ``flock`` for the daemon's whole life.

A lock, not the pid number, decides whether a daemon is alive: the kernel drops it when the process
dies however it dies, so a stale pid file (a crash, a ``kill -9``) is simply taken over, and a
recycled pid can never make a dead daemon look alive. libzmq unlinks an existing socket file when it
binds an ipc endpoint, so without this lock a second daemon would silently steal a live one's
control socket.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from pathlib import Path

from clockwork.contracts.errors import DaemonError


def read_pid(path: Path) -> int | None:
    """The pid written in a pid file, or None when there is no usable one."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def running_pid(path: Path) -> int | None:
    """The pid of the live daemon holding the pid file ``path``, or None when no process holds it.

    Unlike ``kill(pid, 0)`` this cannot be fooled by a recycled pid. It takes a shared lock for an
    instant, so a daemon starting in that very instant may refuse to start (and the caller retries).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_pid(path) or -1
    finally:
        os.close(fd)  # closing drops a lock we took
    return None


def socket_in_use(path: Path) -> bool:
    """Whether a process listens on the Unix socket ``path`` (a leftover file of a dead one refuses)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK)
    finally:
        probe.close()
    return True


class InstanceLock:
    """The pid file of the one daemon allowed to own a run folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Lock the pid file and write our pid; DaemonError when a live daemon holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                pid = read_pid(self.path)
                raise DaemonError(
                    f"another clockworkd (pid {pid if pid else 'unknown'}) is running: it holds {self.path}",
                    code="already_running",
                ) from None
            # The holder may have removed the file between our open and our lock: lock the live file.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Remove the pid file, then drop the lock (in that order, so no newcomer's file is removed)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None
