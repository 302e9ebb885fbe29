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
  that ``clockwork snapshot verify`` accepts;
* the last line of defence: a job on 2 nodes with no spare (``--clockwork-spares=none``) loses a node once a
  snapshot of step >= 20 exists. No spare comes within ``spare_timeout_s`` (a capacity failure), so the leading
  agent requeues the job itself (``torchpass.requeued``); it runs again on the nodes left, restores that
  snapshot and ends bitwise equal to the fault-free job. The crashed node comes back once the requeue is
  said, as an admin's reboot would bring it, so Slurm can finish the old run's cleanup on it.

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
from tests.integration.conftest import CLOCKWORK, SandboxManager, daemon_paths, slurm_env
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


def _submit(
    box: Sandbox,
    out: Path,
    *,
    snapshot: str,
    steps: int = STEPS,
    nodes: int = NODES,
    spares: str = "standby",
    settings: tuple[str, ...] = (),
) -> tuple[int, dict[str, str]]:
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
    sets = "".join(f" --set {s}" for s in ("collective_timeout_s=20", *settings))
    command = f"{sys.executable} -m torchpass run{sets} {job_script.SCRIPT}"
    options = [
        f"-N{nodes}",
        "--no-kill",
        "--requeue",
        "--open-mode=append",
        "--clockwork-ft",
        f"--clockwork-spares={spares}",
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


def _wait_snapshot(out: Path, step: int) -> None:
    snapdir = out / "snapshots"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        complete = [i for i in list_snapshots(snapdir) if i.complete]
        if complete and complete[-1].step >= step:
            return
        assert not (out / "final-0.json").exists(), f"the job ended before a snapshot of step >= {step} was written"
        time.sleep(0.1)
    raise AssertionError(
        f"no snapshot of step >= {step} in {snapdir}: {[i.summary() for i in list_snapshots(snapdir)]}"
    )


def test_a_job_that_cannot_recover_requeues_itself_and_resumes_bitwise(
    box: Sandbox, base: Path, reference: list[str]
) -> None:
    out = base / "last-line"
    job_id, _env = _submit(
        box, out, snapshot="2s", nodes=NPROC, spares="none", settings=("spare_timeout_s=3", "max_requeues=1")
    )
    _wait_snapshot(out, 20)
    info = box.slurm().job(job_id)
    assert info is not None and len(info.nodes) == NPROC, info
    lost = info.nodes[-1]
    box.crash_node(lost)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not _rank_events(out, "torchpass.requeued"):
            said = _rank_events(out, "torchpass.not_requeued")
            assert not said, f"the job was not requeued: {said}"
            assert time.monotonic() < deadline, f"no requeue within {JOB_TIMEOUT_S} s"
            time.sleep(0.2)
    finally:
        box.restore_node(lost)
    _wait_end(box, job_id, out)
    requeued = _rank_events(out, "torchpass.requeued")
    failed = _rank_events(out, "torchpass.failed")
    assert failed and failed[0]["cause"] == "capacity", failed
    restored = _rank_events(out, "torchpass.restored")
    steps = {int(str(e["step"])) for e in restored}
    assert len(restored) == NPROC and len(steps) == 1 and min(steps) >= int(str(requeued[0]["step"])), restored
    assert int(str(restored[0]["step"])) >= 20
    assert _finals(out) == reference
    final = box.slurm().job(job_id)
    assert final is not None and final.restart_count == 1, final
    # The survivor's Epilog reported the first run (moved to JOB.N.json if the second ran there too): requeued.
    reports = daemon_paths(box, info.nodes[0]).reports_dir
    runs = [reports / f"{job_id}.json", *sorted(reports.glob(f"{job_id}.*.json"))]
    endings = [json.loads(p.read_text()).get("ending", "") for p in runs if p.exists()]
    assert any(e.startswith("requeued: requeued to restore the snapshot of step") for e in endings), endings
