"""Asking a TorchPass job's coordinator to migrate a rank or take a snapshot: what ``clockwork migrate``,
``clockwork snapshot take`` and the daemon's GPU health watch use.

How the coordinator is found: every TorchPass node agent posts a ``torchpass.coordinator`` event to its node
daemon when it starts and whenever the coordinator's leader changes (``{leader, endpoints, world_size, spares,
agent, term, key}``). The newest such event of the job says where the leader is; ``endpoints`` lists every
replica, so a stale record still works: a passive replica answers with a redirect to the leader, and a dead one
is skipped after a timeout.

Requests go through :class:`CoordinatorRpc`, the one client of the coordinator's wire protocol
(:mod:`clockwork.contracts.coordinator_wire`): the command line here, and every TorchPass rank for its own requests
(:mod:`torchpass.rank.control`). It imports no TorchPass: clockworkd must not import torch, and the dependency runs
torchpass -> clockworkd, never the reverse. Every socket is CURVE-authenticated with the job's key, which the
record carries (:mod:`clockwork.contracts.jobkey`). The coordinator answers at once; the rank moves at its next step
boundary.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from clockwork.contracts.coordinator_wire import MAX_MESSAGE_BYTES, ProtocolError, decode, encode
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.jobkey import ENV_JOB_KEY, JobKey, JobKeyError

__all__ = [
    "COORDINATOR_EVENT",
    "COORDINATOR_HELP",
    "CoordinatorBusy",
    "CoordinatorLost",
    "CoordinatorRefused",
    "CoordinatorRpc",
    "JobStopped",
    "ask_leader",
    "coordinator_record",
    "local_record",
    "read_coordinator_file",
    "request_migration",
    "write_coordinator_file",
]

log = logging.getLogger("clockwork.coordinator_client")

COORDINATOR_EVENT = "torchpass.coordinator"
MAX_REDIRECTS = 3
RETRY_INTERVAL_S = 0.5
COORDINATOR_HELP = (
    "The coordinator file `torchpass run --local` printed (address and job key), or tcp://HOST:PORT with the "
    f"job key in {ENV_JOB_KEY}."
)


class CoordinatorBusy(ClockworkError):
    """The coordinator refused for now; the same request may succeed later (e.g. no spare is ready yet)."""


class CoordinatorLost(RuntimeError):
    """The coordinator did not answer in time (in local mode: the launcher is gone)."""


class CoordinatorRefused(RuntimeError):
    """The coordinator answered with an error (the message says why).

    ``leader`` is set when the answer came from a passive replica (Slurm mode): where the leader is; ``retry``
    when the same request may succeed later (a migration asked for before a spare is ready)."""

    def __init__(self, message: str, leader: str = "", *, retry: bool = False) -> None:
        super().__init__(message)
        self.leader = leader
        self.retry = retry


class JobStopped(RuntimeError):
    """The coordinator ended the job: ``done`` True when it finished, False when it failed."""

    def __init__(self, reason: str, done: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.done = done


class CoordinatorRpc:
    """Requests over one DEALER socket, from one thread; every request has an id its reply repeats.

    ``key``: the job's (None: from ``TORCHPASS_JOB_KEY``). ``identity``: a rank's request socket is ``WID.r``,
    so that the coordinator (or the proxy in its node agent) sees the rank itself."""

    _ids = itertools.count(int(time.time() * 1000) % 1_000_000)

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        timeout_s: float,
        identity: bytes | None = None,
        *,
        key: JobKey | None = None,
    ) -> None:
        if key is None:
            key = JobKey.from_environ()
            if key is None:
                raise JobKeyError(f"{ENV_JOB_KEY} is not set: the coordinator answers only the job's own processes")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._sock = context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        key.connect_as_client(self._sock)
        self._sock.connect(endpoint)

    def close(self) -> None:
        """Close the socket (pending requests are dropped)."""
        self._sock.close(0)

    def call(self, op: str, *, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """One round trip. Raises :class:`CoordinatorLost`, :class:`CoordinatorRefused` or :class:`JobStopped`."""
        return self.wait(op, time.monotonic() + (timeout_s or self.timeout_s), **fields)

    def wait(
        self,
        op: str,
        deadline: float,
        *,
        interrupt: Callable[[], None] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Send once and wait for the reply until ``deadline`` (monotonic) — a long poll when the coordinator
        parks the request. ``interrupt`` is called every quarter second and may raise to give up early."""
        req_id = next(self._ids)
        self._sock.send(encode(op, id=req_id, **fields))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CoordinatorLost(f"no answer to {op} from the coordinator at {self.endpoint}")
            if self._sock.poll(int(min(left, 0.25) * 1000) + 1, zmq.POLLIN):
                try:
                    reply = decode(self._sock.recv())
                except ProtocolError as exc:
                    log.warning("unreadable reply from the coordinator: %s", exc)
                    continue
                if reply.get("id") != req_id:
                    continue  # a late answer to an abandoned request
                if not reply.get("ok", False):
                    raise CoordinatorRefused(
                        str(reply.get("error", "refused")),
                        str(reply.get("leader") or ""),
                        retry=bool(reply.get("retry")),
                    )
                if reply.get("stop"):
                    raise JobStopped(str(reply.get("reason", "")), bool(reply.get("done")))
                return reply
            if interrupt is not None:
                interrupt()


def write_coordinator_file(path: Path, endpoint: str, key: JobKey) -> None:
    """Write a local job's coordinator address and job key, for ``--coordinator FILE`` (mode 0600)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{endpoint}\n{key.hex}\n")


def read_coordinator_file(path: Path) -> tuple[str, JobKey]:
    """(endpoint, key) from a file :func:`write_coordinator_file` wrote."""
    lines = path.read_text().split()
    if len(lines) != 2 or not lines[0].startswith("tcp://"):
        raise JobKeyError(f"{path}: not a TorchPass coordinator file (an address and a job key)")
    return lines[0], JobKey.from_hex(lines[1], where=str(path))


def local_record(target: str) -> dict[str, Any]:
    """The coordinator record of a job found by ``--coordinator FILE|tcp://HOST:PORT`` (see COORDINATOR_HELP)
    instead of through the node daemons: what ``torchpass run --local`` jobs need."""
    try:
        if target.startswith("tcp://"):
            found = JobKey.from_environ()
            if found is None:
                raise ClockworkError(f"--coordinator {target}: the job key is missing ({ENV_JOB_KEY})", exit_code=2)
            endpoint, key = target, found
        else:
            endpoint, key = read_coordinator_file(Path(target))
    except OSError as exc:
        raise ClockworkError(
            f"--coordinator {target}: neither tcp://HOST:PORT nor a readable file ({exc.strerror})", exit_code=2
        ) from None
    except JobKeyError as exc:
        raise ClockworkError(str(exc), exit_code=2) from None
    return {"leader": endpoint, "endpoints": [endpoint], "key": key.hex}


def coordinator_record(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest ``torchpass.coordinator`` record among a job's events (None: not a TorchPass job)."""
    records = [e for e in events if e.get("kind") == COORDINATOR_EVENT and isinstance(e.get("fields"), dict)]
    if not records:
        return None
    newest = max(records, key=lambda e: (float(e.get("time", 0)), int(e["fields"].get("term", 0))))
    return dict(newest["fields"])


def request_migration(
    record: dict[str, Any],
    rank: int,
    timeout_s: float,
    requester: str,
    *,
    wait_s: float = 0.0,
    on_wait: Callable[[str], None] | None = None,
    group: int = 1,
    near: str = "",
) -> dict[str, Any]:
    """Ask the job's leading coordinator to migrate ``rank``; the reply (``target``, ``generation``).

    While the coordinator says "not now" (no spare is ready yet, another membership change is in progress),
    ask again for up to ``wait_s`` seconds; ``on_wait`` hears the first such answer. ``group`` and ``near``:
    one rank of a whole node's move (:class:`clockwork.contracts.coordinator_requests.Migrate`)."""
    world = int(record.get("world_size", 0))
    if world and not 0 <= rank < world:
        raise ClockworkError(f"rank {rank} is out of range: the job trains on ranks 0..{world - 1}", exit_code=2)
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fields: dict[str, Any] = {"op": "migrate", "slot": rank, "requester": requester}
            if group > 1 or near:
                fields.update(group=group, near=near)
            return ask_leader(record, fields, timeout_s, "migrated")
        except CoordinatorBusy as exc:
            if time.monotonic() + RETRY_INTERVAL_S > deadline:
                raise ClockworkError(f"{exc} (waited {wait_s:g} s)" if wait_s else str(exc)) from None
            if on_wait is not None and not told:
                on_wait(str(exc))
                told = True
            time.sleep(RETRY_INTERVAL_S)


def ask_leader(record: dict[str, Any], fields: dict[str, Any], timeout_s: float, purpose: str) -> dict[str, Any]:
    """Send one request (``fields`` with ``op``) to the job's leading coordinator, following redirects and
    skipping dead replicas; the reply, or ClockworkError (refused: 1, nobody answered: 3)."""
    endpoints = [str(record["leader"])] if record.get("leader") else []
    endpoints += [str(e) for e in record.get("endpoints", []) if str(e) not in endpoints]
    if not endpoints:
        raise ClockworkError("the job's coordinator record names no endpoint")
    if not record.get("key"):
        raise ClockworkError(f"the job's coordinator record has no job key: its TorchPass is too old to be {purpose}")
    key = JobKey.from_hex(str(record["key"]), where="the job's coordinator record")
    request = dict(fields)
    op = str(request.pop("op"))
    tried: list[str] = []
    queue = list(endpoints)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        while queue and len(tried) < len(endpoints) + MAX_REDIRECTS:
            endpoint = queue.pop(0)
            if endpoint in tried:
                continue
            tried.append(endpoint)
            rpc = CoordinatorRpc(context, endpoint, timeout_s, key=key)
            try:
                return rpc.call(op, **request)
            except CoordinatorLost:
                continue  # a replica on a lost node: try the next
            except CoordinatorRefused as exc:
                if exc.leader.startswith("tcp://") and exc.leader not in tried:
                    queue.insert(0, exc.leader)  # a passive replica: it knows who leads
                    continue
                refused = f"the coordinator refused: {exc}"
                raise CoordinatorBusy(refused) if exc.retry else ClockworkError(refused) from None
            except JobStopped as exc:
                raise ClockworkError(f"the coordinator says the job ended: {exc.reason}") from None
            finally:
                rpc.close()
    finally:
        context.term()
    raise ClockworkError(
        f"no coordinator replica of the job answered within {timeout_s:g} s (tried {', '.join(tried)})", exit_code=3
    )
