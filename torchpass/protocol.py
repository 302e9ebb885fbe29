"""The wire between ranks, the coordinator and the CLI: environment contract, messages, generation records.

Everything here is plain data (msgpack over ZeroMQ), with no torch, so the launcher, the coordinator and
``clockwork migrate`` stay light and a later Slurm wiring (agents on every node, the node daemon) can speak
the same protocol from any process.

Sockets: the coordinator binds one ROUTER. Each rank connects two DEALERs, one per thread (ZeroMQ sockets
are not thread-safe): ``WID.r`` carries the main thread's requests (register, await_generation, broken,
joined, finished, migrate) and ``WID.n`` belongs to the rank's control thread (heartbeats out; pushes in:
``generation`` when membership changes, ``stop`` when the job ends). Every request carries an ``id`` that
its reply repeats, so a late reply to an abandoned long poll is never taken for a newer answer.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import zmq

__all__ = [
    "ENV_AGENT",
    "ENV_COORDINATOR",
    "ENV_DAEMON_SOCKET",
    "ENV_GLOO_HOST",
    "ENV_HOST",
    "ENV_JOB_ID",
    "ENV_LOCAL",
    "ENV_ROLE",
    "ENV_WORKER_ID",
    "ENV_WORLD_SIZE",
    "MAX_MESSAGE_BYTES",
    "GenerationInfo",
    "Handoff",
    "LaunchEnv",
    "ProtocolError",
    "decode",
    "encode",
    "rank_argv",
    "router_messages",
]

# ----- what the launcher puts in each rank's environment -------------------------------------------
ENV_COORDINATOR = "TORCHPASS_COORDINATOR"  # tcp://HOST:PORT of the coordinator (the leader, in Slurm mode)
ENV_WORKER_ID = "TORCHPASS_WORKER_ID"  # unique per process for the job's life (w0, w1, ...)
ENV_ROLE = "TORCHPASS_ROLE"  # "slot:K" for an initial member, "spare" for a standby process
ENV_WORLD_SIZE = "TORCHPASS_WORLD_SIZE"  # number of training slots (fixed for the job)
ENV_HOST = "TORCHPASS_HOST"  # address this process binds its store server and collectives to
ENV_JOB_ID = "TORCHPASS_JOB_ID"  # Slurm job id (for daemon events); empty in local mode
ENV_LOCAL = "TORCHPASS_LOCAL"  # "1": local launcher; the rank dies with it (PR_SET_PDEATHSIG)
ENV_AGENT = "TORCHPASS_AGENT"  # Slurm mode: index of the node agent that started this process (it dies with it)
ENV_GLOO_HOST = "TORCHPASS_GLOO_HOST"  # Slurm mode: the address gloo's device binds to (the node's address)
ENV_DAEMON_SOCKET = "TORCHPASS_DAEMON_SOCKET"  # the node daemon's control socket, for rank events ('' = none)
TRANSPARENT_MODULE = "torchpass.transparent"  # the rank bootstrap of model-transparent mode


def rank_argv(python: str, script: str, script_args: list[str], *, transparent: bool) -> list[str]:
    """The command line of a rank or spare process: the script itself (model-aware mode: it calls
    ``torchpass.init``), or, in model-transparent mode, TorchPass's bootstrap, which installs its interposers
    and then runs the unmodified script (:mod:`torchpass.transparent`)."""
    if transparent:
        return [python, "-m", TRANSPARENT_MODULE, script, *script_args]
    return [python, script, *script_args]


def die_with_parent(parent: int | None = None) -> None:
    """This process gets SIGKILL when its parent dies (``PR_SET_PDEATHSIG``); if the parent is already gone (the
    parent is no longer ``parent``, or is init when ``parent`` is None), it exits at once: nothing would ever
    stop it otherwise.

    Ranks die with their launcher (local mode), zygote or node agent (Slurm mode): under Slurm this is what
    makes an agent's death a node's death, with no orphan rank still training or holding a slot.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    orphaned = os.getppid() == 1 if parent is None else os.getppid() != parent
    if orphaned:
        os._exit(1)


MAX_MESSAGE_BYTES = 1 << 20


class ProtocolError(ValueError):
    """A message that is not a msgpack map with a string ``op``, or is too large."""


def encode(op: str, **fields: Any) -> bytes:
    """One message: a msgpack map with ``op`` and the given fields."""
    return msgpack.packb({"op": op, **fields}, use_bin_type=True)


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


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it in the environment."""

    coordinator: str
    worker_id: str
    role: str  # "slot:K" or "spare"
    world_size: int
    host: str
    job_id: str
    local: bool
    agent: int = -1  # Slurm mode: the node agent that started this process; -1 in local mode

    @property
    def initial_slot(self) -> int | None:
        """The slot the launcher gave this process at start, or None for a spare."""
        if self.role.startswith("slot:"):
            return int(self.role.split(":", 1)[1])
        return None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
        """The launcher's description, or None when this process was not started by a TorchPass launcher."""
        env = os.environ if environ is None else environ
        if not env.get(ENV_COORDINATOR):
            return None
        missing = [k for k in (ENV_WORKER_ID, ENV_ROLE, ENV_WORLD_SIZE) if not env.get(k)]
        if missing:
            raise ProtocolError(f"launcher environment incomplete: {', '.join(missing)} unset")
        role = env[ENV_ROLE]
        if role != "spare" and not (role.startswith("slot:") and role[5:].isdigit()):
            raise ProtocolError(f"{ENV_ROLE} must be 'slot:K' or 'spare', got {role!r}")
        return cls(
            coordinator=env[ENV_COORDINATOR],
            worker_id=env[ENV_WORKER_ID],
            role=role,
            world_size=int(env[ENV_WORLD_SIZE]),
            host=env.get(ENV_HOST, "127.0.0.1"),
            job_id=env.get(ENV_JOB_ID, ""),
            local=env.get(ENV_LOCAL, "") == "1",
            agent=int(env.get(ENV_AGENT) or -1),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables that describe this process (what the launcher exports)."""
        return {
            ENV_COORDINATOR: self.coordinator,
            ENV_WORKER_ID: self.worker_id,
            ENV_ROLE: self.role,
            ENV_WORLD_SIZE: str(self.world_size),
            ENV_HOST: self.host,
            ENV_JOB_ID: self.job_id,
            ENV_LOCAL: "1" if self.local else "0",
            ENV_AGENT: str(self.agent),
        }


def router_messages(sock: zmq.Socket[bytes], log: logging.Logger) -> Iterator[tuple[bytes, bytes, dict[str, Any]]]:
    """(sender identity, raw payload, message) for every message a ROUTER socket holds now; malformed ones are
    logged and dropped, never raised (a stranger's garbage must not stop a coordinator or a proxy)."""
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) < 2:
            continue
        ident, payload = frames[0], frames[-1]
        try:
            msg = decode(payload)
        except ProtocolError as exc:
            log.warning("dropping a malformed message from %r: %s", ident, exc)
            continue
        yield ident, payload, msg
