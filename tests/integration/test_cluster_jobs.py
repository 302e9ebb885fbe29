"""Real jobs on the real sandbox Slurm: sbatch, srun across nodes, sacct, the hooks' event log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from clockwork.sandbox.cluster import REPO_ROOT, Sandbox
from slurm_hooks import events
from tests.integration.conftest import CLOCKWORK, on_node, slurm_env, wait_job


def test_sbatch_srun_hostname_on_four_nodes_and_sacct_completed(sandbox: Sandbox, tmp_path: Path) -> None:
    """The issue's command line, literally: eval the env, sbatch -N4 'srun hostname', sacct."""
    out = tmp_path / "hostname-%j.out"
    script = (
        f'eval "$({CLOCKWORK} --set sandbox.state_dir={sandbox.paths.root} sandbox env)" && '
        f"sbatch --parsable -N4 -o {out} --wrap 'srun hostname'"
    )
    sub = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
    )
    assert sub.returncode == 0, sub.stderr
    job_id = int(sub.stdout.strip())
    assert wait_job(sandbox, job_id) == "COMPLETED"
    lines = Path(str(out).replace("%j", str(job_id))).read_text().split()
    assert sorted(lines) == ["node1", "node2", "node3", "node4"]

    acct = subprocess.run(
        ["sacct", "-j", str(job_id), "-X", "-n", "-o", "State"],
        capture_output=True,
        text=True,
        env=slurm_env(sandbox),
        timeout=30,
    )
    assert acct.stdout.split() == ["COMPLETED"], acct


def test_hooks_record_every_context(sandbox: Sandbox) -> None:
    """Prolog/Epilog on each node and PrologSlurmctld/EpilogSlurmctld record their events with the job's facts."""
    job_id = sandbox.slurm().submit("srun true; exit 3", ["-N2", "-o", "/dev/null"])
    assert wait_job(sandbox, job_id) == "FAILED"
    recorded = events.read(sandbox.paths.spool, job_id)
    kinds = {(e["node"], e["event"]) for e in recorded}
    nodes = {e["node"] for e in recorded if e["event"] == "job.prolog"}
    assert len(nodes) == 2 and nodes <= {"node1", "node2", "node3", "node4"}
    for node in nodes:
        assert {(node, "job.prolog"), (node, "job.epilog")} <= kinds
    assert {("slurmctld", "job.start"), ("slurmctld", "job.end")} <= kinds
    end = next(e for e in recorded if e["event"] == "job.end")
    assert end["exit_code"] == 3 and end["user"] == "root" and end["partition"] == "low"
    # Prolog of every node ran before its Epilog.
    for node in nodes:
        order = [e["event"] for e in recorded if e["node"] == node]
        assert order == ["job.prolog", "job.epilog"]


def test_nodes_have_own_hostname_and_node_address(sandbox: Sandbox) -> None:
    status = sandbox.status()
    for node in status["nodes"]:
        result = on_node(sandbox, node["name"], "sh", "-c", "hostname; getent hosts $(hostname)")
        assert result.returncode == 0, result.stderr
        name, resolved = result.stdout.splitlines()
        assert name == node["name"]
        assert resolved.split()[0] == node["node_addr"]


def test_gloo_training_across_three_nodes_binds_node_addresses(sandbox: Sandbox, tmp_path: Path) -> None:
    """The demo's training job: three ranks, one per node, over the node addresses; same weights everywhere."""
    out = tmp_path / "train-%j.out"
    cmd = f"srun {sys.executable} {REPO_ROOT / 'examples' / 'train_ddp.py'} --steps 8"
    job_id = sandbox.slurm().submit(cmd, ["-N3", "--ntasks-per-node=1", "-o", str(out)])
    state = wait_job(sandbox, job_id, timeout_s=240)
    text = Path(str(out).replace("%j", str(job_id))).read_text()
    assert state == "COMPLETED", text
    assert text.count("step ") >= 8 and "final weights sha256" in text
    addrs = {n["name"]: n["node_addr"] for n in sandbox.status()["nodes"]}
    done = [line for line in text.splitlines() if line.startswith("rank ") and line.endswith(" done")]
    assert len(done) == 3
    for line in done:
        _, _rank, _on, host, addr, _ = line.split()
        assert addr.strip("()").split(",")[0] == addrs[host]


def test_status_json_describes_nodes_nics_and_paths(sandbox: Sandbox) -> None:
    result = subprocess.run(
        [CLOCKWORK, "sandbox", "--state", str(sandbox.paths.root), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["running"] is True and info["accounting"] is True
    assert Path(info["slurm_conf"]).is_file() and Path(info["munge_socket"]).is_socket()
    assert [n["name"] for n in info["nodes"]] == ["node1", "node2", "node3", "node4"]
    for i, node in enumerate(info["nodes"], start=1):
        assert node["node_addr"] == f"198.18.0.{i}"
        assert node["slurm_state"] == "IDLE"
        assert [(n["nic"], n["addr"], n["switch_port"]) for n in node["nics"]] == [
            ("nic0", f"198.18.1.{i}/24", f"n{i}-nic0"),
            ("nic1", f"198.18.2.{i}/24", f"n{i}-nic1"),
        ]
    assert all(svc["alive"] for svc in info["services"].values())
    assert {"munged", "slurmctld", "slurmdbd", "mariadb", "slurmd-node1"} <= set(info["services"])
