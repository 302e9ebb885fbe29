"""The coordinator's decisions, driven by fake ranks over its real ZeroMQ socket (no torch, no processes).

Each fake rank speaks the wire protocol exactly as :mod:`torchpass.rank.context` does (a request DEALER and a
control DEALER), so these tests pin the protocol: who gets which generation, when spares are used, how a
collective error without a death is handled, what a migration announces, when the job is done or failed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from clockwork.cli.main import run as clockwork
from clockwork.contracts.coordinator_wire import GenerationInfo, decode, encode
from clockwork.contracts.versions import VERSION
from tests.conftest import until
from torchpass.auth import connect_as_client
from torchpass.cli import main as cli_main
from torchpass.config import TorchPassConfig
from torchpass.coordinator.service import DONE, FAILED, Coordinator
from torchpass.rank.control import CoordinatorRefused, CoordinatorRpc, JobStopped

pytestmark = pytest.mark.usefixtures("job_key")  # the in-process coordinators need the job key


class Events:
    """A thread-safe event sink that remembers (kind, fields)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        with self._lock:
            self.items.append((kind, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [f for k, f in self.items if k == kind]


class FakeRank:
    """A rank without torch: registers, long-polls, reports, and reads its control socket."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, wid: str, role: str, port: int):
        self.wid, self.role, self.port = wid, role, port
        self.rpc = CoordinatorRpc(context, endpoint, 2.0, identity=f"{wid}.r".encode())
        self.control = context.socket(zmq.DEALER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.IDENTITY, f"{wid}.n".encode())
        connect_as_client(self.control)
        self.control.connect(endpoint)
        self.control.send(encode("hello", wid=wid, step=-1))
        self.heartbeats = 1  # the hello and every "hb" sent on the control socket: each is answered by an hb_ack
        self.acked = 0  # hb_acks read off the control socket so far

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        return self.rpc.call(op, wid=self.wid, **fields)

    def register(self) -> None:
        pid = 1000 + int("".join(c for c in self.wid if c.isdigit()))  # w3 -> 1003, a3.0 -> 1030
        self.call("register", pid=pid, host="127.0.0.1", store_port=self.port, role=self.role, version=VERSION)

    def await_generation(self, after: int, timeout: float = 30.0) -> GenerationInfo:
        reply = self.rpc.wait("await_generation", time.monotonic() + timeout, wid=self.wid, after=after)
        return GenerationInfo.from_wire(reply["generation"])

    def joined(self, info: GenerationInfo, **extra: Any) -> None:
        slot = info.slot_of(self.wid)
        self.call("joined", gen=info.gen, slot=slot, resume_step=0, arrived_at=time.time(), **extra)

    def beat(self, step: int, skipped: list[int] | None = None, uc: list[Any] | None = None) -> None:
        """One heartbeat on the control socket, as the rank's control thread sends it."""
        self.control.send(encode("hb", wid=self.wid, step=step, skipped=skipped or [], uc=uc))
        self.heartbeats += 1

    def pushes(self, timeout: float = 0.5) -> list[dict[str, Any]]:
        """What the control socket receives within ``timeout`` (hb_acks counted in ``acked``)."""
        out, deadline = [], time.monotonic() + timeout
        while self.control.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = decode(self.control.recv())
            if msg.get("op") == "hb_ack":
                self.acked += 1
            out.append(msg)
        return out

    def wait_push(self, wanted: Any, timeout: float = 30.0) -> dict[str, Any]:
        """Read the control socket until a message ``wanted(msg)`` accepts arrives; that message."""
        deadline = time.monotonic() + timeout
        while True:
            for msg in self.pushes(0.05):
                if wanted(msg):
                    return msg
            assert time.monotonic() < deadline, "the push never came"

    def all_heartbeats_answered(self, timeout: float = 30.0) -> None:
        """Wait until the coordinator has answered every heartbeat sent so far: it has handled them all (the
        answer to each one is sent after the coordinator acted on it, in the order they were sent)."""
        deadline = time.monotonic() + timeout
        while self.acked < self.heartbeats:
            self.pushes(0.05)
            assert time.monotonic() < deadline, f"{self.acked} of {self.heartbeats} heartbeats answered"

    def close(self) -> None:
        self.rpc.close()
        self.control.close(0)


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _start(world: int, events: Events, **cfg: Any) -> tuple[Coordinator, list[str], list[str]]:
    taken: list[str] = []
    evicted: list[str] = []
    config = TorchPassConfig(**{"heartbeat_timeout_s": 60.0, "broken_grace_s": 0.05, **cfg})
    coord = Coordinator(world, config, event_sink=events, on_spare_taken=taken.append, on_evict=evicted.append)
    coord.start()
    return coord, taken, evicted


def _ranks(zctx: zmq.Context[zmq.Socket[bytes]], coord: Coordinator, roles: list[str]) -> list[FakeRank]:
    ranks = [FakeRank(zctx, coord.endpoint, f"w{i}", role, 40000 + i) for i, role in enumerate(roles)]
    for rank in ranks:
        rank.register()
    return ranks


#: How long a test waits for a condition only a broken run never reaches.
WAIT_S = 30.0


def _start_generation0(events: Events, *members: FakeRank) -> GenerationInfo:
    """Every member is told generation 0 and joins it; returns once the job has started."""
    g0 = members[0].await_generation(-1)
    for member in members[1:]:
        member.await_generation(-1)
    for member in members:
        member.joined(g0)
    until("the torchpass.started event", lambda: events.of("torchpass.started"), WAIT_S, 0.01)
    return g0


def test_start_failure_spare_recovery_and_finish(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events = Events()
    coord, taken, _ = _start(2, events)
    try:
        a, b, spare = _ranks(zctx, coord, ["slot:0", "slot:1", "spare"])
        g0 = a.await_generation(-1)
        assert g0.gen == 0 and g0.members == {0: "w0", 1: "w1"} and not g0.expect_state
        assert (g0.store_host, g0.store_port) == ("127.0.0.1", a.port)  # lowest slot hosts the rendezvous
        assert b.await_generation(-1) == g0
        a.joined(g0)
        b.joined(g0)
        until("the torchpass.started event", lambda: events.of("torchpass.started"), WAIT_S, 0.01)

        coord.worker_exited("w1", "slot:1", -9)
        g1 = a.await_generation(0)
        assert g1.gen == 1 and g1.members == {0: "w0", 1: "w2"} and g1.replaced == {1: "w2"}
        assert g1.expect_state and g1.store_port == a.port  # a survivor, never the newcomer, hosts it
        assert spare.await_generation(-1) == g1
        a.wait_push(lambda p: p["op"] == "generation" and p["gen"] == 1)
        assert taken == ["w2"]
        failed = events.of("torchpass.member_failed")
        assert failed == [failed[0]] and failed[0]["slot"] == 1 and failed[0]["generation"] == 0

        a.joined(g1, first_error_at=time.time())
        move = {"part": 0, "what": "the training state", "source": 0, "target": 1, "bytes": 123, "ms": 1.5}
        spare.joined(g1, received=True, source=0, transfer_bytes=123, rebuild_ms=4.0, transfer_ms=2.0, moves=[move])
        until("the torchpass.recovered event", lambda: events.of("torchpass.recovered"), WAIT_S, 0.01)
        recovered = events.of("torchpass.recovered")[0]
        assert recovered["slots"] == [1] and recovered["received_by"] == [1] and recovered["source_slots"] == [0]
        assert recovered["moves"] == [{**move, "handoff": False}]  # what moved from whom (under FSDP: a shard)
        for key in ("detect_ms", "decide_ms", "spare_ready_ms", "total_ms", "rebuild_ms", "transfer_ms"):
            assert recovered[key] >= 0, key

        outcomes: list[BaseException] = []

        def finish(rank: FakeRank) -> None:
            try:
                rank.rpc.wait("finished", time.monotonic() + 30, wid=rank.wid, gen=1, committed=41)
            except JobStopped as exc:
                outcomes.append(exc)

        waiter = threading.Thread(target=finish, args=(a,))
        waiter.start()
        until(
            "w0's finished to arrive (the coordinator holds it)",
            lambda: ("w0", "finished") in coord.unanswered(),
            WAIT_S,
            0.01,
        )
        assert coord.state != DONE and waiter.is_alive()  # parked until every member finished
        finish(spare)
        waiter.join(30)
        assert len(outcomes) == 2 and all(isinstance(o, JobStopped) and o.done for o in outcomes)
        assert coord.state == DONE and events.of("torchpass.finished")[0]["committed"] == [41]
    finally:
        coord.stop()


def test_a_recovery_over_two_generations_names_every_slot_it_replaced(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Two ranks die moments apart: the generation that replaced the first never completes (the second died
    meanwhile); the recovery the next one completes names both slots, so neither failure stays open in the report."""
    events = Events()
    coord, _, _ = _start(3, events)
    try:
        a, b, c, s1, s2 = _ranks(zctx, coord, ["slot:0", "slot:1", "slot:2", "spare", "spare"])
        _start_generation0(events, a, b, c)
        coord.worker_exited("w1", "slot:1", -9)
        g1 = a.await_generation(0)
        assert g1.replaced == {1: "w3"}
        coord.worker_exited("w2", "slot:2", -9)  # before generation 1 completed
        g2 = a.await_generation(1)
        assert g2.replaced == {2: "w4"} and g2.members == {0: "w0", 1: "w3", 2: "w4"}
        for rank in (a, s1, s2):
            rank.joined(g2)
        until("the torchpass.recovered event", lambda: events.of("torchpass.recovered"), WAIT_S, 0.01)
        assert events.of("torchpass.recovered")[0]["slots"] == [1, 2]
    finally:
        coord.stop()


def test_collective_error_without_death_rebuilds_then_gives_up(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Rebuilt with the same members, until max_resets rebuilds at the same step have not helped: then the job
    fails with that diagnosis. A rebuild at a later step starts the count again (the job made progress)."""
    events = Events()
    coord, _, _ = _start(2, events, max_resets=1)
    try:
        a, b = _ranks(zctx, coord, ["slot:0", "slot:1"])
        g0 = a.await_generation(-1)
        b.await_generation(-1)
        a.joined(g0)
        b.joined(g0)
        infos = [g0]
        for step in (5, 9):  # one rebuild at step 5, one at step 9: each within the limit
            for rank in (a, b):
                rank.beat(step)
                rank.all_heartbeats_answered()
            gen = infos[-1].gen
            a.call("broken", gen=gen, slot=0, step=step, committed=step - 1, error="Connection reset", at=time.time())
            info = a.await_generation(gen)
            assert b.await_generation(gen).gen == info.gen == gen + 1
            assert info.members == g0.members and info.replaced == {} and "no member lost" in info.reason
            a.joined(info)
            b.joined(info)
            infos.append(info)
        assert events.of("torchpass.collective_error")
        a.call("broken", gen=infos[-1].gen, slot=0, step=9, committed=8, error="Timed out", at=time.time())
        with pytest.raises(JobStopped) as stop:
            b.await_generation(infos[-1].gen)
        assert not stop.value.done and "after 1 rebuild(s) at step 9 with no member lost" in stop.value.reason
        assert "Timed out" in stop.value.reason and "counter of its own" in stop.value.reason
        assert coord.state == FAILED
    finally:
        coord.stop()


def test_a_rank_waiting_in_a_collective_its_peer_went_past_fails_the_job(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Slot 1's heartbeats say it waits in the script's all_reduce of step 12; slot 0 reports step 13. The job
    fails with the diagnosis as soon as slot 1's report is newer than slot 0's progress by the margin."""
    events = Events()
    coord, _, _ = _start(2, events, heartbeat_interval_s=0.1)
    try:
        a, b = _ranks(zctx, coord, ["slot:0", "slot:1"])
        _start_generation0(events, a, b)
        a.beat(13)
        a.all_heartbeats_answered()
        deadline = time.monotonic() + 30
        while coord.state != FAILED:
            assert time.monotonic() < deadline, "no verdict"
            b.beat(12, uc=[12, 1, "dist.all_reduce"])
            b.all_heartbeats_answered()
            a.beat(13)
            a.all_heartbeats_answered()
        reason = events.of("torchpass.failed")[0]["reason"]
        assert "slot 1 waits in dist.all_reduce (the script's collective #1 of step 12)" in reason, reason
        assert "slot 0 has gone on to step 13" in reason and "enumerate(loader)" in reason
    finally:
        coord.stop()


def test_too_many_failures_fail_the_job_naming_the_last(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Past max_failures the job fails, and the reason names the last failure (a replacement dying the same way
    each time is recognisable from the job's last line)."""
    events = Events()
    coord, _, _ = _start(2, events, max_failures=1)
    try:
        a, b, spare = _ranks(zctx, coord, ["slot:0", "slot:1", "spare"])
        _start_generation0(events, a, b)
        coord.worker_exited("w1", "slot:1", -9)
        g1 = spare.await_generation(-1)
        assert g1.members == {0: "w0", 1: "w2"}
        a.joined(g1)
        spare.joined(g1)
        coord.worker_exited("w2", "spare", -6)
        with pytest.raises(JobStopped) as stop:
            a.await_generation(g1.gen)
        assert not stop.value.done
        assert "2 member failures exceed max_failures=1 (the last: slot 1 (w2)" in stop.value.reason, stop.value.reason
    finally:
        coord.stop()


def test_vacant_slot_waits_for_a_spare(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events = Events()
    coord, _, _ = _start(2, events)
    try:
        a, _b = _ranks(zctx, coord, ["slot:0", "slot:1"])
        g0 = a.await_generation(-1)
        coord.worker_exited("w1", "slot:1", 1)
        until("the torchpass.waiting_for_spare event", lambda: events.of("torchpass.waiting_for_spare"), WAIT_S, 0.01)
        late = FakeRank(zctx, coord.endpoint, "w7", "spare", 40007)
        late.register()
        g1 = a.await_generation(g0.gen)
        assert g1.members == {0: "w0", 1: "w7"}
    finally:
        coord.stop()


def test_initial_rank_lost_before_registering_gets_a_spare(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events = Events()
    coord, _, _ = _start(2, events)
    try:
        coord.expect_worker("w1", "slot:1")
        coord.worker_exited("w1", "slot:1", 1)
        a = FakeRank(zctx, coord.endpoint, "w0", "slot:0", 40000)
        spare = FakeRank(zctx, coord.endpoint, "w2", "spare", 40002)
        a.register()
        spare.register()
        g0 = a.await_generation(-1)
        assert g0.gen == 0 and g0.members == {0: "w0", 1: "w2"} and not g0.expect_state
    finally:
        coord.stop()


def test_planned_migration_announces_a_handoff(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events = Events()
    coord, _, _ = _start(2, events)
    try:
        a, b = _ranks(zctx, coord, ["slot:0", "slot:1"])
        g0 = a.await_generation(-1)
        b.await_generation(-1)
        with pytest.raises(CoordinatorRefused, match="not running a generation yet"):
            a.call("migrate", slot=1)
        a.joined(g0)
        b.joined(g0)
        until("the torchpass.started event", lambda: events.of("torchpass.started"), WAIT_S, 0.01)
        with pytest.raises(CoordinatorRefused, match="no spare is ready"):
            a.call("migrate", slot=1)
        spare = FakeRank(zctx, coord.endpoint, "w2", "spare", 40002)
        spare.register()
        with pytest.raises(CoordinatorRefused, match="no slot 5"):
            a.call("migrate", slot=5)
        reply = a.call("migrate", slot=1)
        assert reply["target"] == "w2" and reply["generation"] == 1
        g1 = b.await_generation(0)  # the departing rank is told too, although it is no member
        assert g1.members == {0: "w0", 1: "w2"} and g1.handoff is not None
        assert (g1.handoff.source, g1.handoff.target, g1.handoff.port) == ("w1", "w2", b.port)
        b.call("departed", gen=1, handoff_ok=True, handoff_ms=3.0)
        coord.worker_exited("w1", "slot:1", 0)  # it leaves cleanly after its handoff: no failure
        a.joined(g1)
        spare.joined(g1, handoff_ok=True, received=False)
        until("the torchpass.migrated event", lambda: events.of("torchpass.migrated"), WAIT_S, 0.01)
        assert events.of("torchpass.migrated")[0]["handoff_ok"] and not events.of("torchpass.member_failed")
    finally:
        coord.stop()


def test_departing_rank_lost_before_handoff_triggers_a_plain_generation(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    events = Events()
    coord, _, _ = _start(2, events)
    try:
        a, b, spare = _ranks(zctx, coord, ["slot:0", "slot:1", "spare"])
        _start_generation0(events, a, b)
        a.call("migrate", slot=1)
        g1 = spare.await_generation(-1)
        assert g1.handoff is not None
        coord.worker_exited("w1", "slot:1", -9)  # dies before handing its state over
        g2 = spare.await_generation(g1.gen)
        assert g2.handoff is None and g2.members == g1.members and "before its handoff" in g2.reason
        assert not events.of("torchpass.member_failed")
    finally:
        coord.stop()


def test_silent_rank_is_evicted(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events = Events()
    coord, _, evicted = _start(1, events, heartbeat_timeout_s=0.3, heartbeat_interval_s=0.05)
    try:
        (a,) = _ranks(zctx, coord, ["slot:0"])
        a.await_generation(-1)
        until("w0 to be evicted", lambda: evicted == ["w0"], WAIT_S, 0.01)
        assert "no heartbeat" in events.of("torchpass.member_failed")[0]["why"]
        assert coord.state == FAILED  # the only member is gone: nobody holds the state
    finally:
        coord.stop()


def test_cli_status_and_migrate(zctx: zmq.Context[zmq.Socket[bytes]], capsys: pytest.CaptureFixture[str]) -> None:
    events = Events()
    coord, _, _ = _start(1, events)
    try:
        (a,) = _ranks(zctx, coord, ["slot:0"])
        a.joined(a.await_generation(-1))
        until("the torchpass.started event", lambda: events.of("torchpass.started"), WAIT_S, 0.01)
        assert cli_main(["status", "--coordinator", coord.endpoint]) == 0
        out = capsys.readouterr().out
        assert "generation 0" in out and "slot 0: w0" in out
        assert clockwork(["migrate", "--coordinator", coord.endpoint, "--rank", "0", "--wait", "0"]) == 1
        assert "no spare is ready" in capsys.readouterr().err
        # Asked while the spare is still starting: it asks again until the spare is ready.
        spare = FakeRank(zctx, coord.endpoint, "w1", "spare", 40001)
        late = threading.Timer(1.0, spare.register)
        late.start()
        try:
            assert clockwork(["migrate", "--coordinator", coord.endpoint, "--rank", "0", "--wait", "30"]) == 0
        finally:
            late.join()
        assert "rank 0 moves to spare w1 in generation 1" in capsys.readouterr().out
    finally:
        coord.stop()


def test_cli_run_requires_local(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "train.py"]) == 2
    assert "--local" in capsys.readouterr().err


def test_one_command_per_action(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    """Migration and snapshots are clockwork's commands, for Slurm and local jobs alike; torchpass points there."""
    assert cli_main(["migrate", "--coordinator", "f", "--slot", "1"]) == 2
    assert "clockwork migrate --coordinator FILE --rank R" in capsys.readouterr().err
    assert cli_main(["snapshot", "--coordinator", "f"]) == 2
    assert "clockwork snapshot take --coordinator FILE" in capsys.readouterr().err
    assert clockwork(["migrate", "5", "--coordinator", "f", "--rank", "0"]) == 2  # a job id or a file, not both
    assert "not both" in capsys.readouterr().err
    assert clockwork(["snapshot", "take", "--coordinator", str(tmp_path / "missing")]) == 2
    assert "neither tcp://HOST:PORT nor a readable file" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.write_text("not a coordinator file\n")
    assert clockwork(["migrate", "--coordinator", str(bad), "--rank", "0"]) == 2
    assert "not a TorchPass coordinator file" in capsys.readouterr().err
    assert cli_main(["run", "--local", "--set", "nope=1", "train.py"]) == 2
    assert "unknown key" in capsys.readouterr().err


def test_only_holders_of_the_job_key_are_answered(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A plain TCP client and a CURVE client with another job's key get no answer; the job's own does."""
    from clockwork.contracts.jobkey import JobKey
    from torchpass.auth import job_key

    events = Events()
    coord, _, _ = _start(2, events)
    try:
        replies = {}
        for name, key in (("plain", None), ("other job", JobKey.new()), ("this job", job_key())):
            sock = zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if key is not None:
                key.connect_as_client(sock)
            sock.connect(coord.endpoint)
            sock.send(encode("status", id=1))
            wait_ms = 30_000 if name == "this job" else 1500  # the answer expected is waited for, not timed
            replies[name] = decode(sock.recv()) if sock.poll(wait_ms) else None
            sock.close()
        assert replies["plain"] is None and replies["other job"] is None, replies
        assert replies["this job"] is not None and replies["this job"]["ok"], replies
    finally:
        coord.stop()


def test_snapshots_asked_for_are_merged_and_planned_again_when_skipped(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A snapshot asked for while another is planned shares it; one a member skipped (still writing the last
    one) is planned again, once whoever skipped it, up to SNAPSHOT_ATTEMPTS; a periodic one is not."""
    events = Events()
    coord, _, _ = _start(2, events, heartbeat_interval_s=0.2)
    try:
        a, b = _ranks(zctx, coord, ["slot:0", "slot:1"])
        _start_generation0(events, a, b)

        def beat(step: int, *skipped: int) -> None:
            for rank in (a, b):
                rank.beat(step, list(skipped))

        beat(10)
        time.sleep(0.2)
        beat(11)  # a pace of about 5 steps/s
        until(
            "both workers' step rates",
            lambda: coord.workers["w0"].rate > 0 and coord.workers["w1"].rate > 0,
            WAIT_S,
            0.01,
        )
        first = a.call("snapshot")["step"]
        assert first > 11 and b.call("snapshot")["step"] == first  # planned, not reached: it serves both
        assert [(e["step"], e["reason"], e.get("shared")) for e in events.of("torchpass.snapshot_requested")] == [
            (first, "requested by w0", None),
            (first, "requested by w1", True),
        ]

        beat(first + 1, first)  # both skipped it: one incomplete snapshot, asked for once more
        until(
            "3 torchpass.snapshot_requested events",
            lambda: len(events.of("torchpass.snapshot_requested")) == 3,
            WAIT_S,
            0.01,
        )
        (incomplete,) = events.of("torchpass.snapshot_incomplete")
        assert incomplete["step"] == first and incomplete["asked_again"] is True
        second = events.of("torchpass.snapshot_requested")[2]
        assert second["step"] > first + 1 and f"skipped the one after step {first}" in second["reason"]

        beat(second["step"] + 1, second["step"])
        until(
            "4 torchpass.snapshot_requested events",
            lambda: len(events.of("torchpass.snapshot_requested")) == 4,
            WAIT_S,
            0.01,
        )
        third = events.of("torchpass.snapshot_requested")[3]["step"]
        beat(third + 1, third)  # the third attempt skipped too: SNAPSHOT_ATTEMPTS reached, no fourth
        until(
            "3 torchpass.snapshot_incomplete events",
            lambda: len(events.of("torchpass.snapshot_incomplete")) == 3,
            WAIT_S,
            0.01,
        )
        assert events.of("torchpass.snapshot_incomplete")[-1]["asked_again"] is False
        for rank in (a, b):  # both skip reports of the third attempt handled, and every heartbeat before them
            rank.all_heartbeats_answered()
        assert len(events.of("torchpass.snapshot_requested")) == 4  # nothing more was planned
    finally:
        coord.stop()


def test_a_skipped_periodic_snapshot_waits_for_the_next_period(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events = Events()
    coord, _, _ = _start(1, events, heartbeat_interval_s=0.2, snapshot_interval_s=1.0)
    try:
        (a,) = _ranks(zctx, coord, ["slot:0"])
        _start_generation0(events, a)
        step = 0
        while not events.of("torchpass.snapshot_requested"):  # the first one is planned once the pace is known
            step += 4
            a.control.send(encode("hb", wid=a.wid, step=step))
            time.sleep(0.2)
        (periodic,) = events.of("torchpass.snapshot_requested")
        assert periodic["reason"] == "periodic"
        a.control.send(encode("hb", wid=a.wid, step=periodic["step"] + 1, skipped=[periodic["step"]]))
        until(
            "the torchpass.snapshot_incomplete event", lambda: events.of("torchpass.snapshot_incomplete"), WAIT_S, 0.01
        )
        assert events.of("torchpass.snapshot_incomplete")[0] == {
            "step": periodic["step"],
            "skipped_by": "w0",
            "asked_again": False,
        }
        until(
            "2 torchpass.snapshot_requested events",
            lambda: len(events.of("torchpass.snapshot_requested")) == 2,
            WAIT_S,
            0.01,
        )
        assert events.of("torchpass.snapshot_requested")[1]["reason"] == "periodic"
    finally:
        coord.stop()
