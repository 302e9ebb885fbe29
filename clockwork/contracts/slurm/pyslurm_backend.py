"""Slurm through libslurm, using pyslurm's object API (pyslurm >= 23.02, e.g. 25.11).

Only the frequent reads go through pyslurm (no process per call): ``pyslurm.Job.load``,
``pyslurm.Nodes.load``, ``pyslurm.db.Jobs.load`` and ``pyslurm.Job(id).cancel()``. Everything that
is rare or has sbatch/scontrol semantics pyslurm does not reproduce is delegated to a
:class:`~clockwork.contracts.slurm.cli_backend.CliBackend`: ``submit`` (sbatch parses ``#SBATCH`` lines and
runs SPANK plugins, which Clockwork's ``--clockwork-*`` options need), ``set_admin_comment``
(slurmctld or slurmdbd depending on the job's life), ``drain``/``resume``, ``ping`` and ``version``.

pyslurm is never imported here: :func:`clockwork.contracts.slurm.make_backend` imports it (after pointing
``SLURM_CONF`` at the right file, which libslurm reads once at import) and hands the module in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from clockwork.contracts.errors import SlurmError
from clockwork.contracts.hostlist import expand_hostlist
from clockwork.contracts.slurm.backend import AcctRecord, JobInfo, NodeInfo, SlurmVersion, node_state
from clockwork.contracts.slurm.cli_backend import CliBackend

__all__ = ["PyslurmBackend", "pyslurm_release"]

_log = logging.getLogger("clockwork.slurm")

ESLURM_INVALID_JOB_ID = 2017


class PyslurmBackend:
    """:class:`~clockwork.contracts.slurm.backend.SlurmBackend` on libslurm via an imported ``pyslurm`` module."""

    def __init__(self, pyslurm: ModuleType, cli: CliBackend) -> None:
        self._ps: Any = pyslurm
        self._cli = cli

    def __repr__(self) -> str:
        return f"PyslurmBackend(pyslurm {'.'.join(map(str, pyslurm_release(self._ps)))}, {self._cli!r})"

    def version(self) -> SlurmVersion:
        return self._cli.version()

    def ping(self) -> bool:
        return self._cli.ping()

    def nodes(self) -> list[NodeInfo]:
        try:
            loaded = self._ps.Nodes.load()
        except self._ps.RPCError as exc:
            raise SlurmError(f"pyslurm Nodes.load() failed: {exc}") from exc
        return [
            NodeInfo(
                name=str(node.name),
                state=node_state(node.state or ""),
                addr=node.address or "",
                partitions=list(node.partitions or []),
                reason=node.reason or "",
            )
            for node in loaded.values()
        ]

    def job(self, job_id: int) -> JobInfo | None:
        try:
            job = self._ps.Job.load(job_id)
        except self._ps.RPCError as exc:
            if _is_invalid_job(exc):
                return None
            raise SlurmError(f"pyslurm Job.load({job_id}) failed: {exc}") from exc
        return JobInfo(
            job_id=int(job.id),
            name=job.name or "",
            state=job.state or "",
            user=job.user_name or "",
            partition=job.partition or "",
            nodes=expand_hostlist(job.allocated_nodes or ""),
            exit_code=f"{job.exit_code or 0}:{job.exit_code_signal or 0}",
            restart_count=int(job.requeue_count or 0),
            admin_comment=job.admin_comment or "",
        )

    def submit(self, script: Path | str, args: Sequence[str] = ()) -> int:
        return self._cli.submit(script, args)

    def cancel(self, job_id: int) -> None:
        try:
            self._ps.Job(job_id).cancel()  # pyslurm ignores "already done" for SIGKILL itself
        except self._ps.RPCError as exc:
            if _is_invalid_job(exc):
                return
            raise SlurmError(f"pyslurm Job({job_id}).cancel() failed: {exc}") from exc

    def accounting(self, job_id: int, all_steps: bool = False) -> list[AcctRecord]:
        db = self._ps.db
        try:
            jobs = db.Jobs.load(db.JobFilter(ids=[job_id]))
        except self._ps.RPCError as exc:
            raise SlurmError(f"pyslurm db.Jobs.load(ids=[{job_id}]) failed: {exc}") from exc
        out: list[AcctRecord] = []
        for job in jobs:
            out.append(_acct_record(str(job.id), job, job.admin_comment or ""))
            if all_steps:
                for step in (job.steps or {}).values():
                    out.append(_acct_record(f"{job.id}.{step.id}", step, ""))
        return out

    def set_admin_comment(self, job_id: int, text: str) -> None:
        self._cli.set_admin_comment(job_id, text)

    def drain(self, node: str, reason: str) -> None:
        self._cli.drain(node, reason)

    def resume(self, node: str) -> None:
        self._cli.resume(node)

    def expand_hostlist(self, expr: str) -> list[str]:
        return self._cli.expand_hostlist(expr)


def pyslurm_release(pyslurm: Any) -> tuple[int, int]:
    """Major.minor of the Slurm release a pyslurm module was built for.

    pyslurm's MAJOR.MINOR is the Slurm release it targets (pyslurm 25.11.x <-> Slurm 25.11), so
    ``pyslurm.version()`` answers; ``slurm_version()`` (when present) is preferred as it reports the
    libslurm actually compiled in.
    """
    for name in ("slurm_version", "version"):
        func = getattr(pyslurm, name, None)
        if callable(func):
            try:
                return _major_minor(func())
            except (ValueError, TypeError, AttributeError):
                continue
    return _major_minor(getattr(pyslurm, "__version__", ""))


def _major_minor(value: Any) -> tuple[int, int]:
    if isinstance(value, tuple | list) and len(value) >= 2:
        return int(value[0]), int(value[1])
    parts = str(value).strip().split(".")
    if len(parts) < 2:
        raise ValueError(f"not a version: {value!r}")
    return int(parts[0]), int(parts[1])


def _is_invalid_job(exc: BaseException) -> bool:
    return getattr(exc, "errno", None) == ESLURM_INVALID_JOB_ID or "invalid job id" in str(exc).lower()


def _acct_record(job_id: str, rec: Any, admin_comment: str) -> AcctRecord:
    return AcctRecord(
        job_id=job_id,
        state=rec.state or "",
        nodes=_nodes(rec.nodelist),
        start=_iso(rec.start_time),
        end=_iso(rec.end_time),
        exit_code=f"{rec.exit_code or 0}:{rec.exit_code_signal or 0}",
        admin_comment=admin_comment,
    )


def _nodes(nodelist: str | None) -> list[str]:
    # slurmdbd stores the literal "None assigned" for jobs that never got nodes.
    return [] if not nodelist or nodelist == "None assigned" else expand_hostlist(nodelist)


def _iso(epoch: int | None) -> str:
    """Unix time -> local ``YYYY-MM-DDTHH:MM:SS``, the format sacct prints with SLURM_TIME_FORMAT=standard."""
    if not epoch:
        return ""
    return datetime.fromtimestamp(int(epoch)).isoformat(timespec="seconds")
