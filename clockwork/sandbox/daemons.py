"""One ``clockworkd`` per sandbox node, started and stopped on demand (benchmarks, tests, demos).

On a real cluster the Prolog starts the node daemon; on the sandbox Fleet Lens and LinkPass are often
wanted with no job running, so ``clockwork sandbox daemons up`` starts one per node (detached, marked
as the sandbox's own, so ``sandbox down`` removes them with everything else). Settings can be given
as ``{"lens.interval_ms": "5"}``: they reach the daemons as ``CLOCKWORK_SECTION_KEY`` variables.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from clockwork.contracts.config import load_config
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.errors import ClockworkError, SandboxError
from clockwork.contracts.instance_lock import running_pid
from clockwork.sandbox import processes
from clockwork.sandbox.cluster import Sandbox


def _wait(what: str, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SandboxError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def settings_env(settings: Mapping[str, str]) -> dict[str, str]:
    """``{"lens.interval_ms": "5"}`` -> ``{"CLOCKWORK_LENS_INTERVAL_MS": "5"}``."""
    env = {}
    for name, value in settings.items():
        section, dot, key = name.partition(".")
        if not dot or not section or not key:
            raise SandboxError(f"setting {name!r}: expected SECTION.KEY (e.g. lens.interval_ms)")
        env[f"CLOCKWORK_{section.upper()}_{key.upper()}"] = str(value)
    return env


class NodeDaemons:
    """The node daemons of one running sandbox."""

    def __init__(self, box: Sandbox) -> None:
        box.require_up()
        self.box = box
        self.cfg = load_config(box.paths.clockwork_toml, env={}).config.daemon
        self.nodes = [n.name for n in box.layout().nodes]
        self.exe = str(Path(sys.executable).parent / "clockworkd")

    def paths(self, node: str) -> DaemonPaths:
        return DaemonPaths.from_config(self.cfg, node)

    def request(self, node: str, op: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """``op``'s reply from ``node``'s daemon, or None when it does not answer."""
        try:
            with DaemonClient(self.paths(node), timeout_s=timeout_s) as client:
                return client.request(op)
        except ClockworkError:
            return None

    def pid(self, node: str) -> int | None:
        reply = self.request(node, "ping", timeout_s=1.0)
        return int(reply["pid"]) if reply else None

    def stop(self, node: str) -> None:
        """SIGTERM the node's daemon (whoever started it); SIGKILL after 10 s; wait until its lock is free."""
        paths = self.paths(node)
        pid = self.pid(node) or running_pid(paths.pid_file)
        if pid is None or pid <= 0:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (processes.alive(pid) or running_pid(paths.pid_file) is not None):
            processes._reap(pid)
            time.sleep(0.05)
        if processes.alive(pid):
            os.kill(pid, signal.SIGKILL)

            def gone() -> bool:
                processes._reap(pid)
                return not processes.alive(pid) and running_pid(paths.pid_file) is None

            _wait(f"clockworkd on {node} to die", gone, 10)

    def start(self, node: str, settings: Mapping[str, str] | None = None) -> int:
        """Start ``node``'s daemon (stopping a running one first); returns its pid once it answers."""
        self.stop(node)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCKWORK_")}
        env["CLOCKWORK_CONFIG"] = str(self.box.paths.clockwork_toml)
        env.update(settings_env(settings or {}))
        argv = self.box.exec_argv(node, [self.exe, "--config", str(self.box.paths.clockwork_toml)])
        log_file = self.box.paths.logs / f"clockworkd-{node}.log"
        processes.start(argv, log_file=log_file, state_dir=self.box.paths.root, env=env)
        _wait(f"clockworkd on {node} to answer (see {log_file})", lambda: self.pid(node) is not None, 20)
        pid = self.pid(node)
        assert pid is not None
        return pid

    def start_all(self, settings: Mapping[str, str] | None = None) -> dict[str, int]:
        for node in self.nodes:
            self.stop(node)
        return {node: self.start(node, settings) for node in self.nodes}

    def stop_all(self) -> None:
        for node in self.nodes:
            self.stop(node)

    def lens_ready(self) -> bool:
        """Every node's Fleet Lens receives from every peer on every rail, judges each path against the baseline
        it learned, and has clock estimates: what a Lens scene or test needs before it injects a fault."""
        for node in self.nodes:
            snap = self.request(node, "lens") or {}
            paths = snap.get("paths") or []
            if len(paths) < len(self.nodes) - 1 or not all(p.get("verdict") for p in paths) or not snap.get("clock"):
                return False
        return True

    def component(self, node: str, name: str) -> dict[str, Any]:
        """``status()[name]`` of ``node``'s daemon (``{}`` when it does not answer)."""
        status = self.request(node, "status") or {}
        value = status.get(name)
        return value if isinstance(value, dict) else {}
