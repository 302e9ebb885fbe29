"""Ranks that disagree on which steps run the script's own collectives: the coordinator's verdict.

A script that gates a collective on a counter of its own (``if step % 5 == 0: dist.all_reduce(loss)``) keeps
working as long as every rank's counter agrees. TorchPass restores the training state, not the script's local
variables: a replacement starts its counter again, and a survivor also counted the step it redid. Then one
rank waits in the script's collective while its peers have gone on without it, and plain DDP would hang until
the collective timeout, rebuild, and hang again.

The script's collectives run on a process group of their own (:mod:`torchpass.rank.backends`), so they never pair
with a gradient bucket; each rank reports in its heartbeats the one it is waiting in (step, ordinal within the
step, name). A peer that has moved on to a later step, or finished, while this rank still waits in a
collective of an earlier step can never meet it there: ranks run in lockstep, so a peer past step S has
completed every collective of S it was going to run. The verdict needs the waiting rank's report to be newer
than the peer's progress by ``margin_s`` (a collective that completes as the peer moves on clears the report
at once), and is computed here apart from any I/O, from what the coordinator's heartbeats recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

from clockwork.contracts.coordinator_requests import parse_collective

__all__ = ["CollectiveWait", "MemberProgress", "find_mismatch", "parse_wait"]


@dataclass(frozen=True)
class CollectiveWait:
    """A rank inside one of the script's collectives, as its latest heartbeat (received at ``reported_at``,
    coordinator's monotonic clock) said."""

    step: int
    ordinal: int  # 1 for the step's first collective of the script's, 2 for the second, ...
    name: str
    reported_at: float


@dataclass(frozen=True)
class MemberProgress:
    """What the coordinator knows of one member: its step and since when (monotonic), whether it finished."""

    slot: int
    step: int
    step_since: float
    waiting: CollectiveWait | None = None
    finished_at: float | None = None


def parse_wait(value: object, reported_at: float) -> CollectiveWait | None:
    """The ``uc`` field of a heartbeat ([step, ordinal, name], or nothing); anything else reads as nothing
    (:func:`clockwork.contracts.coordinator_requests.parse_collective`, which the coordinator's heartbeat parser
    uses)."""
    wait = parse_collective(value)
    return None if wait is None else CollectiveWait(*wait, reported_at)


def find_mismatch(members: list[MemberProgress], margin_s: float) -> str | None:
    """The diagnosis when a member waits in a collective that a peer has already gone past, else None."""
    for waiter in members:
        wait = waiter.waiting
        if wait is None:
            continue
        for peer in members:
            if peer.slot == waiter.slot:
                continue
            if peer.finished_at is not None and peer.finished_at + margin_s <= wait.reported_at:
                passed = "has finished"
            elif peer.step > wait.step and peer.step_since + margin_s <= wait.reported_at:
                passed = f"has gone on to step {peer.step}"
            else:
                continue
            return (
                f"the ranks disagree on which steps run the script's own collectives: slot {waiter.slot} waits in "
                f"{wait.name} (the script's collective #{wait.ordinal} of step {wait.step}) while slot {peer.slot} "
                f"{passed} without it. A counter the script keeps itself is not state TorchPass restores (a "
                "replacement starts it again; a survivor also counted the step it redid). Gate the collective on "
                "the step TorchPass gives: the step from ctx.steps(), or in transparent mode the index from "
                "enumerate(loader) (docs/user-guide.md, 'Collectives of your own')"
            )
    return None
