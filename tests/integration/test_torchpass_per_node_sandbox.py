"""TorchPass on the sandbox's real Slurm with 2 ranks per node: a node crash replaces both of its ranks at once.

The oracle's deterministic DDP training (the rank script of ``tests/unit/test_torchpass_oracle.py``) as a user
submits it to nodes of several ranks: ``sbatch -N5 --ntasks-per-node=2 --no-kill --clockwork-ft
--clockwork-spares=standby`` whose batch script runs ``torchpass run`` with no rank count at all. The sandbox's
nodes have no GPUs and 2 CPUs each (its default ``cpus_per_node``), so G comes from the job's
``--ntasks-per-node``: 4 training nodes of 2 ranks (8 ranks, slots numbered per node as torchrun does) and one
standby node whose agent runs 2 spares.

A node crash (``clockwork sandbox fault node NODE crash``: every process on it killed, its links dark) while its
first rank is at the chosen point of a step loses both of its ranks; the node daemons' verdict has the leader
count the node lost, and the standby node's two spares take both slots in one generation, in local order. The
job's final parameters, optimizer, scheduler and registered state on every slot are ``torch.equal`` to the
fault-free job's, and every slot's journal shows each step committed exactly once.

Two single-rank SIGKILLs on different nodes (one GPU is the failure domain): both nodes stay up, and the one
standby node absorbs both ranks, one spare slot each. The second kill waits for the first recovery's
``torchpass.recovered`` event, so each failure is repaired on its own.

HSDP as sites lay it out (the FSDP oracle's 2 x 2 mesh on 2 nodes of 2 ranks: sharded within a node,
replicated across nodes): a node crash loses a whole replica, and each shard is rebuilt from its holder in the
other replica, bitwise.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from clockwork.sandbox.cluster import Sandbox
from tests.integration import sandbox_jobs as jobs
from tests.integration.conftest import CLOCKWORK, SandboxManager
from tests.unit import test_torchpass_fsdp as fsdp
from tests.unit import test_torchpass_oracle as oracle
from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal

NODES = 5
PER_NODE = 2
NPROC = 8  # 4 training nodes x 2
STEPS = 40
STEP_SLEEP_S = 0.05
JOB_TIMEOUT_S = 300
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
CRASH_PHASES = ("crashnode", "crashnode-backward", "crashnode-optimizer")  # the rank waits there for the crash


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    return jobs.faults_box(sandbox_manager, nodes=NODES, accounting=False, seed=SEED, replays="the node crash")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-per-node-sandbox")


def _run(
    box: Sandbox, base: Path, name: str, *, kill: str = "", during: Callable[[Path], None] | None = None
) -> oracle.Run:
    """Submit the job with 2 tasks per node, crash the nodes its ranks ask for, call ``during(out)`` every round
    while it runs, wait for its end."""
    out = base / name
    out.mkdir()
    env = jobs.job_env(box, out, kill=kill, step_sleep=STEP_SLEEP_S, CW_TEST_STEPS=str(STEPS))
    command = jobs.torchpass_command(out, oracle.SCRIPT)
    options = [
        f"-N{NODES}",
        f"--ntasks-per-node={PER_NODE}",
        "--no-kill",
        "--clockwork-ft",
        "--clockwork-spares=standby",
        f"--output={out}/job.out",
    ]
    job_id = jobs.submit(options, command, env)
    tick = None if during is None else (lambda: during(out))
    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, tick)
    run = oracle.Run(out, returncode, f"{output}\ncrashed: {crashed}", jobs.job_events(out))
    jobs.wait_gone(box, job_id)
    return run


def _check(run: oracle.Run, reference: oracle.Run) -> None:
    run.check_ok()
    oracle._assert_same_final_state(run, reference, nproc=NPROC, steps=STEPS)
    oracle._assert_each_step_once(run, nproc=NPROC, steps=STEPS)


@pytest.fixture(scope="module")
def reference(box: Sandbox, base: Path) -> oracle.Run:
    run = _run(box, base, "reference")
    run.check_ok()
    return run


def test_fault_free_job_runs_two_ranks_per_node(reference: oracle.Run) -> None:
    assert "2 rank(s) per node (one per task: SLURM_NTASKS_PER_NODE=2)" in reference.output, reference.output[-3000:]
    oracle._assert_each_step_once(reference, nproc=NPROC, steps=STEPS)
    expected = oracle._final(reference, 0)
    for slot in range(1, NPROC):
        assert_bitwise_equal(oracle._final(reference, slot), expected, f"slot {slot}")
    records = reference.of_kind("torchpass.coordinator")
    assert records and all(f["world_size"] == NPROC and f["ranks_per_node"] == PER_NODE for f in records)
    (generation,) = reference.of_kind("torchpass.generation")
    assert generation["members"] == {str(k * 2 + j): f"a{k}.{j}.{j}" for k in range(4) for j in range(2)}


def test_node_crash_replaces_both_ranks_on_the_standby_node(box: Sandbox, base: Path, reference: oracle.Run) -> None:
    slot = 2  # agent 1's local index 0; its node also runs slot 3
    step, phase = random.Random(SEED).randint(8, 28), random.Random(SEED + 1).choice(CRASH_PHASES)
    run = _run(box, base, "node-crash", kill=f"{slot}:{step}:{phase}")
    assert "crashed: ['node" in run.output, run.output[-3000:]
    _check(run, reference)
    failed = {f["slot"]: f["local"] for f in run.of_kind("torchpass.member_failed")}
    assert failed == {2: 0, 3: 1}, run.of_kind("torchpass.member_failed")
    (replaced,) = [g for g in run.of_kind("torchpass.generation") if g["replaced"]]
    assert replaced["replaced"] == {"2": "a4.0.0", "3": "a4.1.1"}, replaced  # agent 4: the standby batch host
    assert [p["local"] for p in replaced["placed"].values()] == [0, 1], replaced
    fields = oracle._recovered(run, 2)
    assert fields["slots"] == [2, 3], fields  # one recovery, both ranks, at the same step
    assert "silent on every rail" in str(fields["reason"]), fields  # the node daemons' verdict


def test_two_single_rank_kills_on_two_nodes_are_both_absorbed_by_the_standby_node(
    box: Sandbox, base: Path, reference: oracle.Run
) -> None:
    """Slot 1 (agent 0's node, local index 1) kills itself at a random point of a random step; once its recovery
    has completed (``torchpass.recovered`` names slot 1), the test SIGKILLs slot 2 (agent 1's node, local index
    0) wherever its process is. Neither node is lost: each failure takes one spare slot, and the best fit puts
    both on the standby node, one at each local index (its spare slots were ready before the spare that agent
    0 starts on the GPU that lost its process). The job ends bitwise equal to the fault-free job."""
    rng = random.Random(SEED + 3)
    step, phase = rng.randint(6, 16), rng.choice(("forward", "backward", "optimizer"))
    print(f"first kill 1:{step}:{phase}")
    second: list[str] = []

    def kill_slot_2_once_slot_1_recovered(out: Path) -> None:
        if second:
            return
        recovered = [e for e in jobs.job_events(out) if e["kind"] == "torchpass.recovered"]
        if not any(1 in e["fields"]["slots"] for e in recovered if isinstance(e["fields"], dict)):
            return
        journal = (out / "journal-slot2.txt").read_text().split()  # "commit GEN STEP PID" per committed step
        pid = int(journal[-1])
        os.kill(pid, signal.SIGKILL)  # the sandbox's nodes share the host's pid namespace
        second.append(f"SIGKILL pid {pid} after {len(journal) // 4} commits")

    run = _run(box, base, "two-rank-kills", kill=f"1:{step}:{phase}", during=kill_slot_2_once_slot_1_recovered)
    assert second, f"slot 1 never recovered, so slot 2 was not killed\n{run.output[-3000:]}"
    print(f"second kill: {second[0]}")
    assert "crashed: []" in run.output, run.output[-3000:]
    _check(run, reference)
    nodes = next(f["nodes"] for f in run.of_kind("torchpass.coordinator"))
    failed = [(f["slot"], f["node"], f["local"]) for f in run.of_kind("torchpass.member_failed")]
    assert failed == [(1, nodes[0], 1), (2, nodes[1], 0)], failed
    assert not run.of_kind("torchpass.agent_lost")  # two GPUs failed, no node
    generations = [g for g in run.of_kind("torchpass.generation") if g["replaced"]]
    assert [list(g["replaced"]) for g in generations] == [["1"], ["2"]], generations
    placed = [g["placed"][slot] for g, slot in zip(generations, ("1", "2"), strict=True)]
    standby = nodes[4]  # agent 4: the batch host, the standby node
    assert [p["node"] for p in placed] == [standby, standby], placed
    assert sorted(p["local"] for p in placed) == [0, 1], placed  # one spare slot each
    assert sorted(wid for g in generations for wid in g["replaced"].values()) == ["a4.0.0", "a4.1.1"], generations
    first, later = oracle._recovered(run, 1), oracle._recovered(run, 2)
    assert first["slots"] == [1] and later["slots"] == [2], (first, later)
    recovered_at = next(e["time"] for e in run.events if e["kind"] == "torchpass.recovered")
    failed_at = [e["time"] for e in run.events if e["kind"] == "torchpass.member_failed"]
    assert failed_at[0] < recovered_at < failed_at[1], (failed_at, recovered_at)  # one repair after the other


# ----- HSDP as sites lay it out: sharded within a node, replicated across nodes --------------------------------

HSDP_CRASH_PHASES = ("crashnode-allgather", "crashnode-reducescatter", "crashnode-allreduce", "crashnode-optimizer")


def _run_hsdp(box: Sandbox, base: Path, name: str, *, kill: str = "") -> FinishedJob:
    """The FSDP oracle's 2 x 2 HSDP job on 2 nodes of 2 ranks and a standby node: each node holds one replica,
    its two ranks the two shards (mesh rows are contiguous ranks, and so are a node's)."""
    out = base / name
    out.mkdir()
    env = jobs.job_env(box, out, kill=kill, step_sleep=STEP_SLEEP_S, CW_TEST_MESH="2x2")
    command = jobs.torchpass_command(out, fsdp.SCRIPT)
    options = ["-N3", f"--ntasks-per-node={PER_NODE}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby"]
    job_id = jobs.submit([*options, f"--output={out}/job.out"], command, env)
    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S)
    run = FinishedJob(out, returncode, f"{output}\ncrashed: {crashed}")
    run.events = jobs.job_events(out)
    jobs.wait_gone(box, job_id)
    return run


def test_hsdp_node_crash_rebuilds_a_whole_replica_from_the_other_node(box: Sandbox, base: Path) -> None:
    """Node 1 holds replica 1 (slots 2 and 3, one shard each); its crash loses the whole replica at once. Both
    ranks are rebuilt on the standby node in one generation, each shard from its holder in replica 0 (slot 0 for
    slot 2, slot 1 for slot 3), and the job ends bitwise equal to the fault-free HSDP job."""
    reference = _run_hsdp(box, base, "hsdp-reference")
    reference.check_ok()
    fsdp._assert_each_step_once(reference)
    rng = random.Random(SEED + 2)
    step, phase = rng.randrange(2, fsdp.STEPS - 2), rng.choice(HSDP_CRASH_PHASES)
    kill = f"2:{step}:{phase}:{-1 if phase.endswith('optimizer') else rng.randrange(fsdp.LAYERS)}"
    print(f"crash {kill}")
    run = _run_hsdp(box, base, "hsdp-node-crash", kill=kill)
    assert "crashed: ['node" in run.output, run.output[-3000:]
    fields = fsdp._check_fault(run, reference, kill)  # bitwise, each step once, every shard from its holder
    assert fields["slots"] == [2, 3], fields  # the whole replica, in one recovery
    assert sorted((m["target"], m["source"]) for m in fields["moves"]) == [(2, 0), (3, 1)], fields
    journals = fsdp._assert_each_step_once(run)
    assert len({pid for *_, pid in journals[3]}) == 2, "slot 3 was not taken over by another process"


def test_whole_node_migration_with_clockwork_migrate_ranks_on(box: Sandbox, base: Path, reference: oracle.Run) -> None:
    """`clockwork migrate JOBID --ranks-on NODE`, run on a node of the job as on a real cluster, while the job
    trains: both ranks of agent 1's node move live to the standby node, one after the other, each handing its
    state over; nothing fails and the job ends bitwise equal to the fault-free job."""
    out = base / "migrate-node"
    out.mkdir()
    env = jobs.job_env(box, out, kill="", step_sleep=0.08, CW_TEST_STEPS=str(STEPS))
    command = jobs.torchpass_command(out, oracle.SCRIPT)
    options = [f"-N{NODES}", f"--ntasks-per-node={PER_NODE}", "--no-kill", "--clockwork-ft"]
    job_id = jobs.submit([*options, "--clockwork-spares=standby", f"--output={out}/job.out"], command, env)
    said: list[str] = []

    def migrate_when_due() -> None:
        journal = out / "journal-slot2.txt"
        if said or not journal.exists() or len(journal.read_text().splitlines()) < 8:
            return
        records = [e["fields"] for e in jobs.job_events(out) if e["kind"] == "torchpass.coordinator"]
        node = next(str(f["node"]) for f in records if isinstance(f, dict) and f.get("agent") == 1)
        argv = [CLOCKWORK, "migrate", str(job_id), "--ranks-on", node]
        proc = subprocess.run(box.exec_argv("node2", argv), env=env, capture_output=True, text=True, timeout=120)
        said.append(f"rc {proc.returncode}: {proc.stdout}{proc.stderr}")

    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, migrate_when_due)
    run = oracle.Run(out, returncode, f"{output}\nmigrate: {said}", jobs.job_events(out))
    jobs.wait_gone(box, job_id)
    assert said and said[0].startswith("rc 0:"), said
    assert "rank 2 moves to spare a4.0.0" in said[0] and "rank 3 moves to spare a4.1.1" in said[0], said
    _check(run, reference)
    migrated = run.of_kind("torchpass.migrated")
    assert [m["slots"] for m in migrated] == [[2], [3]] and all(m["handoff_ok"] for m in migrated), migrated
    assert not run.of_kind("torchpass.member_failed") and not crashed
