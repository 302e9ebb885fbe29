"""The one small interface Clockwork uses to talk to Slurm, and the records it returns.

Two implementations exist: :class:`~clockwork.contracts.slurm.cli_backend.CliBackend` (Slurm's client commands,
works everywhere) and :class:`~clockwork.contracts.slurm.pyslurm_backend.PyslurmBackend` (libslurm through
pyslurm, only when pyslurm was built for the site's Slurm release). Callers hold a
:class:`SlurmBackend` and never learn which one they got; :func:`clockwork.contracts.slurm.make_backend` picks.

Records are frozen dataclasses with plain values (strings as Slurm prints them, hostnames already
expanded), so both backends produce identical records and tests can compare them with ``==``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "FINISHED_JOB_STATES",
    "AcctRecord",
    "JobInfo",
    "NodeInfo",
    "SlurmBackend",
    "SlurmVersion",
    "json_number",
    "node_state",
]

SlurmVersion = tuple[int, int, int]

FINISHED_JOB_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "TIMEOUT",
    }
)
"""Job states after which the job will not run again (a requeued job shows PENDING/REQUEUED instead)."""


@dataclass(frozen=True)
class JobInfo:
    """A job as slurmctld knows it right now (it forgets finished jobs after MinJobAge)."""

    job_id: int
    name: str
    state: str
    """Slurm's job state string, e.g. RUNNING, PENDING, COMPLETED; a flag state such as COMPLETING or
    REQUEUED wins over the base state, as in ``scontrol show job``."""
    user: str
    partition: str
    nodes: list[str]
    """Allocated nodes, expanded; empty while pending."""
    exit_code: str
    """``"<exit status>:<signal>"`` as scontrol/sacct print it, e.g. ``"0:0"``, ``"1:0"``, ``"0:9"``."""
    restart_count: int
    """How often Slurm requeued the job (SLURM_RESTART_COUNT in the job)."""
    admin_comment: str

    @property
    def finished(self) -> bool:
        """True once the job reached a terminal state."""
        return self.state in FINISHED_JOB_STATES


@dataclass(frozen=True)
class NodeInfo:
    """A node as slurmctld reports it."""

    name: str
    state: tuple[str, ...]
    """Base state first, then flags, upper case: ``("IDLE", "DRAIN")``, ``("DOWN", "NOT_RESPONDING")``."""
    addr: str
    partitions: list[str]
    reason: str
    """Why the node is down/drained, without scontrol's ``[user@time]`` suffix; empty if none."""

    @property
    def base_state(self) -> str:
        """The base state (IDLE, ALLOCATED, MIXED, DOWN, ...) or "" when Slurm gave none."""
        return self.state[0] if self.state else ""

    def has(self, state: str) -> bool:
        """True if the base state or any flag equals ``state`` (case-insensitive), e.g. ``has("DRAIN")``."""
        return state.upper() in self.state


@dataclass(frozen=True)
class AcctRecord:
    """One accounting row from slurmdbd: the job itself or one of its steps."""

    job_id: str
    """``"12"`` for the job, ``"12.batch"``, ``"12.extern"``, ``"12.0"`` for steps."""
    state: str
    """Base state without sacct's ``by <uid>`` suffix, e.g. CANCELLED."""
    nodes: list[str]
    start: str
    """Local time ``YYYY-MM-DDTHH:MM:SS`` or "" when the job/step never started."""
    end: str
    """Local time ``YYYY-MM-DDTHH:MM:SS`` or "" while it is still running."""
    exit_code: str
    admin_comment: str
    restarts: int | None = None
    """Requeue count when the source knows it; ``sacct`` (22.05) does not, so the CLI leaves None."""

    @property
    def is_step(self) -> bool:
        return "." in self.job_id


_STATE_SYMBOLS = {
    "*": "NOT_RESPONDING",
    "~": "POWERED_DOWN",
    "#": "POWERING_UP",
    "%": "POWERING_DOWN",
    "!": "POWER_DOWN",
    "$": "MAINTENANCE",
    "@": "REBOOT_REQUESTED",
    "^": "REBOOT_ISSUED",
    "-": "PLANNED",
}


def node_state(raw: str | Sequence[str] | None, flags: Iterable[str] = ()) -> tuple[str, ...]:
    """Normalize every spelling of a node state that Slurm versions print into one tuple.

    Accepts ``"IDLE+DRAIN"`` (scontrol, pyslurm), ``"idle"`` plus ``flags=["DRAIN"]`` (22.05 JSON),
    ``["IDLE", "DRAIN"]`` (23.02+ JSON) and sinfo's symbol suffixes (``"DOWN*"`` -> NOT_RESPONDING).
    """
    if raw is None:
        parts: list[str] = []
    elif isinstance(raw, str):
        parts = raw.split("+")
    else:
        parts = [str(p) for p in raw]
    out: list[str] = []
    for part in [*parts, *flags]:
        word = part.strip().upper()
        extra: list[str] = []
        while word and word[-1] in _STATE_SYMBOLS:
            extra.insert(0, _STATE_SYMBOLS[word[-1]])
            word = word[:-1]
        for state in (word, *extra):
            if state and state not in out:
                out.append(state)
    return tuple(out)


@runtime_checkable
class SlurmBackend(Protocol):
    """What Clockwork needs from Slurm. Every failure raises :class:`clockwork.contracts.errors.SlurmError`."""

    def version(self) -> SlurmVersion:
        """The site's Slurm release, e.g. ``(22, 5, 8)``; needs no controller."""
        ...

    def ping(self) -> bool:
        """True if slurmctld answers; False when it is down or too slow (never raises for that)."""
        ...

    def nodes(self) -> list[NodeInfo]:
        """Every node slurmctld knows."""
        ...

    def job(self, job_id: int) -> JobInfo | None:
        """The live job record, or None when slurmctld no longer (or never) knew the job."""
        ...

    def submit(self, script: Path | str, args: Sequence[str] = ()) -> int:
        """Submit with sbatch semantics and return the job id.

        ``script`` is a batch script file when it is a :class:`~pathlib.Path` and a command line for
        ``sbatch --wrap`` when it is a ``str``. ``args`` are sbatch options (SPANK options included).
        """
        ...

    def cancel(self, job_id: int) -> None:
        """Cancel a job; cancelling a job that already ended is not an error."""
        ...

    def accounting(self, job_id: int, all_steps: bool = False) -> list[AcctRecord]:
        """slurmdbd's records for the job (and its steps with ``all_steps``); needs slurmdbd."""
        ...

    def set_admin_comment(self, job_id: int, text: str) -> None:
        """Set AdminComment on a live job (slurmctld) or a finished one (slurmdbd).

        ``text`` must not contain quotes or newlines: sacctmgr turns quotes into backticks, so the same
        comment would read differently depending on when it was written.
        """
        ...

    def drain(self, node: str, reason: str) -> None:
        """Drain a node: running jobs continue, nothing new is scheduled there."""
        ...

    def resume(self, node: str) -> None:
        """Return a drained/down node to service."""
        ...

    def expand_hostlist(self, expr: str) -> list[str]:
        """Expand a hostlist expression such as ``n[01-03],gpu1``."""
        ...


def json_number(value: Any) -> int | None:
    """An integer field of Slurm's JSON: a plain number, or 23.02+'s ``{"set": true, "number": N}`` wrapper; None
    when unset, infinite or not a number."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
