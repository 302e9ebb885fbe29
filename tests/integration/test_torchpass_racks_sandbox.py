"""Failure domains on the sandbox's real Slurm: pure FSDP with peer copies loses a whole rack (two nodes at once)
and recovers, bitwise equal per slot to the fault-free job, where the ring in hostlist order loses a shard.

The sandbox has two racks (``[sandbox] racks``: Slurm's topology.conf with TopologyPlugin=topology/tree, so each
task sees ``SLURM_TOPOLOGY_ADDR``): rack0 holds node1, node2, node5 and node6, rack1 node3 and node4. The job is
the FSDP oracle's training (the rank script of ``tests/unit/test_torchpass_fsdp.py``) on a 1 x 4 mesh, one rank per
node, ``peer_copies = 1`` (the default), submitted as ``sbatch -N6 --no-kill --clockwork-ft
--clockwork-spares=standby`` with ``torchpass run --spares 2``: the batch host node1 goes last, so the ranks run on
node2, node3, node4 and node5 (slots 0..3: rack0, rack1, rack1, rack0) and node6 and node1 wait as standby nodes.
Rack1 holds two training nodes and no spare; the batch host's rack could not be lost whole at all (Slurm ends a
job whose batch host fails, --no-kill or not).

In slot order the ring puts slot 1's copy on slot 2: both in rack1, so losing the rack loses shard 1 with its only
copy. The ring TorchPass orders by domain is 0, 1, 3, 2: every shard's copy is in the other rack. Slot 1's rank asks
for its node's crash at a random point of a random step (once its neighbours hold the copy of its last commit), and
the test crashes rack1's two nodes at once (their links dark, every process killed). The oracle: the job ends
bitwise equal per slot to the fault-free job, shards 1 and 2 rebuilt from the copies in slots 3 and 0, on the
standby nodes of rack0. The same crash with ``failure_domains = off`` (the slot-order ring) stops the job with
"no member holds shard 1".
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
from torchpass.failure_domains import Place
from torchpass.sharded import peer_ring

NODES = 6
RACKS = "node[1-2,5-6] node[3-4]"
RACK1 = ["node3", "node4"]
STEP_SLEEP_S = 0.05
JOB_TIMEOUT_S = 300
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
PHASES = ("crashnode-allgather", "crashnode-reducescatter")


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    return jobs.faults_box(
        sandbox_manager, nodes=NODES, accounting=False, seed=SEED, replays="the rack crash", racks=RACKS
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-racks-sandbox")


def _rack_of(node: str) -> list[str]:
    """What a rank's crash request takes down: its whole rack when that is rack1."""
    return RACK1 if node in RACK1 else [node]


def _run(box: Sandbox, base: Path, name: str, *, kill: str = "", settings: tuple[str, ...] = ()) -> FinishedJob:
    """Submit the pure FSDP job with two standby nodes, crash the rack its rank asks for, wait for its end."""
    out = base / name
    out.mkdir()
    env = jobs.job_env(box, out, kill=kill, step_sleep=STEP_SLEEP_S, CW_TEST_MESH="1x4", CW_TEST_AFTER_COPY="1")
    options = " ".join(["--spares 2", *(f"--set {setting}" for setting in settings)])
    command = jobs.torchpass_command(out, oracle.SCRIPT, options)
    sbatch = [f"-N{NODES}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    job_id = jobs.submit(sbatch, command, env)
    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, crash=_rack_of)
    run = FinishedJob(out, returncode, f"{output}\ncrashed: {crashed}")
    run.events = jobs.job_events(out)
    jobs.wait_gone(box, job_id)
    return run


def _kill() -> str:
    rng = random.Random(SEED)
    step, phase, layer = rng.randrange(2, oracle.STEPS - 2), rng.choice(PHASES), rng.randrange(oracle.LAYERS)
    return f"1:{step}:{phase}:{layer}"


@pytest.fixture(scope="module")
def reference(box: Sandbox, base: Path) -> FinishedJob:
    run = _run(box, base, "reference")
    run.check_ok()
    return run


def test_the_ring_alternates_the_racks(reference: FinishedJob) -> None:
    (ring,) = reference.logged("torchpass.peer_ring")
    assert ring["places"] == {"0": "node2 rack0", "1": "node3 rack1", "2": "node4 rack1", "3": "node5 rack0"}, ring
    assert ring["rings"] == [[0, 1, 3, 2]] and ring["separated"], ring
    places = [Place.from_wire(ring["places"][str(slot)]) for slot in range(4)]
    assert not peer_ring.separated(range(4), places, 1)  # in slot order, slot 1's copy is in slot 2: rack1 too
    expected = load_final(reference.out, 0)
    for slot in range(1, oracle.NPROC):
        assert_bitwise_equal(load_final(reference.out, slot), expected, f"slot {slot}")


def test_losing_a_whole_rack_recovers_bitwise(box: Sandbox, base: Path, reference: FinishedJob) -> None:
    kill = _kill()
    print(f"crash rack1 at {kill}")
    run = _run(box, base, "rack-crash", kill=kill)
    assert "crashed: ['node3', 'node4']" in run.output, run.output[-3000:]
    run.check_ok()
    expected = load_final(reference.out, 0)
    for slot in range(oracle.NPROC):
        assert_bitwise_equal(load_final(run.out, slot), expected, f"slot {slot}")
    failed = {f["slot"]: f["node"] for f in run.of_kind("torchpass.member_failed")}
    assert failed == {1: "node3", 2: "node4"}, run.of_kind("torchpass.member_failed")
    recovered = run.of_kind("torchpass.recovered")
    sources = {m["target"]: m["source"] for r in recovered for m in r["moves"] if m["target"] in (1, 2)}
    assert sources == {1: 3, 2: 0}, recovered  # each lost shard from its copy in the other rack
    placed = {k: p["node"] for g in run.of_kind("torchpass.generation") for k, p in g.get("placed", {}).items()}
    assert sorted(placed.values()) == ["node1", "node6"], placed  # the standby nodes of rack0
    print(f"recovered: {recovered}")


def test_the_slot_order_ring_loses_a_shard_with_the_rack(box: Sandbox, base: Path) -> None:
    """What the job did before failure domains: the same crash, ``failure_domains = off``."""
    run = _run(box, base, "rack-crash-slot-order", kill=_kill(), settings=("failure_domains=off",))
    assert "crashed: ['node3', 'node4']" in run.output, run.output[-3000:]
    assert run.returncode != 0
    (ring,) = run.logged("torchpass.peer_ring")
    assert ring["rings"] == [[0, 1, 2, 3]] and not ring["separated"], ring
    reasons = [f["reason"] for f in run.of_kind("torchpass.failed")]
    assert reasons and "no member holds shard 1 of the 1x4 mesh" in reasons[0], run.output[-4000:]
