"""Starting, finding and stopping the sandbox's daemons.

Every process the sandbox starts carries the marker variable ``_CLOCKWORK_SANDBOX=<state folder>`` in its
environment, and every node process lives in a sandbox network namespace. Tear-down finds processes
by those two facts, not only by recorded pids, so it also cleans up after a crash or a half-built
cluster, and never kills a reused pid that belongs to someone else.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from clockwork.contracts.errors import SandboxError
from clockwork.sandbox.shell import run

log = logging.getLogger("clockwork.sandbox")

MARKER = "_CLOCKWORK_SANDBOX"


def start(argv: Sequence[str], *, log_file: Path, state_dir: Path, env: Mapping[str, str] | None = None) -> int:
    """Start a daemon in its own session, output to ``log_file``; returns its pid."""
    full_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", MARKER: str(state_dir)}
    full_env.update(env or {})
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            close_fds=True,
        )
    log.debug("started pid %d: %s", proc.pid, " ".join(argv))
    return proc.pid


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            break
    return pids


def marked(state_dir: Path) -> set[int]:
    """Pids of live processes started by the sandbox at ``state_dir`` (by their environment marker)."""
    needle = f"{MARKER}={state_dir}\0".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read() + b"\0":
                        found.add(int(entry))
            except OSError:
                continue
    return found - _ancestors()


def netns_pids(namespaces: Iterable[str]) -> set[int]:
    """Pids of every process inside the given network namespaces."""
    pids: set[int] = set()
    for ns in namespaces:
        out = run(["ip", "netns", "pids", ns], check=False).stdout
        pids.update(int(p) for p in out.split() if p.isdigit())
    return pids - _ancestors()


def stop(pids: Iterable[int], grace_s: float = 2.0) -> set[int]:
    """SIGTERM, then SIGKILL whatever is left after ``grace_s`` (slurmd ignores TERM while jobs run)."""
    pids = {p for p in pids if alive(p)}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for pid in pids:
            _reap(pid)
        if not any(alive(p) for p in pids):
            return pids
        time.sleep(0.02)
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        for pid in pids:
            _reap(pid)
        time.sleep(0.02)
    return pids


def wait_until(
    what: str,
    ready: Callable[[], bool],
    *,
    timeout_s: float,
    pid: int | None = None,
    log_file: Path | None = None,
    interval_s: float = 0.02,
) -> None:
    """Poll ``ready`` until true; fail early if ``pid`` died, naming the log to read."""
    deadline = time.monotonic() + timeout_s
    while True:
        if ready():
            return
        where = f" (see {log_file})" if log_file else ""
        if pid is not None and not alive(pid):
            tail = ""
            if log_file and log_file.exists():
                tail = ": " + " | ".join(log_file.read_text(errors="replace").strip().splitlines()[-3:])
            raise SandboxError(f"{what} exited during start-up{where}{tail}")
        if time.monotonic() > deadline:
            raise SandboxError(f"{what} not ready after {timeout_s:g} s{where}")
        time.sleep(interval_s)


def port_open(host: str, port: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            return False

    return check
