"""How a launcher starts a rank: the environment contract, the command line, and dying with the parent.

Plain data, no torch, so the launcher and the node agents stay light. The messages ranks, coordinator and
command line exchange are :mod:`clockwork.contracts.coordinator_wire`'s and the two message modules beside it
(:mod:`clockwork.contracts.coordinator_requests`, :mod:`clockwork.contracts.coordinator_replies`): one definition for
TorchPass and the daemon.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from clockwork.contracts.coordinator_wire import ProtocolError, Role

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
    "LaunchEnv",
    "die_with_parent",
    "rank_argv",
    "thread_default",
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
TRANSPARENT_MODULE = "torchpass.transparent.bootstrap"  # the rank bootstrap of model-transparent mode
ENV_OMP_THREADS = "OMP_NUM_THREADS"


def thread_default(env: Mapping[str, str], ranks_per_node: int) -> dict[str, str]:
    """``{"OMP_NUM_THREADS": "1"}`` when several ranks share a node and the user set no thread count; else ``{}``.

    What torchrun does, for the same reason: each rank's intra-op thread pool is otherwise as large as the node,
    so G ranks run G x cores threads that spin against each other (on a 2-core machine a 4-rank CPU job took
    twice the CPU). The rule is the job's, not the node's (``ranks_per_node`` is G, or a local job's rank
    count), so that every process of a job, spares and replacements included, computes with the same thread
    count: the bitwise equality of a recovered job depends on it. A value the user set is kept.
    """
    if ranks_per_node > 1 and not env.get(ENV_OMP_THREADS, "").strip():
        return {ENV_OMP_THREADS: "1"}
    return {}


def rank_argv(python: str, script: str, script_args: list[str], *, transparent: bool) -> list[str]:
    """The command line of a rank or spare process: the script itself (model-aware mode: it calls
    ``torchpass.init``), or, in model-transparent mode, TorchPass's bootstrap, which installs its interposers
    and then runs the unmodified script (:mod:`torchpass.transparent.bootstrap`)."""
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
        return Role.parse(self.role).slot

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
        try:
            known = Role.parse(role).known
        except ProtocolError:
            known = False
        if not known:
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
