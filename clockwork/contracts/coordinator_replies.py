"""What a TorchPass job's coordinator sends: typed replies to requests, pushes to a rank's control thread.

Apart from the requests (:mod:`clockwork.contracts.coordinator_requests`) because the two directions are read by
different sides: the coordinator builds what is here and sends it with ``to_wire()``, a rank reads the pushes back with
:func:`parse_push`. The framing and the values the messages carry (generations, job states) are
:mod:`clockwork.contracts.coordinator_wire`'s.

A reply (op ``reply``) repeats its request's ``id`` and says ``ok``; :class:`Refusal` is the one with ``ok``
False. Pushes go to a rank's control socket (``WID.n``): :class:`GenerationPush`, :class:`StopPush`,
:class:`SnapshotPush`, and :class:`HeartbeatAck`, the answer to every heartbeat.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from clockwork.contracts.coordinator_wire import GenerationInfo, JobState, encode, int_tuple, read_field

__all__ = [
    "Ack",
    "GenerationAnswer",
    "GenerationPush",
    "HeartbeatAck",
    "MigrationAccepted",
    "Push",
    "Refusal",
    "Registered",
    "Reply",
    "SnapshotPlanned",
    "SnapshotPush",
    "StatusAnswer",
    "StopAnswer",
    "StopPush",
    "parse_push",
]


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
    """A newer generation exists (only its number: the control thread aborts a doomed collective with it).
    ``planned``: it only moves a live rank's slot to a spare (a migration): every member of the current
    generation is alive, so the ranks finish the step in progress and follow at its end, nothing aborted."""

    OP: ClassVar[str] = "generation"
    gen: int
    planned: bool = False


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
    planned: bool = False  # ``gen`` is a planned generation (:class:`GenerationPush`)


Reply = Ack | Registered | GenerationAnswer | MigrationAccepted | SnapshotPlanned | StatusAnswer | StopAnswer | Refusal
Push = GenerationPush | StopPush | SnapshotPush | HeartbeatAck


def parse_push(msg: Mapping[str, Any]) -> Push | None:
    """What a rank's control socket received, typed; None for an op it does not know (ignored)."""
    op = msg.get("op")
    snap = read_field("snap", msg.get("snap"), int_tuple)
    planned = bool(msg.get("planned", False))
    if op == "generation":
        return GenerationPush(read_field("gen", msg.get("gen", -1), int), planned)
    if op == "hb_ack":
        try:
            state = JobState(str(msg.get("state", JobState.RUNNING.value)))
        except ValueError:
            state = JobState.RUNNING  # a state this side does not know: the job goes on as far as it can tell
        return HeartbeatAck(read_field("gen", msg.get("gen", -1), int), state, snap, planned)
    if op == "stop":
        return StopPush(bool(msg.get("done")), str(msg.get("reason", "")))
    if op == "snapshot":
        return SnapshotPush(snap)
    return None
