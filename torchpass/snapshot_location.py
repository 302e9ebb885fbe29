"""Where a job's snapshots live, and whether this start restores one (torch-free: node agents ask too).

Kept apart from taking and restoring snapshots because the launcher and the command line need these answers
before any state exists (and without a process group).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from torchpass.config import TorchPassConfig

__all__ = ["ENV_RESTART_COUNTS", "restart_count", "restore_target", "snapshot_directory"]

# What Slurm sets in a requeued job's environment (sbatch(1), "SLURM_RESTART_COUNT"); the longer spelling is
# accepted too, as some site wrappers and documents use it.
ENV_RESTART_COUNTS = ("SLURM_RESTART_COUNT", "SLURM_JOB_RESTART_COUNT")


def snapshot_directory(config: TorchPassConfig, environ: Mapping[str, str] | None = None) -> Path:
    """The job's snapshot folder: ``snapshot_dir`` with ``{job}`` replaced by the Slurm job id (or ``local``)."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID", "") or "local"
    return Path(config.snapshot_dir.replace("{job}", job)).expanduser().absolute()


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times Slurm requeued this job (0: its first run, or not under Slurm)."""
    restarts = 0
    for name in ENV_RESTART_COUNTS:
        try:
            restarts = max(restarts, int(environ.get(name, "0") or 0))
        except ValueError:
            pass
    return restarts


def restore_target(config: TorchPassConfig, environ: Mapping[str, str] | None = None) -> tuple[Path | None, bool]:
    """Where to restore from, and whether restoring is required (an explicit request) or only implied.

    ``restore = "auto"`` restores after a Slurm requeue (``SLURM_RESTART_COUNT`` > 0) and is not required:
    a job requeued before its first snapshot was written starts fresh, with a warning (there is nothing it
    could have resumed). ``"latest"`` or a path is required: nothing good there is an error."""
    env = os.environ if environ is None else environ
    choice = config.restore
    if choice == "never":
        return None, False
    if choice == "auto":
        return (snapshot_directory(config, env), False) if restart_count(env) > 0 else (None, False)
    if choice == "latest":
        return snapshot_directory(config, env), True
    return Path(choice).expanduser().absolute(), True
