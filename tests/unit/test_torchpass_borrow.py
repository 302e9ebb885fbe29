"""Borrowed spares, TorchPass's side: the borrower in the leading agent and the guest on the borrowed node.

Real coordinators on loopback sockets (with the job key), real processes for the guest; the node daemon is the
one seam (an in-process object answering ``borrow``/``borrow_status`` as tests/unit/test_borrow.py shows the
real daemon does), because no Slurm runs here.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.conftest import until
from torchpass.config import TorchPassConfig
from torchpass.coordinator.service import Coordinator
from torchpass.launch.borrow import Borrower, guest_command, guest_environment
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
        self.outcome = outcome or {"state": "acquired", "node": "node5", "holder": 900, "preempted": 500}
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
    cmd = guest_command("srun", "/py", 900, "node5", "train.py", ["--steps", "9"])
    assert cmd[:6] == ["srun", "--jobid=900", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=node5"]
    assert cmd[-7:] == ["/py", "-m", "torchpass", "guest", "train.py", "--steps", "9"]
    assert "ab" * 32 not in " ".join(cmd)  # the key never goes on a command line


def test_a_borrowed_node_is_launched_and_timed() -> None:
    events = Events()
    launched: list[tuple[int, str]] = []
    failed: list[str] = []
    daemon = FakeDaemon()
    borrower = Borrower(
        100,
        connect=lambda: daemon,
        launch=lambda holder, node: launched.append((holder, node)) or None,  # type: ignore[func-returns-value]
        fail=failed.append,
        lost_node=lambda: "node3",
        event_sink=events,
        poll_s=0.01,
    )
    borrower.borrow_once()
    assert daemon.asked == [(100, "node3")] and launched == [(900, "node5")] and failed == []
    (borrowed,) = events.of("torchpass.borrowed")
    assert (borrowed["node"], borrowed["holder"], borrowed["from_job"], borrowed["lost_node"]) == (
        "node5",
        900,
        500,
        "node3",
    )
    assert {"request_ms", "acquire_ms", "launch_ms"} <= set(borrowed)


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
            launch=lambda h, n: None,
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
        rpc.call("register", wid=wid, pid=port, host="127.0.0.1", store_port=port, role=role)
    finally:
        rpc.close()


def test_a_lost_member_is_replaced_by_the_borrowed_guest(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events = Events()
    coord = Coordinator(2, TorchPassConfig(heartbeat_timeout_s=60.0), event_sink=events)
    coord.start()
    try:
        launched: list[str] = []

        def launch(holder: int, node: str) -> None:  # what the guest's spare does on the borrowed node
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
            7, connect=lambda: refusing, launch=lambda h, n: None, fail=coord.fail_now, event_sink=events
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
