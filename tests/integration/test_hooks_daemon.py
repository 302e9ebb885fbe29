"""Prolog/Epilog with the node daemon on the real sandbox: start/adopt, register, report, AdminComment, health."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clockwork.contracts.daemon_client import DaemonClient
from clockwork.sandbox.cluster import Sandbox
from slurm_hooks import events
from tests.conftest import until
from tests.integration.conftest import CLOCKWORK, daemon_paths, daemon_pid, on_node, slurm_env, wait_job


def submit(box: Sandbox, *args: str) -> int:
    out = subprocess.run(
        ["sbatch", "--parsable", "-o", "/dev/null", *args],
        capture_output=True,
        text=True,
        env=slurm_env(box),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def start_and_wait(box: Sandbox, tmp_path: Path, seconds: int, *args: str) -> int:
    """Submit a job whose script runs until the test creates ``tmp_path/release`` or ``seconds`` pass; return once
    the script started (so the batch host's Prolog ran; from 26.05 the other nodes' Prologs may still run)."""
    marker, release = tmp_path / "started", tmp_path / "release"
    script = f"touch {marker}; for i in $(seq {seconds * 5}); do [ -e {release} ] && break; sleep 0.2; done"
    job_id = submit(box, *args, "--wrap", script)
    # generous: on a loaded CI machine the previous test's Epilog (a Python hook) may still hold the nodes
    deadline = time.monotonic() + 180
    while not marker.exists():
        assert time.monotonic() < deadline, f"job {job_id} never started:\n{_why_pending(box, job_id)}"
        time.sleep(0.1)
    return job_id


def _why_pending(box: Sandbox, job_id: int) -> str:
    """What Slurm says about a job that did not start, and the nodes' states with their reasons."""
    job = subprocess.run(
        ["scontrol", "show", "job", str(job_id)], capture_output=True, text=True, env=slurm_env(box), timeout=60
    )
    nodes = subprocess.run(
        ["sinfo", "-N", "-o", "%N %T %E"], capture_output=True, text=True, env=slurm_env(box), timeout=60
    )
    return f"{job.stdout}{job.stderr}\n{nodes.stdout}{nodes.stderr}"


def drained(box: Sandbox) -> dict[str, str]:
    return {n.name: n.reason for n in box.slurm().nodes() if n.has("DRAIN")}


def admin_comment(box: Sandbox, job_id: int) -> str:
    deadline = time.monotonic() + 20
    comment = ""
    while time.monotonic() < deadline and not comment:
        rows = [r for r in box.slurm().accounting(job_id) if not r.is_step]
        comment = rows[0].admin_comment if rows else ""
        time.sleep(0.3)
    return comment


def test_clockwork_job_is_registered_reported_and_summarised(sandbox: Sandbox, tmp_path: Path) -> None:
    # held until node2's registration was seen: a job of a few seconds could end, and node2's Epilog unregister
    # it, before node2's Prolog (which 26.05 no longer waits for) had registered it on a loaded machine
    job_id = start_and_wait(sandbox, tmp_path, 300, "-N2", "-w", "node1,node2", "--clockwork-ft")

    def node2_jobs() -> dict[int, dict[str, Any]] | None:
        status = subprocess.run(
            [CLOCKWORK, "--config", str(sandbox.paths.clockwork_toml), "node", "status", "--node", "node2", "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if status.returncode != 0:  # node2's Prolog has not started its daemon yet
            return None
        listed = {j["job_id"]: j for j in json.loads(status.stdout)["jobs"]}
        return listed if job_id in listed else None

    # 26.05 starts the batch script once the batch host's Prolog is done, not every node's (22.05 and 24.11
    # waited for all): node2's Prolog may still be registering the job.
    try:
        jobs = until(f"node2's daemon to list job {job_id}", node2_jobs, 120)
    except AssertionError:
        sandbox.slurm().cancel(job_id)  # a job left holding node1 and node2 would fail the module's next tests
        raise
    assert jobs[job_id]["nodes"] == ["node1", "node2"] and jobs[job_id]["options"]["ft"] == "aware"
    (tmp_path / "release").touch()
    assert wait_job(sandbox, job_id) == "COMPLETED"

    comment = admin_comment(sandbox, job_id)
    assert comment.startswith("clockwork: 0 link failovers, 0 migrations, 0 rollbacks; report=")
    report_path = Path(comment.split("report=", 1)[1])
    report = json.loads(report_path.read_text())
    assert report["job_id"] == job_id and report["node"] == "node1"
    assert any(e["kind"] == "job.registered" for e in report["events"])
    assert (daemon_paths(sandbox, "node2").reports_dir / f"{job_id}.json").exists()
    with DaemonClient(daemon_paths(sandbox, "node2")) as client:
        ended = {j["job_id"]: j for j in client.jobs()}[job_id]
    assert ended["state"] == "ended"


def test_killed_daemon_is_started_again_by_the_next_prolog(sandbox: Sandbox) -> None:
    first = submit(sandbox, "-N1", "-w", "node3", "--clockwork-ft", "--wrap", "true")
    assert wait_job(sandbox, first) == "COMPLETED"
    pid = daemon_pid(sandbox, "node3")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert daemon_pid(sandbox, "node3") is None

    second = submit(sandbox, "-N1", "-w", "node3", "--clockwork-ft", "--wrap", "true")
    assert wait_job(sandbox, second) == "COMPLETED"
    new_pid = daemon_pid(sandbox, "node3")
    assert new_pid is not None and new_pid != pid
    actions = [e["event"] for e in events.read(sandbox.paths.spool, second) if e["event"].startswith("daemon.")]
    assert actions[0] in ("daemon.started", "daemon.restarted")
    with DaemonClient(daemon_paths(sandbox, "node3")) as client:
        known = {j["job_id"] for j in client.jobs()}
    assert {first, second} <= known  # the restarted daemon kept the first job's record
    assert drained(sandbox) == {}


def test_job_runs_and_node_stays_in_service_when_the_daemon_cannot_start(sandbox: Sandbox) -> None:
    paths = daemon_paths(sandbox, "node4")
    pid = daemon_pid(sandbox, "node4")
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    run_dir = paths.run_dir
    if run_dir.exists():
        for child in run_dir.iterdir():
            child.unlink()
        run_dir.rmdir()
    run_dir.write_text("not a folder: the daemon cannot create its sockets here\n")
    try:
        job_id = submit(sandbox, "-N1", "-w", "node4", "--clockwork-ft", "--wrap", "true")
        assert wait_job(sandbox, job_id) == "COMPLETED"
        kinds = [e["event"] for e in events.read(sandbox.paths.spool, job_id)]
        assert "daemon.unavailable" in kinds
        assert drained(sandbox) == {}
    finally:
        run_dir.unlink()


def test_another_user_cannot_act_on_a_job_through_the_control_socket(sandbox: Sandbox, short_tmp: Path) -> None:
    tmp_path = short_tmp
    job_id = start_and_wait(sandbox, tmp_path, 20, "-N1", "-w", "node2", "--clockwork-ft")
    control = daemon_paths(sandbox, "node2").control_socket
    script = tmp_path / "intruder.py"
    script.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "from clockwork.contracts.daemon_client import DaemonClient\n"
        "from clockwork.contracts.errors import DaemonError\n"
        "client = DaemonClient(Path(sys.argv[1]), timeout_s=5)\n"
        "for op in ('unregister_job', 'job_events'):\n"
        "    try:\n"
        "        getattr(client, op)(int(sys.argv[2]))\n"
        "        print(op, 'ALLOWED')\n"
        "    except DaemonError as exc:\n"
        "        print(op, exc.code)\n"
    )
    for path in (tmp_path, script):
        path.chmod(0o755)
    for parent in control.parents:  # the control socket must be reachable by any local user
        if parent == Path("/"):
            break
        parent.chmod(parent.stat().st_mode | 0o005)
    result = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            str(script),
            str(control),
            str(job_id),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["unregister_job forbidden", "job_events forbidden"]
    with DaemonClient(control) as client:  # the owner's side (root here) still sees the job running
        assert {j["job_id"]: j for j in client.jobs()}[job_id]["state"] == "running"
    box_slurm = sandbox.slurm()
    box_slurm.cancel(job_id)
    wait_job(sandbox, job_id)


@pytest.mark.parametrize("node", ["node2"])
def test_healthcheck_drains_a_node_with_a_dead_nic_and_resumes_only_its_own_drains(sandbox: Sandbox, node: str) -> None:
    healthcheck = str(sandbox.paths.hooks / "healthcheck")
    assert on_node(sandbox, node, healthcheck).returncode == 0
    assert drained(sandbox) == {}

    sandbox.fault("link", node, "nic1", "down")
    # Where Fleet Lens watches nic1, the check waits for its verdict (one node's link, not a switch's) before it
    # drains, at most the sandbox's [hooks] lens_verdict_wait_s (10 s). With only the daemons of an earlier job's
    # two nodes up, Lens names both ends of the one dead path at confidence 0.25, which is no switch verdict. So,
    # like slurmd every HealthCheckInterval, the check runs until it drains (it must, within the bound).
    until(
        f"the health check to drain {node}",
        lambda: (
            on_node(sandbox, node, healthcheck).returncode == 0
            and drained(sandbox).get(node, "").startswith("clockwork: nic1 down")
        ),
        60,
    )

    sandbox.clear_faults()
    assert on_node(sandbox, node, healthcheck).returncode == 0
    assert drained(sandbox) == {}

    sandbox.slurm().drain(node, "maintenance by the admin")
    try:
        assert on_node(sandbox, node, healthcheck).returncode == 0
        assert drained(sandbox) == {node: "maintenance by the admin"}  # not ours: left alone
    finally:
        sandbox.slurm().resume(node)
    sinfo = subprocess.run(["sinfo", "-R", "-h"], capture_output=True, text=True, env=slurm_env(sandbox))
    assert sinfo.stdout.strip() == ""
