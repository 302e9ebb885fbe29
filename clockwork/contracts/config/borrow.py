"""The admin's borrowing policy: the ``[borrow]`` section of clockwork.toml (one documented dataclass).

A job submitted with ``--clockwork-spares=borrow`` may, when it loses a node, take one from preemptible work.
Everything that decides *which* work may be taken, *for whom*, and *how* lives here, in the admin's file: a
user's request carries nothing but its job id. Lists are comma-separated strings (TOML-, environment- and
command-line-friendly alike); :meth:`BorrowConfig.__post_init__` refuses settings that cannot work, naming the
key and the value, so a half-configured policy fails at load time rather than at a node failure.
"""

from __future__ import annotations

from dataclasses import dataclass

from clockwork.contracts.config.fields import setting
from clockwork.contracts.errors import ConfigError

__all__ = ["BorrowConfig", "names"]


def names(text: str) -> tuple[str, ...]:
    """``"a, b,,c"`` -> ``("a", "b", "c")``: the comma-separated lists of this section."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclass(frozen=True)
class BorrowConfig:
    """Borrowed spares: a failing --clockwork-spares=borrow job takes a node from preemptible work via Slurm."""

    enabled: bool = setting(
        False,
        "Let the node daemons borrow nodes for --clockwork-spares=borrow jobs. Off: every borrow request is "
        "refused (the job falls back or fails at once, with this reason). Whether such jobs may be submitted "
        "at all is the SPANK plugin's allow_borrow (plugstack.conf).",
    )
    partitions: str = setting(
        "",
        "Comma-separated partitions whose running jobs may be preempted for a borrow (e.g. 'low'). A job is "
        "a candidate when its partition is listed here or its QOS is listed in 'qos'.",
    )
    qos: str = setting("", "Comma-separated QOS whose running jobs may be preempted for a borrow (e.g. 'scavenger').")
    method: str = setting(
        "partition_prio",
        "How Slurm is made to preempt: 'partition_prio' submits the holder allocation to holder_partition "
        "(a higher PriorityTier over the same nodes; PreemptType=preempt/partition_prio); 'qos' submits it "
        "with holder_qos, whose Preempt list names the borrowable QOS (PreemptType=preempt/qos).",
        choices=("partition_prio", "qos"),
    )
    holder_partition: str = setting(
        "",
        "Partition of the holder allocation. Required for method 'partition_prio'; with 'qos', empty means "
        "the preempted job's own partition.",
    )
    holder_qos: str = setting(
        "", "QOS of the holder allocation. Required for method 'qos'; empty = see holder_qos_from_job."
    )
    holder_qos_from_job: bool = setting(
        True,
        "With holder_qos empty, submit the holder with the training job's own QOS (its limits and billing "
        "apply to the borrowed node too); false: no QOS given (the user's default). The holder always gets "
        "the job's account, GRES per node and at most its remaining time.",
    )
    max_nodes_per_job: int = setting(1, "Most nodes one job may hold borrowed at a time; 0 = no borrowing.", min=0)
    min_age_minutes: float = setting(
        0.0,
        "Jobs that started less than this many minutes ago are never taken (protects work that keeps being "
        "restarted from thrashing); 0 = no such protection.",
        min=0.0,
    )
    requeueable_only: bool = setting(
        True,
        "Only take jobs that Slurm may requeue (--requeue, or JobRequeue=1): a preempted job that cannot be "
        "requeued is cancelled, and its work is lost for good.",
    )
    choose: str = setting(
        "least_node_time",
        "Which candidate loses its node, least work lost first: 'least_node_time' (elapsed time x nodes of "
        "the job, every node of a preempted job is requeued), 'least_elapsed' (shortest run so far).",
        choices=("least_node_time", "least_elapsed"),
    )
    give_back: str = setting(
        "job_end",
        "When the holder allocation ends and the node returns to the preempted work: 'job_end' (the training "
        "job's Epilog cancels it), 'node_return' (also as soon as the job's own failed node is back in "
        "service and no job step of the holder is still running there).",
        choices=("job_end", "node_return"),
    )
    timeout_s: float = setting(
        60.0,
        "Seconds from submitting the holder until it must run on the chosen node (keep it above GraceTime); "
        "past it the holder is cancelled and the job is told at once.",
        min=1.0,
    )
    allow_users: str = setting("", "Comma-separated users who may borrow; empty = every user.")
    allow_accounts: str = setting("", "Comma-separated Slurm accounts whose jobs may borrow; empty = every account.")
    allow_partitions: str = setting(
        "", "Comma-separated partitions whose jobs may borrow; empty = jobs of every partition."
    )

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        if not names(self.partitions) and not names(self.qos):
            raise ConfigError("[borrow] partitions/qos: both empty while enabled = true: name what may be preempted")
        if self.method == "partition_prio" and not self.holder_partition.strip():
            raise ConfigError(
                f"[borrow] holder_partition: invalid value {self.holder_partition!r} (method 'partition_prio' "
                "needs the higher-PriorityTier partition the holder is submitted to)"
            )
        if self.method == "qos" and not self.holder_qos.strip():
            raise ConfigError(
                f"[borrow] holder_qos: invalid value {self.holder_qos!r} (method 'qos' needs the QOS whose "
                "Preempt list names the borrowable QOS)"
            )
        if self.holder_partition.strip() in names(self.partitions):
            raise ConfigError(
                f"[borrow] holder_partition: invalid value {self.holder_partition!r} (it is also listed in "
                "'partitions': holders could be taken from each other)"
            )
