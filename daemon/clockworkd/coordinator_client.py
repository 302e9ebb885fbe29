"""Asking a TorchPass job's coordinator to migrate a rank or take a snapshot: what ``clockwork migrate``,
``clockwork snapshot take`` and the daemon's GPU health watch use.

How the coordinator is found: every TorchPass node agent posts a ``torchpass.coordinator`` event to its node
daemon when it starts and whenever the coordinator's leader changes (``{leader, endpoints, world_size, spares,
agent, term, key}``). The newest such event of the job says where the leader is; ``endpoints`` lists every
replica, so a stale record still works: a passive replica answers with a redirect to the leader, and a dead one
is skipped after a timeout.

The request speaks TorchPass's coordinator wire format (a msgpack map with ``op`` and ``id`` over a ZeroMQ
DEALER; the reply repeats the id) without importing TorchPass: clockworkd must not import torch, and the
dependency direction is torchpass -> clockworkd, never the reverse. It is CURVE-authenticated with the job's
key, which the record carries (:mod:`clockworkd.jobkey`). The coordinator answers at once; the rank moves at its
next step boundary.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from clockworkd.errors import ClockworkError
from clockworkd.jobkey import ENV_JOB_KEY, JobKey, JobKeyError

__all__ = [
    "COORDINATOR_EVENT",
    "COORDINATOR_HELP",
    "CoordinatorBusy",
    "ask_leader",
    "coordinator_record",
    "local_record",
    "read_coordinator_file",
    "request_migration",
    "write_coordinator_file",
]

COORDINATOR_EVENT = "torchpass.coordinator"
MAX_REDIRECTS = 3
_ids = itertools.count(int(time.time() * 1000) % 1_000_000)
RETRY_INTERVAL_S = 0.5
COORDINATOR_HELP = (
    "The coordinator file `torchpass run --local` printed (address and job key), or tcp://HOST:PORT with the "
    f"job key in {ENV_JOB_KEY}."
)


class CoordinatorBusy(ClockworkError):
    """The coordinator refused for now; the same request may succeed later (e.g. no spare is ready yet)."""


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


def _call(endpoint: str, key: JobKey, request: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
    """One request to a coordinator replica; None when it does not answer in time."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
    try:
        key.connect_as_client(sock)
        sock.connect(endpoint)
        sock.send(msgpack.packb(request, use_bin_type=True))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            try:
                reply = msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)
            except (ValueError, msgpack.UnpackException):
                continue
            if isinstance(reply, dict) and reply.get("id") == request["id"]:
                return reply
        return None
    finally:
        sock.close(0)
        context.term()


def request_migration(
    record: dict[str, Any],
    rank: int,
    timeout_s: float,
    requester: str,
    *,
    wait_s: float = 0.0,
    on_wait: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Ask the job's leading coordinator to migrate ``rank``; the reply (``target``, ``generation``).

    While the coordinator says "not now" (no spare is ready yet, another membership change is in progress),
    ask again for up to ``wait_s`` seconds; ``on_wait`` hears the first such answer."""
    world = int(record.get("world_size", 0))
    if world and not 0 <= rank < world:
        raise ClockworkError(f"rank {rank} is out of range: the job trains on ranks 0..{world - 1}", exit_code=2)
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            return ask_leader(record, {"op": "migrate", "slot": rank, "requester": requester}, timeout_s, "migrated")
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
    tried: list[str] = []
    queue = list(endpoints)
    while queue and len(tried) < len(endpoints) + MAX_REDIRECTS:
        endpoint = queue.pop(0)
        if endpoint in tried:
            continue
        tried.append(endpoint)
        request = {**fields, "id": next(_ids)}
        reply = _call(endpoint, key, request, timeout_s)
        if reply is None:
            continue  # a replica on a lost node: try the next
        if reply.get("ok"):
            return reply
        leader = str(reply.get("leader") or "")
        if leader.startswith("tcp://") and leader not in tried:
            queue.insert(0, leader)  # a passive replica: it knows who leads
            continue
        refused = f"the coordinator refused: {reply.get('error', 'no reason given')}"
        raise CoordinatorBusy(refused) if reply.get("retry") else ClockworkError(refused)
    raise ClockworkError(
        f"no coordinator replica of the job answered within {timeout_s:g} s (tried {', '.join(tried)})", exit_code=3
    )
