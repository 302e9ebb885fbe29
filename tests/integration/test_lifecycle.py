"""Bring-up and tear-down: `up` refuses a second cluster, `down` leaves nothing behind, whatever the state."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from clockwork.contracts.errors import SandboxError
from clockwork.sandbox import fabric, processes
from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.layout import Layout
from tests.integration.conftest import CLOCKWORK, SandboxManager, worker_sandbox_config


def sandbox_namespaces(layout: Layout) -> list[str]:
    """The network namespaces of ``layout`` that exist (other workers' sandboxes are not ours to count)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    return [n for n in layout.namespaces if n in names]


def _net_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def slurm_processes(box: Sandbox) -> list[str]:
    """Live Slurm/munge/MariaDB processes of ``box``: marked with its state folder, in one of its namespaces,
    or in a namespace that no longer has a name (a torn-down node's). Another sandbox's are left out."""
    root_net = _net_inode("/proc/self/ns/net")
    named = {_net_inode(f"/run/netns/{n}"): n for n in fabric.existing_namespaces()}
    ours = set(box.layout().namespaces)
    marked = processes.marked(box.paths.root)
    out = subprocess.run(["ps", "-eo", "pid=,stat=,comm="], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        pid, stat, comm = line.split(None, 2)
        if comm not in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "slurmstepd") or stat.startswith("Z"):
            continue
        net = _net_inode(f"/proc/{pid}/ns/net")
        in_ours = net is not None and net != root_net and (net not in named or named[net] in ours)
        if int(pid) in marked or in_ours:
            found.append(line)
    return found


def assert_nothing_left(box: Sandbox) -> None:
    assert sandbox_namespaces(box.layout()) == []
    assert processes.marked(box.paths.root) == set()
    assert slurm_processes(box) == []
    assert subprocess.run(["ip", "link", "show", box.layout().root_dev], capture_output=True).returncode != 0


def test_up_twice_says_so_and_down_removes_everything(sandbox_manager: SandboxManager) -> None:
    box = sandbox_manager.ensure_up(nodes=2, accounting=False)
    state = str(box.paths.root)
    again = subprocess.run(
        [CLOCKWORK, "sandbox", "up", "--nodes", "2", "--state", state], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 3
    assert "a sandbox is already running at" in again.stderr and "sandbox down" in again.stderr
    assert box.running()  # the refused second `up` did not disturb the first

    down = subprocess.run([CLOCKWORK, "sandbox", "down", "--help"], capture_output=True, text=True)
    assert down.returncode == 0
    result = subprocess.run(
        [CLOCKWORK, "sandbox", "--state", state, "down"], capture_output=True, text=True, timeout=120
    )
    sandbox_manager.current = None
    assert result.returncode == 0, result.stderr
    assert f"namespace {box.layout().node('node1').netns}" in result.stdout
    assert_nothing_left(box)
    status = json.loads(
        subprocess.run(
            [CLOCKWORK, "sandbox", "--state", state, "status", "--json"], capture_output=True, text=True
        ).stdout
    )
    assert status["running"] is False and status["phase"] == "down"


def test_down_cleans_a_crashed_sandbox_whose_record_is_lost(sandbox_manager: SandboxManager, short_tmp: Path) -> None:
    sandbox_manager.ensure_down()
    box = Sandbox(worker_sandbox_config(short_tmp / "state", nodes=2, accounting=True))
    box.up()
    job_id = box.slurm().submit("srun sleep 300", ["-N2", "-o", "/dev/null"])
    st = box.state()
    assert st is not None
    # A crash: the controller and munge die hard, and the record of what was started is gone.
    for name in ("slurmctld", "munged"):
        os.kill(st.pids[name], signal.SIGKILL)
    box.paths.state_file.unlink()
    assert job_id > 0 and sandbox_namespaces(box.layout()) != []
    removed = Sandbox(box.config).down()
    assert f"namespace {box.layout().fabric_ns}" in removed
    assert_nothing_left(box)


def test_up_names_a_live_sandbox_in_the_way_and_reclaims_a_dead_one(
    sandbox_manager: SandboxManager, short_tmp: Path
) -> None:
    sandbox_manager.ensure_down()
    first = Sandbox(worker_sandbox_config(short_tmp / "a", nodes=2, accounting=False))
    second = str(short_tmp / "b")
    up_second = [CLOCKWORK, "sandbox", "up", "--nodes", "2", "--state", second]
    try:
        first.up()
        refused = subprocess.run(up_second, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 3
        assert f"the sandbox at {first.paths.root} owns them" in refused.stderr
        assert f"clockwork sandbox --state {first.paths.root} down" in refused.stderr
        assert first.running()  # the refusal left the live sandbox alone
        # Everything of the first sandbox dies at once (its session was killed), and its folder is gone.
        for pid in processes.marked(first.paths.root):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(first.paths.root)
        assert sandbox_namespaces(first.layout()) != []
        built = subprocess.run(up_second, capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stdout + built.stderr
        assert f"the sandbox at {first.paths.root} left its namespaces behind" in built.stderr
        assert Sandbox(worker_sandbox_config(second)).running()
    finally:
        first.down()
        Sandbox(worker_sandbox_config(second)).down()
    assert_nothing_left(Sandbox(worker_sandbox_config(second)))


def test_failed_bring_up_tears_down_what_it_built(sandbox_manager: SandboxManager, short_tmp: Path) -> None:
    sandbox_manager.ensure_down()
    cfg = worker_sandbox_config(short_tmp / "state", nodes=2)
    # Occupy slurmctld's port so that the controller cannot start.
    blocker = socket.create_server(("0.0.0.0", cfg.port_base))
    try:
        with pytest.raises(SandboxError, match="slurmctld"):
            Sandbox(cfg).up()
    finally:
        blocker.close()
    assert_nothing_left(Sandbox(cfg))
    assert (Path(cfg.state_dir) / "log" / "slurmctld.log").exists()  # the logs stay for the post-mortem


def test_state_folder_that_is_not_a_sandbox_is_refused(short_tmp: Path) -> None:
    # short_tmp, not tmp_path: pytest's own folder names grow with its run counter and would trip the
    # socket-length check first.
    (short_tmp / "precious.txt").write_text("do not delete")
    result = subprocess.run([CLOCKWORK, "sandbox", "up", "--state", str(short_tmp)], capture_output=True, text=True)
    assert result.returncode == 3
    assert "is not a sandbox state folder" in result.stderr
    assert (short_tmp / "precious.txt").read_text() == "do not delete"


def test_state_folder_too_long_for_slurm_sockets_is_refused(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 60) / "state"
    result = subprocess.run([CLOCKWORK, "sandbox", "up", "--state", str(deep)], capture_output=True, text=True)
    assert result.returncode == 3
    assert "unix socket limit; choose a shorter --state" in result.stderr
    assert sandbox_namespaces(Sandbox(worker_sandbox_config(deep)).layout()) == []
