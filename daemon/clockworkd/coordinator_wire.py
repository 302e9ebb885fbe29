"""The wire protocol of a TorchPass job's coordinator, as typed messages: one definition for every side.

Who speaks it: a rank (``torchpass.control``), the coordinator itself (``torchpass.coordinator``), the node
agents' proxy, and the command line and the daemon's GPU health watch (:mod:`clockworkd.coordinator_client`).
It lives on the daemon side and imports neither torch nor TorchPass, so that ``clockwork migrate`` and the
daemon can use it; TorchPass imports it (the dependency runs torchpass -> clockworkd, never back).

Framing: every message is a msgpack map with a string ``op`` (:func:`encode`, :func:`decode`), at most
:data:`MAX_MESSAGE_BYTES`. A request carries an ``id`` that its reply (op ``reply``) repeats, so a late reply
to an abandoned long poll is never taken for a newer answer; ``ok`` False is a refusal (``error``; ``leader``
from a passive replica; ``retry`` when the same request may succeed later); ``stop`` True says the job ended
(``done``, ``reason``).

Sockets: the coordinator binds one ROUTER. Each rank connects two DEALERs, one per thread (ZeroMQ sockets are
not thread-safe): ``WID.r`` carries the main thread's requests (:data:`REQUESTS`) and ``WID.n`` belongs to the
rank's control thread: heartbeats out (:class:`Heartbeat`, answered by :class:`HeartbeatAck`), pushes in
(:class:`GenerationPush`, :class:`StopPush`, :class:`SnapshotPush`).

What is typed here: every request (:func:`parse_request` validates a decoded map into one, and says what is
wrong with a malformed one), every reply and push the coordinator sends (``to_wire()``), and the pushes a rank
reads (:func:`parse_push`). The field names on the wire are the dataclass fields' (``wid``, ``slot``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

import msgpack

__all__ = [
    "MAX_MESSAGE_BYTES",
    "REQUESTS",
    "SPARE",
    "UNKNOWN",
    "Ack",
    "AwaitGeneration",
    "Broken",
    "Departed",
    "Fatal",
    "Finished",
    "GenerationAnswer",
    "GenerationInfo",
    "GenerationPush",
    "Handoff",
    "Heartbeat",
    "HeartbeatAck",
    "JobState",
    "Joined",
    "Migrate",
    "MigrationAccepted",
    "PartMove",
    "ProtocolError",
    "Refusal",
    "Register",
    "Registered",
    "Request",
    "Role",
    "SnapshotAsk",
    "SnapshotPlanned",
    "SnapshotPush",
    "Status",
    "StatusAnswer",
    "StopAnswer",
    "StopPush",
    "decode",
    "encode",
    "parse_collective",
    "parse_push",
    "parse_request",
]

MAX_MESSAGE_BYTES = 1 << 20


class ProtocolError(ValueError):
    """A message that is not a msgpack map with a string ``op``, is too large, or lacks what its op needs."""


def encode(op: str, **values: Any) -> bytes:
    """One message: a msgpack map with ``op`` and the given fields."""
    return msgpack.packb({"op": op, **values}, use_bin_type=True)


def decode(payload: bytes) -> dict[str, Any]:
    """Parse a message; :class:`ProtocolError` names what is wrong."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("a message must be a map with a string 'op'")
    return msg


# ----- values ---------------------------------------------------------------------------------


class JobState(StrEnum):
    """Where a job is: forming its first generation, running, or ended (done, or failed with a reason)."""

    FORMING = "forming"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        """Done or failed: processes are leaving and nothing is decided any more."""
        return self in (JobState.DONE, JobState.FAILED)


@dataclass(frozen=True)
class Role:
    """What a process was started as: the initial member of ``slot``, or a spare (``slot`` None).

    On the wire and in the launch environment: ``slot:K`` or ``spare`` (``?``: not known yet, e.g. a process
    whose heartbeat arrived before its registration)."""

    slot: int | None = None
    known: bool = True

    @classmethod
    def parse(cls, text: str) -> Role:
        """``slot:K``, ``spare`` or ``?``; ProtocolError for anything else."""
        if text == "spare":
            return SPARE
        if text == "?":
            return UNKNOWN
        head, _, number = text.partition(":")
        if head != "slot" or not number.isdigit():
            raise ProtocolError(f"a role is 'slot:K' or 'spare', not {text!r}")
        return cls(int(number))

    @property
    def is_spare(self) -> bool:
        """A standby process (no slot of its own)."""
        return self.known and self.slot is None

    def __str__(self) -> str:
        if not self.known:
            return "?"
        return "spare" if self.slot is None else f"slot:{self.slot}"


SPARE = Role()
UNKNOWN = Role(known=False)


@dataclass(frozen=True)
class Handoff:
    """A planned migration: the departing rank sends its live state straight to the spare taking its slot."""

    slot: int
    source: str  # worker id of the departing rank
    target: str  # worker id of the spare
    host: str  # the departing rank's store server, which hosts the two-rank handoff rendezvous
    port: int


@dataclass(frozen=True)
class GenerationInfo:
    """One generation of the job's membership: who holds which slot and where they meet.

    Every membership change (start, failure, migration, a reset after an unexplained collective error)
    makes a new generation. Its rendezvous keys live under ``PREFIX/gN/`` in the store server of one live
    member (``store_host``/``store_port``), never in a fixed process, so losing any one process loses no
    rendezvous that is still needed.
    """

    gen: int
    world_size: int
    members: dict[int, str]  # slot -> worker id
    store_host: str
    store_port: int
    reason: str
    expect_state: bool  # training has progressed: some member must hold committed state
    replaced: dict[int, str] = field(default_factory=dict)  # slot -> new worker id, for slots that changed
    handoff: Handoff | None = None

    def slot_of(self, worker_id: str) -> int | None:
        """The slot ``worker_id`` holds in this generation, or None."""
        for slot, wid in self.members.items():
            if wid == worker_id:
                return slot
        return None

    def to_wire(self) -> dict[str, Any]:
        """Plain dict for msgpack."""
        out = asdict(self)
        out["members"] = {int(k): v for k, v in self.members.items()}
        out["replaced"] = {int(k): v for k, v in self.replaced.items()}
        return out

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> GenerationInfo:
        """Inverse of :meth:`to_wire`."""
        handoff = data.get("handoff")
        return cls(
            gen=int(data["gen"]),
            world_size=int(data["world_size"]),
            members={int(k): str(v) for k, v in data["members"].items()},
            store_host=str(data["store_host"]),
            store_port=int(data["store_port"]),
            reason=str(data["reason"]),
            expect_state=bool(data["expect_state"]),
            replaced={int(k): str(v) for k, v in data.get("replaced", {}).items()},
            handoff=Handoff(**handoff) if handoff else None,
        )


# ----- requests (to the coordinator) ----------------------------------------------------------


@dataclass(frozen=True)
class Register:
    """A rank or spare process introduces itself (again, through a proxy, after a leader change)."""

    OP: ClassVar[str] = "register"
    id: int
    wid: str
    role: Role
    pid: int
    host: str
    store_port: int
    agent: int | None = None  # Slurm mode: the node agent that runs it; None: read it from the worker id


@dataclass(frozen=True)
class AwaitGeneration:
    """A long poll: the next generation after ``after`` that includes the sender (``gen``, ``slot``,
    ``committed``: where it is, for the coordinator's log)."""

    OP: ClassVar[str] = "await_generation"
    id: int
    wid: str
    after: int = -1
    gen: int = -1
    slot: int = -1
    committed: int = -1


@dataclass(frozen=True)
class Broken:
    """A collective of generation ``gen`` failed on the sender (first seen at ``at``, wall clock)."""

    OP: ClassVar[str] = "broken"
    id: int
    wid: str
    gen: int
    slot: int | None = None
    step: int | None = None
    committed: int = -1
    error: str = ""
    at: float | None = None


@dataclass(frozen=True)
class PartMove:
    """A part of the training state (DDP: all of it; FSDP: a shard) a rank received while joining: which, from
    which slot (a migration's departing rank: its own), how many bytes, how long it took."""

    part: int
    what: str  # the layout's name for it, e.g. "shard 1 of the 2x2 mesh"
    source: int
    target: int
    bytes: int
    ms: float
    handoff: bool = False  # handed over by a departing rank (planned migration), not sent by a replica

    @classmethod
    def read(cls, value: Any) -> PartMove:
        """One record from its wire map (unknown keys ignored)."""
        if not isinstance(value, Mapping):
            raise ValueError(f"a move is a map, got {type(value).__name__}")
        return cls(
            int(value["part"]),
            str(value.get("what", ""))[:120],
            int(value["source"]),
            int(value["target"]),
            int(value["bytes"]),
            float(value["ms"]),
            bool(value.get("handoff", False)),
        )


def _moves(value: Any) -> tuple[PartMove, ...]:
    return tuple(PartMove.read(v) for v in (value or ())[:4096])


@dataclass(frozen=True)
class Joined:
    """The sender formed generation ``gen`` and holds the state to resume at ``resume_step``; how it went."""

    OP: ClassVar[str] = "joined"
    id: int
    wid: str
    gen: int
    slot: int = -1
    resume_step: int = 0
    source: int | None = None  # the slot it received the state from
    received: bool = False
    transfer_bytes: int = 0
    arrived_at: float | None = None  # wall clock, at the rendezvous
    first_error_at: float | None = None  # wall clock, the first failure it saw
    left_at: float | None = None  # wall clock, when it left the previous generation
    handoff_ok: bool = False
    rebuild_ms: float = 0.0
    transfer_ms: float = 0.0
    moves: tuple[PartMove, ...] = ()  # what it received, part by part
    rolled_back: int = 0  # committed steps it undid: the generation resumed from an older peer copy


@dataclass(frozen=True)
class Finished:
    """A long poll at the end: the sender committed its last step (``committed``) in generation ``gen``."""

    OP: ClassVar[str] = "finished"
    id: int
    wid: str
    gen: int
    committed: int
    slot: int = -1


@dataclass(frozen=True)
class Migrate:
    """Move ``slot`` to a spare at its next step boundary (from a rank: ``wid``; from the command line:
    ``requester``)."""

    OP: ClassVar[str] = "migrate"
    id: int
    slot: int
    wid: str = ""
    requester: str = ""


@dataclass(frozen=True)
class Departed:
    """A migrating rank handed its state over (or failed to) and leaves."""

    OP: ClassVar[str] = "departed"
    id: int
    wid: str
    gen: int | None = None
    handoff_ok: bool = False
    handoff_ms: float | None = None
    handoff_bytes: int = 0


@dataclass(frozen=True)
class Fatal:
    """The sender found the job cannot go on (the state does not fit, no member holds it)."""

    OP: ClassVar[str] = "fatal"
    id: int
    wid: str
    message: str = "fatal error"


@dataclass(frozen=True)
class Status:
    """The coordinator's view of the job (``torchpass status``)."""

    OP: ClassVar[str] = "status"
    id: int
    wid: str = ""


@dataclass(frozen=True)
class SnapshotAsk:
    """Take a snapshot soon (``clockwork snapshot take``, or a rank's ``ctx.snapshot_now``)."""

    OP: ClassVar[str] = "snapshot"
    id: int
    wid: str = ""
    requester: str = ""


Request = Register | AwaitGeneration | Broken | Joined | Finished | Migrate | Departed | Fatal | Status | SnapshotAsk
REQUESTS: dict[str, type[Request]] = {
    cls.OP: cls
    for cls in (Register, AwaitGeneration, Broken, Joined, Finished, Migrate, Departed, Fatal, Status, SnapshotAsk)
}


@dataclass(frozen=True)
class Heartbeat:
    """From a rank's control socket: ``hello`` once, then ``hb`` every interval. ``step``: its step (None: not
    said); ``skipped``: snapshot steps it had to skip; ``collective``: the script's collective it waits in,
    as (step, ordinal within the step, name)."""

    wid: str
    step: int | None = None
    skipped: tuple[int, ...] = ()
    collective: tuple[int, int, str] | None = None
    hello: bool = False


def parse_collective(value: object) -> tuple[int, int, str] | None:
    """A heartbeat's ``uc`` ([step, ordinal, name], or nothing); anything else reads as nothing."""
    if not isinstance(value, list | tuple) or len(value) != 3:
        return None
    step, ordinal, name = value
    if not (isinstance(step, int) and isinstance(ordinal, int) and isinstance(name, str)) or step < 0:
        return None
    return step, ordinal, name[:80]


_T = TypeVar("_T")


def _coerce(name: str, value: Any, kind: Callable[[Any], _T]) -> _T:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"field {name!r}: cannot read {value!r}") from None


def _optional(kind: Callable[[Any], _T]) -> Callable[[Any], _T | None]:
    return lambda value: None if value is None else kind(value)


def _int_list(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in (value or ()))


_READERS: dict[str, Callable[[Any], Any]] = {
    "int": int,
    "str": str,
    "float": float,
    "bool": bool,
    "Role": lambda v: Role.parse(str(v)),
    "int | None": _optional(int),
    "float | None": _optional(float),
    "tuple[PartMove, ...]": _moves,
}


def parse_request(msg: Mapping[str, Any]) -> Request | Heartbeat:
    """The typed request (or heartbeat) a decoded message is; ProtocolError names an unknown op or a missing or
    unreadable field. Unknown extra fields are ignored (a newer sender may say more)."""
    op = msg.get("op")
    if op in ("hello", "hb"):
        wid = str(msg.get("wid") or "")
        step = msg.get("step")
        return Heartbeat(
            wid,
            None if step is None else _coerce("step", step, int),
            _coerce("skipped", msg.get("skipped"), _int_list),
            parse_collective(msg.get("uc")),
            hello=op == "hello",
        )
    cls = REQUESTS.get(str(op))
    if cls is None:
        raise ProtocolError(f"unknown op {op!r}")
    values: dict[str, Any] = {}
    for spec in fields(cls):
        if spec.name in msg and (msg[spec.name] is not None or "None" in str(spec.type)):
            values[spec.name] = _coerce(spec.name, msg[spec.name], _READERS[str(spec.type)])
        elif spec.default is MISSING and spec.default_factory is MISSING:
            raise ProtocolError(f"{op} without {spec.name!r}")
    return cls(**values)


# ----- replies and pushes (from the coordinator) ------------------------------------------------


def _plain(value: Any) -> Any:
    """A field's value as msgpack takes it."""
    if isinstance(value, GenerationInfo):
        return value.to_wire()
    if isinstance(value, JobState):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


class _Message:
    """``to_wire``: the op and the dataclass's fields; a reply (op ``reply``) says ``ok`` and repeats ``id``."""

    OP: ClassVar[str] = "reply"
    EXTRA: ClassVar[dict[str, Any]] = {}

    def to_wire(self) -> bytes:
        values = {spec.name: _plain(getattr(self, spec.name)) for spec in fields(self)}  # type: ignore[arg-type]
        if self.OP == "reply":
            values["ok"] = True
        return encode(self.OP, **values, **self.EXTRA)


@dataclass(frozen=True)
class Ack(_Message):
    """The request was taken."""

    id: Any


@dataclass(frozen=True)
class Registered(_Message):
    """Welcome: the job trains ``world_size`` slots."""

    id: Any
    world_size: int


@dataclass(frozen=True)
class GenerationAnswer(_Message):
    """The answer to a long poll: the generation to join."""

    id: Any
    generation: GenerationInfo


@dataclass(frozen=True)
class MigrationAccepted(_Message):
    """The migration is decided: ``target`` takes the slot in generation ``generation``."""

    id: Any
    generation: int
    target: str


@dataclass(frozen=True)
class SnapshotPlanned(_Message):
    """Every member snapshots after ``step``."""

    id: Any
    step: int


@dataclass(frozen=True)
class StatusAnswer(_Message):
    """The coordinator's view (the map ``Coordinator.snapshot`` describes)."""

    id: Any
    status: dict[str, Any]


@dataclass(frozen=True)
class StopAnswer(_Message):
    """The job ended (``done``: finished; else failed, ``reason`` says why), or the sender was evicted."""

    EXTRA: ClassVar[dict[str, Any]] = {"stop": True}
    id: Any
    done: bool
    reason: str


@dataclass(frozen=True)
class Refusal:
    """The request was refused: ``error`` says why; ``retry``: it may succeed later; ``leader``: a passive
    replica's pointer to the one that decides."""

    id: Any
    error: str
    retry: bool = False
    leader: str | None = None

    def to_wire(self) -> bytes:
        """``ok`` False; ``retry`` and ``leader`` only when they say something."""
        extra: dict[str, Any] = {"retry": True} if self.retry else {}
        if self.leader is not None:
            extra["leader"] = self.leader
        return encode("reply", id=self.id, ok=False, error=self.error, **extra)


@dataclass(frozen=True)
class GenerationPush(_Message):
    """A newer generation exists (only its number: the control thread aborts a doomed collective with it)."""

    OP: ClassVar[str] = "generation"
    gen: int


@dataclass(frozen=True)
class StopPush(_Message):
    """The job ended, or the coordinator counts the receiver as dead."""

    OP: ClassVar[str] = "stop"
    done: bool
    reason: str


@dataclass(frozen=True)
class SnapshotPush(_Message):
    """Snapshot after these steps."""

    OP: ClassVar[str] = "snapshot"
    snap: tuple[int, ...]


@dataclass(frozen=True)
class HeartbeatAck(_Message):
    """The answer to every heartbeat: the newest generation, the job's state, the snapshots still planned."""

    OP: ClassVar[str] = "hb_ack"
    gen: int
    state: JobState
    snap: tuple[int, ...] = ()


Reply = Ack | Registered | GenerationAnswer | MigrationAccepted | SnapshotPlanned | StatusAnswer | StopAnswer | Refusal
Push = GenerationPush | StopPush | SnapshotPush | HeartbeatAck


def parse_push(msg: Mapping[str, Any]) -> Push | None:
    """What a rank's control socket received, typed; None for an op it does not know (ignored)."""
    op = msg.get("op")
    snap = _coerce("snap", msg.get("snap"), _int_list)
    if op == "generation":
        return GenerationPush(_coerce("gen", msg.get("gen", -1), int))
    if op == "hb_ack":
        try:
            state = JobState(str(msg.get("state", JobState.RUNNING.value)))
        except ValueError:
            state = JobState.RUNNING  # a state this side does not know: the job goes on as far as it can tell
        return HeartbeatAck(_coerce("gen", msg.get("gen", -1), int), state, snap)
    if op == "stop":
        return StopPush(bool(msg.get("done")), str(msg.get("reason", "")))
    if op == "snapshot":
        return SnapshotPush(snap)
    return None
