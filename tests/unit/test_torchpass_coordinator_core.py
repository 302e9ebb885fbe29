"""The coordinator's core by table: typed events in, typed decisions out, at a clock the test turns.

Every row of SCENARIOS is a job's history written as steps (processes registering, exiting, reporting a broken
collective, a node agent lost, a migration, time passing) and what must come of it: the job's state, the last
generation (members, newcomers, handoff, reason), the story's events, the failure's reason. Leadership
(passive replicas, a takeover after the leader's loss) and snapshot planning have tests of their own below.
Pure: no sockets, no threads, no sleeping (the clock is :class:`Now`, moved by the steps)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest

from clockwork.contracts.coordinator_replies import (
    GenerationAnswer,
    GenerationPush,
    HeartbeatAck,
    MigrationAccepted,
    Refusal,
    Registered,
    SnapshotPlanned,
    SnapshotPush,
    StatusAnswer,
    StopAnswer,
    StopPush,
)
from clockwork.contracts.coordinator_requests import (
    WHOLE_STATE,
    AwaitGeneration,
    Broken,
    Departed,
    Fatal,
    Finished,
    Heartbeat,
    Joined,
    Migrate,
    PartMove,
    Register,
    SnapshotAsk,
    Status,
)
from clockwork.contracts.coordinator_wire import FailureKind, JobState, Role
from clockwork.contracts.versions import VERSION
from torchpass.config import TorchPassConfig
from torchpass.coordinator.core import CoordinatorCore
from torchpass.coordinator.records import (
    AgentLost,
    CheckHeartbeats,
    Decision,
    Emit,
    Evict,
    FailNow,
    HeartbeatIn,
    JobEnded,
    Now,
    RequestIn,
    Send,
    SpareNeeded,
    SpareTaken,
    StepDown,
    TakeOver,
    Tick,
    WorkerExited,
    WorkerExpected,
)
from torchpass.coordinator.snapshot_plan import SNAPSHOT_ATTEMPTS

Step = tuple[Any, ...]


class Sim:
    """One core, its clock, and every decision it made; the steps of a scenario as methods."""

    def __init__(self, world: int, *, active: bool = True, **cfg: Any) -> None:
        config = TorchPassConfig(**{"heartbeat_timeout_s": 60.0, "broken_grace_s": 0.5, **cfg})
        self.now = Now(100.0, 1_000.0)
        self.core = CoordinatorCore(world, config, self.now, active=active)
        self.decisions: list[Decision] = []
        self.ids = itertools.count(1)
        self.seen: dict[str, int] = {}  # wid -> the newest generation it was answered

    @property
    def m(self) -> Any:
        return self.core.membership

    def handle(self, event: Any) -> list[Decision]:
        out = self.core.handle(event, self.now)
        self.decisions += out
        return out

    def advance(self, seconds: float) -> None:
        self.now = Now(self.now.mono + seconds, self.now.wall + seconds)

    def ask(self, wid: str, request: Any) -> list[Decision]:
        return self.handle(RequestIn(f"{wid}.r".encode(), request))

    def answer(self, out: list[Decision], wid: str) -> Any:
        """The one reply ``out`` sent to ``wid``'s request socket."""
        (reply,) = [d.message for d in out if isinstance(d, Send) and d.to == f"{wid}.r".encode()]
        return reply

    def pushed(self, wid: str) -> list[Any]:
        return [d.message for d in self.decisions if isinstance(d, Send) and d.to == f"{wid}.n".encode()]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [d.fields for d in self.decisions if isinstance(d, Emit) and d.kind == kind]

    def kinds(self) -> list[str]:
        return [d.kind for d in self.decisions if isinstance(d, Emit)]

    # ----- steps -------------------------------------------------------------------------------

    def register(self, wid: str, role: str, port: int = 0) -> list[Decision]:
        self.handle(HeartbeatIn(f"{wid}.n".encode(), Heartbeat(wid, hello=True)))
        port = port or 40000 + int("".join(c for c in wid if c.isdigit()))
        return self.ask(wid, Register(next(self.ids), wid, Role.parse(role), 1, "10.0.0.1", port, version=VERSION))

    def poll(self, wid: str) -> Any:
        """``wid`` long-polls for the next generation; the answer, or None while it is parked."""
        out = self.ask(wid, AwaitGeneration(next(self.ids), wid, after=self.seen.get(wid, -1)))
        replies = [d.message for d in out if isinstance(d, Send) and d.to == f"{wid}.r".encode()]
        if replies and isinstance(replies[0], GenerationAnswer):
            self.seen[wid] = replies[0].generation.gen
        return replies[0] if replies else None

    def join(self, *wids: str, step: int = 0) -> None:
        info = self.m.info
        for wid in wids or tuple(info.members.values()):
            self.ask(wid, Joined(next(self.ids), wid, info.gen, slot=info.slot_of(wid) or 0, resume_step=step))

    def start(self, *wids: str) -> None:
        for slot, wid in enumerate(wids):
            self.register(wid, f"slot:{slot}")
        for wid in wids:
            self.poll(wid)
        self.join()

    def run(self, step: Step) -> None:
        verb, *args = step
        if verb == "start":
            self.start(*args)
        elif verb == "spare":
            for wid in args:
                self.register(wid, "spare")
        elif verb == "exit":
            self.handle(WorkerExited(args[0], Role.parse(args[1]) if len(args) > 1 else Role(), -9, self.now.wall))
        elif verb == "join":
            self.join(*args)
        elif verb == "poll":
            for wid in args:
                self.poll(wid)
        elif verb == "broken":
            wid, at_step = args
            self.ask(wid, Broken(next(self.ids), wid, self.m.gen, step=at_step, error="Connection reset"))
        elif verb == "beat":
            wid, at_step = args
            self.handle(HeartbeatIn(f"{wid}.n".encode(), Heartbeat(wid, at_step)))
        elif verb == "wait":
            self.advance(args[0])
            self.handle(Tick())
        elif verb == "silence":
            self.advance(args[0])
            self.handle(CheckHeartbeats())
        elif verb == "lose":
            agent, *hints = args
            self.handle(AgentLost(agent, {w: Role.parse(r) for w, r in hints}, f"agent {agent} silent", self.now.wall))
        elif verb == "migrate":
            self.ask("cli", Migrate(next(self.ids), args[0], requester="test"))
        elif verb == "departed":
            self.ask(args[0], Departed(next(self.ids), args[0], self.m.gen, handoff_ok=True))
        elif verb == "finish":
            wid, committed = args
            self.ask(wid, Finished(next(self.ids), wid, self.m.gen, committed))
        elif verb == "fatal":
            self.ask(args[0], Fatal(next(self.ids), args[0], args[1], *args[2:]))
        elif verb == "fail_now":
            self.handle(FailNow(*args))
        else:
            raise AssertionError(f"no step {verb!r}")


@dataclass
class Expect:
    """What a scenario must end with (None: not checked)."""

    state: JobState = JobState.RUNNING
    gen: int | None = None
    members: dict[int, str] | None = None
    replaced: dict[int, str] | None = None
    reason: str | None = None  # a part of the last generation's reason
    handoff: tuple[str, str] | None = None  # (source, target) of the last generation's handoff
    failed: str | None = None  # a part of the failure's reason
    cause: FailureKind | None = None  # the failure's kind (whether a requeue from a snapshot can undo it)
    events: list[str] = field(default_factory=list)  # kinds that must have been emitted, in this order
    absent: list[str] = field(default_factory=list)  # kinds that must not have been emitted
    refused: str | None = None  # a part of the refusal the command line got (asked again later: retry)


SCENARIOS: list[tuple[str, int, dict[str, Any], list[Step], Expect]] = [
    (
        "start: every slot registers, generation 0 forms, the job has started",
        2,
        {},
        [("start", "w0", "w1")],
        Expect(gen=0, members={0: "w0", 1: "w1"}, reason="start", events=["torchpass.generation", "torchpass.started"]),
    ),
    (
        "an initial rank dies before it registers: a spare takes its slot from the start",
        2,
        {},
        [("exit", "w1", "slot:1"), ("spare", "w2"), ("start", "w0")],
        Expect(gen=0, members={0: "w0", 1: "w2"}, replaced={1: "w2"}, events=["torchpass.member_failed"]),
    ),
    (
        "a member dies: the first spare takes its slot in the next generation",
        2,
        {},
        [("start", "w0", "w1"), ("spare", "w2"), ("exit", "w1"), ("join",)],
        Expect(
            gen=1,
            members={0: "w0", 1: "w2"},
            replaced={1: "w2"},
            reason="slot 1 (w1) exited with code -9",
            events=["torchpass.started", "torchpass.member_failed", "torchpass.generation", "torchpass.recovered"],
        ),
    ),
    (
        "a member dies with no spare ready: the slot waits, and the spare that comes fills it",
        2,
        {},
        [("start", "w0", "w1"), ("exit", "w1"), ("spare", "w7")],
        Expect(gen=1, members={0: "w0", 1: "w7"}, events=["torchpass.waiting_for_spare", "torchpass.generation"]),
    ),
    (
        "no spare within spare_timeout_s: the job fails",
        2,
        {"spare_timeout_s": 5.0},
        [("start", "w0", "w1"), ("exit", "w1"), ("wait", 6.0)],
        Expect(state=JobState.FAILED, gen=0, failed="no spare for slot(s) [1] within 5 s", cause=FailureKind.CAPACITY),
    ),
    (
        "two deaths at once (their node agent lost): one generation replaces both",
        3,
        {},
        [("start", "a0.0", "a1.0", "a1.1"), ("spare", "a2.0", "a2.1"), ("lose", 1)],
        Expect(gen=1, members={0: "a0.0", 1: "a2.0", 2: "a2.1"}, replaced={1: "a2.0", 2: "a2.1"}),
    ),
    (
        "two deaths one after the other: each makes its generation, the second replaces the first's newcomer",
        2,
        {},
        [("start", "w0", "w1"), ("spare", "w2", "w3"), ("exit", "w1"), ("exit", "w2"), ("join",)],
        Expect(
            gen=2, members={0: "w0", 1: "w3"}, replaced={1: "w3"}, reason="slot 1 (w2)", events=["torchpass.recovered"]
        ),
    ),
    (
        "a death during a rejoin: the generation being joined is replaced before it completes",
        3,
        {},
        [("start", "w0", "w1", "w2"), ("spare", "w3", "w4"), ("exit", "w1"), ("join", "w0", "w3"), ("exit", "w2")],
        Expect(gen=2, members={0: "w0", 1: "w3", 2: "w4"}, replaced={2: "w4"}, absent=["torchpass.recovered"]),
    ),
    (
        "a lost node agent that ran only a spare: no new generation",
        2,
        {},
        [("start", "a0.0", "a1.0"), ("spare", "a2.0"), ("lose", 2)],
        Expect(gen=0, members={0: "a0.0", 1: "a1.0"}, events=["torchpass.spare_lost"]),
    ),
    (
        "a node agent lost with a process this replica never heard of (a hint): counted dead all the same",
        2,
        {},
        [("start", "a0.0", "a1.0"), ("spare", "a2.0"), ("lose", 1, ("a1.5", "spare"))],
        Expect(gen=1, members={0: "a0.0", 1: "a2.0"}),
    ),
    (
        "a broken collective with no death: after broken_grace_s the same members rebuild",
        2,
        {},
        [("start", "w0", "w1"), ("broken", "w0", 5), ("wait", 1.0)],
        Expect(
            gen=1,
            members={0: "w0", 1: "w1"},
            replaced={},
            reason="collective error with no member lost: rebuild",
            events=["torchpass.collective_error", "torchpass.generation"],
        ),
    ),
    (
        "a broken collective explained by a death within the grace: one generation, for the death",
        2,
        {},
        [("start", "w0", "w1"), ("spare", "w2"), ("broken", "w0", 5), ("exit", "w1"), ("wait", 1.0)],
        Expect(gen=1, members={0: "w0", 1: "w2"}, reason="slot 1 (w1) exited"),
    ),
    (
        "rebuilds at the same step beyond max_resets: the job fails with the diagnosis",
        2,
        {"max_resets": 1},
        [
            ("start", "w0", "w1"),
            ("beat", "w0", 9),
            ("broken", "w0", 9),
            ("wait", 1.0),
            ("join",),
            ("broken", "w1", 9),
            ("wait", 1.0),
        ],
        Expect(
            state=JobState.FAILED,
            gen=1,
            failed="after 1 rebuild(s) at step 9 with no member lost",
            cause=FailureKind.LIMIT,
        ),
    ),
    (
        "a rebuild at a later step starts the count again",
        2,
        {"max_resets": 1},
        [
            ("start", "w0", "w1"),
            ("beat", "w0", 5),
            ("broken", "w0", 5),
            ("wait", 1.0),
            ("join",),
            ("beat", "w0", 9),
            ("broken", "w1", 9),
            ("wait", 1.0),
        ],
        Expect(gen=2, members={0: "w0", 1: "w1"}),
    ),
    (
        "more member failures than max_failures: the job fails naming the last",
        2,
        {"max_failures": 1},
        [("start", "w0", "w1"), ("spare", "w2"), ("exit", "w1"), ("join",), ("exit", "w2")],
        Expect(
            state=JobState.FAILED,
            gen=1,
            failed="2 member failures exceed max_failures=1 (the last: slot 1 (w2)",
            cause=FailureKind.LIMIT,
        ),
    ),
    (
        "every member gone: nobody holds the state",
        1,
        {},
        [("start", "w0"), ("spare", "w1"), ("exit", "w0")],
        Expect(state=JobState.FAILED, gen=0, failed="every member is gone", cause=FailureKind.STATE_LOST),
    ),
    (
        "a planned migration: the spare takes the slot and the departing rank hands its state over",
        2,
        {},
        [("start", "w0", "w1"), ("spare", "w2"), ("migrate", 1), ("departed", "w1"), ("exit", "w1"), ("join",)],
        Expect(
            gen=1,
            members={0: "w0", 1: "w2"},
            handoff=("w1", "w2"),
            events=["torchpass.migration_requested", "torchpass.departed", "torchpass.migrated"],
            absent=["torchpass.member_failed"],
        ),
    ),
    (
        "a migration racing a crash of the departing rank: a plain generation, the spare's state from a replica",
        2,
        {},
        [("start", "w0", "w1"), ("spare", "w2"), ("migrate", 1), ("exit", "w1")],
        Expect(
            gen=2,
            members={0: "w0", 1: "w2"},
            handoff=None,
            reason="departing w1 exited with code -9 before its handoff",
        ),
    ),
    (
        "a migration racing a crash of another member: the crash's generation drops the handoff",
        3,
        {},
        [("start", "w0", "w1", "w2"), ("spare", "w3", "w4"), ("migrate", 1), ("exit", "w0")],
        Expect(gen=2, members={0: "w4", 1: "w3", 2: "w2"}, replaced={0: "w4"}, handoff=None),
    ),
    (
        "a migration asked for while a death waits for a spare: refused, to be asked again (nothing changes)",
        3,
        {},
        [("start", "w0", "w1", "w2"), ("exit", "w2"), ("migrate", 1)],
        Expect(gen=0, members={0: "w0", 1: "w1", 2: "w2"}, refused="a membership change is already in progress"),
    ),
    (
        "every member finished: the job is done",
        2,
        {},
        [("start", "w0", "w1"), ("finish", "w0", 41), ("finish", "w1", 41)],
        Expect(state=JobState.DONE, gen=0, events=["torchpass.finished"]),
    ),
    (
        "a rank's fatal report fails the job",
        2,
        {},
        [("start", "w0", "w1"), ("fatal", "w1", "model state differs")],
        Expect(state=JobState.FAILED, failed="w1: model state differs", cause=FailureKind.SCRIPT),
    ),
    (
        "a rank's report that every holder of a part is gone fails the job as a state loss",
        2,
        {},
        [("start", "w0", "w1"), ("fatal", "w1", "part 1 has no holder", "state_lost")],
        Expect(state=JobState.FAILED, failed="w1: part 1 has no holder", cause=FailureKind.STATE_LOST),
    ),
    (
        "fail_now (no node could be borrowed) fails the job at once",
        2,
        {},
        [("start", "w0", "w1"), ("exit", "w1"), ("fail_now", "no node to borrow", FailureKind.CAPACITY)],
        Expect(state=JobState.FAILED, failed="no node to borrow", cause=FailureKind.CAPACITY),
    ),
    (
        "a silent member is counted dead after heartbeat_timeout_s",
        2,
        {"heartbeat_timeout_s": 3.0},
        [
            ("start", "w0", "w1"),
            ("spare", "w2"),
            ("silence", 2.0),
            ("beat", "w0", 1),
            ("beat", "w2", -1),
            ("silence", 2.0),
        ],
        Expect(gen=1, members={0: "w0", 1: "w2"}, reason="silent for 4.0 s (no heartbeat)"),
    ),
]


@pytest.mark.parametrize(("world", "cfg", "steps", "expect"), [r[1:] for r in SCENARIOS], ids=[r[0] for r in SCENARIOS])
def test_scenario(world: int, cfg: dict[str, Any], steps: list[Step], expect: Expect) -> None:
    sim = Sim(world, **cfg)
    for step in steps:
        sim.run(step)
    m = sim.m
    assert m.state == expect.state, m.failure_reason
    info = m.info
    if expect.gen is not None:
        assert info is not None and info.gen == expect.gen
    if expect.members is not None:
        assert info is not None and info.members == expect.members
    if expect.replaced is not None:
        assert info is not None and info.replaced == expect.replaced
    if expect.reason is not None:
        assert info is not None and expect.reason in info.reason, info.reason
    if expect.gen is not None and info is not None:
        handoff = None if info.handoff is None else (info.handoff.source, info.handoff.target)
        assert handoff == expect.handoff
    if expect.failed is not None:
        assert expect.failed in m.failure_reason, m.failure_reason
    if expect.cause is not None:
        assert m.failure_kind is expect.cause, m.failure_kind
        exported = m.export()
        assert exported["failure_kind"] == expect.cause.value  # a successor replica (and every agent) knows it
    kinds = sim.kinds()
    rest = iter(kinds)
    assert all(kind in rest for kind in expect.events), kinds  # a subsequence: in this order, others between
    assert not [k for k in expect.absent if k in kinds], kinds
    refusals = [d.message for d in sim.decisions if isinstance(d, Send) and isinstance(d.message, Refusal)]
    if expect.refused is not None:
        assert [r.retry for r in refusals if expect.refused in r.error] == [True], refusals
    else:
        assert not refusals, refusals


# ----- what each generation tells whom -------------------------------------------------------------


def test_a_new_generation_is_pushed_to_every_member_and_answered_to_parked_polls() -> None:
    sim = Sim(2)
    sim.start("w0", "w1")
    sim.register("w2", "spare")
    assert sim.poll("w0") is None and sim.poll("w2") is None  # parked until there is a newer generation
    out = sim.handle(WorkerExited("w1", Role(1), -9, sim.now.wall))
    sent = {d.to: d.message for d in out if isinstance(d, Send)}
    assert sent[b"w0.n"] == GenerationPush(1) and sent[b"w2.n"] == GenerationPush(1) and b"w1.n" not in sent
    assert isinstance(sent[b"w0.r"], GenerationAnswer) and sent[b"w0.r"].generation.members == {0: "w0", 1: "w2"}
    assert sent[b"w0.r"].generation.store_port == 40000  # a survivor, never the newcomer, hosts the rendezvous
    assert SpareTaken("w2") in out
    assert sim.core.unanswered() == []


def test_a_poll_for_a_generation_past_the_new_one_stays_parked() -> None:
    """A rank that heard of generation 5 (from a leader lost before it replicated) is not sent generation 1."""
    sim = Sim(2)
    sim.start("w0", "w1")
    sim.register("w2", "spare")
    sim.ask("w0", AwaitGeneration(40, "w0", after=5))
    out = sim.handle(WorkerExited("w1", Role(1), -9, sim.now.wall))
    assert [d.message for d in out if isinstance(d, Send) and d.to == b"w0.r"] == []
    assert Send(b"w0.n", GenerationPush(1)) in out and sim.core.unanswered() == [("w0", "await")]


def test_without_a_spare_the_launcher_is_asked_for_one_once() -> None:
    sim = Sim(2)
    sim.start("w0", "w1")
    first = sim.handle(WorkerExited("w1", Role(1), -9, sim.now.wall))
    assert first.count(SpareNeeded()) == 1
    sim.run(("wait", 1.0))
    assert sim.decisions.count(SpareNeeded()) == 1


def test_the_departing_rank_is_told_and_a_late_poll_after_a_takeover_lets_it_go() -> None:
    sim = Sim(2)
    sim.start("w0", "w1")
    sim.register("w2", "spare")
    out = sim.ask("cli", Migrate(99, 1, requester="test"))
    assert sim.answer(out, "cli") == MigrationAccepted(99, 1, "w2")
    # the departing rank too, although it is no member; planned: every member finishes its step before following
    assert GenerationPush(1, planned=True) in sim.pushed("w1") and GenerationPush(1, planned=True) in sim.pushed("w0")
    reply = sim.poll("w1")
    assert isinstance(reply, GenerationAnswer) and reply.generation.handoff is not None
    sim.handle(WorkerExited("w0", Role(0), -9, sim.now.wall))  # generation 2 drops the handoff...
    sim.register("w3", "spare")
    assert sim.m.info.handoff is None
    assert GenerationPush(2) in sim.pushed("w2") and not sim.m.planned  # a failure's: aborts the step
    reply = sim.poll("w1")  # ...and w1 has nothing left to do
    assert isinstance(reply, StopAnswer) and (reply.done, reply.reason) == (True, "migrated away")


def test_requests_from_the_dead_and_the_unknown_are_told_to_stop() -> None:
    sim = Sim(2)
    sim.start("w0", "w1")
    sim.handle(WorkerExited("w1", Role(1), -9, sim.now.wall))
    out = sim.ask("w1", Broken(50, "w1", 0))
    assert sim.answer(out, "w1") == StopAnswer(50, False, "evicted or unknown worker")
    out = sim.ask("w9", AwaitGeneration(51, "w9"))
    assert sim.answer(out, "w9") == StopAnswer(51, False, "evicted or unknown worker")
    out = sim.handle(HeartbeatIn(b"w1.n", Heartbeat("w1", 3)))
    assert out == [Send(b"w1.n", StopPush(False, "evicted: the coordinator counts this process as dead"))]


def test_the_end_answers_every_parked_request_and_pushes_stop() -> None:
    sim = Sim(2)
    sim.start("w0", "w1")
    sim.ask("w0", Finished(60, "w0", 0, 41))
    assert ("w0", "finished") in sim.core.unanswered() and sim.m.state == JobState.RUNNING
    out = sim.ask("w1", Finished(61, "w1", 0, 41))
    sent = {d.to: d.message for d in out if isinstance(d, Send)}
    assert sent[b"w0.r"] == StopAnswer(60, True, "job finished")
    assert sent[b"w1.r"] == StopAnswer(61, True, "job finished")
    assert sent[b"w0.n"] == StopPush(True, "job finished") and out[-1] == JobEnded(True)
    assert sim.events("torchpass.finished")[0]["committed"] == [41]


def test_finishing_in_an_old_generation_gets_the_new_one() -> None:
    sim = Sim(2)
    sim.start("w0", "w1")
    sim.register("w2", "spare")
    sim.handle(WorkerExited("w1", Role(1), -9, sim.now.wall))
    out = sim.ask("w0", Finished(70, "w0", 0, 12))
    reply = sim.answer(out, "w0")
    assert isinstance(reply, GenerationAnswer) and reply.generation.gen == 1


def test_an_evicted_process_is_killed_by_its_launcher() -> None:
    sim = Sim(1, heartbeat_timeout_s=0.3)
    sim.start("w0")
    sim.run(("silence", 1.0))
    assert Evict("w0") in sim.decisions and sim.m.state == JobState.FAILED


def test_migration_refusals_say_whether_to_ask_again() -> None:
    sim = Sim(2)
    sim.register("w0", "slot:0")
    sim.register("w1", "slot:1")
    out = sim.ask("cli", Migrate(1, 1))
    assert sim.answer(out, "cli") == Refusal(
        1, "cannot migrate slot 1: the job is not running a generation yet (state running)", retry=True
    )
    sim.join()
    out = sim.ask("cli", Migrate(2, 1))
    assert sim.answer(out, "cli") == Refusal(2, "cannot migrate slot 1: no spare is ready", retry=True)
    sim.register("w2", "spare")
    out = sim.ask("cli", Migrate(3, 5))
    assert sim.answer(out, "cli") == Refusal(3, "cannot migrate slot 5: no slot 5 (slots 0..1)")
    sim.ask("cli", Migrate(4, 1))
    out = sim.ask("cli", Migrate(5, 0))
    assert sim.answer(out, "cli").error == "cannot migrate slot 0: a membership change is already in progress"


def test_nodes_of_two_ranks_fill_a_crashed_node_from_one_spare_node_and_a_gpu_move_from_a_lone_slot() -> None:
    """Slurm ids aK.N.J (agent K, local index J). Node 1's crash (slots 2 and 3) is rebuilt on standby node 3, in
    local order, although node 2 offers a lone spare slot that was ready first. A migration of one GPU's rank
    takes a lone spare slot although a whole standby node was ready first, keeping that node whole."""
    sim = Sim(4)
    sim.start("a0.0.0", "a0.1.1", "a1.0.0", "a1.1.1")
    for spare in ("a2.5.1", "a3.1.1", "a3.0.0"):
        sim.register(spare, "spare")
    sim.handle(AgentLost(1, {"a1.0.0": Role(2), "a1.1.1": Role(3)}, "node 1 silent", sim.now.wall))
    assert sim.m.info.replaced == {2: "a3.0.0", 3: "a3.1.1"}
    failed = [(f["slot"], f["node"], f["local"]) for f in sim.events("torchpass.member_failed")]
    assert failed == [(2, "agent 1", 0), (3, "agent 1", 1)]  # the coordinator was given no node names here

    sim = Sim(4)
    sim.start("a0.0.0", "a0.1.1", "a1.0.0", "a1.1.1")
    for spare in ("a3.1.1", "a3.0.0", "a2.5.1"):
        sim.register(spare, "spare")
    sim.ask("cli", Migrate(90, 0))
    assert sim.m.info.handoff.target == "a2.5.1" and sim.m.info.replaced == {0: "a2.5.1"}


def test_a_racks_loss_is_rebuilt_on_spares_of_another_rack() -> None:
    """Agents 1 and 2 (rack1) are lost at once; the spares ready first are rack1's agent 3 and rack0's agent 4, then
    rack2's agent 5. A domain that lost a node is suspect, so the two slots go to the spares outside it; with too
    few spares outside, every spare counts, as without domains."""
    sim = Sim(3)
    sim.m.domains = {0: "rack0", 1: "rack1", 2: "rack1", 3: "rack1", 4: "rack0", 5: "rack2"}
    sim.start("a0.0", "a1.0", "a2.0")
    for spare in ("a3.0", "a4.0", "a5.0"):
        sim.register(spare, "spare")
    sim.handle(AgentLost(1, {}, "rack1 silent", sim.now.wall))
    assert sim.m.info.replaced == {1: "a4.0"}  # a lone slot: best fit would have taken rack1's a3.0, ready first
    sim.join()
    sim.handle(AgentLost(2, {}, "rack1 silent", sim.now.wall))
    assert sim.m.info.replaced == {2: "a5.0"}

    sim = Sim(3)
    sim.m.domains = {0: "rack0", 1: "rack1", 2: "rack1", 3: "rack1", 4: "rack0"}
    sim.start("a0.0", "a1.0", "a2.0")
    for spare in ("a3.0", "a4.0"):
        sim.register(spare, "spare")
    sim.m.lose_agents({1, 2}, {}, "rack1 silent", sim.now.wall)
    assert sim.m.info.replaced == {1: "a3.0", 2: "a4.0"}  # one spare outside rack1 for two slots: all count


def test_a_whole_nodes_move_lands_on_one_spare_node() -> None:
    """`clockwork migrate --ranks-on NODE`: one request per rank, the first saying 2 ranks are to move (a node
    with room for both, not the lone slot ready first), the second naming where the first went (it follows)."""
    sim = Sim(4)
    sim.start("a0.0.0", "a0.1.1", "a1.0.0", "a1.1.1")
    for spare in ("a2.5.1", "a3.1.1", "a3.0.0"):
        sim.register(spare, "spare")
    out = sim.ask("cli", Migrate(91, 2, group=2))
    assert sim.answer(out, "cli").target == "a3.0.0"  # the lower local index of the node with room for both
    sim.ask("a1.0.0", Departed(92, "a1.0.0", handoff_ok=True))
    sim.handle(WorkerExited("a1.0.0", Role(2), 0, sim.now.wall))  # the first has left, its successor not joined
    out = sim.ask("cli", Migrate(99, 3, group=1, near="a3.0.0"))  # too soon: it would supersede that generation
    assert sim.answer(out, "cli") == Refusal(
        99, "cannot migrate slot 3: a membership change is already in progress", retry=True
    )
    sim.join(step=3)
    assert [e["slots"] for e in sim.events("torchpass.migrated")] == [[2]]
    out = sim.ask("cli", Migrate(93, 3, group=1, near="a3.0.0"))
    assert sim.answer(out, "cli").target == "a3.1.1"  # with it, past the lone slot a best fit would take
    assert sim.m.members == {0: "a0.0.0", 1: "a0.1.1", 2: "a3.0.0", 3: "a3.1.1"}


def test_the_completion_event_measures_each_phase() -> None:
    sim = Sim(2)
    sim.start("w0", "w1")
    sim.register("w2", "spare")
    sim.advance(1.0)
    sim.handle(WorkerExited("w1", Role(1), -9, sim.now.wall - 0.2))  # seen 0.2 s after it happened
    declared = sim.now.wall
    sim.advance(0.5)
    info = sim.m.info
    sim.ask("w0", Joined(80, "w0", info.gen, slot=0, resume_step=7, first_error_at=declared - 0.3))
    sim.ask(
        "w2",
        Joined(
            81,
            "w2",
            info.gen,
            slot=1,
            resume_step=7,
            source=0,
            received=True,
            arrived_at=declared + 0.1,
            transfer_bytes=123,
            rebuild_ms=4.0,
            transfer_ms=2.0,
        ),
    )
    (recovered,) = sim.events("torchpass.recovered")
    assert recovered["slots"] == [1] and recovered["source_slots"] == [0] and recovered["received_by"] == [1]
    assert (recovered["step"], recovered["transfer_bytes"], recovered["rebuild_ms"]) == (7, 123, 4.0)
    assert recovered["detect_ms"] == pytest.approx(300.0) and recovered["decide_ms"] == pytest.approx(0.0)
    assert recovered["spare_ready_ms"] == pytest.approx(100.0) and recovered["total_ms"] == pytest.approx(800.0)


def test_the_part_each_replaced_slot_received_is_kept_and_replicated() -> None:
    """What the job's AdminComment names beside each moved slot (the agent's ``torchpass.placement``): the part of
    the state its rank received, where the layout names parts; DDP's whole state is not worth a name."""
    sim = Sim(4)
    sim.start("w0", "w1", "w2", "w3")
    sim.register("w4", "spare")
    sim.register("w5", "spare")
    sim.handle(WorkerExited("w0", Role(0), -9, sim.now.wall))
    sim.handle(WorkerExited("w3", Role(3), -9, sim.now.wall))
    info = sim.m.info
    stage = PartMove(0, "stage 0 of the 2x2 pipeline", 2, 0, 5376, 8.4)
    whole = PartMove(0, WHOLE_STATE, 1, 3, 4096, 3.0)
    for wid in info.members.values():
        slot = info.slot_of(wid) or 0
        moves = {0: (stage,), 3: (whole,)}.get(slot, ())
        sim.ask(wid, Joined(next(sim.ids), wid, info.gen, slot=slot, resume_step=5, moves=moves))
    assert sim.events("torchpass.recovered") and sim.m.parts == {0: "stage 0 of the 2x2 pipeline"}
    copy = Sim(4, active=False)
    copy.m.adopt(sim.m.export())
    assert copy.m.parts == sim.m.parts


# ----- leadership ----------------------------------------------------------------------------------


def test_a_passive_replica_redirects_the_command_line_and_holds_rank_messages() -> None:
    sim = Sim(2, active=False)
    sim.core.leader_hint = "tcp://10.0.0.1:5001"
    out = sim.ask("cli", Status(1))
    assert sim.answer(out, "cli") == Refusal(
        1, "not the leader: the leader is tcp://10.0.0.1:5001", leader="tcp://10.0.0.1:5001"
    )
    out = sim.register("a0.0", "slot:0")
    assert [d for d in out if isinstance(d, Send)] == []
    assert sim.core.unanswered() == [("a0.0", "hello"), ("a0.0", "register")]
    assert sim.handle(AgentLost(1, {}, "silent", sim.now.wall)) == [] and sim.m.dead_agents == {1}
    assert sim.handle(Tick()) == [] and sim.handle(CheckHeartbeats()) == []


def test_loss_of_the_leader_a_follower_takes_over_from_its_snapshot() -> None:
    """The leader (agent 0) ran slot 0; the follower (agent 1) takes over with the leader's last replicated
    state: agent 0's processes are dead, a spare takes slot 0, and the generation skips one number (the lost
    leader may have announced one it had no time to replicate). Held rank messages are then answered."""
    leader = Sim(2)
    leader.start("a0.0", "a1.0")
    leader.register("a2.0", "spare")
    snapshot = leader.core.membership.export()

    follower = Sim(2, active=False)
    follower.register("a1.0", "slot:1")  # held: the proxy replays it to the new leader
    out = follower.handle(TakeOver(snapshot, frozenset({0}), {"a0.0": Role(0)}, "leader silent", follower.now.wall))
    m = follower.m
    assert follower.core.active and m.state == JobState.RUNNING
    assert m.info.gen == 2 and m.info.members == {0: "a2.0", 1: "a1.0"} and m.info.replaced == {0: "a2.0"}
    assert "leader silent" in m.info.reason and m.info.expect_state
    replayed = [d.message for d in out if isinstance(d, Send) and d.to == b"a1.0.r"]
    assert [type(r) for r in replayed] == [Registered]  # the held register, answered now
    assert follower.core.unanswered() == []


def test_takeover_while_forming_starts_without_the_lost_agents_processes() -> None:
    follower = Sim(2, active=False)
    follower.register("a0.0", "slot:0")
    follower.register("a1.0", "slot:1")
    follower.register("a2.0", "spare")
    follower.handle(TakeOver(None, frozenset({1}), {"a1.0": Role(1)}, "leader silent", follower.now.wall))
    assert follower.m.info.gen == 1 and follower.m.info.members == {0: "a0.0", 1: "a2.0"}


def test_a_leader_that_steps_down_holds_from_then_on() -> None:
    sim = Sim(2)
    sim.start("a0.0", "a1.0")
    sim.handle(StepDown("tcp://10.0.0.2:5001"))
    assert not sim.core.active and sim.core.leader_hint == "tcp://10.0.0.2:5001"
    sim.ask("a0.0", Broken(5, "a0.0", 0))
    assert sim.core.unanswered() == [("a0.0", "broken")]


def test_the_replicated_state_round_trips() -> None:
    sim = Sim(2)
    sim.start("w0", "w1")
    sim.register("w2", "spare")
    sim.handle(WorkerExpected("w3", Role()))
    copy = Sim(2, active=False)
    copy.m.adopt(sim.m.export())
    assert copy.m.export() == sim.m.export()


# ----- snapshots -----------------------------------------------------------------------------------


def _paced(world: int = 2, **cfg: Any) -> Sim:
    """A started job whose members ran from step 10 to 11 in 0.2 s (5 steps/s) as heartbeats said."""
    sim = Sim(world, heartbeat_interval_s=0.2, **cfg)
    sim.start(*[f"w{i}" for i in range(world)])
    for step in (10, 11):
        for i in range(world):
            sim.run(("beat", f"w{i}", step))
        sim.advance(0.2)
    return sim


def test_a_snapshot_before_the_pace_is_known_is_refused() -> None:
    sim = Sim(2)
    sim.start("w0", "w1")
    out = sim.ask("cli", SnapshotAsk(1, requester="cli"))
    assert "its pace is not known" in sim.answer(out, "cli").error


def test_a_snapshot_is_planned_ahead_of_the_fastest_member_and_shared() -> None:
    sim = _paced()
    out = sim.ask("cli", SnapshotAsk(1, requester="cli"))
    # newest step 11 + int(5 steps/s * (2 * 0.2 s + 0.5 s)) + 2
    assert sim.answer(out, "cli") == SnapshotPlanned(1, 11 + 4 + 2)
    assert SnapshotPush((17,)) in sim.pushed("w0") and SnapshotPush((17,)) in sim.pushed("w1")
    out = sim.ask("w1", SnapshotAsk(2, wid="w1"))
    assert sim.answer(out, "w1") == SnapshotPlanned(2, 17)  # not reached yet: it serves both
    assert [(e["reason"], e.get("shared")) for e in sim.events("torchpass.snapshot_requested")] == [
        ("requested by cli", None),
        ("requested by w1", True),
    ]
    ack = sim.handle(HeartbeatIn(b"w0.n", Heartbeat("w0", 12)))
    assert ack == [Send(b"w0.n", HeartbeatAck(0, JobState.RUNNING, (17,)))]


def test_a_skipped_snapshot_asked_for_is_planned_again_up_to_the_limit() -> None:
    sim = _paced()
    step = sim.answer(sim.ask("cli", SnapshotAsk(1)), "cli").step
    for attempt in range(1, SNAPSHOT_ATTEMPTS + 1):
        for wid in ("w0", "w1"):  # both skip it: one incomplete snapshot, planned again once
            sim.handle(HeartbeatIn(f"{wid}.n".encode(), Heartbeat(wid, step + 1, skipped=(step,))))
        incomplete = sim.events("torchpass.snapshot_incomplete")
        assert len(incomplete) == attempt and incomplete[-1]["asked_again"] == (attempt < SNAPSHOT_ATTEMPTS)
        step = sim.events("torchpass.snapshot_requested")[-1]["step"]
    assert len(sim.events("torchpass.snapshot_requested")) == SNAPSHOT_ATTEMPTS


def test_the_periodic_snapshot_is_planned_when_due_and_not_again_when_skipped() -> None:
    sim = _paced(snapshot_interval_s=5.0)
    sim.run(("wait", 5.0))
    (periodic,) = sim.events("torchpass.snapshot_requested")
    assert periodic["reason"] == "periodic"
    sim.handle(HeartbeatIn(b"w0.n", Heartbeat("w0", periodic["step"] + 1, skipped=(periodic["step"],))))
    assert sim.events("torchpass.snapshot_incomplete") == [
        {"step": periodic["step"], "skipped_by": "w0", "asked_again": False}
    ]
    sim.run(("wait", 1.0))
    assert len(sim.events("torchpass.snapshot_requested")) == 1  # the next one waits for the next period


def test_a_rank_waiting_in_a_collective_its_peer_went_past_fails_the_job() -> None:
    sim = Sim(2, heartbeat_interval_s=0.1)
    sim.start("w0", "w1")
    sim.run(("beat", "w0", 13))
    sim.advance(2.0)
    sim.handle(HeartbeatIn(b"w1.n", Heartbeat("w1", 12, collective=(12, 1, "dist.all_reduce"))))
    assert sim.m.state == JobState.FAILED
    assert "slot 1 waits in dist.all_reduce (the script's collective #1 of step 12)" in sim.m.failure_reason


def test_status_answers_anyone() -> None:
    sim = Sim(1)
    sim.start("w0")
    out = sim.ask("cli", Status(3))
    status = sim.answer(out, "cli")
    assert isinstance(status, StatusAnswer) and status.status["state"] == "running"
    assert status.status["members"] == {"0": "w0"} and status.status["workers"]["w0"]["role"] == "slot:0"
