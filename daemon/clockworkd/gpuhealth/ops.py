"""The node daemon's op answered from the GPU health watch: ``gpus``, each GPU's reading, health and ranks.

Apart from the daemon's loop (:mod:`clockworkd.server`) because it is the watch's side of the control socket,
declared here with its access class: any local user may ask, and sees the ranks and migrations of its own jobs
only (root and the Slurm user see every job's), as ``status`` and ``jobs`` show each user its own jobs.
"""

from __future__ import annotations

from typing import Any

from clockwork.contracts.daemon_wire import GPUS
from clockworkd.daemon_auth import Access, Caller, OpAccess
from clockworkd.daemon_component import OpsContext
from clockworkd.daemon_ops import OpSpec
from clockworkd.registry import UnknownJobError

__all__ = ["HealthOps"]


class HealthOps:
    """The op ``gpus``, answered by the daemon's component ``"health"``."""

    def __init__(self, daemon: OpsContext) -> None:
        self.daemon = daemon

    def ops(self) -> list[OpSpec]:
        return [OpSpec(GPUS, OpAccess.of(Access.LOCAL_ANY), self.gpus)]

    def gpus(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """The GPU health watch's view; ranks and migrations only of the jobs the caller may see."""
        node = self.daemon.node
        health = self.daemon.components.get("health")
        if health is None or isinstance(health, str):
            return {"node": node, "enabled": False, "state": health or "not configured", "gpus": []}
        snapshot = getattr(health, "snapshot", None)
        if not callable(snapshot):
            return {"node": node, "enabled": False, "state": "no snapshot", "gpus": []}

        def visible(job_id: int) -> bool:
            try:
                job = self.daemon.job_of(job_id)
            except UnknownJobError:
                return False
            return caller.privileged or job.uid == caller.uid

        return dict(snapshot(visible))
