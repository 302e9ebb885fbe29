"""Slurm mode, as real processes: one ``torchpass run`` agent per simulated node, node crashes included.

Each test starts N + S agents exactly as ``srun --ntasks-per-node=1 torchpass run`` would: the same command,
with the Slurm variables srun sets (``SLURM_JOB_ID``, ``SLURM_PROCID``, ``SLURM_STEP_ID``, ``SLURM_NTASKS``,
``SLURM_NODEID``, ``SLURM_STEP_NODELIST``, ``SLURMD_NODENAME``) and the SPANK plugin's
``CLOCKWORK_SPARES=standby``. Node K is the address 127.0.0.(K+1): every agent, store server and gloo device
binds to its own node's address (all of
127/8 is the loopback), and the agents' ports are the same on every node, as on a cluster. Each agent runs in
a session of its own, so its process group is its node: the rank script of the oracle
(:mod:`tests.unit.test_torchpass_oracle`) crashes a node by SIGKILLing (``node``) or SIGSTOPping
(``nodestop``, silent: sockets stay open, nothing is reset) its whole process group, agent and rank together.

The oracle is the same as in local mode: final model, optimizer, scheduler and registered state of every slot
bitwise equal to the fault-free run's, and every step committed exactly once per slot.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clockwork.cli.main import run as clockwork
from clockwork.contracts.jobkey import JobKey
from tests.unit.daemon_harness import RunningDaemon, daemons, scratch, start_daemon, write_config
from tests.unit.test_torchpass_oracle import (
    NPROC,
    SCRIPT,
    STEPS,
    Run,
    _assert_each_step_once,
    _assert_same_final_state,
)
from tests.unit.test_torchpass_slurm import _free_port_pair
from torchpass.config import TorchPassConfig

__all__ = ["daemons", "scratch"]  # fixtures used by name below

JOB_ID = 4242
RUN_TIMEOUT_S = 150


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@dataclass
class AgentsRun(Run):
    """A finished Slurm-mode job: every agent's exit status (None: stopped, i.e. a silent node)."""

    codes: list[int | None] | None = None


def _run_agents(
    base: Path,
    name: str,
    *,
    agents: int = NPROC + 1,
    kill: str = "",
    settings: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    while_running: Callable[[Path], None] | None = None,
    script: Path = SCRIPT,
    ft: str = "aware",
    nproc: int = NPROC,
    per_node: int = 1,
) -> AgentsRun:
    out = base / name
    out.mkdir()
    addresses = [f"127.0.0.{k + 1}" for k in range(agents)]
    port = _free_port_pair(addresses)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    key = JobKey.new().hex  # what a user exports before `srun torchpass run`
    for k in range(agents):
        env = {key: v for key, v in os.environ.items() if not key.startswith(("SLURM", "CLOCKWORK_", "TORCHPASS"))}
        env.update(
            SLURM_JOB_ID=str(JOB_ID),
            SLURM_PROCID=str(k),
            SLURM_STEP_ID="0",
            SLURM_NTASKS=str(agents),
            SLURM_NODEID=str(k),
            SLURM_JOB_NODELIST=f"127.0.0.[1-{agents}]",
            SLURM_STEP_NODELIST=f"127.0.0.[1-{agents}]",
            SLURMD_NODENAME=addresses[k],
            CLOCKWORK_FT=ft,
            CLOCKWORK_SPARES="standby",
            TORCHPASS_JOB_KEY=key,
            CW_TEST_DIR=str(out),
            CW_TEST_KILL=kill,
            CW_TEST_MIGRATE="",
            CW_TEST_STEPS=str(STEPS),
            **(extra_env or {}),
        )
        log = open(out / f"agent{k}.log", "wb")  # closed below
        logs.append(log)
        cmd = [
            sys.executable,
            "-m",
            "torchpass",
            "run",
            "--nproc",
            str(nproc),
            *(("--nproc-per-node", str(per_node)) if per_node > 1 else ()),
            "--port",
            str(port),
            "--events",
            str(out / "events-{agent}.jsonl"),
            "--set",
            "collective_timeout_s=20",
            "--set",
            "join_timeout_s=60",
            *(arg for setting in settings for arg in ("--set", setting)),
            str(script),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if while_running is not None:
                while_running(out)
            if all(p.poll() is not None or _stopped(p.pid) for p in procs):
                break
            time.sleep(0.05)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the agent's "node": a stopped one, and any leftover
            except ProcessLookupError:
                pass
            p.wait()
        for log in logs:
            log.close()
    output = "\n".join(
        f"===== agent {k}\n" + (out / f"agent{k}.log").read_text(errors="replace") for k in range(agents)
    )
    events: list[dict[str, Any]] = []
    for path in sorted(out.glob("events-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines()]
    events.sort(key=lambda e: e["time"])
    return AgentsRun(out, 0 if all(c == 0 for c in codes) else 1, output, events, codes)


def _check(run: AgentsRun, expected_codes: list[int | None]) -> None:
    assert run.codes == expected_codes, f"agent exit codes {run.codes}\n{run.output[-12000:]}"


def _recovery(run: AgentsRun, slot: int) -> dict[str, Any]:
    matches = [f for f in run.of_kind("torchpass.recovered") if slot in f["slots"]]
    assert matches, f"no recovery of slot {slot}\n{run.output[-8000:]}"
    print(f"recovered slot {slot}: {json.dumps(matches[0], sort_keys=True)}")
    return matches[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-agents")


@pytest.fixture(scope="module")
def reference(base: Path) -> AgentsRun:
    """The fault-free Slurm-mode run every faulted run must match bit for bit."""
    run = _run_agents(base, "reference")
    _check(run, [0, 0, 0, 0])
    return run


def test_fault_free_run(reference: AgentsRun) -> None:
    _assert_each_step_once(reference)
    _assert_same_final_state(reference, reference)  # the three replicas agree
    started = reference.of_kind("torchpass.started")
    assert len(started) == 1 and started[0]["generation"] == 0
    records = reference.of_kind("torchpass.coordinator")
    assert sorted(r["agent"] for r in records) == [0, 1, 2, 3]
    assert all(r["leader_agent"] == 0 and r["world_size"] == NPROC and r["spares"] == 1 for r in records)
    assert not reference.of_kind("torchpass.agent_lost") and not reference.of_kind("torchpass.leader_elected")
    generation = reference.of_kind("torchpass.generation")[0]
    assert generation["members"] == {"0": "a0.0", "1": "a1.0", "2": "a2.0"}
    assert generation["store"].startswith("127.0.0.1:")  # slot 0's store server, on node 0's address


def test_leader_node_crash(base: Path, reference: AgentsRun) -> None:
    """Node 0 (slot 0, and the coordinator's leader) dies at once, agent and rank together."""
    run = _run_agents(base, "leader-crash", kill="0:9:node")
    _check(run, [-signal.SIGKILL, 0, 0, 0])
    _assert_same_final_state(run, reference)
    _assert_each_step_once(run)
    elected = run.of_kind("torchpass.leader_elected")
    assert len(elected) == 1 and elected[0]["agent"] == 1 and elected[0]["previous"] == 0, elected
    # elected once the leader had been silent for the agent lease, not before (the silence measured then)
    assert elected[0]["silent_ms"] >= 1000 * TorchPassConfig().agent_timeout_s, elected
    fields = _recovery(run, 0)
    assert "coordinator leader agent 0" in fields["reason"] and fields["transfer_bytes"] > 0, fields
    generation = next(g for g in run.of_kind("torchpass.generation") if g["replaced"])
    assert generation["replaced"] == {"0": "a3.0"}  # the standby node took slot 0
    assert [r["leader_agent"] for r in run.of_kind("torchpass.coordinator")][-3:] == [1, 1, 1]


def test_silent_node(base: Path, reference: AgentsRun) -> None:
    """Node 2 stops dead (SIGSTOP of agent and rank: no reset reaches anybody). The leader notices its
    silence; the survivors' all-reduce, blocked on the silent peer, is aborted by the new generation."""
    run = _run_agents(base, "silent-node", kill="2:13:nodestop")
    _check(run, [0, 0, None, 0])
    _assert_same_final_state(run, reference)
    _assert_each_step_once(run)
    lost = run.of_kind("torchpass.agent_lost")
    assert [e["agent"] for e in lost] == [2] and lost[0]["by"] == 0
    fields = _recovery(run, 2)
    # The mesh's word ended the stuck all-reduce, not the 20 s collective timeout: no survivor reported a
    # collective error, and the recovery names the silent agent as its cause.
    assert fields["reason"].startswith("slot 2 (a2.0) agent 2 ") and "silent for" in fields["reason"], fields
    assert not run.of_kind("torchpass.collective_error"), run.of_kind("torchpass.collective_error")


def test_rank_crash_keeps_its_node_as_a_spare(base: Path, reference: AgentsRun) -> None:
    """Only rank 1 dies (its node is fine): the standby node takes slot 1 and node 1's agent starts a new
    spare, so the job still has one; a second failure on slot 2 five steps later is covered by it."""
    run = _run_agents(base, "rank-crashes", kill="1:9:backward,2:14:optimizer")
    _check(run, [0, 0, 0, 0])
    _assert_same_final_state(run, reference)
    _assert_each_step_once(run)
    replaced = [g["replaced"] for g in run.of_kind("torchpass.generation") if g["replaced"]]
    assert [list(r) for r in replaced] == [["1"], ["2"]], replaced
    # Whichever spares were ready first: the standby node's (a3.0), node 1's new one (a1.1, started when rank 1
    # died) or node 2's (a2.1, started when rank 2 died, if a1.1 was still importing torch on a loaded machine).
    workers = [w for r in replaced for w in r.values()]
    assert len(set(workers)) == 2 and set(workers) <= {"a3.0", "a1.1", "a2.1"}, replaced
    # The node agents' zygotes fork every process, the replacements on the healthy nodes too.
    for wid in ("a1.1", "a2.1"):
        assert re.search(rf"started {wid} \(spare\) .* \(forked by the zygote\)", run.output), run.output[-8000:]
    _recovery(run, 1)
    _recovery(run, 2)


def test_fresh_interpreters_under_slurm_train_bitwise_like_the_zygotes_forks(base: Path, reference: AgentsRun) -> None:
    """``zygote = false``: every agent starts each process as its own interpreter, a rank crash still recovers,
    and the result is the reference's (every process forked from its node's zygote), bit for bit."""
    run = _run_agents(base, "no-zygote", kill="1:9:backward", settings=("zygote=false",))
    _check(run, [0, 0, 0, 0])
    _assert_same_final_state(run, reference)
    _assert_each_step_once(run)
    assert "(forked by the zygote)" not in run.output and "started a1.1 (spare)" in run.output, run.output[-8000:]
    assert run.output.count("(own interpreter)") >= 5, run.output[-8000:]  # 3 ranks, the standby spare, a1.1
    _recovery(run, 1)


def test_two_leader_crashes_in_a_row(base: Path, reference: AgentsRun) -> None:
    """Five nodes (3 ranks, 2 standby). The leader's node dies, then, five steps later, its successor's."""
    run = _run_agents(base, "two-leaders", agents=NPROC + 2, kill="0:8:node,1:13:node")
    _check(run, [-signal.SIGKILL, -signal.SIGKILL, 0, 0, 0])
    _assert_same_final_state(run, reference)
    _assert_each_step_once(run)
    elected = [(e["agent"], e["previous"], e["term"]) for e in run.of_kind("torchpass.leader_elected")]
    assert elected == [(1, 0, 1), (2, 1, 2)], elected
    _recovery(run, 0)
    _recovery(run, 1)


def test_migrate_and_daemon_events(
    base: Path, reference: AgentsRun, scratch: Path, daemons: list[RunningDaemon], capsys: pytest.CaptureFixture[str]
) -> None:
    """Under Clockwork (CLOCKWORK_CONFIG set) every agent and rank posts its events to the node daemon, and
    `clockwork migrate JOBID --rank 1` finds the coordinator there and moves rank 1 to the spare, live."""
    config = write_config(scratch)
    daemon = start_daemon(daemons, config)
    with daemon.client() as client:
        client.register_job(JOB_ID, os.getuid(), pwd.getpwuid(os.getuid()).pw_name, ["n1"], {"ft": "aware"})
    results: list[int] = []
    release = base / "migration-asked"

    def migrate_when_training(out: Path) -> None:
        journal = out / "journal-slot1.txt"
        if results or not journal.exists() or len(journal.read_text().splitlines()) < 8:
            return
        # The job holds at step 20 until the request is answered: a spare slow to start on a loaded machine
        # must not let the job finish first.
        results.append(clockwork(["--config", str(config), "migrate", str(JOB_ID), "--rank", "1", "--wait", "120"]))
        release.touch()

    env = {"CLOCKWORK_CONFIG": str(config), "CW_TEST_HOLD": f"20:{release}"}
    run = _run_agents(base, "migrate", extra_env=env, while_running=migrate_when_training)
    _check(run, [0, 0, 0, 0])
    assert results == [0], capsys.readouterr().err
    assert f"job {JOB_ID}: rank 1 moves to spare a3.0" in capsys.readouterr().out
    _assert_same_final_state(run, reference)
    journals = _assert_each_step_once(run)
    assert len({pid for *_, pid in journals[1]}) == 2
    migrated = run.of_kind("torchpass.migrated")
    assert migrated and migrated[0]["slots"] == [1] and migrated[0]["handoff_ok"], migrated
    assert not run.of_kind("torchpass.member_failed")
    with daemon.client() as client:
        kinds = [e["kind"] for e in client.job_events(JOB_ID)]
    for kind in (
        "torchpass.coordinator",  # every agent's, for `clockwork migrate`
        "torchpass.generation",  # the coordinator's decisions
        "torchpass.migration_requested",
        "torchpass.migrated",
        "torchpass.departed",
        "torchpass.joined",  # the ranks' own events
        "torchpass.finished",
    ):
        assert kind in kinds, f"{kind} not in the daemon's log: {sorted(set(kinds))}"
    assert kinds.count("torchpass.coordinator") >= 4
