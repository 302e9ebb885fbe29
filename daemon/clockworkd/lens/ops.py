"""The node daemon's op answered from Fleet Lens: ``lens``, the latest snapshot of what this node measures.

Apart from the daemon's loop (:mod:`clockworkd.server`) because it is Lens's side of the control socket, declared
here with its access class: any local user may read it (it is fabric telemetry, no job's data). Lens is looked up
among the daemon's components on each request: one that is off answers with the reason why.
"""

from __future__ import annotations

from typing import Any

from clockwork.contracts.daemon_wire import LENS
from clockworkd.daemon_auth import Access, Caller, OpAccess
from clockworkd.daemon_component import OpsContext
from clockworkd.daemon_ops import OpSpec

__all__ = ["LensOps"]


class LensOps:
    """The op ``lens``, answered by the daemon's component ``"lens"``."""

    def __init__(self, daemon: OpsContext) -> None:
        self.daemon = daemon

    def ops(self) -> list[OpSpec]:
        return [OpSpec(LENS, OpAccess.of(Access.LOCAL_ANY), self.lens)]

    def lens(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """Lens's latest snapshot (``enabled`` False, with ``state``, when it is off)."""
        lens = self.daemon.components.get("lens")
        if lens is None or isinstance(lens, str):
            return {"node": self.daemon.node, "enabled": False, "state": lens or "not configured"}
        snapshot = getattr(lens, "snapshot", None)
        return dict(snapshot()) if callable(snapshot) else {"node": self.daemon.node, "enabled": False}
