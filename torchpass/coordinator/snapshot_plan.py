"""When the members snapshot: the coordinator's choice of a step every member can still reach, pure.

A snapshot is taken by every member after the same step (:mod:`torchpass.snapshot` writes it). The coordinator
picks that step ahead of the fastest member by what it may run before it hears of it, from the pace its
heartbeats show, and pushes it; heartbeat answers repeat the steps still planned until the slowest member has
passed them. A snapshot someone asked for that a member had to skip (still writing its previous one) is
planned again, up to :data:`SNAPSHOT_ATTEMPTS` times; a periodic one waits for the next period.

No clocks here: the time is :attr:`torchpass.coordinator.records.Outbox.now`. This module imports no torch.
"""

from __future__ import annotations

from clockwork.contracts.coordinator_replies import Refusal, SnapshotPlanned, SnapshotPush
from clockwork.contracts.coordinator_requests import SnapshotAsk
from clockwork.contracts.coordinator_wire import JobState
from torchpass.config import TorchPassConfig
from torchpass.coordinator.membership import Membership
from torchpass.coordinator.records import Outbox, WorkerRecord

__all__ = ["SNAPSHOT_ATTEMPTS", "SnapshotPlanner"]

#: How many times a snapshot someone asked for is planned when members skip it (still writing the last one).
SNAPSHOT_ATTEMPTS = 3


class SnapshotPlanner:
    """The snapshot steps planned for a job's members, and the pace they are planned from."""

    def __init__(self, membership: Membership, config: TorchPassConfig, outbox: Outbox) -> None:
        self.membership = membership
        self.config = config
        self.out = outbox
        # Steps every member is asked to snapshot after (pushed, and repeated in every heartbeat answer until
        # the slowest member passed them).
        self.steps: list[int] = []
        # Snapshot steps asked for by someone (not periodic) -> attempts so far (-1: a skip of it was handled).
        self.asked: dict[int, int] = {}
        interval = config.snapshot_interval_s
        self.due: float | None = outbox.now.mono + interval if interval > 0 else None  # the next periodic one

    def note_step(self, rec: WorkerRecord, step: int) -> None:
        """A heartbeat said ``rec`` is at ``step``: its pace is the steps between two heartbeats over the time."""
        now = self.out.now.mono
        if step > rec.step >= 0 and now > rec.step_seen_at:
            rec.rate = (step - rec.step) / (now - rec.step_seen_at)
        if step != rec.step:
            rec.step, rec.step_seen_at = step, now

    def pending(self) -> list[int]:
        """Planned snapshot steps that some member may still reach (older ones are dropped)."""
        if not self.steps:
            return []  # the common case, on every heartbeat: no walk over the members
        m = self.membership
        steps = [m.workers[w].step for w in m.members.values() if w in m.workers]
        slowest = min(steps) if steps else -1
        self.steps = [s for s in self.steps if s >= slowest]
        return list(self.steps)

    def plan(self, reason: str, *, asked: int = 0) -> int | None:
        """Choose the step every member snapshots after: ahead of the fastest member by what it may run
        before it hears of it (two heartbeat intervals at its observed pace, plus two steps), and push it.
        A snapshot already planned that no member can have reached serves instead (two snapshots a few steps
        apart would collide: a rank still writing the first one skips the second). None while no member's pace is
        known yet (fewer than two heartbeats with a step): a step planned then could already be behind the
        members, and a snapshot planned for a passed step never happens. ``asked``: how many times this
        snapshot was asked for, 0 for a periodic one (a skipped periodic snapshot waits for the next period)."""
        m = self.membership
        members = [m.workers[w] for w in m.members.values() if w in m.workers]
        newest = max((r.step for r in members), default=-1)
        rate = max((r.rate for r in members), default=0.0)
        if rate <= 0:
            return None
        # Where the fastest member may be by the time it hears of it (its last report is up to a heartbeat old).
        now, interval = self.out.now.mono, self.config.heartbeat_interval_s
        reach = max((r.step + r.rate * (now - r.step_seen_at + interval) for r in members), default=-1.0)
        ahead = [s for s in self.pending() if s > reach]
        if ahead:
            step, shared = ahead[0], {"shared": True}
        else:
            step, shared = max(0, newest) + int(rate * (2 * interval + 0.5)) + 2, {}
            self.steps.append(step)
            for wid in m.members.values():
                m.push(wid, SnapshotPush((step,)))
        if asked:
            self._note_asked(step, max(asked, self.asked.get(step, 0)))
        self.out.emit("torchpass.snapshot_requested", step=step, reason=reason, **shared)
        return step

    def _note_asked(self, step: int, attempt: int) -> None:
        """Record the attempt of the snapshot after ``step`` (-1: a skip of it was handled)."""
        self.asked[step] = attempt
        while len(self.asked) > 16:  # a skip is reported within a heartbeat: old entries are done
            del self.asked[min(self.asked)]

    def skipped(self, wid: str, step: int) -> None:
        """A member skipped the snapshot planned after ``step`` (still writing its previous one): the snapshot
        is incomplete. One that was asked for is planned again (once, whichever members skipped it)."""
        attempt = self.asked.get(step, 0)
        if attempt < 0:
            return  # another member's report of the same snapshot was handled
        self._note_asked(step, -1)
        again = 0 < attempt < SNAPSHOT_ATTEMPTS and self.membership.state == JobState.RUNNING
        self.out.emit("torchpass.snapshot_incomplete", step=step, skipped_by=wid, asked_again=again)
        if again:
            self.plan(f"asked again: {wid} skipped the one after step {step}", asked=attempt + 1)

    def ask(self, sender: bytes, req: SnapshotAsk) -> None:
        """Someone asked for a snapshot: plan it and answer with its step."""
        m = self.membership
        if m.state != JobState.RUNNING or not m.progressed:
            error = f"cannot snapshot now: the job is not training (state {m.state})"
            self.out.send(sender, Refusal(req.id, error))
            return
        requester = req.requester or req.wid or "cli"
        step = self.plan(f"requested by {requester}", asked=1)
        if step is None:
            error = (
                "cannot snapshot yet: the job has just started and its pace is not known; ask again in a few seconds"
            )
            self.out.send(sender, Refusal(req.id, error))
            return
        self.out.send(sender, SnapshotPlanned(req.id, step))

    def periodic(self) -> None:
        """Plan the periodic snapshot when it is due (soon again while the members' pace is not known)."""
        now = self.out.now.mono
        if self.due is None or now < self.due:
            return
        self.due = now + self.config.snapshot_interval_s
        m = self.membership
        if m.state == JobState.RUNNING and m.progressed and not m.vacant:
            if self.plan("periodic") is None:  # pace not known yet: try again soon
                self.due = now + self.config.heartbeat_interval_s
