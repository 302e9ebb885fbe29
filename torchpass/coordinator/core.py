"""The coordinator's core: typed events in, typed decisions out, with no sockets, threads or clocks inside.

:meth:`CoordinatorCore.handle` takes one event (:mod:`torchpass.coordinator.records`: a request, a heartbeat,
a process exit, a lost node agent, a takeover, a timer) and the time it is handled at, and returns what must
be done, in order: messages to send, events of the job's story, spares to start, processes to evict, the
job's end. :mod:`torchpass.coordinator.service` is the socket shell around it; a table test drives it directly.

Its parts: :class:`torchpass.coordinator.membership.Membership` (who holds which slot, every transition of the job) and
:class:`torchpass.coordinator.snapshot_plan.SnapshotPlanner` (when the members snapshot). This module adds what sits
around them: the dispatch of requests and heartbeats, the timers, and leadership. Under Slurm a replica of
the coordinator runs in every node's agent and only the leader's is *active*; the others are *passive*: they
hold no decisions, answer the command line with a redirect to the leader, and keep whatever a rank sends them
until they lead. A replica that takes over (:class:`~torchpass.coordinator.records.TakeOver`) starts from its
predecessor's replicated state, declares the lost nodes' processes dead and starts a fresh generation,
numbered past anything its predecessor may have announced.

This module imports no torch.
"""

from __future__ import annotations

import logging
from typing import Any

from clockwork.contracts.coordinator_replies import Ack, HeartbeatAck, Refusal, StatusAnswer, StopAnswer, StopPush
from clockwork.contracts.coordinator_requests import (
    AwaitGeneration,
    Broken,
    Departed,
    Fatal,
    Finished,
    Heartbeat,
    Joined,
    Migrate,
    Register,
    Request,
    SnapshotAsk,
    Status,
)
from clockwork.contracts.coordinator_wire import UNKNOWN, FailureKind, JobState
from clockwork.contracts.versions import VERSION, skew_message
from torchpass.config import TorchPassConfig
from torchpass.coordinator.lockstep import CollectiveWait
from torchpass.coordinator.membership import Membership
from torchpass.coordinator.records import (
    AgentLost,
    CheckHeartbeats,
    Decision,
    Event,
    FailNow,
    HeartbeatIn,
    Now,
    Outbox,
    RecoveryClock,
    RequestIn,
    StepDown,
    TakeOver,
    Tick,
    WorkerExited,
    WorkerExpected,
)
from torchpass.coordinator.snapshot_plan import SnapshotPlanner

__all__ = ["CoordinatorCore"]

log = logging.getLogger("clockwork.torchpass.coordinator")

#: A passive replica keeps at most this many rank messages until it leads.
MAX_HELD = 100_000
# Requests a process not (or no longer) counted alive may still make: introducing itself, and the command
# line's (which comes from no worker at all).
_FROM_ANYONE = (Register, Migrate, Status, SnapshotAsk)


class CoordinatorCore:
    """Membership, snapshots and leadership of one job, driven by :meth:`handle` (see the module docstring)."""

    def __init__(self, world_size: int, config: TorchPassConfig, started: Now, *, active: bool = True) -> None:
        self.config = config
        self.out = Outbox(started)
        self.membership = Membership(world_size, config, self.out)
        self.snapshots = SnapshotPlanner(self.membership, config, self.out)
        self.active = active
        self.leader_hint = ""  # a passive replica points the command line here
        self.held: list[tuple[bytes, Request | Heartbeat]] = []

    # ----- the one entry point --------------------------------------------------------------

    def handle(self, event: Event, now: Now) -> list[Decision]:
        """Handle ``event`` at ``now``; the decisions it makes, in order."""
        self.out.begin(now)
        m = self.membership
        match event:
            case RequestIn(sender, request):
                self._receive(sender, request)
            case HeartbeatIn(sender, beat):
                self._receive(sender, beat)
            case WorkerExpected(wid, role):
                m.worker(wid, role)
            case WorkerExited(wid, role, code, at):
                if m.worker(wid, role).alive:
                    m.on_death(wid, f"exited with code {code}", at)
            case AgentLost(agent, hints, why, at):
                if self.active:
                    m.lose_agents({agent}, hints, why, at)
                else:
                    m.dead_agents.add(agent)
            case TakeOver():
                self._take_over(event)
            case StepDown(leader):
                if self.active:
                    log.warning("another replica leads (%s): this one turns passive", leader)
                self.active = False
                self.leader_hint = leader
            case FailNow(reason, kind):
                if self.active:
                    m.fail(reason, kind)
            case CheckHeartbeats():
                if self.active:
                    m.check_heartbeats()
            case Tick():
                if self.active:
                    self._timers()
        return self.out.take()

    def plan_snapshot(self, reason: str, now: Now, *, asked: int = 0) -> tuple[int | None, list[Decision]]:
        """Plan a snapshot step now (see :meth:`torchpass.coordinator.snapshot_plan.SnapshotPlanner.plan`); the step
        (None while the members' pace is unknown) and the decisions (its push to every member)."""
        self.out.begin(now)
        step = self.snapshots.plan(reason, asked=asked)
        return step, self.out.take()

    def next_deadline(self) -> float | None:
        """The earliest monotonic time a timer fires (None: none runs); a passive replica runs none."""
        return self.membership.next_deadline()

    # ----- views ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The coordinator's view: state, generation, members, spares, per-worker liveness and step."""
        m = self.membership
        return {
            "state": m.state.value,
            "generation": m.gen,
            "world_size": m.world_size,
            "members": {str(k): v for k, v in sorted(m.members.items())},
            "vacant": sorted(m.vacant),
            "spares": list(m.spares),
            "failures": m.failures,
            "failure_reason": m.failure_reason,
            "workers": {
                w.wid: {"role": str(w.role), "alive": w.alive, "pid": w.pid, "step": w.step} for w in m.workers.values()
            },
        }

    def unanswered(self) -> list[tuple[str, str]]:
        """(worker, op) of the requests received and not answered yet: long polls parked until their answer
        exists and, on a passive replica, every rank message held until it leads."""
        held = [(msg.wid, _op(msg)) for _, msg in list(self.held)]
        return held + [(wid, parked.kind.value) for wid, parked in list(self.membership.parked.items())]

    # ----- requests and heartbeats ----------------------------------------------------------

    def _receive(self, sender: bytes, msg: Request | Heartbeat) -> None:
        if not self.active:
            self._hold(sender, msg)
            return
        try:
            self._dispatch(sender, msg)
        except Exception:  # one bad request must not take the job's coordinator down
            log.exception("error handling %s from %r", _op(msg), sender)
            if not isinstance(msg, Heartbeat):
                self.out.send(sender, Refusal(msg.id, "internal coordinator error (see its log)"))

    def _refuse_version(self, sender: bytes, msg: Register) -> None:
        """A process of another TorchPass version (an older or newer image) wants in: refused, both versions
        named. Before the job started, one of its initial ranks being another version fails the whole job (it
        cannot start with that slot, and waiting would only hide why); a spare is turned away and the job goes on."""
        why = skew_message(
            "the job's coordinator",
            f"{msg.wid} (pid {msg.pid} on {msg.host})",
            msg.version,
            fix="every node of a job must run the same image (a guest or a re-pulled tag may differ)",
        )
        log.error("%s", why)
        self.out.send(sender, Refusal(msg.id, why))
        self.out.emit("torchpass.version_mismatch", worker=msg.wid, host=msg.host, theirs=msg.version, ours=VERSION)
        if self.membership.state == JobState.FORMING and not msg.role.is_spare:
            self.membership.fail(why)

    def _hold(self, sender: bytes, msg: Request | Heartbeat) -> None:
        """Passive replica: the command line is pointed at the leader; a rank's message waits until we lead
        (a proxy only sends here once it believes this replica leads, so it will shortly)."""
        if not msg.wid:
            hint = self.leader_hint or "unknown yet (an election is under way)"
            if not isinstance(msg, Heartbeat):
                self.out.send(sender, Refusal(msg.id, f"not the leader: the leader is {hint}", leader=hint))
            return
        if len(self.held) < MAX_HELD:
            self.held.append((sender, msg))

    def _dispatch(self, sender: bytes, msg: Request | Heartbeat) -> None:
        m, now = self.membership, self.out.now
        rec = m.workers.get(msg.wid)
        if rec is not None:
            rec.last_seen = now.mono
        if isinstance(msg, Heartbeat):
            self._heartbeat(sender, msg)
            return
        if not isinstance(msg, _FROM_ANYONE) and (rec is None or not rec.alive):
            self.out.send(sender, StopAnswer(msg.id, False, "evicted or unknown worker"))
            return
        match msg:
            case Register() if msg.version != VERSION:
                self._refuse_version(sender, msg)
            case Register():
                m.register(sender, msg)
            case AwaitGeneration():
                m.await_generation(sender, msg)
            case Broken():
                m.broken(sender, msg)
            case Joined():
                m.joined_generation(sender, msg)
            case Finished():
                m.finished_training(sender, msg)
            case Migrate():
                m.migrate(sender, msg)
            case Departed():
                self.out.send(sender, Ack(msg.id))
                m.departed_rank(msg.wid)
                self.out.emit(
                    "torchpass.departed",
                    worker=msg.wid,
                    generation=msg.gen,
                    handoff_ok=msg.handoff_ok,
                    handoff_ms=msg.handoff_ms,
                    handoff_bytes=msg.handoff_bytes,
                )
            case Fatal():
                self.out.send(sender, Ack(msg.id))
                if msg.kind == "replica_mismatch" and not m.state.ended:  # the first rank to say so (all may)
                    fields = {"worker": msg.wid, "step": msg.step, "tensor": msg.tensor, "reason": msg.message}
                    self.out.emit("torchpass.replica_mismatch", **fields)
                kind = FailureKind.STATE_LOST if msg.kind == FailureKind.STATE_LOST else FailureKind.SCRIPT
                m.fail(f"{msg.wid}: {msg.message}", kind)
            case Status():
                self.out.send(sender, StatusAnswer(msg.id, self.status()))
            case SnapshotAsk():
                self.snapshots.ask(sender, msg)

    def _heartbeat(self, sender: bytes, beat: Heartbeat) -> None:
        """A rank's control socket spoke: where pushes go, its step and pace, what it waits in, what it
        skipped; answered with the newest generation and the snapshots still planned (or its eviction)."""
        m, now = self.membership, self.out.now
        rec = m.workers.get(beat.wid)
        if rec is None:
            if not beat.wid:
                return
            rec = m.worker(beat.wid, UNKNOWN)  # its register may still be in flight
        rec.notify = sender
        self.snapshots.note_step(rec, rec.step if beat.step is None else beat.step)
        rec.waiting = None if beat.collective is None else CollectiveWait(*beat.collective, now.mono)
        if rec.waiting is not None:
            m.check_lockstep()
        for step in beat.skipped:
            self.snapshots.skipped(beat.wid, step)
        if not rec.alive:
            self.out.send(sender, StopPush(False, "evicted: the coordinator counts this process as dead"))
        else:
            self.out.send(sender, HeartbeatAck(m.gen, m.state, tuple(self.snapshots.pending()), m.planned))

    # ----- timers ----------------------------------------------------------------------------

    def _timers(self) -> None:
        m = self.membership
        m.check_lockstep()
        self.snapshots.periodic()
        m.rebuild_after_grace()
        m.check_spare_timeout()

    # ----- leadership -----------------------------------------------------------------------

    def _take_over(self, event: TakeOver) -> None:
        if self.active:
            return
        m, now = self.membership, self.out.now
        if event.snapshot is not None:
            m.adopt(event.snapshot)
        self.active = True
        # Skip one number: the lost leader may have announced a generation it had no time to replicate.
        m.gen_floor = m.gen + 2
        log.warning("taking over as the job's coordinator (generation %d, state %s): %s", m.gen, m.state, event.why)
        dead = set(event.dead_agents)
        if m.state == JobState.RUNNING:
            m.recovery = m.recovery or RecoveryClock(evidence_at=event.at, death_seen_at=now.wall)
            m.lose_agents(dead, event.hints, event.why, event.at, force=True)
        elif m.state == JobState.FORMING:
            m.lose_agents(dead, event.hints, event.why, event.at)
            m.maybe_start()
        else:
            m.dead_agents |= dead
        held, self.held = self.held, []
        for sender, msg in held:
            self._receive(sender, msg)


def _op(msg: Request | Heartbeat) -> str:
    """The op a message had on the wire."""
    if isinstance(msg, Heartbeat):
        return "hello" if msg.hello else "hb"
    return msg.OP
