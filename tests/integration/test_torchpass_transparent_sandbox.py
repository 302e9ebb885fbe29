"""Model-transparent mode on the sandbox's real Slurm: an unmodified DDP script, faulted, ends bitwise equal.

The job is the unmodified DDP script of ``tests/unit/test_torchpass_transparent.py`` (it also holds the
assertions): 4 ranks on 4 sandbox nodes and one standby node, ``sbatch -N5 --no-kill
--clockwork-ft=transparent --clockwork-spares=standby`` whose batch script runs ``torchpass run SCRIPT``
without ``--transparent``: the SPANK plugin's ``CLOCKWORK_FT=transparent`` selects the mode. Faults land at a
random step and a random point of it; the seed is printed and ``CW_TEST_SEED`` replays it.

* SIGKILL of one rank;
* a node crash (``clockwork sandbox fault node NODE crash``) while its rank is at the chosen point;
* planned migration with ``clockwork migrate JOBID --rank R`` through the node daemons.

Each run's final model, optimizer and scheduler state on every slot is ``torch.equal`` to the fault-free
run's, and the coordinator finished with every member at the last step.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from clockwork.sandbox.cluster import Sandbox
from tests.integration import sandbox_jobs as jobs
from tests.integration.conftest import SandboxManager
from tests.unit import test_torchpass_transparent as transparent

NODES = 5
NPROC = 4
STEPS = transparent.EPOCHS * (transparent.SAMPLES // (transparent.BATCH * NPROC))  # 21
STEP_SLEEP_S = 0.15  # ~3 s of training: time for a migration request to land mid-job
JOB_TIMEOUT_S = 240
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
PHASES = ("forward", "backward", "optimizer")
CRASH_PHASES = ("crashnode", "crashnode-backward", "crashnode-optimizer")


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    return jobs.faults_box(sandbox_manager, nodes=NODES, accounting=False, seed=SEED, replays="these faults")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-transparent-sandbox")


def _run(box: Sandbox, base: Path, name: str, *, kill: str = "", migrate: int | None = None) -> transparent.Run:
    """Submit the job, crash the nodes its ranks ask for, migrate rank ``migrate`` mid-job, wait for its end."""
    out = base / name
    out.mkdir()
    step_file = "0:6" if migrate is not None else ""
    held = jobs.held_for_migration(out, 6) if migrate is not None else {}
    env = jobs.job_env(box, out, kill=kill, step_sleep=STEP_SLEEP_S, CW_TEST_STEP_FILE=step_file, **held)
    command = jobs.torchpass_command(out, transparent.SCRIPT)
    options = [
        f"-N{NODES}",
        "--no-kill",
        "--clockwork-ft=transparent",
        "--clockwork-spares=standby",
        f"--output={out}/job.out",
    ]
    job_id = jobs.submit(options, command, env)
    migrated = ""

    def migrate_when_due() -> None:
        nonlocal migrated
        if migrate is not None and not migrated and (out / "at-step").exists():
            migrated = jobs.clockwork_migrate(box, job_id, migrate, env)

    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, migrate_when_due)
    run = transparent.Run(out, returncode, f"{output}\ncrashed: {crashed}\nmigrate: {migrated}")
    run.events = jobs.job_events(out)
    jobs.wait_gone(box, job_id)
    return run


def _check(run: transparent.Run, reference: transparent.Run) -> None:
    run.check_ok()
    transparent._assert_same_final_state(run, reference, nproc=NPROC, steps=STEPS)


@pytest.fixture(scope="module")
def reference(box: Sandbox, base: Path) -> transparent.Run:
    run = _run(box, base, "reference")
    run.check_ok()
    return run


def test_fault_free_job_is_consistent(reference: transparent.Run) -> None:
    _check(reference, reference)
    assert not reference.of_kind("torchpass.recovered")
    # The mode came from the SPANK option alone: the agents say so, and the ranks ran under the bootstrap.
    assert "clockwork-ft transparent" in reference.output, reference.output[-3000:]
    assert "TorchPass owns the process group" in reference.output, reference.output[-3000:]


def test_sigkill_of_a_rank(box: Sandbox, base: Path, reference: transparent.Run) -> None:
    rng = random.Random(SEED)
    step, phase = rng.randint(4, STEPS - 4), rng.choice(PHASES)
    run = _run(box, base, "kill", kill=f"2:{step}:{phase}")
    _check(run, reference)
    assert len(run.pids(2)) == 2, "the slot was not taken over by another process"
    assert [f for f in run.of_kind("torchpass.recovered") if 2 in f["slots"]]


def test_node_crash(box: Sandbox, base: Path, reference: transparent.Run) -> None:
    rng = random.Random(SEED + 10)
    step, phase = rng.randint(4, STEPS - 4), rng.choice(CRASH_PHASES)
    run = _run(box, base, "crash", kill=f"1:{step}:{phase}")
    assert "crashed: ['node" in run.output, run.output[-3000:]
    _check(run, reference)
    recovered = [f for f in run.of_kind("torchpass.recovered") if 1 in f["slots"]]
    assert recovered and "silent" in str(recovered[0]["reason"]), recovered


def test_planned_migration_with_clockwork_migrate(box: Sandbox, base: Path, reference: transparent.Run) -> None:
    run = _run(box, base, "migrate", migrate=2)
    assert "migrate: rc 0" in run.output, run.output[-3000:]
    _check(run, reference)
    assert len(run.pids(2)) == 2
    moved = run.of_kind("torchpass.migrated")
    assert moved and moved[0]["slots"] == [2] and moved[0]["handoff_ok"], moved
    assert not run.of_kind("torchpass.member_failed")
