"""The job's membership by generation, and every transition on it: the heart of the coordinator, pure.

It keeps, per generation, the map slot -> process, and makes a new generation whenever that map must change:

* a member dies (the launcher saw its process exit, its heartbeats stopped, or its node's agent was lost): its
  slot gets the first ready spare, the generation number goes up, and every member is told at once;
* a rank reports a broken collective and no death explains it within ``broken_grace_s``: the same members
  rebuild their process group in a new generation (``max_resets`` times at the same step at most);
* a planned migration: the spare takes the slot and the departing rank hands it its live state before leaving.

Each generation's rendezvous lives in the store server of one live member, preferably a survivor, so no single
process is the job's rendezvous for its whole life.

How a generation reaches a rank, and why twice: it is pushed to the rank's control socket as a number
(:class:`clockwork.contracts.coordinator_replies.GenerationPush`) and answered in full to the rank's long poll
(:class:`clockwork.contracts.coordinator_replies.GenerationAnswer`). The push is a notification to every member, busy or
not: a rank inside a collective (its main thread blocked, possibly on a silently dead peer) has no poll open,
and its control thread turns the number into an abort of the doomed collective at once. The answer is the
content, delivered to whoever asks for it when it asks: a push can be lost (sent without blocking to a control
socket that is not connected yet, e.g. a spare whose first heartbeat is still under way, or that is
reconnecting through a proxy after a leader change), while a long poll is what the node agent's proxy replays
to a new leader. Neither can stand in for the other; heartbeat answers repeat the number as a backstop.

No sockets, threads or clocks here: the time of each event is :attr:`Outbox.now`, and every reply, push,
story event and callback is a decision put in the :class:`~torchpass.coordinator.records.Outbox`.
This module imports no torch.
"""

from __future__ import annotations

import logging
from typing import Any

from clockwork.contracts.coordinator_replies import (
    Ack,
    GenerationAnswer,
    GenerationPush,
    MigrationAccepted,
    Push,
    Refusal,
    Registered,
    StopAnswer,
    StopPush,
)
from clockwork.contracts.coordinator_requests import AwaitGeneration, Broken, Finished, Joined, Migrate, Register
from clockwork.contracts.coordinator_wire import FailureKind, GenerationInfo, Handoff, JobState, Role
from torchpass.config import TorchPassConfig
from torchpass.coordinator.lockstep import MemberProgress, find_mismatch
from torchpass.coordinator.placement import choose_move_target, choose_spares
from torchpass.coordinator.records import (
    Evict,
    JobEnded,
    Outbox,
    ParkedPoll,
    RecoveryClock,
    SpareNeeded,
    SpareTaken,
    WaitKind,
    WorkerRecord,
    completion_fields,
    parts_received,
    place_of,
)
from torchpass.failure_domains import spares_outside

__all__ = ["Membership"]

log = logging.getLogger("clockwork.torchpass.coordinator")


class Membership:
    """Who holds which slot in which generation, who is spare, and how the job ends (see the module docstring)."""

    def __init__(self, world_size: int, config: TorchPassConfig, outbox: Outbox) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self.config = config
        self.out = outbox
        self.state = JobState.FORMING
        self.failure_reason = ""
        self.failure_kind = FailureKind.SCRIPT  # meaningful once the job failed
        self.gen = -1
        self.info: GenerationInfo | None = None
        self.members: dict[int, str] = {}  # slot -> wid of the current (or forming) membership
        self.vacant: set[int] = set()
        self.spares: list[str] = []
        self.failures = 0
        self.workers: dict[str, WorkerRecord] = {}
        self.dead_agents: set[int] = set()
        self.node_names: dict[int, str] = {}  # Slurm mode: agent -> its node, to name where a rank failed
        self.domains: dict[int, str] = {}  # Slurm mode: agent -> its node's failure domain (torchpass.failure_domains)
        self.initial: dict[int, str] = {}  # slot -> wid of the first generation's members, as they register
        self.parts: dict[int, str] = {}  # slot -> the part its newest rank received, when named (a stage, a shard)
        self.parked: dict[str, ParkedPoll] = {}
        self.joined: dict[str, Joined] = {}
        self.finished: dict[str, int] = {}
        self.finished_at: dict[str, float] = {}  # monotonic
        self.progressed = False  # a generation completed: some member must hold committed state
        self.recovery: RecoveryClock | None = None
        self.grace: tuple[int, float] | None = None  # (generation, monotonic deadline) of a broken report
        self.vacant_since: float | None = None
        self.pending_handoff: Handoff | None = None
        self.planned = False  # the current generation only moves a migrated slot (GenerationPush.planned)
        self.resets = 0  # consecutive rebuilds with no member lost at the same step (reset_step)
        self.reset_step = -1
        self.last_error = ""  # the latest broken-collective report's error
        self.departing: str | None = None
        self.departed = False  # the departing rank reported its handoff (successful or not)
        self.gen_floor = 0  # the next generation number is at least this (raised by a takeover)
        self.hold_declare = False  # batch several deaths into one generation

    # ----- queries ---------------------------------------------------------------------------

    def worker(self, wid: str, role: Role) -> WorkerRecord:
        """The record of ``wid``, made now when it is new."""
        rec = self.workers.get(wid)
        if rec is None:
            rec = self.workers[wid] = WorkerRecord(wid=wid, role=role, last_seen=self.out.now.mono)
        return rec

    def entitled(self, wid: str) -> bool:
        """Whether ``wid`` takes part in the current generation (a member, or the departing handoff source)."""
        info = self.info
        if info is None:
            return False
        return wid in info.members.values() or (info.handoff is not None and info.handoff.source == wid)

    def recovering(self) -> bool:
        """Whether the newest generation is still forming (until every member joined it): a move declared before
        then would supersede a generation that never completes, and its story (``torchpass.migrated``) with it."""
        return self.recovery is not None

    def placement(self, rec: WorkerRecord) -> dict[str, Any]:
        """Where a Slurm-mode process runs, for the job's events (:func:`place_of`)."""
        return place_of(rec, self.node_names)

    def push(self, wid: str, message: Push) -> None:
        """Send ``message`` to ``wid``'s control socket, when it is alive and its socket is known."""
        rec = self.workers.get(wid)
        if rec is not None and rec.alive and rec.notify is not None:
            self.out.send(rec.notify, message)

    def stop_answer(self, req_id: int) -> StopAnswer:
        """What a request gets once the job ended."""
        return StopAnswer(req_id, self.state == JobState.DONE, self.failure_reason)

    # ----- requests --------------------------------------------------------------------------

    def register(self, sender: bytes, req: Register) -> None:
        rec = self.worker(req.wid, req.role)
        if not rec.alive:
            self.out.send(sender, StopAnswer(req.id, False, "evicted"))
            return
        rec.pid, rec.host, rec.store_port = req.pid, req.host, req.store_port
        rec.registered, rec.role = True, req.role
        if req.agent is not None:
            rec.agent = req.agent
        log.info("registered %s (%s, pid %d, store %s:%d)", req.wid, req.role, rec.pid, rec.host, rec.store_port)
        if self.state.ended:
            self.out.send(sender, self.stop_answer(req.id))
            return
        self.out.send(sender, Registered(req.id, self.world_size))
        if req.role.is_spare:
            if req.wid in self.spares or req.wid in self.members.values():
                return  # registered again (through a proxy, after a leader change): nothing new
            self.spares.append(req.wid)
            if self.vacant and self.state == JobState.RUNNING:
                self.try_declare()
        elif self.state == JobState.FORMING and req.role.slot is not None:
            self.initial[req.role.slot] = req.wid
            self.maybe_start()

    def await_generation(self, sender: bytes, req: AwaitGeneration) -> None:
        if self.state.ended:
            self.out.send(sender, self.stop_answer(req.id))
            return
        if self.entitled(req.wid) and self.info is not None and self.info.gen > req.after:
            self.out.send(sender, GenerationAnswer(req.id, self.info))
            return
        if req.wid == self.departing and not self.entitled(req.wid) and req.after >= 0:
            # Its slot went to a spare and the generation carrying the handoff is gone (a new leader took over
            # meanwhile): the spare got the state from a replica; this rank has nothing left to do.
            self.out.send(sender, StopAnswer(req.id, True, "migrated away"))
            return
        self.parked[req.wid] = ParkedPoll(sender, req.id, WaitKind.AWAIT, req.after)

    def broken(self, sender: bytes, req: Broken) -> None:
        self.out.send(sender, Ack(req.id))
        if req.gen != self.gen or self.state != JobState.RUNNING or self.vacant:
            return
        self.last_error = req.error[:300]
        if self.recovery is None:
            self.recovery = RecoveryClock(evidence_at=req.at if req.at is not None else self.out.now.wall)
        if self.grace is None:
            self.grace = (req.gen, self.out.now.mono + self.config.broken_grace_s)
            self.out.emit(
                "torchpass.collective_error",
                generation=req.gen,
                reporter=req.wid,
                slot=req.slot,
                step=req.step,
                error=req.error[:300],
            )

    def joined_generation(self, sender: bytes, req: Joined) -> None:
        self.out.send(sender, Ack(req.id))
        if req.gen != self.gen or self.info is None:
            return
        self.joined[req.wid] = req
        if set(self.joined) >= set(self.info.members.values()):
            self.generation_complete()

    def finished_training(self, sender: bytes, req: Finished) -> None:
        if self.state.ended:
            self.out.send(sender, self.stop_answer(req.id))
            return
        if self.info is not None and req.gen < self.gen and self.entitled(req.wid):
            self.out.send(sender, GenerationAnswer(req.id, self.info))
            return
        self.finished[req.wid] = req.committed
        self.finished_at[req.wid] = self.out.now.mono
        self.parked[req.wid] = ParkedPoll(sender, req.id, WaitKind.FINISHED)
        if self.info is not None and not self.vacant and set(self.finished) >= set(self.info.members.values()):
            self.finish()

    def migrate(self, sender: bytes, req: Migrate) -> None:
        slot = req.slot
        problem, retry = "", True
        if self.state != JobState.RUNNING or self.info is None or not self.progressed:
            problem = f"the job is not running a generation yet (state {self.state})"
        elif self.vacant or self.pending_handoff is not None or self.departing is not None or self.recovering():
            problem = "a membership change is already in progress"
        elif slot not in self.members:
            problem, retry = f"no slot {slot} (slots 0..{self.world_size - 1})", False
        elif not self.spares:
            problem = "no spare is ready"
        if problem:
            error = f"cannot migrate slot {slot}: {problem}"
            self.out.send(sender, Refusal(req.id, error, retry=retry and not self.state.ended))
            return
        source = self.members.pop(slot)
        src = self.workers[source]
        self.departing, self.departed = source, False
        target = choose_move_target(self.spares, req.group, req.near)  # one GPU's move: one spare slot, best fit
        self.pending_handoff = Handoff(slot, source, target, src.host, src.store_port)
        self.vacant.add(slot)
        requester = req.wid or req.requester or "cli"
        self.recovery = RecoveryClock(evidence_at=self.out.now.wall, death_seen_at=self.out.now.wall)
        self.recovery.reasons.append(f"migration of slot {slot} ({source}) requested by {requester}")
        self.out.emit("torchpass.migration_requested", slot=slot, source=source, by=requester)
        generation = max(self.gen + 1, self.gen_floor)
        self.try_declare()  # before the answer: whoever reads the job after it sees the migration decided
        self.out.send(sender, MigrationAccepted(req.id, generation, target))

    def departed_rank(self, wid: str) -> None:
        """The departing rank reported its handoff (it leaves cleanly now: not a failure)."""
        if wid == self.departing:
            self.departed = True

    # ----- transitions -----------------------------------------------------------------------

    def maybe_start(self) -> None:
        """Start training once every slot has registered its first member (or is vacant)."""
        if self.state != JobState.FORMING:
            return
        if all(slot in self.initial or slot in self.vacant for slot in range(self.world_size)):
            self.state = JobState.RUNNING
            self.members = {s: w for s, w in self.initial.items() if self.workers[w].alive}
            self.vacant |= set(range(self.world_size)) - set(self.members)
            self.recovery = RecoveryClock(evidence_at=self.out.now.wall, reasons=["start"])
            self.try_declare()

    def on_death(self, wid: str, why: str, at: float) -> None:
        """Process ``wid`` is dead (``at``: when it was first known, wall clock)."""
        rec = self.workers[wid]
        rec.alive = False
        self.parked.pop(wid, None)
        if self.state.ended:
            return  # processes leaving a finished job
        if wid in self.spares:
            self.spares.remove(wid)
            self.out.emit("torchpass.spare_lost", worker=wid, why=why)
            return
        if wid == self.departing:
            self.departing = None
            log.info("departing %s is gone (%s)", wid, why)
            info = self.info
            if not self.departed and info is not None and info.handoff is not None and info.handoff.source == wid:
                # It died before handing its state over: the spare must not wait for it. A new generation
                # without a handoff makes the spare take the state from a replica instead.
                self.recovery = self.recovery or RecoveryClock(evidence_at=at)
                self.recovery.reasons.append(f"departing {wid} {why} before its handoff")
                self.try_declare()
            return
        if self.state == JobState.FORMING:
            if rec.role.slot is not None:
                self.initial.pop(rec.role.slot, None)
                self.vacant.add(rec.role.slot)
                self.failures += 1
                self.out.emit("torchpass.member_failed", slot=rec.role.slot, worker=wid, why=why, generation=-1)
                self.maybe_start()
            return
        held = [s for s, w in self.members.items() if w == wid]
        if not held:
            return
        slot = held[0]
        del self.members[slot]
        self.vacant.add(slot)
        self.failures += 1
        if self.recovery is None:
            self.recovery = RecoveryClock(evidence_at=at)
        self.recovery.death_seen_at = self.recovery.death_seen_at or self.out.now.wall
        self.recovery.reasons.append(f"slot {slot} ({wid}) {why}")
        self.grace = None
        self.out.emit(
            "torchpass.member_failed",
            slot=slot,
            worker=wid,
            why=why,
            generation=self.gen,
            last_step=rec.step,
            failures=self.failures,
            **self.placement(rec),
        )
        if self.failures > self.config.max_failures:
            self.fail(
                f"{self.failures} member failures exceed max_failures={self.config.max_failures} "
                f"(the last: slot {slot} ({wid}) {why}, at step {rec.step})",
                FailureKind.LIMIT,
            )
            return
        if not self.members:
            self.fail("every member is gone: no replica holds the training state", FailureKind.STATE_LOST)
            return
        self.try_declare()

    def lose_agents(self, agents: set[int], hints: dict[str, Role], why: str, at: float, force: bool = False) -> None:
        """Every process of ``agents`` is dead; one new generation covers them all (``force``: even when none
        of them was a member, so that nothing depends on what a lost leader was in the middle of)."""
        self.dead_agents |= agents
        for wid, role in hints.items():
            self.worker(wid, role)
        gen = self.gen
        self.hold_declare = True
        try:
            for rec in list(self.workers.values()):
                if rec.alive and rec.agent in agents:
                    self.on_death(rec.wid, why, at)
        finally:
            self.hold_declare = False
        if self.state != JobState.RUNNING:
            return
        if self.vacant or (force and self.gen == gen):
            if self.recovery is None:
                self.recovery = RecoveryClock(evidence_at=at, death_seen_at=self.out.now.wall)
            if not self.recovery.reasons:
                self.recovery.reasons.append(why)
            self.try_declare()

    def try_declare(self) -> None:
        """Fill vacant slots with spares and announce a new generation (or wait for spares)."""
        if self.state != JobState.RUNNING or self.hold_declare:
            return
        if len(self.spares) < len(self.vacant):
            if self.vacant_since is None:
                self.vacant_since = self.out.now.mono
                self.out.decide(SpareNeeded())
                self.out.emit(
                    "torchpass.waiting_for_spare",
                    vacant=sorted(self.vacant),
                    spares=len(self.spares),
                    generation=self.gen,
                )
            return
        handoff = self.pending_handoff
        fixed = {handoff.slot: handoff.target} if handoff is not None and handoff.slot in self.vacant else {}
        pool = spares_outside(self.spares, len(self.vacant), self.domains, self.dead_agents)  # domains: not a lost one
        replaced = choose_spares(sorted(self.vacant), pool, fixed)  # a node's ranks stay together
        for slot, wid in sorted(replaced.items()):
            self.spares.remove(wid)
            self.members[slot] = wid
            self.out.decide(SpareTaken(wid))
        self.vacant.clear()
        self.vacant_since = None
        self.grace = None
        survivors = [s for s in sorted(self.members) if self.members[s] not in replaced.values()]
        host_slot = (survivors or sorted(self.members))[0]
        host = self.workers[self.members[host_slot]]
        recovery = self.recovery or RecoveryClock(evidence_at=self.out.now.wall)
        recovery.declared_at = self.out.now.wall
        recovery.replaced |= set(replaced)  # a generation that never completes still replaced its slots
        self.recovery = recovery
        self.gen = max(self.gen + 1, self.gen_floor)
        reason = "; ".join(recovery.reasons) or "collective error with no member lost: rebuild"
        recovery.reasons = []
        info = self.info = GenerationInfo(
            gen=self.gen,
            world_size=self.world_size,
            members=dict(self.members),
            store_host=host.host,
            store_port=host.store_port,
            reason=reason,
            expect_state=self.progressed,
            replaced=replaced,
            handoff=self.pending_handoff,
        )
        # Planned: only the migrated slot changes hands, every member of the last generation is alive, so the
        # ranks finish their step before they follow (GenerationPush.planned).
        self.planned = info.handoff is not None and set(replaced) == {info.handoff.slot}
        self.pending_handoff = None
        self.joined, self.finished, self.finished_at = {}, {}, {}
        self.out.emit(
            "torchpass.generation",
            generation=self.gen,
            reason=reason,
            members={str(k): v for k, v in sorted(self.members.items())},
            replaced={str(k): v for k, v in replaced.items()},
            store=f"{host.host}:{host.store_port} (slot {host_slot})",
            handoff=None if info.handoff is None else info.handoff.source,
            **(
                {"placed": {str(k): self.placement(self.workers[v]) for k, v in replaced.items()}}
                if self.node_names
                else {}
            ),
        )
        notify = set(self.members.values())
        if info.handoff is not None:
            notify.add(info.handoff.source)
        for wid in notify:
            self.push(wid, GenerationPush(self.gen, self.planned))
        for wid, parked in list(self.parked.items()):
            if wid not in notify:
                continue
            if parked.kind == WaitKind.AWAIT and parked.after >= self.gen:
                continue
            del self.parked[wid]
            self.out.send(parked.sender, GenerationAnswer(parked.req_id, info))

    def generation_complete(self) -> None:
        """Every member of the current generation resumed: record how long the change took."""
        assert self.info is not None
        info, rec = self.info, self.recovery
        self.recovery = None
        fields = completion_fields(list(self.joined.values()), set(info.replaced.values()), rec, self.out.now)
        handoff_ok = fields.pop("handoff_ok")
        if info.handoff is not None:
            kind = "torchpass.migrated"
            fields["handoff_ok"] = handoff_ok
        elif not self.progressed:
            kind = "torchpass.started"
        else:
            kind = "torchpass.recovered"
        self.progressed = True
        self.parts.update(parts_received(fields.get("moves", [])))
        slots = sorted(info.replaced.keys() | (rec.replaced if rec is not None else set()))
        if self.node_names:  # Slurm mode: where each replaced slot's rank runs now (its node, local index)
            fields["placed"] = {str(k): self.placement(self.workers[v]) for k, v in info.replaced.items()}
        self.out.emit(kind, generation=info.gen, reason=info.reason, slots=slots, **fields)

    def rebuild_after_grace(self) -> None:
        """A broken collective that no death explained within ``broken_grace_s``: the same members rebuild,
        unless ``max_resets`` rebuilds at this step have not helped."""
        if self.grace is None or self.out.now.mono < self.grace[1]:
            return
        gen, _ = self.grace
        self.grace = None
        if gen != self.gen or self.state != JobState.RUNNING or self.vacant:
            return
        step = max((self.workers[w].step for w in self.members.values() if w in self.workers), default=-1)
        if step != self.reset_step:
            self.resets, self.reset_step = 0, step
        self.resets += 1
        if self.resets > self.config.max_resets:
            self.fail(
                f"after {self.resets - 1} rebuild(s) at step {step} with no member lost, a collective "
                f"failed again (the last error: {self.last_error or 'none reported'}): the "
                "same collective keeps failing there. Either it outlasts collective_timeout_s="
                f"{self.config.collective_timeout_s:g}, or the ranks' collectives do not line up (e.g. the "
                "script's own, gated on a counter of its own, which TorchPass does not restore)",
                FailureKind.LIMIT,
            )
            return
        if self.recovery is None:
            self.recovery = RecoveryClock(evidence_at=self.out.now.wall)
        self.recovery.reasons.append("collective error with no member lost: rebuild")
        self.try_declare()

    def check_spare_timeout(self) -> None:
        """Fail when a vacant slot waited for a spare longer than ``spare_timeout_s``."""
        if self.vacant_since is not None and self.out.now.mono - self.vacant_since > self.config.spare_timeout_s:
            self.fail(
                f"no spare for slot(s) {sorted(self.vacant)} within {self.config.spare_timeout_s:g} s",
                FailureKind.CAPACITY,
            )

    def check_heartbeats(self) -> None:
        """Count registered processes silent for ``heartbeat_timeout_s`` as dead (and evict them)."""
        if self.state.ended:
            return  # processes are exiting; their silence means nothing now
        now, limit = self.out.now, self.config.heartbeat_timeout_s
        for rec in list(self.workers.values()):
            if rec.alive and rec.registered and now.mono - rec.last_seen > limit:
                log.warning("%s silent for %.1f s: counting it as dead", rec.wid, now.mono - rec.last_seen)
                self.on_death(rec.wid, f"silent for {now.mono - rec.last_seen:.1f} s (no heartbeat)", now.wall)
                self.out.decide(Evict(rec.wid))

    def check_lockstep(self) -> None:
        """Fail the job at once when a member waits in a collective its peers went past
        (torchpass.coordinator.lockstep)."""
        if self.state != JobState.RUNNING or self.vacant or self.info is None:
            return
        members = [
            MemberProgress(slot, rec.step, rec.step_seen_at, rec.waiting, self.finished_at.get(wid))
            for slot, wid in sorted(self.members.items())
            if (rec := self.workers.get(wid)) is not None
        ]
        verdict = find_mismatch(members, max(1.0, 1.5 * self.config.heartbeat_interval_s))
        if verdict is not None:
            self.fail(verdict)

    def finish(self) -> None:
        """Every member finished the last step: the job is done."""
        self.state = JobState.DONE
        steps = sorted(set(self.finished.values()))
        self.out.emit("torchpass.finished", generation=self.gen, committed=steps, failures=self.failures)
        self.stop_all(done=True, reason="job finished")

    def fail(self, reason: str, kind: FailureKind = FailureKind.SCRIPT) -> None:
        """The job cannot go on: tell everyone why (``kind``: whether new nodes and a snapshot could help)."""
        if self.state.ended:
            return
        self.state = JobState.FAILED
        self.failure_reason, self.failure_kind = reason, kind
        self.out.emit("torchpass.failed", reason=reason, cause=kind.value, generation=self.gen, failures=self.failures)
        self.stop_all(done=False, reason=reason)

    def stop_all(self, *, done: bool, reason: str) -> None:
        for parked in self.parked.values():
            self.out.send(parked.sender, StopAnswer(parked.req_id, done, reason))
        self.parked.clear()
        for wid in self.workers:
            self.push(wid, StopPush(done, reason))
        self.out.decide(JobEnded(done))

    def next_deadline(self) -> float | None:
        """The earliest monotonic time a timer of this membership fires (None: no timer runs)."""
        deadlines = [self.grace[1]] if self.grace is not None else []
        if self.vacant_since is not None:
            deadlines.append(self.vacant_since + self.config.spare_timeout_s)
        return min(deadlines, default=None)

    # ----- replication ------------------------------------------------------------------------

    def export(self) -> dict[str, Any]:
        """Everything a successor needs to carry on (plain data for msgpack). Heartbeat times and steps are
        left out: they change all the time and mean nothing in another process."""
        return {
            "state": self.state.value,
            "failure_reason": self.failure_reason,
            "failure_kind": self.failure_kind.value,
            "gen": self.gen,
            "info": None if self.info is None else self.info.to_wire(),
            "members": {int(k): v for k, v in self.members.items()},
            "vacant": sorted(self.vacant),
            "spares": list(self.spares),
            "failures": self.failures,
            "progressed": self.progressed,
            "resets": self.resets,
            "initial": {int(k): v for k, v in self.initial.items()},
            "parts": dict(self.parts),
            "departing": self.departing,
            "departed": self.departed,
            "dead_agents": sorted(self.dead_agents),
            "workers": {w.wid: w.to_wire() for w in self.workers.values()},
        }

    def adopt(self, snap: dict[str, Any]) -> None:
        """Carry on from a predecessor's :meth:`export` (processes this replica already counts dead stay dead)."""
        self.state = JobState(str(snap["state"]))
        self.failure_reason = str(snap["failure_reason"])
        self.failure_kind = FailureKind(str(snap.get("failure_kind", FailureKind.SCRIPT.value)))
        self.gen = int(snap["gen"])
        self.info = None if snap["info"] is None else GenerationInfo.from_wire(snap["info"])
        self.members = {int(k): str(v) for k, v in snap["members"].items()}
        self.vacant = {int(v) for v in snap["vacant"]}
        self.spares = [str(v) for v in snap["spares"]]
        self.failures = int(snap["failures"])
        self.progressed = bool(snap["progressed"])
        self.resets = int(snap["resets"])
        self.initial = {int(k): str(v) for k, v in snap["initial"].items()}
        self.parts = {int(k): str(v) for k, v in (snap.get("parts") or {}).items()}  # absent: an older replica
        self.departing = snap["departing"]
        self.departed = bool(snap["departed"])
        self.dead_agents |= {int(a) for a in snap["dead_agents"]}
        for wid, w in snap["workers"].items():
            self.worker(wid, Role.parse(str(w["role"]))).load_wire(w, self.out.now.mono)
