"""Make sure this node's clockworkd runs: adopt a live one, restart a dead one, start a missing one.

A daemon that holds its pid file but does not answer is judged before it is killed (:mod:`slurm_hooks.liveness`):
one that is busy (its CPU time advancing, or waiting on a disk) is given up to ``BUSY_WAIT_S`` to answer and is
adopted if it does; one that is gone is replaced without a signal; one that neither answers nor makes progress for
``STALL_S`` (stopped, or blocked in its loop), or stays busy and silent past the bound, is SIGKILLed and restarted.

Called by the Prolog for every clockwork job and by the health check, so it must be fast (a started
daemon answers ``ping`` within a fraction of a second) and idempotent (two Prologs racing start at
most one daemon: the daemon itself refuses to run twice for one run folder).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.errors import DaemonError, DaemonUnavailableError
from clockwork.contracts.instance_lock import running_pid
from slurm_hooks.liveness import Liveness, judge

log = logging.getLogger("clockwork.hooks")

#: How long a hook waits for a daemon it started (or a live one) to answer.
START_WAIT_S = 3.0
PING_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class DaemonCheck:
    """What :func:`ensure_daemon` found and did."""

    action: str  # adopted | started | restarted | failed
    pid: int | None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.action != "failed"


def _ping(paths: DaemonPaths) -> int | None:
    """The daemon's pid if it answers, else None."""
    with DaemonClient(paths, timeout_s=PING_TIMEOUT_S) as client:
        try:
            return int(client.ping()["pid"])
        except DaemonUnavailableError:
            return None


def _daemon_argv(config_path: Path | None) -> list[str]:
    script = Path(sys.executable).parent / "clockworkd"
    argv = [str(script)] if script.exists() else [sys.executable, "-c", "from clockworkd.agent import main; main()"]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    return [*argv, "--foreground"]


def ensure_daemon(cfg: DaemonConfig, config_path: Path | None, log_file: Path | None = None) -> DaemonCheck:
    """Return with this node's daemon answering, or say why it could not be made to."""
    paths = DaemonPaths.from_config(cfg)
    pid = _ping(paths)
    if pid is not None:
        return DaemonCheck("adopted", pid)
    action = "started"
    hung = running_pid(paths.pid_file)
    if hung is not None and hung <= 0:  # the lock is held but names no pid: never signal a guessed one
        log.warning("clockworkd on %s holds its pid file %s without a pid in it", paths.node, paths.pid_file)
    elif hung is not None:  # a live process holds the daemon's lock but does not answer: busy, or dead?
        answered: list[int] = []

        def answers() -> bool:
            try:
                pid = _ping(paths)
            except DaemonError:
                pid = None
            if pid is not None:
                answered.append(pid)
            return pid is not None

        verdict, why = judge(hung, answers)
        if verdict is Liveness.ANSWERS:
            log.info("clockworkd pid %d on %s was busy and %s; kept", hung, paths.node, why)
            return DaemonCheck("adopted", answered[-1], f"busy, {why}")
        if verdict is not Liveness.GONE:
            log.warning("clockworkd pid %d on %s is %s: %s; killing and restarting it", hung, paths.node, verdict, why)
            action = "restarted"
            try:
                os.kill(hung, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + START_WAIT_S  # a new daemon refuses to start while the lock is held
        while running_pid(paths.pid_file) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
    out = log_file or paths.run_dir / "clockworkd.out"
    try:
        paths.run_dir.mkdir(parents=True, exist_ok=True)
        with open(out, "ab") as sink:
            proc = subprocess.Popen(
                _daemon_argv(config_path),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
    except OSError as exc:
        return DaemonCheck("failed", None, f"cannot start clockworkd: {exc}")
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        try:
            pid = _ping(paths)
        except DaemonError:
            pid = None
        if pid is not None:
            log.info("clockworkd %s on %s (pid %d)", action, paths.node, pid)
            return DaemonCheck(action, pid)
        if proc.poll() is not None and _ping(paths) is None:
            return DaemonCheck("failed", None, f"clockworkd exited with code {proc.returncode} (see {out})")
        time.sleep(0.05)
    return DaemonCheck("failed", proc.pid, f"clockworkd did not answer within {START_WAIT_S:g} s (see {out})")
