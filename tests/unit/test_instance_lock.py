"""One daemon per run folder: the pid-file lock, stale files and the liveness probes the hooks use."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

import pytest

from clockwork.contracts.errors import DaemonError
from clockwork.contracts.instance_lock import InstanceLock, read_pid, running_pid, socket_in_use


def test_acquire_writes_pid_and_release_removes_the_file(tmp_path: Path) -> None:
    lock = InstanceLock(tmp_path / "d.pid")
    assert running_pid(lock.path) is None
    lock.acquire()
    assert lock.held
    assert read_pid(lock.path) == os.getpid()
    assert running_pid(lock.path) == os.getpid()
    lock.release()
    assert not lock.held and not lock.path.exists()
    lock.release()  # twice is fine


def test_a_held_lock_refuses_a_second_daemon(tmp_path: Path) -> None:
    first = InstanceLock(tmp_path / "d.pid")
    first.acquire()
    try:
        with pytest.raises(DaemonError) as info:
            InstanceLock(tmp_path / "d.pid").acquire()
        assert info.value.code == "already_running"
        assert f"another clockworkd (pid {os.getpid()}) is running" in str(info.value)
        assert read_pid(first.path) == os.getpid()
    finally:
        first.release()


def test_a_stale_pid_file_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "d.pid"
    path.write_text("999999\n")  # a dead daemon's file: nobody holds the lock
    assert running_pid(path) is None
    lock = InstanceLock(path)
    lock.acquire()
    assert read_pid(path) == os.getpid()
    lock.release()


def test_read_pid_garbage(tmp_path: Path) -> None:
    (tmp_path / "p").write_text("abc")
    assert read_pid(tmp_path / "p") is None
    assert read_pid(tmp_path / "missing") is None


def test_running_pid_of_a_locked_file_without_a_pid(tmp_path: Path) -> None:
    path = tmp_path / "d.pid"
    path.write_text("")
    with open(path) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert running_pid(path) == -1


def test_socket_in_use(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    assert not socket_in_use(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    assert not socket_in_use(path)  # bound but not listening: like a dead daemon's leftover file
    server.listen(1)
    assert socket_in_use(path)
    server.close()
    assert not socket_in_use(path)
    (tmp_path / "plain").write_text("")
    assert not socket_in_use(tmp_path / "plain")
