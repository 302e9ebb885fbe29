"""Real ``clockworkd`` processes for tests: a config under a short /tmp folder, start, wait, stop, clean up.

The daemon runs as a subprocess of the venv's ``clockworkd`` with run and state folders under
``/tmp/cwd-XXXX`` (ipc socket paths must stay under 107 bytes), its TCP socket on 127.0.0.1 with an
OS-chosen port, and ``slurm_user`` set to the test's own user (so a non-root developer may register
jobs). Nothing touches /run/clockwork, /var/lib/clockwork or a sandbox.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from clockwork.contracts.config import load_config
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.errors import DaemonError

CLOCKWORKD = Path(sys.executable).with_name("clockworkd")
START_TIMEOUT_S = 15.0


def make_root() -> Path:
    """A short, world-traversable scratch folder (another uid's client must reach the socket)."""
    root = Path(tempfile.mkdtemp(prefix="cwd-", dir="/tmp"))
    root.chmod(0o755)
    return root


def write_config(root: Path, *, node: str = "n1", curve_dir: Path | None = None, extra: str = "") -> Path:
    curve = curve_dir or root / "no-curve"
    text = f"""\
[log]
level = "debug"
[daemon]
run_dir = "{root}/{{node}}/run"
state_dir = "{root}/{{node}}/state"
node_name = "{node}"
slurm_user = "{pwd.getpwuid(os.getuid()).pw_name}"
listen_port = 0
bind_addr = "127.0.0.1"
curve_secret_key = "{curve}/daemon.key_secret"
curve_public_key = "{curve}/daemon.key"
max_message_bytes = 4096
request_timeout_s = 3.0
{extra}"""
    path = root / f"clockwork-{node}.toml"
    path.write_text(text)
    path.chmod(0o644)
    return path


def daemon_env() -> dict[str, str]:
    """The environment without the caller's CLOCKWORK_* settings (the config file says everything)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CLOCKWORK_")}


@dataclass
class RunningDaemon:
    """One clockworkd subprocess and where it lives."""

    config: Path
    paths: DaemonPaths
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    _log_files: list[object] = field(default_factory=list)

    def start(self) -> RunningDaemon:
        """Start the daemon and return once ``ping`` answers (fails the test with its log otherwise)."""
        log_file = open(self.log, "ab")  # kept open for the daemon's life
        self._log_files.append(log_file)
        began = time.monotonic()
        self.proc = subprocess.Popen(
            [str(CLOCKWORKD), "--config", str(self.config), "--foreground"],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=daemon_env(),
        )
        deadline = began + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"clockworkd exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                with self.client(timeout_s=0.5) as client:
                    client.ping()
                return self
            except DaemonError:
                time.sleep(0.02)
        self.kill()
        pytest.fail(f"clockworkd did not answer within {START_TIMEOUT_S} s:\n{self.log_text()}")

    def client(self, timeout_s: float = 3.0) -> DaemonClient:
        return DaemonClient(self.paths, timeout_s)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        """Signal the daemon and wait for it; its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout_s)
        self.proc = None
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def close_logs(self) -> None:
        for handle in self._log_files:
            handle.close()  # type: ignore[attr-defined]
        self._log_files.clear()


def daemon_for(config: Path) -> RunningDaemon:
    cfg = load_config(config, env={}).config.daemon
    paths = DaemonPaths.from_config(cfg)
    return RunningDaemon(config=config, paths=paths, log=config.parent / f"{paths.node}.log")


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A /tmp/cwd-XXXX folder removed after the test."""
    root = make_root()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def daemons() -> Iterator[list[RunningDaemon]]:
    """Register every daemon a test starts here; each is stopped (SIGTERM, then SIGKILL) afterwards."""
    started: list[RunningDaemon] = []
    yield started
    for daemon in started:
        if daemon.proc is not None:
            try:
                daemon.stop(timeout_s=5)
            except subprocess.TimeoutExpired:
                daemon.kill()
        daemon.close_logs()


def start_daemon(daemons: list[RunningDaemon], config: Path) -> RunningDaemon:
    daemon = daemon_for(config)
    daemons.append(daemon)
    return daemon.start()
