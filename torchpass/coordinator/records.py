"""What the coordinator's core knows and says: worker records, parked long polls, recovery timings, the typed
events it is given and the typed decisions it makes.

Kept apart from the decisions themselves (:mod:`torchpass.coordinator.membership`, :mod:`torchpass.coordinator.core`) so
that a table test can build any event and read any decision without a socket, a thread or a clock: time comes
in with every event (:class:`Now`), and everything the core wants done (send a message, emit an event, start a
spare, evict a process, end the job) comes out as a :class:`Decision` for the socket shell
(:mod:`torchpass.coordinator.service`) to carry out, in order.

This module imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from clockwork.contracts.coordinator_replies import Push, Reply
from clockwork.contracts.coordinator_requests import WHOLE_STATE, Heartbeat, Joined, Request
from clockwork.contracts.coordinator_wire import FailureKind, Role
from torchpass.coordinator.lockstep import CollectiveWait

__all__ = [
    "AgentLost",
    "CheckHeartbeats",
    "Decision",
    "Emit",
    "Event",
    "Evict",
    "FailNow",
    "HeartbeatIn",
    "JobEnded",
    "Now",
    "Outbox",
    "ParkedPoll",
    "RecoveryClock",
    "RequestIn",
    "Send",
    "SpareNeeded",
    "SpareTaken",
    "StepDown",
    "TakeOver",
    "Tick",
    "WaitKind",
    "WorkerExited",
    "WorkerExpected",
    "WorkerRecord",
    "agent_of",
    "completion_fields",
    "local_of",
    "node_key",
    "parts_received",
    "place_of",
    "worker_id",
]


@dataclass(frozen=True)
class Now:
    """When an event is handled: ``mono`` (monotonic, for timeouts) and ``wall`` (wall clock, for reports)."""

    mono: float
    wall: float


def worker_id(agent: int, started: int, local: int, per_node: int) -> str:
    """The worker id of agent ``agent``'s process number ``started`` with local index ``local``: ``aK.N`` on a
    node of one rank, ``aK.N.J`` on a node of several (J: its local index, its GPU)."""
    return f"a{agent}.{started}" if per_node == 1 else f"a{agent}.{started}.{local}"


def agent_of(wid: str) -> int:
    """The agent index in a Slurm-mode worker id (``aK.N`` or ``aK.N.J``), or -1 (local mode's ``wN``)."""
    head = wid.split(".", 1)[0]
    return int(head[1:]) if head.startswith("a") and head[1:].isdigit() else -1


def node_key(wid: str) -> str:
    """Which node a worker runs on, as far as its id says: ``aK`` (node agent K) or ``gH`` (the guest of the
    borrowed node that holder job H holds), '' for local mode's ``wN`` (every local worker counts as one node)."""
    head = wid.split(".", 1)[0]
    return head if head[:1] in ("a", "g") and head[1:].isdigit() and "." in wid else ""


def local_of(wid: str) -> int:
    """The local index on its node (its GPU) in a Slurm-mode worker id: J of ``aK.N.J`` or of a borrowed
    node's ``gH.N.J``, 0 for ``aK.N``/``gH.N`` (a node of one rank) and for local mode's ``wN``."""
    parts = wid.split(".")
    return int(parts[2]) if len(parts) == 3 and node_key(wid) and parts[2].isdigit() else 0


def place_of(rec: WorkerRecord, node_names: dict[int, str]) -> dict[str, Any]:
    """Where a Slurm-mode process runs, for the job's events: its node and local index (its GPU); a borrowed
    node's guest (no agent) by its address, the one name the coordinator has for it, and its holder job."""
    if rec.agent < 0:
        key = node_key(rec.wid)
        return {"node": rec.host, "local": local_of(rec.wid), "holder": int(key[1:])} if key[:1] == "g" else {}
    return {"node": node_names.get(rec.agent, f"agent {rec.agent}"), "local": local_of(rec.wid)}


@dataclass
class WorkerRecord:
    """What the coordinator knows of one rank or spare process."""

    wid: str
    role: Role
    last_seen: float  # monotonic: its latest message
    pid: int = 0
    host: str = ""
    store_port: int = 0
    alive: bool = True
    registered: bool = False
    step: int = -1
    rate: float = 0.0  # steps per second between its last two heartbeats (plans snapshot steps)
    step_seen_at: float = 0.0
    waiting: CollectiveWait | None = None  # the script's collective its latest heartbeat said it waits in
    notify: bytes | None = None  # its control socket, where pushes go
    agent: int = -1  # Slurm mode: the node agent that runs it (its node's loss is this process's death)

    def __post_init__(self) -> None:
        if self.agent < 0:
            self.agent = agent_of(self.wid)

    def to_wire(self) -> dict[str, Any]:
        """What a coordinator replica needs of it (plain data for msgpack; its step and times mean nothing there)."""
        return {
            "role": str(self.role),
            "pid": self.pid,
            "host": self.host,
            "store_port": self.store_port,
            "alive": self.alive,
            "registered": self.registered,
            "agent": self.agent,
        }

    def load_wire(self, wire: dict[str, Any], now_mono: float) -> None:
        """Take a predecessor's :meth:`to_wire` (a process this replica already counts dead stays dead)."""
        self.role, self.pid, self.host = Role.parse(str(wire["role"])), int(wire["pid"]), str(wire["host"])
        self.store_port = int(wire["store_port"])
        self.alive = self.alive and bool(wire["alive"])
        self.registered, self.agent, self.last_seen = bool(wire["registered"]), int(wire["agent"]), now_mono


class WaitKind(StrEnum):
    """What a parked long poll waits for."""

    AWAIT = "await"  # a generation newer than the one it names
    FINISHED = "finished"  # every member finished (or a new generation that needs it)


@dataclass
class ParkedPoll:
    """A long-poll request answered later."""

    sender: bytes
    req_id: int
    kind: WaitKind
    after: int = -1


@dataclass
class RecoveryClock:
    """Timestamps (wall clock) of the membership change in progress, for the recovered/migrated event."""

    evidence_at: float  # first sign of trouble: a death notice or a broken-collective report
    death_seen_at: float | None = None
    declared_at: float | None = None
    reasons: list[str] = field(default_factory=list)
    replaced: set[int] = field(default_factory=set)  # slots given to spares since the last generation completed


# ----- events (what the core is told) ---------------------------------------------------------


@dataclass(frozen=True)
class RequestIn:
    """A request from a rank or the command line, from socket identity ``sender``."""

    sender: bytes
    request: Request


@dataclass(frozen=True)
class HeartbeatIn:
    """A rank's control socket spoke (hello or heartbeat)."""

    sender: bytes
    beat: Heartbeat


@dataclass(frozen=True)
class WorkerExpected:
    """The launcher started ``wid`` (so that an exit before its registration can be attributed)."""

    wid: str
    role: Role


@dataclass(frozen=True)
class WorkerExited:
    """The launcher (or an agent) saw process ``wid`` exit at ``at`` (wall clock)."""

    wid: str
    role: Role
    code: int | None
    at: float


@dataclass(frozen=True)
class AgentLost:
    """Node agent ``agent`` is gone: every process it ran is dead. ``hints``: wid -> role of its processes
    (some may be unknown to this replica yet); ``at``: when it was last heard (wall clock)."""

    agent: int
    hints: dict[str, Role]
    why: str
    at: float


@dataclass(frozen=True)
class TakeOver:
    """This replica leads now: adopt ``snapshot`` (the predecessor's replicated state, None: none yet), count
    every process of ``dead_agents`` as dead, and start a fresh generation."""

    snapshot: dict[str, Any] | None
    dead_agents: frozenset[int]
    hints: dict[str, Role]
    why: str
    at: float


@dataclass(frozen=True)
class StepDown:
    """Another replica won the leadership (``leader``: its endpoint): turn passive."""

    leader: str


@dataclass(frozen=True)
class FailNow:
    """Fail the job at once with ``reason``."""

    reason: str
    kind: FailureKind = FailureKind.SCRIPT


@dataclass(frozen=True)
class CheckHeartbeats:
    """Time to count silent processes as dead."""


@dataclass(frozen=True)
class Tick:
    """Time passed: timers (rebuild grace, spare timeout, periodic snapshot, lockstep verdict)."""


Event = (
    RequestIn
    | HeartbeatIn
    | WorkerExpected
    | WorkerExited
    | AgentLost
    | TakeOver
    | StepDown
    | FailNow
    | CheckHeartbeats
    | Tick
)


# ----- decisions (what the core wants done) ---------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send ``message`` to socket identity ``to`` (a reply to a request, or a push to a control socket)."""

    to: bytes
    message: Reply | Push


@dataclass(frozen=True)
class Emit:
    """An event of the job's story (``torchpass.*``), for the event sink and the log."""

    kind: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class SpareTaken:
    """Spare ``wid`` got a slot (the local launcher starts a new one to refill the pool)."""

    wid: str


@dataclass(frozen=True)
class SpareNeeded:
    """A slot is vacant and no spare is ready (the local launcher starts one; under Slurm: borrow or wait)."""


@dataclass(frozen=True)
class Evict:
    """``wid`` is counted dead while it may still run (silent): its launcher should kill it."""

    wid: str


@dataclass(frozen=True)
class JobEnded:
    """The job is done or failed; every parked request was answered and every process told."""

    done: bool


Decision = Send | Emit | SpareTaken | SpareNeeded | Evict | JobEnded


class Outbox:
    """The time of the event being handled and the decisions made so far, shared by the core's parts."""

    def __init__(self, now: Now) -> None:
        self.now = now
        self.decisions: list[Decision] = []

    def begin(self, now: Now) -> None:
        """A new event, handled at ``now``."""
        self.now = now

    def take(self) -> list[Decision]:
        """The decisions made since the last call, in order."""
        out, self.decisions = self.decisions, []
        return out

    def send(self, to: bytes, message: Reply | Push) -> None:
        """Send ``message`` to ``to``."""
        self.decisions.append(Send(to, message))

    def emit(self, kind: str, **fields: Any) -> None:
        """Emit an event of the job's story."""
        self.decisions.append(Emit(kind, fields))

    def decide(self, decision: Decision) -> None:
        """Any other decision."""
        self.decisions.append(decision)


def parts_received(moves: list[dict[str, Any]]) -> dict[int, str]:
    """Slot -> the part of the training state it received (a completion's ``moves``), where the layout names
    parts (a stage, a shard, a tensor-parallel coordinate; not DDP's whole state): what the job's AdminComment
    says moved with each slot."""
    return {int(m["target"]): str(m["what"]) for m in moves if m.get("what") and m["what"] != WHOLE_STATE}


def completion_fields(
    joined: list[Joined], replaced: set[str], recovery: RecoveryClock | None, now: Now
) -> dict[str, Any]:
    """The fields of the started/recovered/migrated event, once every member joined: where the state came from,
    and how long each phase took (``replaced``: the newcomers' worker ids)."""
    newcomers = [r for r in joined if r.wid in replaced]

    def worst(values: list[float]) -> float:
        return round(max(values, default=0.0), 1)

    out: dict[str, Any] = {
        "step": max(r.resume_step for r in joined),
        "source_slots": sorted({r.source for r in joined if r.source is not None}),
        "received_by": sorted(r.slot for r in joined if r.received),
        "rebuild_ms": worst([r.rebuild_ms or 0.0 for r in joined]),
        "transfer_ms": worst([r.transfer_ms or 0.0 for r in joined]),
        "transfer_bytes": max((r.transfer_bytes or 0) for r in joined),
        # Steps some member had committed and the job computes again (rolled back to an older peer copy).
        "recomputed_steps": max((r.rolled_back for r in joined), default=0),
    }
    moves = sorted((m for r in joined for m in r.moves), key=lambda m: (m.target, m.part))
    if moves:  # which part of the state (a shard, under FSDP) went from whom to whom: bytes, time
        out["moves"] = [asdict(m) for m in moves]
    if recovery is not None and recovery.declared_at is not None:
        # The first sign of the failure: the launcher/daemon seeing the exit, a rank's broken report, or a
        # survivor's collective failing (which can come first: a closed socket is seen in microseconds).
        first_error = [r.first_error_at for r in joined if r.first_error_at]
        evidence = min([recovery.evidence_at, *first_error])
        known = recovery.death_seen_at or recovery.declared_at
        out["detect_ms"] = round(1000 * (known - evidence), 1)
        out["decide_ms"] = round(1000 * (recovery.declared_at - known), 1)
        arrived = [r.arrived_at for r in newcomers if r.arrived_at is not None]
        if arrived:
            out["spare_ready_ms"] = round(1000 * (max(arrived) - recovery.declared_at), 1)
        out["total_ms"] = round(1000 * (now.wall - evidence), 1)
    out["handoff_ok"] = any(r.handoff_ok for r in newcomers)
    return out
