"""A job's events as the node daemons hold them, for the commands that read them (`migrate`, `report`).

Every daemon logs what happened on its node; a command run on one node asks that node's daemon, and, when
the nodes' run folders are reachable from here (``{node}`` in ``[daemon] run_dir``, as in the sandbox), the
daemons of the job's other nodes (from Slurm) too.
"""

from __future__ import annotations

from typing import Any

from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.errors import ClockworkError, DaemonError

__all__ = ["events_from", "job_nodes"]


def events_from(cfg_daemon: Any, node: str, job_id: int) -> list[dict[str, Any]] | None:
    """The job's events on ``node``'s daemon; None when that daemon does not know the job (or is not there)."""
    try:
        with DaemonClient.from_config(cfg_daemon, node) as client:
            return client.job_events(job_id)
    except DaemonError as exc:
        if exc.code in ("unknown_job", "unavailable"):
            return None
        raise


def job_nodes(loaded: Any, job_id: int) -> list[str]:
    """The job's nodes according to Slurm ([] when Slurm cannot say)."""
    from clockwork.contracts.slurm import from_config  # lazy: only needed when the local daemon does not know the job

    try:
        info = from_config(loaded.slurm).job(job_id)
    except ClockworkError:
        return []
    if info is not None and info.nodes:
        return list(info.nodes)
    try:  # a finished job slurmctld forgot: accounting still knows its nodes
        records = from_config(loaded.slurm).accounting(job_id)
    except ClockworkError:
        return []
    return next((list(r.nodes) for r in records if not r.is_step and r.nodes), [])
