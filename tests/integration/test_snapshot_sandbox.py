"""Snapshots on the sandbox's real Slurm: a job killed whole and requeued resumes from its snapshot, bitwise.

The job is the rank script of ``tests/unit/test_snapshot_job.py`` (deterministic training with dropout, Adam
and an LR scheduler; it writes a hash of its final model, optimizer and scheduler state per slot), 2 ranks on
2 sandbox nodes and one standby node: ``sbatch -N3 --no-kill --requeue --open-mode=append --clockwork-ft
--clockwork-spares=standby --clockwork-snapshot=2s`` whose batch script runs ``torchpass run``. The SPANK
plugin exports ``CLOCKWORK_SNAPSHOT=2s``; the job's coordinator plans a snapshot step every 2 s; the shards
go to ``CLOCKWORK_SNAPSHOT_DIR`` (the test's folder, which every sandbox node sees).

* requeue: once a complete snapshot of step >= 20 exists, ``scontrol requeue JOBID`` kills the whole job
  (every node's step, agents, ranks and writers) and puts it back in the queue; it starts again with
  ``SLURM_RESTART_COUNT=1``, restores the newest good snapshot by itself (``restore = auto``) and its
  final state equals the fault-free job's on every slot;
* ``clockwork snapshot take JOBID`` on one of the job's nodes: the step it names becomes a complete snapshot
  that ``clockwork snapshot verify`` accepts.

Run (root, sandbox built; the lead runs these):
``CI=true /work/main/.venv/bin/python -m pytest tests/integration/test_snapshot_sandbox.py -v``
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clockwork.contracts.snapshots.store import list_snapshots, verify_snapshot
from clockwork.sandbox.cluster import Sandbox
from tests.integration.conftest import CLOCKWORK, SandboxManager, slurm_env
from tests.unit import test_snapshot_job as job_script

NODES = 3
NPROC = 2
STEPS = 120
STEP_SLEEP_S = 0.1  # ~12 s of training: several 2 s snapshots, and time to requeue mid-job
JOB_TIMEOUT_S = 420  # includes the requeued job's wait in the queue


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    sandbox = sandbox_manager.ensure_up(nodes=NODES, accounting=False)
    sandbox.clear_faults()
    return sandbox


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("snapshot-sandbox")


def _submit(box: Sandbox, out: Path, *, snapshot: str, steps: int = STEPS) -> tuple[int, dict[str, str]]:
    out.mkdir()
    env = dict(
        slurm_env(box),
        CW_TEST_DIR=str(out),
        CW_TEST_STEPS=str(steps),
        CW_TEST_STEP_SLEEP=str(STEP_SLEEP_S),
        CLOCKWORK_SNAPSHOT_DIR=str(out / "snapshots"),
        OMP_NUM_THREADS="1",
        CLOCKWORK_CONFIG=str(box.paths.clockwork_toml),
    )
    command = f"{sys.executable} -m torchpass run --set collective_timeout_s=20 {job_script.SCRIPT}"
    options = [
        f"-N{NODES}",
        "--no-kill",
        "--requeue",
        "--open-mode=append",
        "--clockwork-ft",
        "--clockwork-spares=standby",
        f"--clockwork-snapshot={snapshot}",
        f"--output={out}/job.out",
    ]
    submit = subprocess.run(
        ["sbatch", "--parsable", *options, f"--wrap={command}"], env=env, capture_output=True, text=True, check=True
    )
    return int(submit.stdout.strip().split(";")[0]), env


def _wait_end(box: Sandbox, job_id: int, out: Path) -> None:
    slurm = box.slurm()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        if info is None or info.finished:
            return
        time.sleep(0.2)
    output = (out / "job.out").read_text()[-6000:] if (out / "job.out").exists() else ""
    raise AssertionError(f"job {job_id} did not end in {JOB_TIMEOUT_S} s: {slurm.job(job_id)}\n{output}")


def _finals(out: Path) -> list[str]:
    return [json.loads((out / f"final-{slot}.json").read_text())["sha"] for slot in range(NPROC)]


def _rank_events(out: Path, kind: str) -> list[dict[str, object]]:
    marker = f" event {kind} "
    text = (out / "job.out").read_text(errors="replace") if (out / "job.out").exists() else ""
    return [json.loads(line.split(marker, 1)[1]) for line in text.splitlines() if marker in line]


@pytest.fixture(scope="module")
def reference(box: Sandbox, base: Path) -> list[str]:
    out = base / "reference"
    job_id, _ = _submit(box, out, snapshot="off")
    _wait_end(box, job_id, out)
    finals = _finals(out)
    assert len(set(finals)) == 1, finals
    return finals


def test_requeued_job_resumes_from_its_snapshot_bitwise(box: Sandbox, base: Path, reference: list[str]) -> None:
    out = base / "requeued"
    job_id, env = _submit(box, out, snapshot="2s")
    snapdir = out / "snapshots"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        complete = [i for i in list_snapshots(snapdir) if i.complete]
        if complete and complete[-1].step >= 20:
            break
        assert not (out / "final-0.json").exists(), "the job ended before a snapshot of step >= 20 was written"
        time.sleep(0.1)
    else:
        raise AssertionError(
            f"no snapshot of step >= 20 in {snapdir}: {[i.summary() for i in list_snapshots(snapdir)]}"
        )
    subprocess.run(["scontrol", "requeue", str(job_id)], env=env, check=True, capture_output=True, text=True)
    _wait_end(box, job_id, out)
    assert _finals(out) == reference
    restored = _rank_events(out, "torchpass.restored")
    assert len(restored) == NPROC and len({int(str(e["step"])) for e in restored}) == 1, restored
    assert int(str(restored[0]["step"])) >= 20
    for info in list_snapshots(snapdir):
        if info.complete:
            assert verify_snapshot(info.path) == []


def test_clockwork_snapshot_take(box: Sandbox, base: Path) -> None:
    out = base / "take"
    steps = 3 * STEPS  # ~36 s of training: the on-demand step is planned well before the end even on a slow start
    job_id, env = _submit(box, out, snapshot="off", steps=steps)
    deadline = time.monotonic() + 120
    answer = ""
    while time.monotonic() < deadline:
        proc = subprocess.run(  # on one of the job's nodes, as on a real cluster
            box.exec_argv("node2", [CLOCKWORK, "snapshot", "take", str(job_id)]),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        answer = proc.stdout + proc.stderr
        if proc.returncode == 0:
            break
        time.sleep(0.5)  # the job may still be starting: not a TorchPass job yet, or not training
    assert "every rank snapshots after step" in answer, answer
    step = int(answer.split("after step")[1].split()[0])
    assert step < steps, f"the snapshot was planned after the job's last step: {answer}"
    _wait_end(box, job_id, out)
    snapdir = out / "snapshots"
    assert step in {i.step for i in list_snapshots(snapdir) if i.complete}
    verified = subprocess.run(
        [CLOCKWORK, "snapshot", "verify", str(snapdir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert verified.returncode == 0 and "OK " in verified.stdout, verified.stdout + verified.stderr
