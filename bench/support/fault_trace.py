"""The fault campaign's seeded fault trace and its figures, apart from any I/O (``bench/fault_campaign.py``).

The trace is computed once per run and replayed against every system, so they all face the same faults at the
same moments (seconds after each system's first training step). It is pure: the same seed, count and horizon give
the same trace, which the unit tests check (tests/unit/test_fault_campaign_trace.py). The figures (time to full
width, steps recomputed, YOCO) are computed here from the ranks' step logs, read by the caller, for the same reason:
one definition for every system, testable without a job.
"""

from __future__ import annotations

import enum
import itertools
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class FaultKind(enum.Enum):
    """What happens to the job. The value is the name printed and written in the JSON line."""

    NODE_CRASH = "node-crash"  # every process of the node SIGKILLed, its links dark (Sandbox.crash_node)
    RANK_KILL = "rank-kill"  # one rank process SIGKILLed
    NIC_DOWN = "nic-down"  # the node's rail-0 switch port down for a while (carrier lost), then up
    LINK_FLAP = "link-flap"  # the same port down and up several times in a row
    LOSS = "loss"  # 2 % of frames dropped on the node's rail-0 port, for a while
    GPU_WARNING = "gpu-warning"  # the node's (emulated) GPU runs hot: a planned migration
    NODE_STOP = "node-stop"  # every process of the node SIGSTOPped for 1 s, then SIGCONT
    BORROW = "borrow"  # a spare borrowed from a preemptible job (full runs; needs a borrow-mode job)


# Faults that take a rank's process away for good: a spare (or a restart) is needed.
LOSES_RANK = frozenset({FaultKind.NODE_CRASH, FaultKind.RANK_KILL})
# Faults that consume a standby node for good: the node does not come back into the job.
CONSUMES_NODE = frozenset({FaultKind.NODE_CRASH})

QUICK_KINDS = (
    FaultKind.NODE_CRASH,
    FaultKind.RANK_KILL,
    FaultKind.NIC_DOWN,
    FaultKind.LINK_FLAP,
    FaultKind.LOSS,
    FaultKind.GPU_WARNING,
    FaultKind.NODE_STOP,
)
FULL_KINDS = (*QUICK_KINDS, FaultKind.BORROW)


@dataclass(frozen=True)
class Fault:
    """One fault of the trace: when (seconds after the first training step), what, and on which rank slot's node
    (the slot's current holder is looked up when the fault fires: after a recovery it may be another node)."""

    at_s: float
    kind: FaultKind
    slot: int
    hold_s: float = 0.0  # how long a lasting fault stays before it is lifted (0: instantaneous)


HOLD_S: Mapping[FaultKind, float] = {
    FaultKind.NIC_DOWN: 2.0,
    FaultKind.LINK_FLAP: 2.4,  # 4 cycles of 0.3 s down, 0.3 s up
    FaultKind.LOSS: 5.0,
    FaultKind.GPU_WARNING: 3.0,
    FaultKind.NODE_STOP: 1.0,
}


def make_trace(
    seed: int,
    count: int,
    horizon_s: float,
    slots: int,
    kinds: Sequence[FaultKind] = QUICK_KINDS,
    caps: Mapping[FaultKind, int] | None = None,
) -> list[Fault]:
    """``count`` faults in ``horizon_s`` seconds, one in each of ``count`` equal windows at a random point of
    the window's middle 60 % (so two recoveries never overlap, and the first and last fault leave the job time to
    start and to finish). The kinds come in a seeded order that shows every kind once before any repeats, skipping
    a kind once its cap (``caps``: the most of that kind, e.g. node crashes <= standby nodes) is reached. The slot
    is drawn uniformly from ``0 .. slots - 1``."""
    if count < 1 or horizon_s <= 0 or slots < 1 or not kinds:
        raise ValueError(f"a trace needs count >= 1, horizon > 0, slots >= 1 and kinds: {count}, {horizon_s}, {slots}")
    caps = dict(caps or {})
    if sum(caps.get(k, count) for k in kinds) < count:
        raise ValueError(f"the caps {caps} allow fewer than {count} faults of kinds {[k.value for k in kinds]}")
    rng = random.Random(seed)
    order: list[FaultKind] = []
    used: dict[FaultKind, int] = {}
    while len(order) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        for kind in round_:
            if len(order) < count and used.get(kind, 0) < caps.get(kind, count):
                order.append(kind)
                used[kind] = used.get(kind, 0) + 1
    window = horizon_s / count
    return [
        Fault(
            at_s=round(i * window + window * (0.2 + 0.6 * rng.random()), 3),
            kind=kind,
            slot=rng.randrange(slots),
            hold_s=HOLD_S.get(kind, 0.0),
        )
        for i, kind in enumerate(order)
    ]


def poisson_trace(
    seed: int,
    duration_s: float,
    mean_gap_s: float,
    slots: int,
    kinds: Sequence[FaultKind] = QUICK_KINDS,
    caps: Mapping[FaultKind, int] | None = None,
    min_gap_s: float = 3.0,
) -> list[Fault]:
    """A soak's faults: arrivals of a Poisson process of mean gap ``mean_gap_s`` (each gap at least ``min_gap_s``,
    so one recovery is over before the next fault) until ``duration_s``; each fault's kind drawn uniformly from
    the kinds whose cap (``caps``) is not reached, its slot uniformly."""
    if duration_s <= 0 or mean_gap_s <= 0 or slots < 1 or not kinds:
        raise ValueError(f"a soak needs duration > 0, mean gap > 0, slots >= 1, kinds: {duration_s}, {mean_gap_s}")
    caps = dict(caps or {})
    rng = random.Random(seed)
    used: dict[FaultKind, int] = {}
    faults: list[Fault] = []
    at = 0.0
    while True:
        at += max(min_gap_s, rng.expovariate(1.0 / mean_gap_s))
        open_kinds = [k for k in kinds if used.get(k, 0) < caps.get(k, math.inf)]
        if at >= duration_s or not open_kinds:
            return faults
        kind = rng.choice(open_kinds)
        used[kind] = used.get(kind, 0) + 1
        faults.append(Fault(round(at, 3), kind, rng.randrange(slots), HOLD_S.get(kind, 0.0)))


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's optimal time between checkpoints, sqrt(2 C M) (C the cost of one checkpoint, M the mean time
    between failures)."""
    if checkpoint_cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"checkpoint cost {checkpoint_cost_s} s and MTBF {mtbf_s} s: need C >= 0, M > 0")
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def checkpoint_every_steps(checkpoint_cost_s: float, mtbf_s: float, step_s: float) -> int:
    """Young/Daly's interval in whole steps (at least 1)."""
    return max(1, round(young_daly_interval_s(checkpoint_cost_s, mtbf_s) / step_s))


# A rank's step log: (step, time begun) in the order executed; a step redone after a fault appears again.
StepLog = Sequence[tuple[int, float]]


@dataclass(frozen=True)
class FaultOutcome:
    """What one fault cost: the time from the fault until every slot completed a step begun after it (None: the
    job never trained at full width again), and the steps begun again after it that the slot had begun before."""

    fault: Fault
    full_width_s: float | None
    recomputed: int


STALL_FLOOR_S = 0.05  # a gap between two steps of a slot counts as a stall above this, or 5 median steps
# A fault's effect begins within this long of the fault or of its end (a crash is judged in well under it, a GPU
# warning read within the health interval, a lossy link's retransmission waits while it lasts): a stall that
# begins later, in a run that had trained on normally, is a hiccup of its own, not the fault's.
EFFECT_S = 1.0


def _resumed_after(log: StepLog, at: float, until: float, effect_until: float = math.inf) -> float:
    """When ``log``'s slot trained normally again after a fault at ``at``, in seconds after it (inf: never). The
    largest stall (a gap between two consecutive steps begun, longer than 5 median steps and STALL_FLOOR_S) that
    begins before ``until`` (less that floor) and before ``effect_until``, and ends after ``at`` -- including the
    one that spans ``at``: a crashed rank's last step before it, its replacement's first after -- ends at the
    resume; with no stall, the slot's second step begun after the fault (its first completed one)."""
    times = [t for _, t in log]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    floor = max(STALL_FLOOR_S, 5 * statistics.median(gaps)) if gaps else STALL_FLOOR_S
    before = [t for t in times if t <= at][-1:]
    after = [t for t in times if t > at]
    seq = before + after
    # A stall that begins within a stall's length of the next fault is the next fault's (a whole-job restart: the
    # last step begun just before that kill); one that begins just after this fault is this one's.
    begins_before = min(until - floor, effect_until)
    stalls = [(b - a, b) for a, b in itertools.pairwise(seq) if b - a > floor and a < begins_before]
    if stalls:
        return max(stalls)[1] - at
    return after[1] - at if len(after) >= 2 else math.inf


def outcomes(logs: Mapping[int, StepLog], fault_times: Sequence[tuple[Fault, float]]) -> list[FaultOutcome]:
    """Each fault's outcome, ``fault_times`` giving each fault's wall time (as the step logs' clock). The time to
    full width is the latest, over slots, of :func:`_resumed_after`: when the most stalled slot trained again
    (a respawned replica's or a restarted job's first step, a stopped node's next one), counting only a stall that
    began by ``EFFECT_S`` after the fault's end. Recomputed steps are counted
    per slot in the fault's window (up to the next fault: a recovery still under way then is the next fault's) and
    the most of any slot is the fault's: steps that the whole job did again, not per-rank copies of the same redo."""
    results = []
    ordered = sorted(fault_times, key=lambda ft: ft[1])
    for i, (fault, at) in enumerate(ordered):
        until = ordered[i + 1][1] if i + 1 < len(ordered) else math.inf
        widths: list[float] = []
        redone = 0
        for log in logs.values():
            widths.append(_resumed_after(log, at, until, at + fault.hold_s + EFFECT_S))
            seen = {s for s, t in log if t <= at}
            again = 0
            for step, t in log:
                if at < t < until:
                    if step in seen:
                        again += 1
                    seen.add(step)
            redone = max(redone, again)
        worst = max(widths) if widths else math.inf
        results.append(FaultOutcome(fault, None if math.isinf(worst) else worst, redone))
    return results


def recomputed_total(logs: Mapping[int, StepLog]) -> int:
    """Steps the job computed more than once: per slot, entries whose step it had already begun; the most of any
    slot (every slot redoes the same steps after a restart)."""
    return max((len(log) - len({s for s, _ in log}) for log in logs.values()), default=0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank, as a distribution's p50/p99 over few samples is read."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summary(results: Sequence[FaultOutcome]) -> dict[str, float | int | None]:
    """p50/p99/max of the time to full width (faults never recovered are counted apart), and the YOCO rate:
    faults resolved with zero recomputed steps and back at full width, over all faults."""
    widths = [r.full_width_s for r in results if r.full_width_s is not None]
    yoco = sum(1 for r in results if r.recomputed == 0 and r.full_width_s is not None)
    return {
        "faults": len(results),
        "never_full_width": len(results) - len(widths),
        "full_width_p50_s": round(statistics.median(widths), 3) if widths else None,
        "full_width_p99_s": round(percentile(widths, 99), 3) if widths else None,
        "full_width_max_s": round(max(widths), 3) if widths else None,
        "yoco_rate": round(yoco / len(results), 3) if results else None,
    }
