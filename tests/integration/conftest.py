"""The session's sandbox cluster: built once, shared, rebuilt by tests that need it down or different."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from clockwork.contracts.config import load_config
from clockwork.contracts.config.core import SandboxConfig
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.errors import ClockworkError
from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.daemons import NodeDaemons
from tests.conftest import until

CLOCKWORK = str(Path(sys.executable).parent / "clockwork")


def _worker_settings() -> dict[str, str]:
    """This pytest process's own sandbox settings, as ``[sandbox]`` keys.

    Under pytest-xdist each worker (``gwN``) runs its sandboxes side by side with the other workers': its own
    namespaces and root-namespace veth (tag ``wN``), management subnet and Slurm ports. ``CLOCKWORK_TEST_SLOT``
    (1-15) moves a whole pytest run to a block of its own, so that two runs (two developers' checkouts on one
    machine) never share a sandbox. Without either there are none: the defaults, as a user gets them.
    """
    worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    slot = int(os.environ.get("CLOCKWORK_TEST_SLOT", "0") or 0)
    if not 0 <= slot <= 15:
        raise pytest.UsageError(f"CLOCKWORK_TEST_SLOT={slot}: give 0 to 15")
    if worker is None and slot == 0:
        return {}
    n = 16 * slot + (int(worker.group(1)) + 1 if worker is not None else 0)
    return {
        "tag": f"s{slot}w{n % 16}" if slot else f"w{n}",
        "mgmt_net": f"198.19.{n}.0/24",
        "port_base": str(SandboxConfig().port_base + 10 * n),
    }


WORKER_SETTINGS = _worker_settings()


def worker_sandbox_config(state_dir: Path | str, **changes: Any) -> SandboxConfig:
    """A sandbox configuration at ``state_dir`` with this worker's settings (and ``changes``)."""
    mine: dict[str, Any] = {k: int(v) if k == "port_base" else v for k, v in WORKER_SETTINGS.items()}
    return replace(SandboxConfig(), state_dir=str(state_dir), **mine, **changes)


@pytest.fixture(scope="session", autouse=True)
def _worker_sandbox_environment() -> Iterator[None]:
    """Every ``clockwork`` command a test runs (``sandbox up``, ``demo`` ...) gets this worker's settings too."""
    saved = dict(os.environ)
    os.environ.update({f"CLOCKWORK_SANDBOX_{k.upper()}": v for k, v in WORKER_SETTINGS.items()})
    yield
    os.environ.clear()
    os.environ.update(saved)


@dataclass
class SandboxManager:
    """Keeps at most one sandbox up; tests ask for the shape they need."""

    state_dir: Path
    current: Sandbox | None = None

    def ensure_up(
        self, nodes: int = 4, accounting: bool = True, slurm: str = "22.05", racks: str = "", **changes: Any
    ) -> Sandbox:
        """The sandbox of this shape (``changes``: other ``[sandbox]`` settings), brought up if it is not the one up."""
        cfg = worker_sandbox_config(
            self.state_dir, nodes=nodes, accounting=accounting, slurm=slurm, racks=racks, **changes
        )
        if self.current is not None and self.current.running() and self.current.config == cfg:
            return self.current
        self.ensure_down()
        box = Sandbox(cfg)
        box.up()
        self.current = box
        return box

    def ensure_down(self) -> None:
        if self.current is not None:
            self.current.down()
            self.current = None


@pytest.fixture(scope="session")
def sandbox_manager() -> Iterator[SandboxManager]:
    from tests.conftest import require_root_and_slurm

    require_root_and_slurm()
    with tempfile.TemporaryDirectory(prefix="cw-", dir="/tmp") as tmp:
        manager = SandboxManager(Path(tmp) / "state")
        yield manager
        manager.ensure_down()


@pytest.fixture(scope="module", autouse=True)
def _no_daemons_past_the_module(sandbox_manager: SandboxManager) -> Iterator[None]:
    """Each module starts the node daemons it needs (its jobs' Prologs, or its fixtures); none outlives it.

    An idle clockworkd still heartbeats every peer on every rail and probes them (LinkPass and Fleet Lens, about
    a sixth of a core each here); left running into the next modules they would only slow everything else.
    """
    yield
    box = sandbox_manager.current
    if box is not None and box.running():
        _cancel_leftover_jobs(box)
        NodeDaemons(box).stop_all()


def _cancel_leftover_jobs(box: Sandbox) -> None:
    """A test that failed or timed out may leave its job behind: cancel it, so the next module finds idle nodes
    (and fails on its own account, if at all)."""
    env = slurm_env(box)

    def queued() -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=60)
        return out.stdout.split()

    left = queued()
    if left:
        subprocess.run(["scancel", *left], env=env, capture_output=True, timeout=60)
        until(f"the jobs left by this module ({', '.join(left)}) to end", lambda: not queued(), 120)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary folder with a short path: Slurm's unix sockets under a state folder must fit 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="cw-", dir="/tmp") as tmp:
        yield Path(tmp)


@pytest.fixture
def sandbox(sandbox_manager: SandboxManager) -> Sandbox:
    """A running 4-node sandbox with accounting (shared across tests; faults cleared before each)."""
    box = sandbox_manager.ensure_up()
    box.clear_faults()
    return box


def slurm_env(box: Sandbox) -> dict[str, str]:
    """The environment a test runs Slurm commands with: the sandbox's slurm.conf and its release's commands
    (the host's, or a root release's wrappers first on PATH), then the venv's programs."""
    env = box.slurm_env()
    slurm_bin = box.slurm_bin()
    first = f"{slurm_bin}:" if slurm_bin is not None else ""
    env["PATH"] = f"{first}{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def on_node(box: Sandbox, node: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a command on a sandbox node, the way `clockwork sandbox exec` does."""
    return subprocess.run(box.exec_argv(node, list(argv)), capture_output=True, text=True, timeout=timeout)


def lens_baselines_learned(daemons: NodeDaemons) -> bool:
    """What the Lens and audit tests need before they inject a fault (:meth:`NodeDaemons.lens_ready`)."""
    return daemons.lens_ready()


def wait_job(box: Sandbox, job_id: int, timeout_s: float = 120) -> str:
    """Wait for a job to reach a terminal state; return that state."""
    slurm = box.slurm()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        if info is not None and info.finished:
            return info.state
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not finish within {timeout_s} s: {slurm.job(job_id)}")


def daemon_paths(box: Sandbox, node: str) -> DaemonPaths:
    """Where ``node``'s clockworkd listens, from the sandbox's own configuration."""
    cfg = load_config(box.paths.clockwork_toml, env={}).config.daemon
    return DaemonPaths.from_config(cfg, node)


def daemon_pid(box: Sandbox, node: str) -> int | None:
    """The pid of ``node``'s daemon if it answers, else None."""
    try:
        with DaemonClient(daemon_paths(box, node), timeout_s=1) as client:
            return int(client.ping()["pid"])
    except ClockworkError:
        return None
