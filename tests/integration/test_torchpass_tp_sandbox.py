"""TorchPass's tensor parallelism on the sandbox's real Slurm: a node crash takes a whole TP group, and the
standby node rebuilds it from the other replica at the same step.

The TP oracle's rank script (``tests/unit/test_torchpass_tp.py``: a Llama-shaped model under torchtitan's
Colwise/Rowwise plan, ``ctx.wrap_fsdp(mesh_shape=(2, 2), tp=2, ...)``, AdamW, ``tp.clip_grad_norm_``, a scheduler)
as a user submits it: ``sbatch -N5 --ntasks-per-node=2 --no-kill --clockwork-ft --clockwork-spares=standby`` whose
batch script runs ``torchpass run``. The mesh is (dp_replicate 2 x dp_shard 2 x tp 2), 8 ranks on 4 nodes of 2:
slot ``r*4 + s*2 + t``, so each node holds one TP group (both tp ranks of one (replica, shard) row), replica 0
on nodes 0 and 1, replica 1 on nodes 2 and 3; the fifth node is the standby node, whose agent runs 2 spares.

Slot 4 (node 2: replica 1, shard 0) stops at a random point of a random step (inside a TP collective in forward
or backward, before the logits' all-gather, or in the optimizer step) and asks for its node's crash
(``clockwork sandbox fault node NODE crash``: every process on it killed, its links dark). Both ranks of the TP
group die at once; the standby node's two spares take slots 4 and 5 in one generation, each fed by its
(shard, tp) counterpart in replica 0 (slots 0 and 1). The job's gathered model, optimizer and scheduler state on
every slot is ``torch.equal`` to the fault-free job's on the same Slurm, and every slot's journal shows each step
committed exactly once.
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
from tests.unit import test_torchpass_tp as tpo
from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal, load_final

NODES = 5  # 4 training nodes of one TP group each, and the standby node
PER_NODE = 2  # = tp: TP inside the node
MESH = "2x2x2"  # dp_replicate x dp_shard x tp
NPROC = 8
JOB_TIMEOUT_S = 300
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
CRASH_PHASES = ("tpforward", "tpgather", "tpbackward", "optimizer")  # the rank waits there for the crash


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    return jobs.faults_box(sandbox_manager, nodes=NODES, accounting=False, seed=SEED, replays="the TP node crash")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-tp-sandbox")


def _run(box: Sandbox, base: Path, name: str, *, kill: str = "") -> FinishedJob:
    """The TP oracle's 2 x 2 x 2 job on 4 nodes of 2 ranks and a standby node; a rank's crash request crashes
    its node."""
    out = base / name
    out.mkdir()
    env = jobs.job_env(box, out, kill=kill, step_sleep=0, CW_TEST_MESH=MESH)
    # the runtime net compares the replicas of each (shard, tp) part every 3 steps, as in the local oracle
    command = jobs.torchpass_command(out, tpo.SCRIPT, "--set replica_check_every_steps=3")
    options = [
        f"-N{NODES}",
        f"--ntasks-per-node={PER_NODE}",
        "--no-kill",
        "--clockwork-ft",
        "--clockwork-spares=standby",
    ]
    return jobs.run_job(box, out, options, command, env, JOB_TIMEOUT_S)


def test_node_crash_rebuilds_a_whole_tp_group_on_the_standby_node(box: Sandbox, base: Path) -> None:
    reference = _run(box, base, "tp-reference")
    reference.check_ok()
    tpo._assert_each_step_once(reference, NPROC)
    expected = load_final(reference.out, 0)
    for slot in range(1, NPROC):  # every slot gathers the same full state
        assert_bitwise_equal(load_final(reference.out, slot), expected, f"reference slot {slot}")
    assert "the replicas agree" in reference.output, "the runtime net never compared the replicas"
    (generation,) = reference.of_kind("torchpass.generation")
    assert generation["members"] == {str(k * 2 + j): f"a{k}.{j}.{j}" for k in range(4) for j in range(2)}

    rng = random.Random(SEED)
    step, phase = rng.randrange(2, tpo.STEPS - 2), rng.choice(CRASH_PHASES)
    layer = -1 if phase in ("tpgather", "optimizer") else rng.randrange(tpo.LAYERS)
    kill = f"4:{step}:crashnode-{phase}:{layer}"
    print(f"crash {kill}")
    run = _run(box, base, "tp-node-crash", kill=kill)
    assert "crashed: ['node" in run.output, run.output[-3000:]
    # bitwise per slot, each step once, slot 4 taken over, every move from the same (shard, tp) in replica 0
    moves = tpo._check_fault(run, reference, kill, MESH)
    journals = tpo._assert_each_step_once(run, NPROC)
    assert len({pid for *_, pid in journals[5]}) == 2, "slot 5 was not taken over by another process"

    nodes = next(f["nodes"] for f in run.of_kind("torchpass.coordinator"))
    failed = {f["slot"]: (f["node"], f["local"]) for f in run.of_kind("torchpass.member_failed")}
    assert failed == {4: (nodes[2], 0), 5: (nodes[2], 1)}, run.of_kind("torchpass.member_failed")
    (replaced,) = [g for g in run.of_kind("torchpass.generation") if g["replaced"]]
    assert replaced["replaced"] == {"4": "a4.0.0", "5": "a4.1.1"}, replaced  # agent 4: the standby node
    assert [(p["node"], p["local"]) for p in replaced["placed"].values()] == [(nodes[4], 0), (nodes[4], 1)], replaced
    (recovered,) = run.of_kind("torchpass.recovered")
    assert recovered["slots"] == [4, 5], recovered  # the whole TP group, in one recovery, at the same step
    assert "silent on every rail" in str(recovered["reason"]), recovered  # the node daemons' verdict
    # the moved coordinates and their sources: (shard 0, tp 0) from slot 0, (shard 0, tp 1) from slot 1
    named = sorted((m["target"], m["source"], m["what"]) for m in moves)
    assert named == [
        (4, 0, f"part 0 (shard 0, tp 0) of the {MESH} mesh"),
        (5, 1, f"part 1 (shard 0, tp 1) of the {MESH} mesh"),
    ], moves
    # both replacements adopted the same committed state: the step before the crash (the crashed step is redone),
    # or the crashed step itself where replica 0 committed it before the group was declared lost
    adopted = {slot: [s for kind, _g, s, _pid in journals[slot] if kind == "adopt"][-1] for slot in (4, 5)}
    assert adopted[4] == adopted[5] in (step - 1, step), (adopted, step)
    # at the job's end every surviving agent tells its node daemon where the slots went and which coordinate moved
    # with each (what the batch host's Epilog puts in the AdminComment)
    placements = run.of_kind("torchpass.placement")
    where = {
        str(slot): {
            "from": f"{nodes[2]}/{tp}",
            "to": f"{nodes[4]}/{tp}",
            "part": f"part {tp} (shard 0, tp {tp}) of the {MESH} mesh",
        }
        for slot, tp in ((4, 0), (5, 1))
    }
    assert placements and all(p["slots"] == where for p in placements), placements
