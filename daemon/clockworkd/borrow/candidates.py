"""Which running job gives up a node for a borrow: the queue as Slurm shows it, and the policy's choice.

Pure functions over records, so the rules (eligibility, exclusions, least work lost) are tested without Slurm.
The queue comes from ``squeue --json`` (22.05 prints every job whatever ``--states`` says; 23.02+ wraps numbers
as ``{"set": ..., "number": ...}`` and states as lists): :func:`parse_queue_json` reads both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clockwork.contracts.config.borrow import BorrowConfig, names
from clockwork.contracts.hostlist import expand_hostlist
from clockwork.contracts.slurm.backend import NodeInfo, json_number

__all__ = [
    "HOLDER_PREFIX",
    "UNUSABLE_NODE_STATES",
    "Choice",
    "QueueJob",
    "choose",
    "holder_name",
    "holders_of",
    "parse_queue_json",
    "why_not",
]

HOLDER_PREFIX = "clockwork-hold-"
#: Node states in which a node is no use to a borrower, whatever runs on it.
UNUSABLE_NODE_STATES = ("DOWN", "DRAIN", "DRAINING", "DRAINED", "FAIL", "FAILING", "NOT_RESPONDING", "POWERED_DOWN")


def holder_name(job_id: int) -> str:
    """The job name of a holder allocation for training job ``job_id`` (how holders are found again)."""
    return f"{HOLDER_PREFIX}{job_id}"


@dataclass(frozen=True)
class QueueJob:
    """One job of the queue, with what the borrowing policy looks at."""

    job_id: int
    name: str
    state: str  # RUNNING, PENDING, ... (flag states such as COMPLETING win, as in scontrol)
    user: str
    account: str
    partition: str
    qos: str
    nodes: tuple[str, ...]
    start_time: float  # epoch seconds; 0 while pending
    requeue: bool  # whether Slurm may requeue it (a preempted non-requeueable job is cancelled)
    admin_comment: str = ""

    def elapsed_s(self, now: float) -> float:
        """Seconds it has run (0 while pending)."""
        return max(0.0, now - self.start_time) if self.start_time > 0 else 0.0


def _state(value: Any) -> str:
    if isinstance(value, list):
        states = [str(s).upper() for s in value]
        flags = ("COMPLETING", "REQUEUED", "RESIZING", "SIGNALING", "STOPPED", "CONFIGURING")
        return next((f for f in flags if f in states), states[0] if states else "")
    return "" if value is None else str(value).upper()


def _bool(value: Any) -> bool:
    if isinstance(value, Mapping):
        value = value.get("number", value.get("set"))
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)


def parse_queue_json(doc: Mapping[str, Any]) -> list[QueueJob]:
    """Jobs of a ``squeue --json`` document (22.05 openapi v0.0.38 and the 23.02+ data_parser shapes)."""
    out: list[QueueJob] = []
    for job in doc.get("jobs") or []:
        job_id = json_number(job.get("job_id"))
        if job_id is None:
            continue
        nodes = str(job.get("nodes") or "")
        out.append(
            QueueJob(
                job_id=job_id,
                name=str(job.get("name") or ""),
                state=_state(job.get("job_state")),
                user=str(job.get("user_name") or ""),
                account=str(job.get("account") or ""),
                partition=str(job.get("partition") or ""),
                qos=str(job.get("qos") or ""),
                nodes=tuple(expand_hostlist(nodes)) if nodes else (),
                start_time=float(json_number(job.get("start_time")) or 0),
                requeue=_bool(job.get("requeue")),
                admin_comment=str(job.get("admin_comment") or ""),
            )
        )
    return out


def holders_of(queue: Iterable[QueueJob], job_id: int) -> list[QueueJob]:
    """Holder allocations of ``job_id`` that still count against its limit (pending or running)."""
    name = holder_name(job_id)
    return [j for j in queue if j.name == name and j.state in ("PENDING", "RUNNING", "CONFIGURING")]


@dataclass(frozen=True)
class Choice:
    """The job that gives up a node, the node, and the other candidates the policy weighed (for the record)."""

    job: QueueJob
    node: str
    work_lost_s: float
    considered: int  # eligible candidates
    excluded: dict[str, str]  # job id -> why it was not eligible (only jobs on borrowable work)


def why_not(job: QueueJob, cfg: BorrowConfig, now: float) -> str:
    """Why ``job`` may not be taken whatever its nodes ('' when it may)."""
    if job.state != "RUNNING" or not job.nodes:
        return f"not running ({job.state})"
    if cfg.requeueable_only and not job.requeue:
        return "not requeueable (submitted with --no-requeue or JobRequeue=0)"
    age_min = job.elapsed_s(now) / 60.0
    if age_min < cfg.min_age_minutes:
        return f"started {age_min:.1f} min ago (< min_age_minutes = {cfg.min_age_minutes:g})"
    return ""


def choose(
    queue: Sequence[QueueJob],
    cfg: BorrowConfig,
    *,
    borrower: QueueJob | None,
    borrower_id: int,
    borrower_nodes: Iterable[str],
    nodes: Sequence[NodeInfo] = (),
    now: float,
) -> Choice | None:
    """The candidate that loses the least work, or None when no job may be taken.

    A candidate runs in a borrowable partition or QOS, is not the borrower nor anyone's holder, passes the
    exclusions, and has a node that is usable (not down or draining) and not one of the borrower's own.
    """
    partitions, qos = set(names(cfg.partitions)), set(names(cfg.qos))
    own = set(borrower_nodes) | (set(borrower.nodes) if borrower is not None else set())
    unusable = {n.name for n in nodes if any(n.has(s) for s in UNUSABLE_NODE_STATES)}
    best: tuple[tuple[float, float, int], QueueJob, str] | None = None
    considered = 0
    excluded: dict[str, str] = {}
    for job in queue:
        if job.job_id == borrower_id or job.name.startswith(HOLDER_PREFIX):
            continue
        if job.partition not in partitions and job.qos not in qos:
            continue  # not borrowable work at all: not worth a line in the record
        why = why_not(job, cfg, now)
        usable = [n for n in job.nodes if n not in own and n not in unusable]
        if not why and not usable:
            why = "no usable node (its nodes are the borrower's own, down or draining)"
        if why:
            excluded[str(job.job_id)] = why
            continue
        considered += 1
        elapsed = job.elapsed_s(now)
        lost = elapsed * len(job.nodes) if cfg.choose == "least_node_time" else elapsed
        key = (lost, elapsed, job.job_id)  # ties: the shorter run, then the older job id (stable)
        if best is None or key < best[0]:
            best = (key, job, usable[0])
    if best is None:
        return None
    return Choice(best[1], best[2], round(best[0][0], 1), considered, excluded)
