"""TorchPass on the sandbox's real Slurm: faulted jobs end bitwise equal to the fault-free job.

The job is the oracle's deterministic training with dropout (the rank script of
``tests/unit/test_torchpass_oracle.py``, which also holds the assertions), 4 ranks on 4 sandbox nodes and one
standby node: ``sbatch -N5 --no-kill --clockwork-ft --clockwork-spares=standby`` whose batch script runs
``torchpass run`` (one agent step per node). Faults land at a random step and a random point of it (forward,
backward while buckets are all-reduced, optimizer step); the seed is printed, and ``CW_TEST_SEED`` replays it.

* SIGKILL of one rank, and of rank 0;
* a node crash (``clockwork sandbox fault node NODE crash``: every process in it killed, its links dark) while
  its rank is at the chosen point, and a crash of the node whose agent leads the coordinator, each found by the
  node daemons' node-silent verdict;
* two failures five steps apart (a SIGKILL, then a node crash);
* planned migration with ``clockwork migrate JOBID --rank R`` through the node daemons.

Each run's final parameters, optimizer, scheduler and registered state on every slot are ``torch.equal`` to
the fault-free run's, and every slot's journal shows each step committed exactly once.
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
from tests.unit import test_torchpass_oracle as oracle
from tests.unit.local_jobs import assert_bitwise_equal

NODES = 5
NPROC = 4
STEPS = 60
STEP_SLEEP_S = 0.08  # ~5 s of training: time for a migration request to land mid-job
JOB_TIMEOUT_S = 240
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
PHASES = ("forward", "backward", "optimizer")
CRASH_PHASES = ("crashnode", "crashnode-backward", "crashnode-optimizer")  # the rank waits there for the crash


def _fault(rng: random.Random, first: int = 8, last: int = 40, phases: tuple[str, ...] = PHASES) -> tuple[int, str]:
    """A random step and point within it."""
    return rng.randint(first, last), rng.choice(phases)


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    return jobs.faults_box(sandbox_manager, nodes=NODES, accounting=False, seed=SEED, replays="these faults")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-sandbox")


def _committed(out: Path, slot: int) -> int:
    journal = out / f"journal-slot{slot}.txt"
    steps = [int(line.split()[2]) for line in journal.read_text().splitlines()] if journal.exists() else []
    return max(steps, default=-1)


def _run(box: Sandbox, base: Path, name: str, *, kill: str = "", migrate: tuple[int, int] | None = None) -> oracle.Run:
    """Submit the job, crash the nodes its ranks ask for, migrate when asked, wait for its end."""
    out = base / name
    out.mkdir()
    held = jobs.held_for_migration(out, migrate[1] + 1) if migrate is not None else {}
    env = jobs.job_env(box, out, kill=kill, step_sleep=STEP_SLEEP_S, CW_TEST_STEPS=str(STEPS), **held)
    command = jobs.torchpass_command(out, oracle.SCRIPT)
    options = [f"-N{NODES}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    job_id = jobs.submit(options, command, env)
    migrated = ""

    def migrate_when_due() -> None:
        nonlocal migrated
        if migrate is not None and not migrated and _committed(out, 0) >= migrate[1]:
            migrated = jobs.clockwork_migrate(box, job_id, migrate[0], env)

    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, migrate_when_due)
    run = oracle.Run(out, returncode, f"{output}\ncrashed: {crashed}\nmigrate: {migrated}", jobs.job_events(out))
    jobs.wait_gone(box, job_id)
    return run


def _check(run: oracle.Run, reference: oracle.Run) -> dict[int, list[tuple[str, int, int, int]]]:
    run.check_ok()
    oracle._assert_same_final_state(run, reference, nproc=NPROC, steps=STEPS)
    return oracle._assert_each_step_once(run, nproc=NPROC, steps=STEPS)


@pytest.fixture(scope="module")
def reference(box: Sandbox, base: Path) -> oracle.Run:
    run = _run(box, base, "reference")
    run.check_ok()
    return run


def test_fault_free_job_is_consistent(reference: oracle.Run) -> None:
    oracle._assert_each_step_once(reference, nproc=NPROC, steps=STEPS)
    assert not reference.of_kind("torchpass.recovered")
    expected = oracle._final(reference, 0)
    for slot in range(1, NPROC):
        assert_bitwise_equal(oracle._final(reference, slot), expected, f"slot {slot}")


@pytest.mark.parametrize("slot", [2, 0], ids=["rank", "rank0"])
def test_sigkill_of_a_rank(box: Sandbox, base: Path, reference: oracle.Run, slot: int) -> None:
    step, phase = _fault(random.Random(SEED + slot))
    run = _run(box, base, f"kill-{slot}", kill=f"{slot}:{step}:{phase}")
    journals = _check(run, reference)
    assert len({pid for *_, pid in journals[slot]}) == 2, "the slot was not taken over by another process"
    oracle._recovered(run, slot)


def _leader_slot(reference: oracle.Run) -> int:
    """The slot whose node's agent led the coordinator (agent K starts slot K)."""
    records = [e["fields"] for e in reference.events if e["kind"] == "torchpass.coordinator"]
    agents = {int(str(f["agent"])) for f in records if isinstance(f, dict) and "agent" in f}
    return min(agents) if agents else 0


@pytest.mark.parametrize("which", ["rank-node", "coordinator-node"])
def test_node_crash(box: Sandbox, base: Path, reference: oracle.Run, which: str) -> None:
    slot = 1 if which == "rank-node" else _leader_slot(reference)
    step, phase = _fault(random.Random(SEED + 10 + slot), phases=CRASH_PHASES)
    run = _run(box, base, f"crash-{which}", kill=f"{slot}:{step}:{phase}")
    assert "crashed: ['node" in run.output, run.output[-3000:]
    _check(run, reference)
    fields = oracle._recovered(run, slot)
    # Found by the node daemons' verdict (silent on every rail, kernel silent), not the agents' 2 s lease.
    assert "silent on every rail" in str(fields["reason"]), fields


def test_two_failures_five_steps_apart(box: Sandbox, base: Path, reference: oracle.Run) -> None:
    rng = random.Random(SEED + 20)
    step, phase = _fault(rng, last=30)
    run = _run(box, base, "two-failures", kill=f"1:{step}:{phase},3:{step + 5}:{rng.choice(CRASH_PHASES)}")
    _check(run, reference)
    oracle._recovered(run, 1)
    oracle._recovered(run, 3)
    assert len(run.of_kind("torchpass.member_failed")) == 2


def test_planned_migration_with_clockwork_migrate(box: Sandbox, base: Path, reference: oracle.Run) -> None:
    run = _run(box, base, "migrate", migrate=(2, random.Random(SEED + 30).randint(8, 30)))
    assert "migrate: rc 0" in run.output, run.output[-3000:]
    journals = _check(run, reference)
    assert len({pid for *_, pid in journals[2]}) == 2
    moved = run.of_kind("torchpass.migrated")
    assert moved and moved[0]["slots"] == [2] and moved[0]["handoff_ok"], moved
    assert not run.of_kind("torchpass.member_failed")
