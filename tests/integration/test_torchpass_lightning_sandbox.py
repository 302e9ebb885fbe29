"""An unmodified PyTorch Lightning script in transparent mode on the sandbox's real Slurm: two SIGKILLs (slot 0
among them) at random moments, and a planned migration, each ending bitwise equal per slot to the fault-free run.

The job is the Lightning script of ``tests/unit/test_torchpass_lightning.py`` (it also holds the assertions): 2
ranks on 2 sandbox nodes and one standby node, ``sbatch -N3 --no-kill --clockwork-ft=transparent
--clockwork-spares=standby`` whose batch script runs ``torchpass run SCRIPT`` without ``--transparent`` (the SPANK
plugin's ``CLOCKWORK_FT=transparent`` selects the mode). Inside a Slurm job Lightning would take its rank from
``SLURM_PROCID`` (the node agent's task); TorchPass's torchrun variables make it take the slot instead. The
faults' batches and phases are drawn from a seed that is printed; ``CW_TEST_SEED`` replays it.
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
from tests.unit import test_torchpass_lightning as lightning

NODES = 3
JOB_TIMEOUT_S = 300
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    return jobs.faults_box(sandbox_manager, nodes=NODES, accounting=False, seed=SEED, replays="these faults")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-lightning-sandbox")


def _run(box: Sandbox, base: Path, name: str, *, kill: str = "", migrate: int | None = None) -> lightning.Run:
    """Submit the job, migrate slot ``migrate`` once it reaches batch 9, wait for its end."""
    out = base / name
    out.mkdir()
    step_file = f"{migrate}:9" if migrate is not None else ""
    held = jobs.held_for_migration(out, 9) if migrate is not None else {}
    env = jobs.job_env(
        box, out, kill=kill, step_sleep=0.1 if migrate is not None else 0.0, CW_TEST_STEP_FILE=step_file, **held
    )
    env["PYTHONWARNINGS"] = "ignore"
    options = [f"-N{NODES}", "--no-kill", "--clockwork-ft=transparent", "--clockwork-spares=standby"]
    job_id = jobs.submit([*options, f"--output={out}/job.out"], jobs.torchpass_command(out, lightning.SCRIPT), env)
    migrated = ""

    def migrate_when_due() -> None:
        nonlocal migrated
        if migrate is not None and not migrated and (out / "at-step").exists():
            migrated = jobs.clockwork_migrate(box, job_id, migrate, env)

    _, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, migrate_when_due)
    run = lightning.Run(out, returncode, f"{output}\nmigrate: {migrated}")
    run.events = jobs.job_events(out)
    jobs.wait_gone(box, job_id)
    return run


@pytest.fixture(scope="module")
def reference(box: Sandbox, base: Path) -> lightning.Run:
    run = _run(box, base, "reference")
    run.check_ok()
    return run


def test_fault_free_lightning_job_under_slurm(reference: lightning.Run) -> None:
    lightning._assert_like_reference(reference, reference, "reference")
    assert not reference.of_kind("torchpass.recovered")
    assert "clockwork-ft transparent" in reference.output, reference.output[-3000:]
    assert "its loop counters and callbacks' state move with the state" in reference.output


def test_two_sigkills_slot0_among_them(box: Sandbox, base: Path, reference: lightning.Run) -> None:
    kill = lightning._random_kills(random.Random(SEED))
    print(f"CW_TEST_SEED={SEED}: kills {kill}")
    run = _run(box, base, "kills", kill=kill)
    lightning._assert_like_reference(run, reference, f"seed {SEED}: {kill}")
    assert len(list(run.out.glob("killed-*"))) == 2, f"seed {SEED}: {kill}: the faults were not injected"
    assert len(run.of_kind("torchpass.member_failed")) == 2, run.of_kind("torchpass.member_failed")


def test_planned_migration_with_clockwork_migrate(box: Sandbox, base: Path, reference: lightning.Run) -> None:
    run = _run(box, base, "migrate", migrate=1)
    assert "migrate: rc 0" in run.output, run.output[-3000:]
    lightning._assert_like_reference(run, reference, "migration")
    moved = run.of_kind("torchpass.migrated")
    assert moved and moved[0]["slots"] == [1] and moved[0]["handoff_ok"], moved
    assert not run.of_kind("torchpass.member_failed")
