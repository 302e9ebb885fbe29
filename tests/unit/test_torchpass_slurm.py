"""Slurm mode without Slurm and without torch: the step layout, the replicated coordinator, the agents' mesh
(heartbeats, election, takeover from a replicated snapshot) and the proxy that moves ranks to a new leader.

The meshes, coordinator replicas and proxies run in this process, one per simulated node on 127.0.0.x
(Linux routes all of 127/8 to the loopback, so each "node" has its own address and the same ports, as on a
cluster), with heartbeat timings short enough for a test. Fake ranks speak the real wire protocol through the
proxies. A node crash is the node's mesh going silent (its thread stopped) together with its coordinator.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.conftest import until
from tests.unit.test_torchpass_coordinator import Events, FakeRank
from torchpass.config import TorchPassConfig
from torchpass.coordinator.service import FAILED, RUNNING, Coordinator
from torchpass.launch.mesh import AgentMesh
from torchpass.launch.node_steps import NodeSteps, cpus_per_node, in_batch_script
from torchpass.launch.proxy import CoordinatorProxy
from torchpass.launch.slurm_layout import (
    SlurmLayout,
    SlurmLayoutError,
    default_port,
    expand_hostlist,
)

pytestmark = pytest.mark.usefixtures("job_key")  # the in-process coordinators need the job key

# ----- the layout ------------------------------------------------------------------------------


def test_hostlist_expansion() -> None:
    assert expand_hostlist("n[1-3],gpu7") == ["n1", "n2", "n3", "gpu7"]
    assert expand_hostlist("node[01-03,10]") == ["node01", "node02", "node03", "node10"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand_hostlist("127.0.0.[1-4]") == ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
    for bad in ("n[1-", "n]1[", "n[3-1]", "n[a-b]"):
        with pytest.raises(SlurmLayoutError):
            expand_hostlist(bad)


def _env(procid: int, ntasks: int = 4, **extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NODEID": str(procid),
        "SLURM_STEP_NODELIST": f"127.0.0.[1-{ntasks}]",
        "SLURMD_NODENAME": f"127.0.0.{procid + 1}",
        **extra,
    }


def test_layout_from_slurm_environment() -> None:
    layout = SlurmLayout.from_environ(_env(3, CLOCKWORK_SPARES="standby"))
    assert (layout.job_id, layout.index, layout.world_size, layout.spares) == (4242, 3, 3, 1)
    assert layout.initial_role == "spare" and layout.address == "127.0.0.4"
    assert layout.port == default_port(4242)
    assert layout.coordinator_endpoints()[0] == f"tcp://127.0.0.1:{layout.port + 1}"
    assert SlurmLayout.from_environ(_env(1, CLOCKWORK_SPARES="standby")).initial_role == "slot:1"
    # the count: --spares, --nproc, SPANK's mode (also under --export=NONE), nothing
    assert SlurmLayout.from_environ(_env(0), spares=2).world_size == 2
    assert SlurmLayout.from_environ(_env(0), nproc=3).spares == 1
    assert SlurmLayout.from_environ(_env(0, SLURM_SPANK_CLOCKWORK_SPARES="standby")).spares == 1
    assert SlurmLayout.from_environ(_env(0, CLOCKWORK_SPARES="none")).spares == 0
    assert SlurmLayout.from_environ(_env(0)).spares == 0
    assert SlurmLayout.from_environ(_env(0, TORCHPASS_PORT="30000")).port == 30000
    assert SlurmLayout.from_environ(_env(0), port=31000).port == 31000


@pytest.mark.parametrize(
    ("env", "kwargs", "message"),
    [
        ({"SLURM_JOB_ID": "1"}, {}, "not a task of a Slurm job step"),
        (_env(0, SLURM_NTASKS="8"), {}, "exactly one agent per node"),
        (_env(1, SLURM_NODEID="0"), {}, "task K on the K-th node"),
        (_env(1, SLURMD_NODENAME="127.0.0.3"), {}, "runs on 127.0.0.3"),
        (_env(0), {"spares": 4}, "at least one task must train"),
        (_env(0), {"spares": 1, "nproc": 2}, "!= 4 tasks"),
        (_env(0, SLURM_STEP_NODELIST="nosuchnode-x[1-4].invalid"), {}, "does not resolve"),
    ],
)
def test_layout_errors_say_what_to_fix(env: dict[str, str], kwargs: dict[str, Any], message: str) -> None:
    if "nosuchnode" in env.get("SLURM_STEP_NODELIST", ""):
        env["SLURMD_NODENAME"] = "nosuchnode-x1.invalid"
    with pytest.raises(SlurmLayoutError, match=message):
        SlurmLayout.from_environ(env, **kwargs)


# ----- the batch-script launcher: one agent step per node -------------------------------------------


def test_batch_script_launcher_plans_one_step_per_node_with_the_batch_host_last() -> None:
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "127.0.0.[1-4]",
        "SLURM_JOB_CPUS_PER_NODE": "2(x3),1",
        "SLURMD_NODENAME": "127.0.0.1",
        "SLURM_PROCID": "0",
    }
    assert in_batch_script(env) and not in_batch_script(dict(env, SLURM_STEP_ID="0"))
    # Slurm 26.05's batch script carries the batch step's id (its sbatch -N3 environment, recorded on the sandbox).
    assert in_batch_script(dict(env, SLURM_STEP_ID="-5", SLURM_STEPID="-5"))
    plan = NodeSteps(["run", "train.py", "--lr", "1"], srun="srun", python="py", environ=env).commands()
    assert [node for node, _, _ in plan] == ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.1"]
    node, cmd, step_env = plan[2]
    assert cmd[:5] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=127.0.0.4", "--kill-on-bad-exit=0"]
    assert "--cpus-per-task=1" in cmd and cmd[-7:] == ["py", "-m", "torchpass", "run", "train.py", "--lr", "1"]
    assert step_env["TORCHPASS_AGENT_INDEX"] == "2"
    step_env.update(SLURM_STEP_ID="0", SLURMD_NODENAME=node)
    layout = SlurmLayout.from_environ(step_env, spares=1)
    assert (layout.index, layout.node, layout.world_size, layout.spares) == (2, "127.0.0.4", 3, 1)
    assert layout.nodes[-1] == "127.0.0.1"  # the batch host starts as the spare


@pytest.mark.parametrize(
    ("expr", "count", "expected"),
    [("4", 1, [4]), ("2(x3),1", 4, [2, 2, 2, 1]), ("8(x2)", 2, [8, 8])],
)
def test_cpus_per_node_expands_slurms_counts(expr: str, count: int, expected: list[int]) -> None:
    assert cpus_per_node(expr, count) == expected


@pytest.mark.parametrize(("expr", "count"), [("2(x3)", 2), ("two", 1), ("2(3)", 1)])
def test_cpus_per_node_errors_name_the_value(expr: str, count: int) -> None:
    with pytest.raises(SlurmLayoutError, match="SLURM_JOB_CPUS_PER_NODE"):
        cpus_per_node(expr, count)


def test_batch_script_launcher_needs_two_nodes() -> None:
    with pytest.raises(SlurmLayoutError, match="at least two"):
        NodeSteps(["run", "x.py"], environ={"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}).commands()


# ----- replicated coordinators, the mesh and the proxies, in process -------------------------------


def _free_port_pair(addresses: list[str]) -> int:
    """A port P such that P and P+1 are free on every address."""
    for _ in range(200):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        if port > 65000:
            continue
        held: list[socket.socket] = []
        try:
            for address in addresses:
                for p in (port, port + 1):
                    s = socket.socket()
                    held.append(s)
                    s.bind((address, p))
            return port
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no free port pair")


@dataclass
class Node:
    """One simulated node: its coordinator replica, mesh and proxy."""

    layout: SlurmLayout
    coordinator: Coordinator
    mesh: AgentMesh
    proxy: CoordinatorProxy
    events: Events
    up: bool = True

    def crash(self) -> None:
        """The node goes silent: its mesh, coordinator and proxy stop (no reset is sent to anybody)."""
        self.up = False
        self.mesh.stop()
        self.proxy.stop()
        self.coordinator.stop()


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[list[Node]]:
    """Four simulated nodes; ``agent_timeout_s`` 0.3 s unless a test parametrizes it (indirect)."""
    nodes: list[Node] = []
    addresses = [f"127.0.0.{k + 1}" for k in range(4)]
    port = _free_port_pair(addresses)
    config = TorchPassConfig(
        agent_heartbeat_interval_s=0.02,
        agent_timeout_s=getattr(request, "param", 0.3),
        agent_startup_timeout_s=5.0,
        heartbeat_timeout_s=60.0,
        broken_grace_s=0.5,
    )
    for k in range(4):
        layout = SlurmLayout(4242, k, 3, 1, tuple(addresses), tuple(addresses), port)
        events = Events()
        coord = Coordinator(3, config, event_sink=events, bind_host=addresses[k], port=port + 1, active=k == 0)
        mesh = AgentMesh(layout, config, coord, event_sink=events)
        coord.replicate = mesh.publish
        coord.leader_hint = mesh.leader_endpoint()
        proxy = CoordinatorProxy(addresses[k], mesh.leader_endpoint)
        mesh.listeners.append(lambda _l, _t, proxy=proxy: proxy.leader_changed())  # type: ignore[misc]
        nodes.append(Node(layout, coord, mesh, proxy, events))
    for node in nodes:
        node.coordinator.start()
        node.mesh.start()
        node.proxy.start()
    yield nodes
    for node in nodes:
        if node.up:
            node.crash()


#: How long a test waits for a condition only a broken run never reaches.
WAIT_S = 30.0


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _start_ranks(zctx: zmq.Context[zmq.Socket[bytes]], cluster: list[Node]) -> list[FakeRank]:
    roles = ["slot:0", "slot:1", "slot:2", "spare"]
    ranks = [FakeRank(zctx, cluster[k].proxy.endpoint, f"a{k}.0", roles[k], 41000 + k) for k in range(4)]
    for rank in ranks:
        rank.register()
    g0 = ranks[0].await_generation(-1)
    assert g0.members == {0: "a0.0", 1: "a1.0", 2: "a2.0"}
    for rank in ranks[:3]:
        rank.joined(g0)
    until("node 0's torchpass.started event", lambda: cluster[0].events.of("torchpass.started"), WAIT_S, 0.01)
    # Every replica knows training began before a test crashes a node: a leader lost before it replicated that
    # leaves a successor that (rightly) reports the next generation as the job's start, not a recovery.
    until("every replica to see generation 0 complete", lambda: all(n.mesh.job_progressed() for n in cluster), WAIT_S)
    return ranks


def test_followers_hold_the_leaders_state(zctx: zmq.Context[zmq.Socket[bytes]], cluster: list[Node]) -> None:
    _start_ranks(zctx, cluster)
    for node in cluster[1:]:
        until("each node's mesh to see the job running", lambda n=node: n.mesh.job_state() == RUNNING, WAIT_S, 0.01)  # type: ignore[misc]
        assert not node.coordinator.active and node.mesh.leader == 0
        assert node.mesh.worker_alive("a3.0") is True
    assert cluster[0].mesh.is_leader() and cluster[0].mesh.endpoints()[0] == cluster[0].layout.coordinator_endpoint(0)


def test_leader_node_crash_moves_the_coordinator(zctx: zmq.Context[zmq.Socket[bytes]], cluster: list[Node]) -> None:
    ranks = _start_ranks(zctx, cluster)
    until("node 1's mesh to see the job running", lambda: cluster[1].mesh.job_state() == RUNNING, WAIT_S, 0.01)
    cluster[0].crash()  # the leader's node, with slot 0's rank
    # a survivor long-polls for the next generation through its proxy; the new leader must answer it
    g = ranks[1].await_generation(0, timeout=30.0)
    assert g.members == {0: "a3.0", 1: "a1.0", 2: "a2.0"} and g.replaced == {0: "a3.0"}
    assert g.gen >= 2  # one number skipped: the lost leader may have announced one it did not replicate
    assert cluster[1].mesh.is_leader() and cluster[1].coordinator.active
    elected = cluster[1].events.of("torchpass.leader_elected")
    assert elected and elected[0]["previous"] == 0 and elected[0]["lost"] == [0] and elected[0]["term"] == 1
    # The mesh's 0.3 s agent lease noticed the node, and not before that lease had run out (the silence it
    # measured when it decided); not the ranks' 60 s heartbeat timeout, which has not run out.
    assert elected[0]["silent_ms"] >= 300, elected
    failed = cluster[1].events.of("torchpass.member_failed")
    assert failed[0]["slot"] == 0 and "coordinator leader agent 0" in failed[0]["why"], failed
    for node in cluster[2:]:
        until("each node's mesh to take node 1 for leader", lambda n=node: n.mesh.leader == 1, WAIT_S, 0.01)  # type: ignore[misc]
        assert not node.coordinator.active
    assert ranks[3].await_generation(-1, timeout=30.0) == g  # the spare, through its own proxy
    assert ranks[2].await_generation(0, timeout=30.0) == g
    for rank in (ranks[1], ranks[2], ranks[3]):
        rank.joined(g)
    until("node 1's torchpass.recovered event", lambda: cluster[1].events.of("torchpass.recovered"), WAIT_S, 0.01)
    assert cluster[1].events.of("torchpass.recovered")[0]["slots"] == [0]


def test_silent_follower_is_declared_lost(zctx: zmq.Context[zmq.Socket[bytes]], cluster: list[Node]) -> None:
    ranks = _start_ranks(zctx, cluster)
    cluster[2].crash()
    g = ranks[0].await_generation(0, timeout=30.0)
    assert g.members == {0: "a0.0", 1: "a1.0", 2: "a3.0"}
    lost = cluster[0].events.of("torchpass.agent_lost")
    assert [e["agent"] for e in lost] == [2] and lost[0]["silent_ms"] >= 300
    assert cluster[0].mesh.is_leader()  # nothing moved: the leader is fine
    # the followers learn it from the snapshot
    until("node 1's mesh to count node 2 dead", lambda: 2 in cluster[1].mesh.dead, WAIT_S, 0.01)


def test_a_rank_exit_reaches_the_leader_through_the_mesh(
    zctx: zmq.Context[zmq.Socket[bytes]], cluster: list[Node]
) -> None:
    ranks = _start_ranks(zctx, cluster)
    cluster[2].proxy.forget("a2.0")
    cluster[2].mesh.child_update("a2.0", "slot:2", -9)  # what the agent does when its pidfd fires
    g = ranks[0].await_generation(0, timeout=30.0)
    assert g.replaced == {2: "a3.0"}
    failed = cluster[0].events.of("torchpass.member_failed")
    assert failed[0]["why"] == "exited with code -9" and failed[0]["slot"] == 2


def test_passive_replica_redirects_the_command_line(zctx: zmq.Context[zmq.Socket[bytes]], cluster: list[Node]) -> None:
    from torchpass.cli import main as cli_main

    _start_ranks(zctx, cluster)
    passive = cluster[2].layout.coordinator_endpoint(2)
    assert cli_main(["status", "--coordinator", passive]) == 0  # follows the redirect to agent 0


def test_takeover_without_a_snapshot_rebuilds_from_the_ranks(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A replica that never received a snapshot (the leader died at once) starts from what the ranks say."""
    events = Events()
    config = TorchPassConfig(heartbeat_timeout_s=60.0)
    coord = Coordinator(2, config, event_sink=events, active=False)
    coord.start()
    try:
        a = FakeRank(zctx, coord.endpoint, "a0.0", "slot:0", 41100)
        b = FakeRank(zctx, coord.endpoint, "a1.0", "slot:1", 41101)
        early = threading.Thread(target=a.register)  # answered only once the replica leads
        early.start()
        until(
            "a0.0's register to reach the coordinator, which holds it",
            lambda: ("a0.0", "register") in coord.unanswered(),
            WAIT_S,
            0.01,
        )
        assert not events.items and early.is_alive()  # passive: nothing decided, the request is held
        coord.take_over(None, {2}, {"a2.0": "spare"}, "test", time.time())
        early.join(2.0)
        b.register()
        g = b.await_generation(-1)
        assert g.members == {0: "a0.0", 1: "a1.0"} and coord.state == RUNNING
    finally:
        coord.stop()


def test_losing_every_member_fails_the_job(zctx: zmq.Context[zmq.Socket[bytes]], cluster: list[Node]) -> None:
    _start_ranks(zctx, cluster)
    for k in (1, 3, 2):
        cluster[0].coordinator.agent_lost(k, {}, "test", time.time())
    cluster[0].coordinator.worker_exited("a0.0", "slot:0", -9)
    until("node 0's coordinator to fail", lambda: cluster[0].coordinator.state == FAILED, WAIT_S, 0.01)
    assert "no replica holds the training state" in cluster[0].coordinator.failure_reason


# ----- the batch-script launcher's wait: verdicts, a hung step, scancel ------------------------------


def _fake_srun(tmp_path: Path, behaviour: dict[str, str]) -> str:
    """An ``srun`` stand-in: the step on node N runs ``behaviour[N]`` (a shell snippet) instead of an agent."""
    script = tmp_path / "srun"
    cases = "\n".join(f"  *--nodelist={node}*) {snippet} ;;" for node, snippet in behaviour.items())
    trap = "trap 'kill $(jobs -p) 2>/dev/null; exit 143' TERM"  # like srun: the task goes with it
    script.write_text(f'#!/bin/bash\n{trap}\ncase "$*" in\n{cases}\nesac\n')
    script.chmod(0o755)
    return str(script)


def _fake_scontrol(tmp_path: Path, down: set[str]) -> str:
    """A ``scontrol -o show node NODE`` stand-in: ``down`` nodes are DOWN+NOT_RESPONDING, the others ALLOCATED."""
    script = tmp_path / "scontrol"
    states = "\n".join(f"  {node}) state=DOWN+NOT_RESPONDING ;;" for node in sorted(down))
    script.write_text(f'#!/bin/bash\nstate=ALLOCATED\ncase "$4" in\n{states}\nesac\necho "NodeName=$4 State=$state"\n')
    script.chmod(0o755)
    return str(script)


def _steps(
    tmp_path: Path, behaviour: dict[str, str], grace: float = 1.0, down: frozenset[str] = frozenset()
) -> NodeSteps:
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n1"}
    srun, scontrol = _fake_srun(tmp_path, behaviour), _fake_scontrol(tmp_path, set(down))
    return NodeSteps(["run", "x.py"], srun=srun, scontrol=scontrol, finish_grace_s=grace, environ=env)


def test_batch_launcher_returns_the_verdict_and_cancels_a_step_whose_node_is_gone(tmp_path: Path) -> None:
    steps = _steps(tmp_path, {"n1": "sleep 0.2; exit 0", "n2": "sleep 0.3; exit 0", "n3": "sleep 600 & wait"})
    assert steps.run() == 0  # n3's step hangs like one on a crashed node: cancelled after the grace


def test_batch_launcher_cancels_the_steps_of_nodes_the_job_counted_lost_soon(tmp_path: Path) -> None:
    # n1 is the batch host: its agent writes the lost nodes where the launcher told it to, then ends the job.
    tell = 'printf "n3\\n" > "$TORCHPASS_LOST_NODES_FILE"; exit 0'
    behaviour = {"n1": tell, "n2": "sleep 0.3; exit 0", "n3": "sleep 600 & wait"}
    steps = _steps(tmp_path, behaviour, grace=600.0)  # without the word n3's step would hold the job 600 s
    steps.lost_grace_s = 0.2
    assert steps.run() == 0
    assert not list(Path(tempfile.gettempdir()).glob(f"torchpass-5-{os.getpid()}.lost"))  # the launcher's file is gone


def test_the_end_of_a_lost_nodes_step_is_not_the_jobs_verdict(tmp_path: Path) -> None:
    """Seen in a soak: Slurm declares a crashed node down SlurmdTimeout after the crash, ends its step, and that
    srun exits 0. The job had counted the node lost long before (the batch host's agent keeps the file current)
    and trains on: the launcher waits for the live agents' verdict (here: the job failed later) instead of taking
    that 0 for the job's end and cancelling the live steps."""
    tell = 'printf "n3\\n" > "$TORCHPASS_LOST_NODES_FILE"; sleep 2; exit 1'
    behaviour = {"n1": tell, "n2": "sleep 2; exit 1", "n3": "sleep 0.5; exit 0"}
    assert _steps(tmp_path, behaviour, grace=0.5).run() == 1


def test_the_end_of_a_step_on_a_node_slurm_holds_down_is_not_the_jobs_verdict(tmp_path: Path) -> None:
    """The same when the lost-nodes file cannot reach the launcher (an agent in a container with a /tmp of its
    own): Slurm's word that the node is down (``scontrol show node``) is the second witness."""
    behaviour = {"n1": "sleep 2; exit 1", "n2": "sleep 2; exit 1", "n3": "sleep 0.5; exit 0"}
    assert _steps(tmp_path, behaviour, grace=0.5, down=frozenset({"n3"})).run() == 1
    assert _steps(tmp_path, behaviour, grace=0.5).run() == 0  # a node Slurm holds up: its agent's word counts


def test_batch_launcher_reports_a_failed_job_and_ignores_a_left_agent(tmp_path: Path) -> None:
    assert _steps(tmp_path, {"n1": "exit 1", "n2": "sleep 0.2; exit 1", "n3": "exit 3"}).run() == 1
    assert _steps(tmp_path, {"n1": "exit 3", "n2": "exit 7", "n3": "exit 9"}).run() == 1  # no verdict at all


def test_batch_launcher_passes_scancel_on(tmp_path: Path) -> None:
    steps = _steps(tmp_path, {"n1": "sleep 600 & wait", "n2": "sleep 600 & wait", "n3": "sleep 600 & wait"})
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        assert steps.run() == 128 + signal.SIGTERM
    finally:
        timer.cancel()


# The agents' own lease is one minute here: only a node verdict can count a node lost within the test.
LONG_LEASE = pytest.mark.parametrize("cluster", [60.0], indirect=True)
VERDICT = "node 127.0.0.3 silent on every rail for 110 ms and its kernel silent to ICMP echo (seen by n1)"


@LONG_LEASE
def test_a_node_verdict_counts_a_follower_lost_at_once(
    zctx: zmq.Context[zmq.Socket[bytes]], cluster: list[Node]
) -> None:
    ranks = _start_ranks(zctx, cluster)
    alive_since = time.time()
    cluster[2].crash()
    # A verdict about a live agent heard after the verdict was made (a stale one) changes nothing ...
    cluster[0].mesh.node_verdict(1, "stale", alive_since - 10.0, 0.1)
    # ... the crashed node's does, long before the one-minute lease.
    cluster[0].mesh.node_verdict(2, VERDICT, time.time() - 0.11, 0.11)
    g = ranks[0].await_generation(0, timeout=30.0)
    assert g.members == {0: "a0.0", 1: "a1.0", 2: "a3.0"}
    lost = cluster[0].events.of("torchpass.agent_lost")
    assert [e["agent"] for e in lost] == [2] and lost[0]["verdict"] == VERDICT, lost
    failed = cluster[0].events.of("torchpass.member_failed")
    assert failed[0]["slot"] == 2 and "silent on every rail" in failed[0]["why"], failed
    assert 1 not in cluster[0].mesh.dead


@LONG_LEASE
def test_a_node_verdict_on_the_leaders_node_elects_a_new_leader(
    zctx: zmq.Context[zmq.Socket[bytes]], cluster: list[Node]
) -> None:
    ranks = _start_ranks(zctx, cluster)
    until(
        "every surviving node's mesh to see the job running",
        lambda: all(node.mesh.job_state() == RUNNING for node in cluster[1:]),
        WAIT_S,
        0.01,
    )
    cluster[0].crash()
    for node in cluster[1:]:  # every follower's own node daemon judges the leader's node
        node.mesh.node_verdict(0, VERDICT, time.time() - 0.11, 0.11)
    g = ranks[1].await_generation(0, timeout=30.0)
    assert g.members == {0: "a3.0", 1: "a1.0", 2: "a2.0"}
    assert cluster[1].mesh.is_leader()
    elected = cluster[1].events.of("torchpass.leader_elected")
    assert elected and elected[0]["lost"] == [0], elected
    failed = cluster[1].events.of("torchpass.member_failed")
    assert "silent on every rail" in failed[0]["why"], failed
