"""Sharded training (HSDP) on the sandbox's real Slurm: a crashed node's rank is rebuilt from the peer holding its
shard, at the same step, and the job ends bitwise equal to the fault-free job.

The job is the FSDP oracle's training (the rank script of ``tests/unit/test_torchpass_fsdp.py``, which also holds
the assertions): a 2 x 2 HSDP mesh, 4 ranks on 4 sandbox nodes and one standby node, ``sbatch -N5 --no-kill
--clockwork-ft --clockwork-spares=standby`` whose batch script runs ``torchpass run`` (one agent step per node).
A rank's node is crashed (``clockwork sandbox fault node NODE crash``: every process in it killed, its links dark)
while the rank is at a random point of a random step: before a layer's all-gather, before its reduce-scatter,
between its reduce-scatter and the all-reduce over the replicas, or in the optimizer step (the seed is printed;
``CW_TEST_SEED`` replays it).
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
from tests.unit import test_torchpass_fsdp as oracle
from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal, load_final

NODES = 5
STEP_SLEEP_S = 0.05
JOB_TIMEOUT_S = 240
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
CRASH_PHASES = ("crashnode-allgather", "crashnode-reducescatter", "crashnode-allreduce", "crashnode-optimizer")


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    return jobs.faults_box(sandbox_manager, nodes=NODES, accounting=False, seed=SEED, replays="these faults")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-fsdp-sandbox")


def _run(box: Sandbox, base: Path, name: str, *, kill: str = "") -> FinishedJob:
    """Submit the job, crash the node its rank asks for, wait for its end."""
    out = base / name
    out.mkdir()
    env = jobs.job_env(box, out, kill=kill, step_sleep=STEP_SLEEP_S, CW_TEST_MESH="2x2")
    command = jobs.torchpass_command(out, oracle.SCRIPT)
    options = [f"-N{NODES}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    job_id = jobs.submit(options, command, env)
    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S)
    run = FinishedJob(out, returncode, f"{output}\ncrashed: {crashed}")
    run.events = jobs.job_events(out)
    jobs.wait_gone(box, job_id)
    return run


@pytest.fixture(scope="module")
def reference(box: Sandbox, base: Path) -> FinishedJob:
    run = _run(box, base, "reference")
    run.check_ok()
    return run


def test_fault_free_hsdp_job_is_consistent(reference: FinishedJob) -> None:
    oracle._assert_each_step_once(reference)
    expected = load_final(reference.out, 0)
    for slot in range(1, oracle.NPROC):
        assert_bitwise_equal(load_final(reference.out, slot), expected, f"slot {slot}")


def test_node_crash_rebuilds_the_shard_from_the_other_replica(box: Sandbox, base: Path, reference: FinishedJob) -> None:
    rng = random.Random(SEED)
    slot, step, phase = rng.randrange(oracle.NPROC), rng.randrange(2, oracle.STEPS - 2), rng.choice(CRASH_PHASES)
    kill = f"{slot}:{step}:{phase}:{-1 if phase.endswith('optimizer') else rng.randrange(oracle.LAYERS)}"
    print(f"crash {kill}")
    run = _run(box, base, "crash", kill=kill)
    assert "crashed: ['node" in run.output, run.output[-3000:]
    fields = oracle._check_fault(run, reference, kill)
    assert "silent" in str(fields["reason"]), fields
    (move,) = [m for m in fields["moves"] if m["target"] == slot]
    assert move["source"] == slot ^ 2, fields  # the same shard in the other replica
    print(f"recovered: {fields}")
