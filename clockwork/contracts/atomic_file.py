"""Replacing a file so that a reader, or a crash, finds the old content or the new, never a mix or nothing.

The one way every Clockwork package writes a file it replaces (job records, the sandbox's record, reports,
snapshot shards, injected GPU faults, LinkPass's home rails): write a temporary file in the same folder, flush
and fsync it, ``os.replace`` it over the target, fsync the folder. Without the file's fsync a crash after the
rename can leave an empty or truncated file under the final name (the rename reaches the disk before the
data); without the folder's fsync the rename itself may be lost. On any failure before the rename the
temporary file is removed and the old file is untouched.

Standard library only: ranks (through :mod:`clockwork.contracts.snapshots.store`), the daemon and the Slurm hooks import
it, and none of them may pay for a heavy import to write a file. LinkPass imports nothing of clockworkd: its
host hands it :func:`write_bytes`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

#: Every temporary file is named ``.NAME.XXXXXXXX.tmp`` next to its target: hidden, and recognisable
#: (:func:`is_temporary`) by whoever lists the folder and must skip or clean up a write a crash interrupted.
TMP_SUFFIX = ".tmp"


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is the temporary file of an unfinished write (a crash left it; safe to remove)."""
    return path.name.startswith(".") and path.name.endswith(TMP_SUFFIX)


def temporary_name(final: Path) -> Path:
    """A fresh temporary name next to ``final``: same folder (a rename across file systems is a copy, and
    not atomic), unique per call so that two writers of one file (threads, processes) never share one."""
    return final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")


def fsync_dir(path: Path) -> None:
    """Make a rename, creation or unlink inside folder ``path`` durable (the entry lives in the folder)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data and metadata to the device (for a file another library wrote and closed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` durably.

    ``mode``: the file's permission bits, set exactly (whatever the umask), for a file whose readers need them
    (a private job record: 0o600; a file another user reads: 0o644). None: as ``open(path, "w")`` creates a
    file, 0o666 less the process's umask. The old file's mode is never carried over: each caller says what
    the file must be, so a file created by hand with other bits gets them back on the first write.
    """
    tmp = temporary_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else 0o600)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: Path, text: str, mode: int | None = None, encoding: str = "utf-8") -> None:
    """:func:`write_bytes` of ``text`` encoded (UTF-8 unless told: never the locale's, which a daemon started
    by systemd and a shell may not share)."""
    write_bytes(path, text.encode(encoding), mode)


def write_with(path: Path, write: Callable[[Path], None], mode: int | None = None) -> None:
    """Call ``write(tmp)`` to create the temporary file (for a library that writes a file by name: HDF5), then
    fsync it, set ``mode`` (as :func:`write_bytes`; None leaves what ``write`` created), rename it to ``path``
    and fsync the folder. The temporary file is removed when anything fails."""
    tmp = temporary_name(path)
    try:
        write(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
