"""The processes a sandbox benchmark starts, each killed at exit whatever happens.

Used by ``bench/linkpass_failover.py``'s harness (``support/linkpass_fabric.py``, ``support/allreduce_ranks.py``):
every daemon and rank runs in a session of its own, so killing its process group ends what it started too.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path


class Procs:
    """Every Popen this run makes, so each one is killed at exit whatever happens."""

    def __init__(self) -> None:
        self.items: list[subprocess.Popen[bytes]] = []

    def start(self, argv: Sequence[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "ab") as sink:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        self.items.append(proc)
        return proc

    def kill_all(self) -> None:
        kill_groups(self.items)
        self.items = []


def kill_groups(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the process group of each process still running, then give each 5 s to be reaped."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
