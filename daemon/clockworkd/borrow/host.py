"""Host the borrow manager in the node daemon (the way ``clockworkd.failover.host`` hosts LinkPass)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from clockwork.contracts.config.borrow import BorrowConfig
from clockwork.contracts.config.core import SlurmConfig
from clockwork.contracts.slurm.cli_backend import CliBackend
from clockworkd.borrow.manager import BorrowManager
from clockworkd.borrow.slurm_ops import CliBorrowSlurm

if TYPE_CHECKING:
    from clockworkd.server import Daemon

__all__ = ["start_borrow"]

log = logging.getLogger("clockwork.daemon.borrow")


def start_borrow(cfg: BorrowConfig, slurm: SlurmConfig, daemon: Daemon) -> BorrowManager | str:
    """The manager, or why borrowing is off (what ``status`` shows; requests are then refused with it).

    Always the CLI backend: holders are submitted with ``sbatch --uid/--gid`` (root only), and the policy
    reads ``squeue --json`` fields that the backend-neutral records leave out."""
    if not cfg.enabled:
        return "disabled ([borrow] enabled = false)"
    cli = CliBackend(Path(slurm.conf), Path(slurm.bin_dir) if slurm.bin_dir else None, slurm.timeout_s)
    manager = BorrowManager(cfg, CliBorrowSlurm(cli), daemon.node, daemon.record_event)
    log.info(
        "node %s: borrowing enabled: from %s, holders via %s, at most %d node(s) per job, give back at %s",
        daemon.node,
        ", ".join(filter(None, (cfg.partitions, cfg.qos))),
        cfg.method,
        cfg.max_nodes_per_job,
        cfg.give_back,
    )
    return manager
