"""What a node agent puts in a new process's environment about the fabric, read from its node daemon.

Every process the agent starts (a rank, a spare, a replacement) gets :func:`torchpass.fabric_env.fabric_environment`
for the HCAs the daemon's LinkPass avoids at that moment (``avoid_hcas`` of the daemon's status: down, no live path,
a Fleet Lens suspect) and for the node's address. NCCL reads ``NCCL_IB_HCA`` once per process, so this is the
moment the exclusion can take effect: the daemon's GPU health watch moves the node's ranks into processes
started after the fault (``[health] hca_down_move_s``), and those carry it. Each change of what processes get is
recorded as a ``torchpass.fabric_env`` event, with what could not be set and why. No torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torchpass.events import EventSink, emit
from torchpass.fabric_env import (
    ENV_NCCL_VERSION,
    FabricEnv,
    StatusReader,
    avoid_hcas_of,
    fabric_environment,
    nccl_path,
    parse_version,
)

log = logging.getLogger("clockwork.torchpass.agent")


class NodeFabric:
    """The fabric environment of the processes this agent starts, kept current with the node daemon's view."""

    def __init__(
        self,
        node: str,
        address: str,
        environ: Mapping[str, str],
        read_status: StatusReader | None,
        event_sink: EventSink | None = None,
        interfaces: Mapping[str, list[str]] | None = None,
    ) -> None:
        self.node = node
        self.address = address
        self.environ = dict(environ)
        self.read_status = read_status
        self.event_sink = event_sink
        self.interfaces = interfaces  # None: the machine's (the seam tests use to name a device)
        self.last: tuple[tuple[tuple[str, str], ...], tuple[str, ...]] | None = None

    def current(self) -> FabricEnv:
        """What a process started now gets; a ``torchpass.fabric_env`` event when that changed."""
        avoid: dict[str, str] = {}
        notes: list[str] = []
        if self.read_status is None:
            notes.append("no node daemon: no HCA is excluded (NCCL_IB_HCA as the job set it)")
        else:
            try:
                avoid = avoid_hcas_of(self.read_status())
            except Exception as exc:  # the daemon restarting: start the process with what is known
                notes.append(f"node daemon unreadable ({type(exc).__name__}: {exc}): no HCA excluded this time")
        fabric = fabric_environment(self.environ, avoid, self.address, self.interfaces)
        fabric = FabricEnv(fabric.env, notes + fabric.notes)
        self._record(avoid, fabric)
        return fabric

    def _record(self, avoid: dict[str, str], fabric: FabricEnv) -> None:
        key = (tuple(sorted(fabric.env.items())), tuple(fabric.notes))
        if key == self.last:
            return
        self.last = key
        path = nccl_path(parse_version(self.environ.get(ENV_NCCL_VERSION)))
        fields: dict[str, Any] = {
            "node": self.node,
            "avoid_hcas": avoid,
            "env": fabric.env,
            "notes": fabric.notes,
            # The agent has no torch: each rank logs its own NCCL's path (torchpass.rank.backends); this is what
            # the job's TORCHPASS_NCCL_VERSION says, if set.
            "nccl": path.why,
        }
        if avoid:
            fields["action"] = (
                "processes started from now exclude " + ", ".join(sorted(avoid)) + "; the node's running ranks move "
                "into such processes when the node daemon's GPU health watch moves them ([health] hca_down_move_s), "
                "which needs a spare process: without one TorchPass cannot act and NCCL keeps failing on the HCA"
            )
        emit(self.event_sink, log, "torchpass.fabric_env", **fields)
