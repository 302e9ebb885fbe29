"""What happened to one job: its faults, how each was resolved, how long that took, and what it saved.

``clockwork report JOBID`` gathers the job's events from the node daemons (every node logs what happened
there) and its accounting record from Slurm; this module turns them into a story. It is pure: events and
accounting rows in, a :class:`JobStory` out, so it is tested without a cluster.

Incidents, one per fault the product handled:

* ``rank replaced``: ``torchpass.member_failed`` followed by the ``torchpass.recovered`` that names its slot
  (a spare took the slot, state from a replica): duration = the recovery's ``total_ms``;
* ``rank migrated``: ``torchpass.migrated`` (planned or health-driven live migration);
* ``link failover`` / ``link failback``: LinkPass moved a NIC's traffic (``route_ms``);
* ``gray failure``: Fleet Lens raised ``lens.suspect`` (resolved when ``lens.clear`` names the same target);
* ``rollback``: ``torchpass.restored`` (the job went back to a disk snapshot: nothing saved; once per step);
* ``job lost``: ``torchpass.requeued`` or ``torchpass.not_requeued`` (TorchPass could not recover the job: Slurm
  requeued it to restore a snapshot, or it failed, with why);
* ``node borrowed`` / ``borrow failed``: ``borrow.acquired`` (which node, from which job, how long Slurm
  took) or a borrow request that ended without a node (``borrow.failed``/``borrow.refused``); part of how a
  ``rank replaced`` was resolved, not a fault of its own.

What a resolved fault saved, against checkpoint-restart with a checkpoint every ``interval`` and a restart
that costs ``restart``: on average half an interval of lost work plus the restart, minus what the repair
took, for every node of the job. A migration or a failback is planned work, not a fault: it saves nothing,
and neither does a gray failure that only raised a suspicion.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FleetSummary", "Incident", "JobStory", "build_story", "fleet_summary"]

#: Incidents that stand for a fault which, without Clockwork, would have killed the job.
FAULTS = ("rank replaced", "link failover")


def _moved_to(fields: dict[str, Any], slot: int) -> str:
    """What a recovery or migration gave ``slot``, from its ``moves`` (per part: under FSDP a shard): "shard 1 of
    the 2x2 mesh from rank 3 (1.2 MB in 15 ms)"; '' when the event names none (older TorchPass)."""
    parts = []
    for move in fields.get("moves") or []:
        if int(move.get("target", -1)) != slot:
            continue
        where = "handed over by the departing rank" if move.get("handoff") else f"from rank {move.get('source', '?')}"
        size = f"{float(move.get('bytes', 0)) / 1e6:.1f} MB in {move.get('ms', '?')} ms"
        parts.append(f"{move.get('what', 'state')} {where} ({size})")
    return ", ".join(parts)


def _where(fields: dict[str, Any], slot: int, word: str = " on") -> str:
    """`` on node5 local 1``: where a recovery or migration put ``slot``'s new rank (its ``placed``, under Slurm:
    node and local index, its GPU); '' when the event does not say."""
    place = (fields.get("placed") or {}).get(str(slot))
    if not isinstance(place, dict) or not place.get("node"):
        return ""
    return f"{word} {place['node']} local {place.get('local', '?')}"


@dataclass
class Incident:
    """One fault (or planned move) and how it was resolved."""

    time: float
    node: str
    what: str  # rank replaced, rank migrated, link failover, link failback, gray failure, rollback, job lost
    detail: str
    resolution: str
    duration_s: float | None = None  # how long the repair took (None: not measured, or still open)
    saved_node_h: float = 0.0  # node-hours saved against checkpoint-restart
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobStory:
    """A job's incidents in time order, its accounting summary and the savings."""

    job_id: int
    incidents: list[Incident]
    accounting: dict[str, Any]
    nodes: int
    checkpoint_interval_s: float
    restart_cost_s: float
    events: int

    @property
    def saved_node_h(self) -> float:
        return sum(i.saved_node_h for i in self.incidents)

    @property
    def faults(self) -> int:
        return sum(1 for i in self.incidents if i.what in FAULTS)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["saved_node_h"] = round(self.saved_node_h, 3)
        out["faults"] = self.faults
        return out


def _saved(duration_s: float | None, nodes: int, interval_s: float, restart_s: float) -> float:
    """Node-hours a repair saved against checkpoint-restart (never negative)."""
    lost = interval_s / 2 + restart_s - (duration_s or 0.0)
    return max(0.0, lost) * nodes / 3600


def build_story(
    job_id: int,
    events: list[dict[str, Any]],
    accounting: dict[str, Any],
    *,
    nodes: int,
    checkpoint_interval_s: float = 1800.0,
    restart_cost_s: float = 600.0,
) -> JobStory:
    """The story of ``job_id`` from its events (any order, any node) and its accounting summary."""
    ordered = sorted(events, key=lambda e: (float(e.get("time", 0)), str(e.get("node", "")), int(e.get("seq", 0))))
    incidents: list[Incident] = []
    open_failures: dict[int, Incident] = {}  # slot -> its rank-replaced incident, until recovered
    open_suspects: dict[str, Incident] = {}
    restored_steps: set[Any] = set()
    incident: Incident | None
    for event in ordered:
        kind, f = str(event.get("kind", "")), event.get("fields") or {}
        at, node = float(event.get("time", 0)), str(event.get("node", ""))
        if kind == "torchpass.member_failed":
            where = f" on {f['node']} local {f['local']}" if f.get("node") and f.get("local") is not None else ""
            detail = f"rank {f.get('slot')}{where}: {f.get('why', '?')}"
            incident = Incident(at, node, "rank replaced", detail, "open", fields=f)
            incidents.append(incident)
            open_failures[int(f.get("slot", -1))] = incident
        elif kind == "torchpass.recovered":
            for slot in f.get("slots", []):
                incident = open_failures.pop(int(slot), None)
                if incident is None:
                    continue
                incident.duration_s = float(f.get("total_ms", 0)) / 1000
                sources = ", ".join(str(s) for s in f.get("source_slots", []))
                state = _moved_to(f, int(slot)) or f"state from rank {sources or '?'}"
                incident.resolution = (
                    f"a spare{_where(f, int(slot))} took rank {slot} with {state} in {incident.duration_s:.2f} s "
                    f"(detect {float(f.get('detect_ms', 0)) / 1000:.2f} s, transfer {f.get('transfer_ms', '?')} ms, "
                    f"rebuild {f.get('rebuild_ms', '?')} ms), resumed at step {f.get('step', '?')}"
                )
                if int(f.get("recomputed_steps") or 0):  # pure FSDP: a peer copy older than the committed step
                    incident.resolution += f"; rolled back in memory, {f['recomputed_steps']} step(s) computed again"
                incident.fields = {**incident.fields, **f}
        elif kind == "torchpass.migrated":
            ms = float(f.get("total_ms", 0))
            moved = ", ".join(f"{s}{_where(f, int(s), ' to')}" for s in f.get("slots", []))
            detail = f"ranks {moved} moved live"
            handed = "; ".join(filter(None, (_moved_to(f, int(slot)) for slot in f.get("slots", []))))
            resolution = (
                f"moved in {ms / 1000:.2f} s at step {f.get('step', '?')}"
                + (f" ({handed})" if handed else "")
                + ("" if f.get("handoff_ok", True) else " (the live hand-off failed: state came from a replica)")
            )
            incidents.append(Incident(at, node, "rank migrated", detail, resolution, ms / 1000, fields=f))
        elif kind in ("link.failover", "link.failback"):
            ms = float(f.get("route_ms", 0))
            peers = ", ".join(f.get("peers", []))
            what = kind.replace(".", " ")
            detail = f"{f.get('nic', '?')} -> {f.get('via', '?')} for {peers or '?'}: {f.get('reason', '?')}"
            incidents.append(Incident(at, node, what, detail, f"routes moved in {ms:.0f} ms", ms / 1000, fields=f))
        elif kind == "borrow.acquired":
            ms = float(f.get("total_ms", 0))
            detail = (
                f"{f.get('node', '?')} from job {f.get('from_job', '?')} ({f.get('from_user', '?')}, partition "
                f"{f.get('from_partition', '?')}), for lost node {f.get('lost_node') or '?'}"
            )
            resolution = (
                f"holder job {f.get('holder', '?')} ran in {ms / 1000:.2f} s (Slurm preemption "
                f"{f.get('preempt_ms', '?')} ms); job {f.get('from_job', '?')} requeued"
            )
            incidents.append(Incident(at, node, "node borrowed", detail, resolution, ms / 1000, fields=f))
        elif kind in ("borrow.failed", "borrow.refused") and f.get("request") is not None:
            detail = str(f.get("reason", "?"))
            incidents.append(Incident(at, node, "borrow failed", detail, "no node borrowed", fields=f))
        elif kind == "lens.suspect":
            target = str(f.get("target") or f.get("link") or f.get("nic") or "?")
            if target in open_suspects:
                continue  # an update of the same suspicion
            kinds = f.get("kinds", [])
            detail = f"{target} ({f.get('direction', '?')}, {', '.join(kinds) if isinstance(kinds, list) else kinds})"
            incident = Incident(at, node, "gray failure", detail, "open", fields=f)
            incidents.append(incident)
            open_suspects[target] = incident
        elif kind == "lens.clear":
            target = str(f.get("target") or f.get("link") or f.get("nic") or "?")
            incident = open_suspects.pop(target, None)
            if incident is not None:
                incident.duration_s = at - incident.time
                incident.resolution = f"path healthy again after {incident.duration_s:.1f} s"
        elif kind in ("torchpass.requeued", "torchpass.not_requeued"):  # TorchPass could not recover the job
            resolution = "Slurm requeued it" if kind == "torchpass.requeued" else "the job failed"
            incidents.append(Incident(at, node, "job lost", str(f.get("why", "?")), resolution, fields=f))
        elif kind == "torchpass.restored" and f.get("step") not in restored_steps:  # every rank says so: once
            restored_steps.add(f.get("step"))
            detail = f"restored the snapshot of step {f.get('step')} ({f.get('folder', '?')})"
            incidents.append(Incident(at, node, "rollback", detail, "restarted from a snapshot"))
    for incident in incidents:
        if incident.what in FAULTS and incident.resolution != "open":
            incident.saved_node_h = _saved(incident.duration_s, nodes, checkpoint_interval_s, restart_cost_s)
    return JobStory(job_id, incidents, accounting, nodes, checkpoint_interval_s, restart_cost_s, len(events))


@dataclass
class FleetSummary:
    """Every job's incidents over a window: ``clockwork report --since``."""

    since: float
    until: float
    jobs: int
    faults: int  # faults the product resolved (rank replaced, link failover)
    rollbacks: int
    by_kind: dict[str, int]
    by_node: dict[str, int]
    worst_links: list[tuple[str, int]]  # NICs that failed over or were suspected most, most first
    saved_node_h: float

    @property
    def mtbf_h(self) -> float | None:
        """Mean time between faults (resolved or rolled back) over the window; None without any."""
        count = self.faults + self.rollbacks
        return (self.until - self.since) / 3600 / count if count else None

    @property
    def compute_once_ratio(self) -> float | None:
        """The share of faults resolved without a rollback ("you only compute once"); None without any."""
        count = self.faults + self.rollbacks
        return self.faults / count if count else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mtbf_h"] = self.mtbf_h
        out["compute_once_ratio"] = self.compute_once_ratio
        out["saved_node_h"] = round(self.saved_node_h, 3)
        return out


def fleet_summary(stories: list[JobStory], since: float, until: float, worst: int = 5) -> FleetSummary:
    """Faults by kind and node, MTBF, the compute-once ratio and the worst links over ``[since, until]``."""
    incidents = [i for story in stories for i in story.incidents if since <= i.time <= until]
    faults = [i for i in incidents if i.what in FAULTS and i.resolution != "open"]
    links: Counter[str] = Counter()
    for i in incidents:
        if i.what == "link failover":
            links.update(f"{i.node}/{nic}" for nic in str(i.fields.get("nic", "?")).split(","))
        elif i.what == "gray failure":
            links[str(i.fields.get("nic") or i.fields.get("link") or "?")] += 1
    return FleetSummary(
        since=since,
        until=until,
        jobs=len(stories),
        faults=len(faults),
        rollbacks=sum(1 for i in incidents if i.what == "rollback"),
        by_kind=dict(Counter(i.what for i in incidents).most_common()),
        by_node=dict(Counter(i.node for i in incidents).most_common()),
        worst_links=links.most_common(worst),
        saved_node_h=sum(i.saved_node_h for i in faults),
    )
