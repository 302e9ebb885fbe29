"""Make sure this node's clockworkd runs: adopt a live one, restart a hung one, start a missing one.

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
    if hung is not None:  # a live process holds the daemon's lock but does not answer: restart it
        log.warning("clockworkd pid %d on %s does not answer; restarting it", hung, paths.node)
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
