"""Who sent a request to the node daemon, and whether they may run it: the daemon's access rules in one place.

Nothing a client says about itself is believed. On the control socket the caller is the kernel's account of the
connecting process: libzmq reads ``SO_PEERCRED`` when the connection is accepted and exposes it as the message
property ``Peer-Address`` = ``"HOST:UID:GID:PID"``. On the daemon-to-daemon socket it is the CURVE key the ZAP
handler admitted. :func:`authorise` then applies the rules before any op runs, apart from the op handlers so that
no handler can forget them: root and ``slurm_user`` may do everything; any other uid acts only on jobs registered
with its uid (:data:`JOB_OPS`), never registers one and never sets an event's ``node``; a peer daemon may run only
:data:`PEER_OPS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import zmq

from clockworkd.protocol import FORBIDDEN, ProtocolError, Request
from clockworkd.registry import JobRecord

__all__ = ["JOB_OPS", "PEER_OPS", "Caller", "authorise", "caller_of", "parse_peer_credentials"]

# Ops a peer daemon may send over TCP.
PEER_OPS = frozenset({"ping", "post_event", "node_view"})
# Ops that act on one job; a non-privileged caller must own it.
JOB_OPS = frozenset(
    {"unregister_job", "post_event", "job_events", "borrow", "borrow_status", "borrow_release", "node_verdicts"}
)


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


def authorise(request: Request, caller: Caller, job_of: Callable[[int], JobRecord], slurm_user: str) -> None:
    """Raise ProtocolError(forbidden) unless ``caller`` may run ``request``; ``job_of`` finds the job a
    :data:`JOB_OPS` request names (raising UnknownJobError for one that is not registered)."""
    op, args = request.op, request.args
    if caller.plane == "peer":
        if op not in PEER_OPS:
            raise ProtocolError(
                FORBIDDEN,
                f"{caller.describe()} may not {op}: the daemon-to-daemon socket serves only "
                + ", ".join(sorted(PEER_OPS)),
            )
        return
    if caller.privileged:
        return
    if op == "register_job":
        raise ProtocolError(
            FORBIDDEN,
            f"uid {caller.uid} may not register job {args['job_id']}: only root and the Slurm user "
            f"({slurm_user}) register jobs",
        )
    if op == "post_event" and "node" in args:
        raise ProtocolError(
            FORBIDDEN,
            f"uid {caller.uid} may not set 'node' of an event of job {args['job_id']} (peer daemons only)",
        )
    if op in JOB_OPS:
        job = job_of(args["job_id"])
        if job.uid != caller.uid:
            raise ProtocolError(
                FORBIDDEN,
                f"uid {caller.uid} (pid {caller.pid}) may not {op} job {job.job_id}: it belongs to uid {job.uid}",
            )
