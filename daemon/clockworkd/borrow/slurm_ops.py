"""The Slurm commands a borrow needs, on top of the CLI backend: the queue, the holder, give-back.

Kept apart from the policy so the manager can be driven by a fake in unit tests and the real CLI (with fake
client executables where no Slurm runs) elsewhere. Every call may raise :class:`clockwork.contracts.errors.SlurmError`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from clockwork.contracts.slurm.backend import JobInfo, NodeInfo
from clockwork.contracts.slurm.cli_backend import CliBackend
from clockwork.contracts.slurm.resources import JobResources
from clockworkd.borrow.candidates import QueueJob, holder_name, parse_queue_json

__all__ = ["BorrowSlurm", "CliBorrowSlurm", "HolderSpec"]

#: What the holder allocation runs: nothing but a placeholder that keeps the node; the replacement rank is
#: started into it as a job step (``srun --jobid=HOLDER --overlap``) by the training job's own agent.
HOLDER_COMMAND = "exec sleep 2147483647"


@dataclass(frozen=True)
class HolderSpec:
    """The holder allocation to submit (as the training job's user, by the privileged daemon)."""

    job_id: int  # the training job it holds a node for
    node: str
    uid: int
    gid: int
    partition: str  # '' = Slurm's choice
    qos: str  # '' = none given
    comment: str
    account: str = ""  # the training job's: the holder is billed where the job is ('' = the user's default)
    gres: str = ""  # per node, as --gres takes it: the job's GPUs (and other GRES) come with the node
    time_minutes: int | None = None  # no longer than the job's remaining time (None: the job has no limit)

    def sbatch_args(self) -> list[str]:
        """sbatch options: pinned to the node, the whole node, never requeued, owned by the job's user, and
        held: Slurm starts it (and so preempts) only once the daemon has labelled the job it preempts. It
        asks for what the training job has per node (GRES: an ``--exclusive`` job gets the node's GRES only
        implicitly, and a step in it sees none unless the job asked), its account and a time limit no
        longer than the job's remaining time."""
        args = [
            f"--job-name={holder_name(self.job_id)}",
            "--hold",
            f"--nodelist={self.node}",
            "--nodes=1",
            "--ntasks=1",
            "--exclusive",
            "--no-requeue",
            f"--uid={self.uid}",
            f"--gid={self.gid}",
            "--chdir=/",
            "--output=/dev/null",
            "--error=/dev/null",
            f"--comment={self.comment}",
        ]
        if self.partition:
            args.append(f"--partition={self.partition}")
        if self.qos:
            args.append(f"--qos={self.qos}")
        if self.account:
            args.append(f"--account={self.account}")
        if self.gres:
            args.append(f"--gres={self.gres}")
        if self.time_minutes is not None:
            args.append(f"--time={self.time_minutes}")
        return args


class BorrowSlurm(Protocol):
    """What the borrow manager asks of Slurm."""

    def queue(self) -> list[QueueJob]: ...
    def nodes(self) -> list[NodeInfo]: ...
    def job(self, job_id: int) -> JobInfo | None: ...
    def job_resources(self, job_id: int) -> JobResources | None: ...
    def submit_holder(self, spec: HolderSpec) -> int: ...
    def release(self, job_id: int) -> None: ...
    def cancel(self, job_id: int) -> None: ...
    def set_admin_comment(self, job_id: int, text: str) -> None: ...
    def running_steps(self, job_id: int) -> int: ...


class CliBorrowSlurm:
    """:class:`BorrowSlurm` through Slurm's client commands (``sbatch --uid`` needs root: the daemon)."""

    def __init__(self, cli: CliBackend) -> None:
        self.cli = cli

    def queue(self) -> list[QueueJob]:
        return parse_queue_json(self.cli.queue_json())

    def nodes(self) -> list[NodeInfo]:
        return self.cli.nodes()

    def job(self, job_id: int) -> JobInfo | None:
        return self.cli.job(job_id)

    def job_resources(self, job_id: int) -> JobResources | None:
        return self.cli.job_resources(job_id)

    def submit_holder(self, spec: HolderSpec) -> int:
        return self.cli.submit(HOLDER_COMMAND, spec.sbatch_args())

    def release(self, job_id: int) -> None:
        self.cli.run_text(["scontrol", "release", str(job_id)])

    def cancel(self, job_id: int) -> None:
        self.cli.cancel(job_id)

    def set_admin_comment(self, job_id: int, text: str) -> None:
        self.cli.set_admin_comment(job_id, text)

    def running_steps(self, job_id: int) -> int:
        """Job steps of ``job_id`` other than batch/extern (the replacement rank runs in one)."""
        out = self.cli.run_text(["squeue", "--noheader", "--steps", f"--jobs={job_id}", "--format=%i"])
        steps = [line.strip() for line in out.splitlines() if line.strip()]
        return sum(1 for s in steps if s.split(".", 1)[-1] not in ("batch", "extern"))


def describe(argv: Sequence[str]) -> str:
    """A command line for the record (quoted as a shell would need it)."""
    return shlex.join(argv)
