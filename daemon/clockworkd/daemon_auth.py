"""Who sent a request to the node daemon, and whether they may run it: the daemon's access rules in one place.

Nothing a client says about itself is believed. On the control socket the caller is the kernel's account of the
connecting process: libzmq reads ``SO_PEERCRED`` when the connection is accepted and exposes it as the message
property ``Peer-Address`` = ``"HOST:UID:GID:PID"``. On the daemon-to-daemon socket it is the CURVE key the ZAP
handler admitted.

Every op declares who may run it (:class:`OpAccess`, one or more :class:`Access` classes, next to its handler:
:mod:`clockworkd.daemon_ops`), and :func:`authorise` applies those declarations before any op runs, apart from the
handlers so that no handler can forget them. Access is denied by default: an op with no declared class is refused
on both planes, so a new op is open to nobody until its component says to whom. Root and ``slurm_user`` are
privileged: they pass every local class; any other uid passes ``local-any``, and ``job-owner`` only for jobs
registered with its uid; a peer daemon passes only ``peer``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import zmq

from clockwork.contracts.daemon_wire import FORBIDDEN, ProtocolError, Request
from clockworkd.registry import JobRecord

__all__ = ["LOCAL_CLASSES", "Access", "Caller", "OpAccess", "authorise", "caller_of", "parse_peer_credentials"]


class Access(Enum):
    """Who may run an op. An op may declare several (``ping``: any local user and any peer daemon)."""

    LOCAL_ANY = "local-any"  # any local user; the handler shows it only what it may see
    JOB_OWNER = "job-owner"  # a local caller whose uid registered the job the request names (``job_id``)
    PRIVILEGED = "privileged"  # root or the Slurm user (``[daemon] slurm_user``) on this node
    PEER = "peer"  # another node's daemon, authenticated by CURVE on the daemon-to-daemon socket


#: The classes a local caller can pass (a privileged local caller passes each of them).
LOCAL_CLASSES = frozenset({Access.LOCAL_ANY, Access.JOB_OWNER, Access.PRIVILEGED})


@dataclass(frozen=True)
class OpAccess:
    """An op's declared access: its classes, and the request fields only a privileged caller or a peer may set
    (``post_event``'s ``node``: where an event happened, which only a relaying daemon may say)."""

    classes: frozenset[Access]
    privileged_fields: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, *classes: Access, privileged_fields: tuple[str, ...] = ()) -> OpAccess:
        return cls(frozenset(classes), frozenset(privileged_fields))

    def describe(self) -> str:
        """The classes as the docs write them, e.g. ``job-owner, peer``."""
        return ", ".join(a.value for a in Access if a in self.classes)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the kernel (local) or CURVE (peer) established it."""

    plane: str  # "local" or "peer"
    uid: int = -1
    gid: int = -1
    pid: int = -1
    address: str = ""
    key: str = ""
    privileged: bool = False

    def describe(self) -> str:
        if self.plane == "peer":
            return f"peer {self.address or '?'} key {self.key[:8] or '?'}"
        return f"uid {self.uid} pid {self.pid}"


def parse_peer_credentials(value: str) -> tuple[int, int, int] | None:
    """(uid, gid, pid) from libzmq's IPC ``Peer-Address`` property ``"HOST:UID:GID:PID"``."""
    parts = value.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[1]), int(parts[2]), int(parts[3])


def _frame_property(frame: zmq.Frame, name: str) -> str:
    try:
        value = frame.get(name)
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""
    return value if isinstance(value, str) else ""


def caller_of(plane: str, frame: zmq.Frame, slurm_uid: int | None) -> Caller | None:
    """The caller of a message received on ``plane`` ("local" or "peer"), from one of its frames' properties;
    None when the kernel's credentials of a local caller cannot be read (its request is refused)."""
    if plane == "peer":
        return Caller(
            plane="peer",
            address=_frame_property(frame, "Peer-Address"),
            key=_frame_property(frame, "User-Id"),
            privileged=True,
        )
    creds = parse_peer_credentials(_frame_property(frame, "Peer-Address"))
    if creds is None:
        return None
    uid, gid, pid = creds
    privileged = uid == 0 or (slurm_uid is not None and uid == slurm_uid)
    return Caller(plane="local", uid=uid, gid=gid, pid=pid, privileged=privileged)


def authorise(
    request: Request,
    caller: Caller,
    rules: Mapping[str, OpAccess],
    job_of: Callable[[int], JobRecord],
    slurm_user: str,
) -> None:
    """Raise ProtocolError(forbidden) unless ``caller`` may run ``request`` by its op's declared access in
    ``rules`` (op -> :class:`OpAccess`); an op with none is refused. ``job_of`` finds the job a ``job-owner``
    request names (raising UnknownJobError for one that is not registered)."""
    op, args = request.op, request.args
    access = rules.get(op)
    if access is None or not access.classes:
        raise ProtocolError(
            f"{op} declares no access class: refused to everyone (access is deny by default)", code=FORBIDDEN
        )
    if caller.plane == "peer":
        if Access.PEER not in access.classes:
            peer_ops = sorted(name for name, rule in rules.items() if Access.PEER in rule.classes)
            raise ProtocolError(
                f"{caller.describe()} may not {op}: the daemon-to-daemon socket serves only " + ", ".join(peer_ops),
                code=FORBIDDEN,
            )
        return
    local = access.classes & LOCAL_CLASSES
    if not local:
        raise ProtocolError(f"uid {caller.uid} may not {op}: it is served to peer daemons only", code=FORBIDDEN)
    if caller.privileged:
        return
    if local == {Access.PRIVILEGED}:
        target = f" job {args['job_id']}" if "job_id" in args else ""
        raise ProtocolError(
            f"uid {caller.uid} may not {op}{target}: only root and the Slurm user ({slurm_user}) may",
            code=FORBIDDEN,
        )
    for name in sorted(access.privileged_fields & set(args)):
        target = f" of job {args['job_id']}" if "job_id" in args else ""
        raise ProtocolError(
            f"uid {caller.uid} may not set '{name}' in {op}{target} (only root, the Slurm user and peer daemons may)",
            code=FORBIDDEN,
        )
    if Access.LOCAL_ANY in local:
        return
    job = job_of(args["job_id"])  # JOB_OWNER (declarations are checked to have a required job_id)
    if job.uid != caller.uid:
        raise ProtocolError(
            f"uid {caller.uid} (pid {caller.pid}) may not {op} job {job.job_id}: it belongs to uid {job.uid}",
            code=FORBIDDEN,
        )
