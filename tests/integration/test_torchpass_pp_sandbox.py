"""TorchPass's pipeline parallelism on the sandbox's real Slurm: a node crash takes one pipeline stage, and the
standby node rebuilds it from the same stage of the other replica, at the same step.

The PP oracle's rank script (``tests/unit/test_torchpass_pp.py``: a small MLP cut in two stages, dropout in both,
``ctx.wrap_pipeline(mesh_shape=(2, 2), schedule=ScheduleGPipe or Schedule1F1B, n_microbatches=4)``, AdamW, an LR
scheduler) as a user submits it: ``sbatch -N5 --ntasks-per-node=1 --no-kill --clockwork-ft
--clockwork-spares=standby`` whose batch script runs ``torchpass run``. The mesh is (dp_replicate 2 x pp 2), one
rank per node: slot ``r*2 + k`` (stage k of replica r) on node ``r*2 + k``; the fifth node is the standby node,
whose agent runs one spare.

A random slot stops at a random point of a random step (after a micro-batch's forward, before it sends the
activations; when a micro-batch's output gradient arrives, before it sends its input gradient back; inside the
loss, on the last stage; between the schedule step and the stage's gradient all-reduce over the replicas; in the
optimizer step) and asks for its node's crash (``clockwork sandbox fault node NODE crash``: every process on it
killed, its links dark). The standby node's spare takes the dead slot, fed by the same stage of the other replica,
and every stage resumes the step the job had reached. Every slot's stage, optimizer and scheduler state is
``torch.equal`` to the fault-free job's on the same Slurm with the same schedule, and every slot's journal shows
each step committed exactly once. The seed (schedule, slot, step, point) is printed; ``CW_TEST_SEED`` replays it.
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
from tests.unit import test_torchpass_pp as ppo
from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal, load_final

NODES = 5  # 4 training nodes of one stage each, and the standby node
NPROC = ppo.RANKS  # 2 replicas x 2 stages, one rank per node
JOB_TIMEOUT_S = 240
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
CRASH_PHASES = ("forward", "backward", "scheduled", "optimizer")  # the rank waits there for the crash
LAST_STAGE_PHASES = ("loss",)  # only the last stage computes the loss


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    return jobs.faults_box(sandbox_manager, nodes=NODES, accounting=False, seed=SEED, replays="the PP node crash")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-pp-sandbox")


def _run(box: Sandbox, base: Path, name: str, *, schedule: str, kill: str = "") -> FinishedJob:
    """The PP oracle's 2 x 2 job on 4 nodes of one rank and a standby node; a rank's crash request crashes its
    node."""
    out = base / name
    out.mkdir()
    env = jobs.job_env(box, out, kill=kill, step_sleep=0, CW_TEST_SCHEDULE=schedule)
    # the runtime net compares the replicas of each stage every 2 steps, as in the local oracle
    command = jobs.torchpass_command(out, ppo.SCRIPT, "--set replica_check_every_steps=2")
    options = [f"-N{NODES}", "--ntasks-per-node=1", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby"]
    return jobs.run_job(box, out, options, command, env, JOB_TIMEOUT_S)


def test_node_crash_rebuilds_a_pipeline_stage_on_the_standby_node(box: Sandbox, base: Path) -> None:
    rng = random.Random(SEED)
    schedule = rng.choice(("gpipe", "1f1b"))
    slot, step = rng.randrange(NPROC), rng.randrange(1, ppo.STEPS - 1)
    replica, stage = divmod(slot, 2)
    phase = rng.choice(CRASH_PHASES + (LAST_STAGE_PHASES if stage == 1 else ()))
    microbatch = -1 if phase in ("scheduled", "optimizer") else rng.randrange(ppo.MICROBATCHES)
    kill = f"{slot}:{step}:crashnode-{phase}:{microbatch}"

    reference = _run(box, base, "pp-reference", schedule=schedule)
    reference.check_ok()
    ppo._assert_each_step_once(reference)
    for k in range(2):  # each stage's replicas end equal (their gradients averaged over the replicas)
        assert_bitwise_equal(load_final(reference.out, k), load_final(reference.out, k + 2), f"reference stage {k}")
        assert load_final(reference.out, k)["stage"] == k
    assert "the replicas agree" in reference.output, "the runtime net never compared the replicas"
    (generation,) = reference.of_kind("torchpass.generation")
    assert generation["members"] == {str(k): f"a{k}.0" for k in range(NPROC)}, generation

    print(f"{schedule}: crash {kill} (replica {replica}, stage {stage})")
    run = _run(box, base, "pp-node-crash", schedule=schedule, kill=kill)
    assert "crashed: ['node" in run.output, run.output[-3000:]
    # bitwise per slot, each step once, the victim taken over, its stage moved from the other replica's same stage
    moves = ppo._check_fault(run, reference, kill)
    journals = ppo._assert_each_step_once(run)

    # the replacement holds the dead rank's (replica, stage) coordinate: its slot, on the standby node
    nodes = next(f["nodes"] for f in run.of_kind("torchpass.coordinator"))
    failed = [(f["slot"], f["node"], f["local"]) for f in run.of_kind("torchpass.member_failed")]
    assert failed == [(slot, nodes[slot], 0)], run.of_kind("torchpass.member_failed")
    (replaced,) = [g for g in run.of_kind("torchpass.generation") if g["replaced"]]
    assert replaced["replaced"] == {str(slot): "a4.0"}, replaced  # agent 4: the standby node
    assert replaced["placed"] == {str(slot): {"node": nodes[4], "local": 0}}, replaced
    assert load_final(run.out, slot)["stage"] == stage
    (move,) = moves
    assert (move["target"], move["source"], move["part"]) == (slot, (1 - replica) * 2 + stage, stage), moves

    # it resumed at the step the job had reached: the crashed one, or the next where every stage had committed it
    # (a crash in the optimizer step comes after both replicas' votes); nothing was computed twice
    (recovered,) = run.of_kind("torchpass.recovered")
    assert recovered["slots"] == [slot], recovered
    assert "silent on every rail" in str(recovered["reason"]), recovered  # the node daemons' verdict
    resumed = step + 1 if phase == "optimizer" else step
    assert recovered["step"] == resumed and recovered["recomputed_steps"] == 0, (recovered, step, phase)
    # the replacement adopted that state once (generation 0's adoption is the start's, by the first process)
    adopted = [s for kind, gen, s, _pid in journals[slot] if kind == "adopt" and gen > 0]
    assert adopted == [resumed - 1], (journals[slot], step, phase)
    # at the job's end every surviving agent tells its node daemon where the slot went and which stage moved with
    # it (what the batch host's Epilog puts in the AdminComment: "slots moved: 1 node2/0->node5/0 (stage 1 ...)")
    placements = run.of_kind("torchpass.placement")
    where = {"from": f"{nodes[slot]}/0", "to": f"{nodes[4]}/0", "part": f"stage {stage} of the 2x2 pipeline"}
    assert placements and all(p["slots"] == {str(slot): where} for p in placements), placements
