"""clockwork.contracts.atomic_file: the one way a file is replaced (old or new content, never half; nothing left
behind)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from clockwork.contracts import atomic_file


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_bytes_replaces_and_leaves_only_the_file(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_file.write_bytes(target, b"one")
    atomic_file.write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_write_text_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    target = tmp_path / "t.txt"
    atomic_file.write_text(target, "nœud\n")
    assert target.read_bytes() == "nœud\n".encode()


def test_explicit_mode_is_exact_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        atomic_file.write_bytes(tmp_path / "shared", b"x", mode=0o644)
        atomic_file.write_bytes(tmp_path / "private", b"x", mode=0o600)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "shared") == 0o644
    assert _mode(tmp_path / "private") == 0o600


def test_default_mode_is_what_open_would_create(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        atomic_file.write_bytes(tmp_path / "f", b"x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "f") == 0o640


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f.json"
    atomic_file.write_bytes(target, b"old")
    real_write = os.write
    calls = []

    def half_then_fail(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real_write(fd, bytes(data)[: len(data) // 2])  # a short write: the loop must go on, then fail

    monkeypatch.setattr(atomic_file.os, "write", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        atomic_file.write_bytes(target, b"the new content")
    monkeypatch.undo()
    assert len(calls) == 2
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_a_failed_fsync_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "f.json"
    atomic_file.write_text(target, "old")

    def fail(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(atomic_file.os, "fsync", fail)
    with pytest.raises(OSError):
        atomic_file.write_text(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_file_and_folder_are_fsynced_before_and_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        order.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        order.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(atomic_file.os, "fsync", fsync)
    monkeypatch.setattr(atomic_file.os, "replace", replace)
    atomic_file.write_bytes(tmp_path / "a", b"x")
    atomic_file.write_with(tmp_path / "b", lambda tmp: tmp.write_bytes(b"y"))
    assert order == ["fsync file", "replace", "fsync dir"] * 2


def test_write_with_removes_what_a_failing_writer_left(tmp_path: Path) -> None:
    target = tmp_path / "shard.h5"
    target.write_bytes(b"old")

    def writer(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        atomic_file.write_with(target, writer)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.h5"]


def test_temporary_names_are_unique_hidden_and_recognised(tmp_path: Path) -> None:
    target = tmp_path / "7.json"
    names = {atomic_file.temporary_name(target) for _ in range(100)}
    assert len(names) == 100
    assert all(n.parent == tmp_path and atomic_file.is_temporary(n) for n in names)
    assert atomic_file.is_temporary(tmp_path / ".7.json.tmp")  # the name of an earlier release's writes
    assert not atomic_file.is_temporary(target)
