"""The last line of defence: a job TorchPass cannot recover asks Slurm to requeue it from its newest snapshot.

Why a requeue, and why only sometimes: some failures are beyond any in-job repair (no spare came within
``spare_timeout_s`` and none could be borrowed; every holder of some part of the state died at once, with no
replica and no peer copy left), yet new nodes and the newest snapshot undo them. Slurm gives both: a requeued
job gets a fresh allocation, and its ranks restore the newest complete snapshot themselves (``restore =
"auto"``, :func:`torchpass.snapshot_location.restore_target`). A failure of the script itself (an exception, a
replica mismatch, collectives out of line) or one over ``max_failures``/``max_resets`` would only fail again, so it
ends the job as before; so does a job with no complete snapshot (a requeue would start it over from step 0,
which the user did not ask for) and one requeued ``max_requeues`` times already.

The leading agent decides (:func:`decide`, no I/O but listing the snapshot folder) and acts (:func:`requeue`:
``scontrol requeue``, which a job's owner may run on their own batch job) after every agent saw the end, and
says which way it went and why in a ``torchpass.requeued`` or ``torchpass.not_requeued`` event, which the
job's report and AdminComment carry. Slurm 25.11's expedited requeue (``sbatch --requeue=expedite``) is Slurm's
own answer to a node failure. It does not expedite this requeue (measured on 26.05: ``scontrol requeue`` leaves the
job at its own priority, only without the requeue delay, and nothing a job's owner may do sets ``EXPEDITING``); see
docs/user-guide.md, "Expedited requeue".
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from clockwork.contracts.coordinator_wire import FailureKind
from clockwork.contracts.snapshots.store import list_snapshots
from torchpass.config import TorchPassConfig
from torchpass.snapshot_location import restart_count, snapshot_directory

__all__ = ["RequeueDecision", "decide", "requeue"]

#: How long ``scontrol requeue`` may take (one RPC to slurmctld).
SCONTROL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RequeueDecision:
    """Whether to requeue a failed job, and the sentence that says why (for the event, the log and the report)."""

    requeue: bool
    why: str
    snapshot: str = ""  # the snapshot the requeued job will restore (when ``requeue``)
    step: int = -1  # its step

    def fields(self) -> dict[str, object]:
        """The event's fields."""
        out: dict[str, object] = {"why": self.why}
        if self.snapshot:
            out.update(snapshot=self.snapshot, step=self.step)
        return out


def decide(kind: FailureKind, config: TorchPassConfig, environ: Mapping[str, str]) -> RequeueDecision:
    """Whether a job that failed with ``kind`` should be requeued, given its settings and its snapshots."""
    if not kind.requeue_helps:
        return RequeueDecision(False, f"a {kind.value} failure: a requeued job would fail the same way")
    if not config.requeue_on_loss:
        return RequeueDecision(False, "requeue_on_loss is off")
    if not environ.get("SLURM_JOB_ID"):
        return RequeueDecision(False, "not a Slurm job")
    restarts = restart_count(environ)
    if restarts >= config.max_requeues:
        return RequeueDecision(
            False, f"the job was requeued {restarts} time(s) already (max_requeues={config.max_requeues})"
        )
    if config.restore != "auto" and config.restore != "latest":
        return RequeueDecision(
            False, f"restore={config.restore!r}: a requeued job would not restore its newest snapshot"
        )
    directory = snapshot_directory(config, environ)
    complete = [info for info in list_snapshots(directory) if info.complete]
    if not complete:
        return RequeueDecision(False, f"no complete snapshot in {directory}: a requeued job would start over")
    newest = complete[-1]
    return RequeueDecision(
        True, f"requeued to restore the snapshot of step {newest.step}", str(newest.path), newest.step
    )


def requeue(job_id: str, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> str:
    """``scontrol requeue JOB``: '' when Slurm took it, else what went wrong (Slurm's words)."""
    try:
        done = run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job_id}: {exc}"
    if done.returncode != 0:
        return f"scontrol requeue {job_id}: {(done.stderr or done.stdout).strip() or f'exit {done.returncode}'}"
    return ""
