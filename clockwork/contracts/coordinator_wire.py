"""The wire protocol of a TorchPass job's coordinator: its framing and the values every message carries.

Who speaks it: a rank (``torchpass.rank.control``), the coordinator itself (``torchpass.coordinator``), the node
agents' proxy, and the command line and the daemon's GPU health watch (:mod:`clockwork.contracts.coordinator_client`).
It lives on the daemon side and imports neither torch nor TorchPass, so that ``clockwork migrate`` and the
daemon can use it; TorchPass imports it (the dependency runs torchpass -> clockworkd, never back).

Framing: every message is a msgpack map with a string ``op`` (:func:`encode`, :func:`decode`), at most
:data:`MAX_MESSAGE_BYTES`. A request carries an ``id`` that its reply (op ``reply``) repeats, so a late reply
to an abandoned long poll is never taken for a newer answer; ``ok`` False is a refusal (``error``; ``leader``
from a passive replica; ``retry`` when the same request may succeed later); ``stop`` True says the job ended
(``done``, ``reason``).

Sockets: the coordinator binds one ROUTER. Each rank connects two DEALERs, one per thread (ZeroMQ sockets are
not thread-safe): ``WID.r`` carries the main thread's requests and ``WID.n`` belongs to the rank's control
thread: heartbeats out, answered by a heartbeat ack, and pushes in.

The typed messages live in two modules, one per direction, so that each side reads only the one it parses:
:mod:`clockwork.contracts.coordinator_requests` (what ranks and the command line send the coordinator, validated by
``parse_request``) and :mod:`clockwork.contracts.coordinator_replies` (what the coordinator sends back, ``to_wire()``,
and the pushes a rank reads with ``parse_push``). This module holds what both share: the framing, the field
readers that turn a wire value into a typed one (or a :class:`ProtocolError` naming the field), and the values
messages carry (job states, roles, generations). The field names on the wire are the dataclass fields'.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

import msgpack

from clockwork.contracts.errors import ProtocolError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "SPARE",
    "UNKNOWN",
    "GenerationInfo",
    "Handoff",
    "JobState",
    "ProtocolError",
    "Role",
    "decode",
    "encode",
    "int_tuple",
    "read_field",
]

MAX_MESSAGE_BYTES = 1 << 20


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


_T = TypeVar("_T")


def read_field(name: str, value: Any, kind: Callable[[Any], _T]) -> _T:
    """``kind(value)``; a value it cannot read is a :class:`ProtocolError` that names the field."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"field {name!r}: cannot read {value!r}") from None


def int_tuple(value: Any) -> tuple[int, ...]:
    """A list of integers on the wire (absent: empty), as a tuple."""
    return tuple(int(v) for v in (value or ()))


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


class FailureKind(StrEnum):
    """Why a job failed, as far as what could bring it back is concerned (the reason's text says the rest).

    Only a failure that new nodes and the newest snapshot can undo (:attr:`requeue_helps`) is worth a Slurm
    requeue: a job the script itself stops (an exception, a replica mismatch) would fail again the same way."""

    SCRIPT = "script"  # the training script or its state: an error, a mismatch, collectives out of line
    CAPACITY = "capacity"  # no spare came (none ready within spare_timeout_s, none could be borrowed)
    STATE_LOST = "state_lost"  # every holder of some part of the state is gone (no replica, no peer copy)
    LIMIT = "limit"  # more failures or rebuilds than max_failures / max_resets allow

    @property
    def requeue_helps(self) -> bool:
        """Whether a requeued job (fresh nodes, restored from the newest snapshot) can get past it."""
        return self in (FailureKind.CAPACITY, FailureKind.STATE_LOST)


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
