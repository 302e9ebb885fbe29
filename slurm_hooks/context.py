"""What Slurm tells a hook about the job, read from the environment Slurm gives it.

Slurm runs Prolog/Epilog (slurmd) and PrologSlurmctld/EpilogSlurmctld (slurmctld) as root with no
PATH, describing the job only through environment variables; this module turns them into one typed
record so the handlers never touch ``os.environ`` themselves.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from clockwork.contracts.job_options import JobOptions, JobOptionsError
from slurm_hooks.gpu_jobmap import parse_gpu_indices

log = logging.getLogger("clockwork.hooks")

#: Hook contexts, as Slurm names them in SLURM_SCRIPT_CONTEXT.
CONTEXTS = ("prolog_slurmd", "epilog_slurmd", "prolog_slurmctld", "epilog_slurmctld")
#: Short names accepted on the command line (``python -m slurm_hooks prolog``).
ALIASES = {"prolog": "prolog_slurmd", "epilog": "epilog_slurmd"}


@dataclass(frozen=True)
class HookContext:
    """One hook invocation."""

    context: str
    job_id: int
    uid: int | None
    user: str
    node: str  # where the hook runs: the node name, or "slurmctld"
    nodelist: str
    partition: str
    restart_count: int
    exit_code: int | None  # Epilogs only
    options: dict[str, str]  # the job's --clockwork-* options, from SPANK_CLOCKWORK_* (as they were exported)
    job: JobOptions = field(default_factory=JobOptions)  # --clockwork-ft and --clockwork-spares, parsed
    gpus: tuple[int, ...] = ()  # the job's GPU indices on this node (SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES)

    @property
    def on_controller(self) -> bool:
        return self.context.endswith("_slurmctld")


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def resolve_context(name: str | None, env: Mapping[str, str]) -> str:
    """The hook context from the command line, else from SLURM_SCRIPT_CONTEXT."""
    context = ALIASES.get(name or "", name) or env.get("SLURM_SCRIPT_CONTEXT", "")
    if context not in CONTEXTS:
        raise ValueError(f"unknown hook context {context!r} (expected one of {', '.join((*ALIASES, *CONTEXTS))})")
    return context


def from_env(context: str, env: Mapping[str, str]) -> HookContext:
    """Build the record; a missing SLURM_JOB_ID is an error (this is not a Slurm hook call)."""
    job_id = _int(env.get("SLURM_JOB_ID"))
    if job_id is None:
        raise ValueError("SLURM_JOB_ID is not set: slurm_hooks must be run by Slurm as a Prolog/Epilog")
    on_ctld = context.endswith("_slurmctld")
    prefix = "SPANK_CLOCKWORK_"
    spank = {k: v for k, v in env.items() if k.startswith(prefix)}
    try:
        job = JobOptions.from_environ(spank)
    except JobOptionsError as exc:  # the plugin validates them: only a tampered job gets here; never drain for it
        log.warning("job %s: %s; treating the job as a plain one (no fault tolerance)", job_id, exc)
        job = JobOptions()
    return HookContext(
        context=context,
        job_id=job_id,
        uid=_int(env.get("SLURM_JOB_UID")),
        user=env.get("SLURM_JOB_USER", ""),
        node="slurmctld" if on_ctld else env.get("SLURMD_NODENAME") or socket.gethostname(),
        nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""),
        partition=env.get("SLURM_JOB_PARTITION", ""),
        restart_count=_int(env.get("SLURM_JOB_RESTART_COUNT")) or 0,
        exit_code=_int(env.get("SLURM_JOB_EXIT_CODE2", "").split(":")[0]) if "epilog" in context else None,
        options={k[len(prefix) :].lower(): v for k, v in spank.items()},
        job=job,
        gpus=() if on_ctld else parse_gpu_indices(env),
    )
