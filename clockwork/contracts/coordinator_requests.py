"""The requests a TorchPass job's coordinator serves, as typed messages, and the parser that validates them.

Apart from the replies (:mod:`clockwork.contracts.coordinator_replies`) because the two directions are read by different
sides: the coordinator parses what is here (:func:`parse_request` turns a decoded map into one of these and says
what is wrong with a malformed one), a rank and the command line only build it. The framing and the values the
requests carry (roles, job states) are :mod:`clockwork.contracts.coordinator_wire`'s.

Who sends what: a rank's main thread (socket ``WID.r``) sends every request in :data:`REQUESTS`; its control
thread (``WID.n``) sends :class:`Heartbeat` (``hello`` once, then ``hb``); the command line sends
:class:`Migrate`, :class:`Status` and :class:`SnapshotAsk`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, TypeVar

from clockwork.contracts.coordinator_wire import ProtocolError, Role, int_tuple, read_field

__all__ = [
    "REQUESTS",
    "WHOLE_STATE",
    "AwaitGeneration",
    "Broken",
    "Departed",
    "Fatal",
    "Finished",
    "Heartbeat",
    "Joined",
    "Migrate",
    "PartMove",
    "Register",
    "Request",
    "SnapshotAsk",
    "Status",
    "parse_collective",
    "parse_request",
]


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
    version: str = ""  # the sender's Clockwork/TorchPass release (''; one too old to say): must be the coordinator's


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


#: :attr:`PartMove.what` of a replicated job's (DDP's) one part: naming it says nothing a slot number does not.
WHOLE_STATE = "the training state"


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
    ``requester``). A whole node's move is one request per rank: ``group`` ranks are still to move with this
    one, and ``near`` is the spare the previous one went to, so that they all land on one node."""

    OP: ClassVar[str] = "migrate"
    id: int
    slot: int
    wid: str = ""
    requester: str = ""
    group: int = 1
    near: str = ""


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
    """The sender found the job cannot go on (the state does not fit, no member holds it). ``kind``
    ``replica_mismatch`` (TorchPass's runtime net: replicas or a transfer differ) comes with the ``step`` and the
    first differing ``tensor``, which the coordinator records as an event."""

    OP: ClassVar[str] = "fatal"
    id: int
    wid: str
    message: str = "fatal error"
    kind: str = ""
    step: int | None = None
    tensor: str = ""


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


def _optional(kind: Callable[[Any], _T]) -> Callable[[Any], _T | None]:
    return lambda value: None if value is None else kind(value)


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
            None if step is None else read_field("step", step, int),
            read_field("skipped", msg.get("skipped"), int_tuple),
            parse_collective(msg.get("uc")),
            hello=op == "hello",
        )
    cls = REQUESTS.get(str(op))
    if cls is None:
        raise ProtocolError(f"unknown op {op!r}")
    values: dict[str, Any] = {}
    for spec in fields(cls):
        if spec.name in msg and (msg[spec.name] is not None or "None" in str(spec.type)):
            values[spec.name] = read_field(spec.name, msg[spec.name], _READERS[str(spec.type)])
        elif spec.default is MISSING and spec.default_factory is MISSING:
            raise ProtocolError(f"{op} without {spec.name!r}")
    return cls(**values)
