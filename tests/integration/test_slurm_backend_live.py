"""The Slurm CLI backend against the real sandbox Slurm: what tests and tools rely on.

Here on the host's Slurm (22.05); test_slurm_releases.py runs these same tests on Slurm 24.11 and 26.05."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from clockwork.contracts.config import load_config
from clockwork.contracts.errors import SlurmError
from clockwork.contracts.slurm import from_config
from clockwork.contracts.slurm.cli_backend import CliBackend
from clockwork.sandbox.cluster import Sandbox
from tests.integration.conftest import wait_job


def backend(box: Sandbox) -> CliBackend:
    """The backend the sandbox's clockwork.toml configures (its slurm.conf, its release's commands)."""
    cfg = load_config(box.paths.clockwork_toml, env={}).config.slurm
    slurm = from_config(replace(cfg, timeout_s=20))
    assert isinstance(slurm, CliBackend)
    return slurm


def test_version_ping_and_nodes(sandbox: Sandbox) -> None:
    slurm = backend(sandbox)
    major, minor, _ = slurm.version()
    assert f"{major}.{minor:02d}" == sandbox.slurm_release().version
    assert slurm.ping() is True
    nodes = {n.name: n for n in slurm.nodes()}
    assert sorted(nodes) == sorted(n.name for n in sandbox.layout().nodes)
    for name in sorted(nodes):
        assert nodes[name].base_state == "IDLE"
        assert nodes[name].addr == sandbox.layout().node(name).mgmt_ip  # Slurm's NodeAddr: the management NIC
        assert set(nodes[name].partitions) == {"low", "high"}
    assert slurm.expand_hostlist("node[1-3],node4") == ["node1", "node2", "node3", "node4"]


def test_submit_job_and_accounting_with_exit_code(sandbox: Sandbox) -> None:
    slurm = backend(sandbox)
    job_id = slurm.submit("exit 3", ["-N1", "-o", "/dev/null", "-J", "exits-three"])
    assert wait_job(sandbox, job_id) == "FAILED"
    info = slurm.job(job_id)
    assert info is not None
    assert info.name == "exits-three" and info.user == "root" and info.partition == "low"
    assert info.exit_code == "3:0" and len(info.nodes) == 1
    deadline = time.monotonic() + 20  # slurmdbd receives the end record asynchronously
    while time.monotonic() < deadline:
        rows = [r for r in slurm.accounting(job_id) if not r.is_step]
        if rows and rows[0].state == "FAILED":
            break
        time.sleep(0.3)
    assert rows[0].job_id == str(job_id) and rows[0].state == "FAILED" and rows[0].exit_code == "3:0"
    assert rows[0].nodes == info.nodes and rows[0].start and rows[0].end


def test_admin_comment_on_live_and_finished_jobs(sandbox: Sandbox) -> None:
    slurm = backend(sandbox)
    live = slurm.submit("sleep 60", ["-N1", "-o", "/dev/null"])
    slurm.set_admin_comment(live, "clockwork borrowed_by=none")
    info = slurm.job(live)
    assert info is not None and info.admin_comment == "clockwork borrowed_by=none"
    slurm.cancel(live)
    assert wait_job(sandbox, live) == "CANCELLED"
    slurm.cancel(live)  # cancelling a finished job is not an error

    done = slurm.submit("true", ["-N1", "-o", "/dev/null"])
    assert wait_job(sandbox, done) == "COMPLETED"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not slurm.accounting(done):
        time.sleep(0.3)
    slurm.set_admin_comment(done, "clockwork report=ok")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rows = [r for r in slurm.accounting(done) if not r.is_step]
        if rows and rows[0].admin_comment == "clockwork report=ok":
            break
        time.sleep(0.3)
    assert rows[0].admin_comment == "clockwork report=ok"


def test_drain_and_resume_a_node(sandbox: Sandbox) -> None:
    slurm = backend(sandbox)
    slurm.drain("node4", "clockwork: test drain")
    node = next(n for n in slurm.nodes() if n.name == "node4")
    assert node.has("DRAIN") and node.reason == "clockwork: test drain"
    slurm.resume("node4")
    node = next(n for n in slurm.nodes() if n.name == "node4")
    assert not node.has("DRAIN") and node.base_state == "IDLE"


def test_unknown_job_is_none_and_bad_submit_names_slurms_error(sandbox: Sandbox) -> None:
    slurm = backend(sandbox)
    assert slurm.job(999999) is None
    with pytest.raises(SlurmError, match="sbatch"):
        slurm.submit("true", ["--partition=nosuchpartition", "-o", "/dev/null"])
