"""Borrowed spares, TorchPass's side: the borrower in the leading agent and the guest on the borrowed node.

Real coordinators on loopback sockets (with the job key), real processes for the guest; the node daemon is the
one seam (an in-process object answering ``borrow``/``borrow_status`` as tests/unit/test_borrow.py shows the
real daemon does), because no Slurm runs here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from clockwork.contracts.versions import VERSION
from tests.conftest import until
from torchpass.config import TorchPassConfig
from torchpass.coordinator.service import Coordinator
from torchpass.launch.borrow import Borrower, guest_command, guest_environment, spawn_guest
from torchpass.launch.guest import GuestAgent, LeaderFinder

pytestmark = pytest.mark.usefixtures("job_key")


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        with self._lock:
            self.items.append((kind, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [f for k, f in self.items if k == kind]


class FakeDaemon:
    """Answers like clockworkd: a refusal at once, or a request that is pending ``polls`` times."""

    def __init__(self, *, refuse: str = "", polls: int = 2, outcome: dict[str, Any] | None = None) -> None:
        self.refuse, self.polls = refuse, polls
        self.outcome = outcome or {
            "state": "acquired",
            "node": "node5",
            "holder": 900,
            "preempted": 500,
            "gres": "gpu:8",
        }
        self.asked: list[tuple[int, str]] = []

    def borrow(self, job_id: int, lost_node: str = "") -> dict[str, Any]:
        self.asked.append((job_id, lost_node))
        if self.refuse:
            raise RuntimeError(self.refuse)
        return {"request": 1, "state": "pending"}

    def borrow_status(self, job_id: int, request: int | None = None) -> list[dict[str, Any]]:
        self.polls -= 1
        if self.polls > 0:
            return [{"request": 1, "state": "pending"}]
        return [{"request": 1, **self.outcome}]

    def close(self) -> None:
        pass


def test_the_guest_step_gets_the_jobs_key_and_replicas_but_not_the_training_steps_slurm_variables() -> None:
    env = guest_environment(
        {
            "SLURM_JOB_ID": "100",
            "SLURM_STEP_ID": "3",
            "SLURM_CONF": "/etc/slurm.conf",
            "SLURM_SPANK_CLOCKWORK_FT": "on",
            "CLOCKWORK_FT": "on",
            "CLOCKWORK_SPARES": "borrow",
            "CLOCKWORK_CONFIG": "/etc/clockwork/clockwork.toml",
            "PATH": "/bin",
            "HOME": "/h",
        },
        job_id=100,
        endpoints=["tcp://10.0.0.2:21001", "tcp://10.0.0.1:21001"],
        world_size=4,
        key_hex="ab" * 32,
    )
    assert not {"SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_SPANK_CLOCKWORK_FT", "CLOCKWORK_FT", "CLOCKWORK_SPARES"} & set(
        env
    )
    assert env["CLOCKWORK_CONFIG"] == "/etc/clockwork/clockwork.toml"
    assert (env["SLURM_CONF"], env["PATH"], env["TORCHPASS_JOB_KEY"]) == ("/etc/slurm.conf", "/bin", "ab" * 32)
    assert env["TORCHPASS_GUEST_ENDPOINTS"] == "tcp://10.0.0.2:21001,tcp://10.0.0.1:21001"
    assert (env["TORCHPASS_GUEST_WORLD"], env["TORCHPASS_GUEST_JOB"]) == ("4", "100")
    assert env["TORCHPASS_RANKS_PER_NODE"] == "1"
    cmd = guest_command("srun", "/py", 900, "node5", "train.py", ["--steps", "9"])
    assert cmd[:6] == ["srun", "--jobid=900", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=node5"]
    assert cmd[-7:] == ["/py", "-m", "torchpass", "guest", "train.py", "--steps", "9"]
    assert "ab" * 32 not in " ".join(cmd)  # the key never goes on a command line
    assert not [a for a in cmd if a.startswith("--gres")]  # a job without GRES: the guest asks for none


def test_the_guest_step_asks_for_the_gres_the_holder_got() -> None:
    """The guest's srun asks for the job's GRES per node (an exclusive allocation's GRES reach a step only when
    the step asks); a reply that is no GRES specification never becomes an option of srun."""
    cmd = guest_command("srun", "/py", 900, "node5", "train.py", [], gres="gpu:h100:8,nic:1")
    assert "--gres=gpu:h100:8,nic:1" in cmd and cmd.index("--gres=gpu:h100:8,nic:1") < cmd.index("/py")
    for bad in ("gpu:8 --uid=0", "--gpus=8", "gpu:8;rm"):
        with pytest.raises(ValueError, match="not a GRES specification"):
            guest_command("srun", "/py", 900, "node5", "train.py", [], gres=bad)


def test_a_borrowed_node_is_launched_and_timed() -> None:
    events = Events()
    launched: list[tuple[int, str, str]] = []
    failed: list[str] = []
    daemon = FakeDaemon()
    borrower = Borrower(
        100,
        connect=lambda: daemon,
        launch=lambda holder, node, gres: launched.append((holder, node, gres)) or None,  # type: ignore[func-returns-value]
        fail=failed.append,
        lost_node=lambda: "node3",
        event_sink=events,
        poll_s=0.01,
    )
    borrower.borrow_once()
    assert daemon.asked == [(100, "node3")] and launched == [(900, "node5", "gpu:8")] and failed == []
    (borrowed,) = events.of("torchpass.borrowed")
    assert (borrowed["node"], borrowed["holder"], borrowed["from_job"], borrowed["lost_node"]) == (
        "node5",
        900,
        500,
        "node3",
    )
    assert {"request_ms", "acquire_ms", "launch_ms"} <= set(borrowed) and borrowed["gres"] == "gpu:8"


def test_a_guest_step_that_ends_before_its_spare_joined_fails_the_borrow_at_once() -> None:
    """srun refused the guest (here: a real process that exits 1 at once, as srun does without a usable Slurm
    client); the job must not wait out spare_timeout_s for a spare that will never come."""
    events, failed = Events(), threading.Event()
    reasons: list[str] = []

    def fail(reason: str) -> None:
        reasons.append(reason)
        failed.set()

    borrower = Borrower(
        100,
        connect=FakeDaemon,
        launch=lambda holder, node, gres: subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"]),
        fail=fail,
        event_sink=events,
        poll_s=0.01,
    )
    assert borrower.borrow_once()
    assert failed.wait(60), "the guest's early end was not noticed"
    assert "the guest step on node5 (holder job 900) ended with exit 1 before its spare joined" in reasons[0]
    assert events.of("torchpass.borrow_failed")


def test_a_guest_whose_spare_joined_may_end_later_without_failing_the_borrow() -> None:
    joined, reasons = threading.Event(), []
    proc: list[subprocess.Popen[bytes]] = []

    def launch(holder: int, node: str, gres: str) -> subprocess.Popen[bytes]:
        proc.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE))
        return proc[0]

    borrower = Borrower(100, connect=FakeDaemon, launch=launch, fail=reasons.append, filled=joined.is_set, poll_s=0.01)
    assert borrower.borrow_once()
    joined.set()  # the coordinator filled the slot: the watcher stops watching

    def watching() -> bool:
        return any(t.name == "torchpass-guest-watch" and t.is_alive() for t in threading.enumerate())

    until("the guest watcher to stop once the spare joined", lambda: not watching(), 30)
    joined.clear()  # a later loss leaves the slot vacant again: the guest's rank died, handled as any member's
    assert proc[0].stdin is not None
    proc[0].stdin.close()
    assert proc[0].wait(30) == 0
    assert reasons == []


@pytest.mark.parametrize(
    ("daemon", "reason"),
    [
        (FakeDaemon(refuse="node1 refused borrow: job 100 already holds 1 borrowed node(s)"), "already holds 1"),
        (FakeDaemon(outcome={"state": "failed", "reason": "no node can be borrowed: nothing runs in low"}), "low"),
    ],
)
def test_no_node_fails_the_job_at_once_unless_waiting_was_allowed(daemon: FakeDaemon, reason: str) -> None:
    for fallback, expect_fail in (("fail", True), ("wait", False)):
        events, failed = Events(), []
        daemon.polls = 1
        borrower = Borrower(
            100,
            connect=lambda: daemon,
            launch=lambda h, n, g: None,
            fail=failed.append,
            fallback=fallback,
            event_sink=events,
            poll_s=0.01,
        )
        assert borrower.borrow_once() is False
        assert bool(failed) is expect_fail
        if failed:
            assert reason in failed[0] and "borrow_fallback=fail" in failed[0]
        (event,) = events.of("torchpass.borrow_failed")
        assert reason in event["reason"] and event["fallback"] == fallback


# ----------------------------------------------------------------------- with a real coordinator


#: How long a test waits for a condition only a broken run never reaches.
WAIT_S = 5.0


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _register(zctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, wid: str, role: str, port: int) -> None:
    from torchpass.rank.control import CoordinatorRpc

    rpc = CoordinatorRpc(zctx, endpoint, 2.0, identity=f"{wid}.r".encode())
    try:
        rpc.call("register", wid=wid, pid=port, host="127.0.0.1", store_port=port, role=role, version=VERSION)
    finally:
        rpc.close()


def test_a_lost_member_is_replaced_by_the_borrowed_guest(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events = Events()
    coord = Coordinator(2, TorchPassConfig(heartbeat_timeout_s=60.0), event_sink=events)
    coord.start()
    try:
        launched: list[str] = []

        def launch(holder: int, node: str, gres: str) -> None:  # what the guest's spare does on the borrowed node
            _register(zctx, coord.endpoint, f"g{holder}.0", "spare", 40009)
            launched.append(node)

        borrower = Borrower(7, connect=FakeDaemon, launch=launch, fail=coord.fail_now, event_sink=events, poll_s=0.01)
        coord.on_spare_needed = borrower.need
        _register(zctx, coord.endpoint, "a0.0", "slot:0", 40000)
        _register(zctx, coord.endpoint, "a1.0", "slot:1", 40001)
        until("generation 0 to start", lambda: coord.gen == 0, WAIT_S, 0.02)
        coord.worker_exited("a1.0", "slot:1", 137)  # its node is gone, and no standby spare exists
        until("generation 1, with the borrowed spare", lambda: coord.gen == 1, WAIT_S, 0.02)
        assert launched == ["node5"] and coord.members == {0: "a0.0", 1: "g900.0"}
        (generation,) = [g for g in events.of("torchpass.generation") if g["generation"] == 1]
        assert generation["replaced"] == {"1": "g900.0"}
    finally:
        coord.stop()


def test_a_refused_borrow_fails_the_job_with_the_reason_not_after_spare_timeout() -> None:
    events = Events()
    coord = Coordinator(2, TorchPassConfig(heartbeat_timeout_s=60.0, spare_timeout_s=600.0), event_sink=events)
    coord.start()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        refusing = FakeDaemon(refuse="job 7 was not submitted with --clockwork-spares=borrow")
        borrower = Borrower(
            7, connect=lambda: refusing, launch=lambda h, n, g: None, fail=coord.fail_now, event_sink=events
        )
        coord.on_spare_needed = borrower.need
        _register(context, coord.endpoint, "a0.0", "slot:0", 40000)
        _register(context, coord.endpoint, "a1.0", "slot:1", 40001)
        until("generation 0 to start", lambda: coord.gen == 0, WAIT_S, 0.02)
        coord.worker_exited("a1.0", "slot:1", 1)
        until("the job to fail on the refused borrow", lambda: coord.state == "failed", WAIT_S, 0.02)
    finally:
        coord.stop()
        context.destroy(linger=0)
    (failed,) = events.of("torchpass.failed")
    assert "no node could be borrowed" in failed["reason"] and "--clockwork-spares=borrow" in failed["reason"]


def test_the_guest_finds_the_leader_through_a_passive_replica(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    leader = Coordinator(1, TorchPassConfig())
    passive = Coordinator(1, TorchPassConfig(), active=False)
    leader.start()
    passive.start()
    passive.leader_hint = leader.endpoint
    try:
        finder = LeaderFinder([passive.endpoint, leader.endpoint])
        try:
            assert finder.probe() == leader.endpoint
            silent = LeaderFinder(["tcp://127.0.0.1:9"], timeout_s=0.3)
            assert silent.probe() is None
            silent.stop()
        finally:
            finder.stop()
    finally:
        leader.stop()
        passive.stop()


SPARE_SCRIPT = """
import os, sys, zmq
from clockwork.contracts.versions import VERSION
from torchpass.rank.control import CoordinatorRpc
ctx = zmq.Context()
wid = os.environ["TORCHPASS_WORKER_ID"]
rpc = CoordinatorRpc(ctx, os.environ["TORCHPASS_COORDINATOR"], 5.0, identity=wid.encode() + b".r")
status = rpc.call("status")["status"]
open(sys.argv[1], "w").write(f"{os.environ['TORCHPASS_ROLE']} {wid} {status['world_size']}")
rpc.close(); ctx.term()
"""


def test_the_guest_runs_a_spare_that_reaches_the_leading_coordinator(tmp_path: Path) -> None:
    leader = Coordinator(3, TorchPassConfig())
    passive = Coordinator(3, TorchPassConfig(), active=False)
    leader.start()
    passive.start()
    passive.leader_hint = leader.endpoint
    script = tmp_path / "spare.py"
    script.write_text(SPARE_SCRIPT)
    out = tmp_path / "out.txt"
    env = guest_environment(
        dict(os.environ, SLURM_JOB_ID="900", SLURMD_NODENAME="localhost"),
        job_id=7,
        endpoints=[passive.endpoint, leader.endpoint],  # the first one no longer leads
        world_size=3,
        key_hex=os.environ["TORCHPASS_JOB_KEY"],
    )
    env["SLURM_JOB_ID"], env["SLURMD_NODENAME"] = "900", "localhost"  # what srun sets in the holder's step
    try:
        code = GuestAgent(str(script), [str(out)], TorchPassConfig(), environ=env, python=sys.executable).run()
    finally:
        leader.stop()
        passive.stop()
    assert code == 0
    assert out.read_text() == "spare g900.0 3"


def test_the_guest_refuses_to_run_by_hand() -> None:
    from torchpass.launch.slurm_layout import SlurmLayoutError

    with pytest.raises(SlurmLayoutError, match="TORCHPASS_GUEST_ENDPOINTS"):
        GuestAgent("train.py", [], TorchPassConfig(), environ={"PATH": "/bin"})


#: ``srun`` where no Slurm runs: what srun gives the guest's step in the holder allocation (its job id, the node's
#: name), then the command after srun's options.
FAKE_SRUN = """#!{python}
import os, sys
args = sys.argv[1:]
options = {{a.split("=", 1)[0]: a.partition("=")[2] for a in args if a.startswith("--")}}
command = [a for a in args if not a.startswith("--")]
os.environ.update(SLURM_JOB_ID=options["--jobid"], SLURMD_NODENAME=options["--nodelist"])
os.execv(command[0], command)
"""

#: A spare of the guest: registers with the job's coordinator through the guest's proxy, says where it runs.
REGISTERING_SPARE = """
import os, sys, zmq
from clockwork.contracts.versions import VERSION
from torchpass.rank.control import CoordinatorRpc
ctx = zmq.Context()
wid = os.environ["TORCHPASS_WORKER_ID"]
rpc = CoordinatorRpc(ctx, os.environ["TORCHPASS_COORDINATOR"], 5.0, identity=wid.encode() + b".r")
rpc.call("register", wid=wid, pid=os.getpid(), host=os.environ["TORCHPASS_HOST"], store_port=1, role="spare",
         version=VERSION)
open(os.path.join(sys.argv[1], wid), "w").write(f"{os.environ['LOCAL_RANK']} {os.environ['LOCAL_WORLD_SIZE']}")
rpc.close(); ctx.term()
"""


def test_a_borrowed_node_offers_a_spare_slot_per_gpu_and_takes_a_crashed_nodes_ranks(tmp_path: Path) -> None:
    """2 ranks per node, borrow mode, no standby: node 1's loss (slots 2 and 3) borrows a node, and the guest
    started there the way the leading agent starts it (``srun`` into the holder, ``torchpass guest``, the job's
    G in its environment) offers 2 spare slots, LOCAL_RANK 0 and 1. Both slots are rebuilt on it in one
    generation, in local order."""
    srun = tmp_path / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(0o755)
    script = tmp_path / "spare.py"
    script.write_text(REGISTERING_SPARE)
    events = Events()
    coord = Coordinator(4, TorchPassConfig(heartbeat_timeout_s=60.0), event_sink=events, node_names={0: "n0", 1: "n1"})
    coord.start()
    env = guest_environment(
        os.environ,
        job_id=7,
        endpoints=[coord.endpoint],
        world_size=4,
        key_hex=os.environ["TORCHPASS_JOB_KEY"],
        ranks_per_node=2,
    )
    daemon = FakeDaemon(outcome={"state": "acquired", "node": "localhost", "holder": 900, "preempted": 500})
    launch = spawn_guest(str(srun), sys.executable, str(script), [str(tmp_path)], env)
    borrower = Borrower(7, connect=lambda: daemon, launch=launch, fail=coord.fail_now, event_sink=events, poll_s=0.01)
    coord.on_spare_needed = borrower.need
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for slot, wid in enumerate(("a0.0.0", "a0.1.1", "a1.0.0", "a1.1.1")):
            _register(context, coord.endpoint, wid, f"slot:{slot}", 40000 + slot)
        until("generation 0 to start", lambda: coord.gen == 0, WAIT_S, 0.02)
        coord.agent_lost(1, {"a1.0.0": "slot:2", "a1.1.1": "slot:3"}, "node n1 silent", time.time())
        until("generation 1, on the borrowed node's two spare slots", lambda: coord.gen == 1, 30.0, 0.05)
        until("the guest to end", lambda: borrower.guests and borrower.guests[0].poll() is not None, 30.0, 0.05)
    finally:
        coord.stop()
        borrower.stop()
        context.destroy(linger=0)
    assert borrower.guests[0].returncode == 0
    assert {p.name: p.read_text() for p in tmp_path.glob("g900.*")} == {"g900.0.0": "0 2", "g900.1.1": "1 2"}
    (generation,) = [g for g in events.of("torchpass.generation") if g["generation"] == 1]
    assert generation["replaced"] == {"2": "g900.0.0", "3": "g900.1.1"}, generation
    assert generation["placed"] == {
        "2": {"node": "127.0.0.1", "local": 0, "holder": 900},
        "3": {"node": "127.0.0.1", "local": 1, "holder": 900},
    }
