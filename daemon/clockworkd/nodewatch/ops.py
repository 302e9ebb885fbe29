"""The node daemon's ops answered from the node watch it hosts: ``node_verdicts`` and ``node_view``.

Apart from the daemon's loop (:mod:`clockworkd.server`) because they are the node watch's side of the control
and peer planes, and the one long poll the daemon serves: a job's agents wait on ``node_verdicts`` for a verdict
about one of the job's nodes, and the daemon parks the request (:mod:`clockworkd.parked`) until there is one or
its wait is over. ``node_view`` is what another daemon asks when its node watch suspects a node dead: what this
node hears of it. The node watch is looked up among the daemon's components on each request: one started after
these ops were made is asked, and one that is off answers with the reason why.

Access (declared in :meth:`NodeWatchOps.ops`): ``node_verdicts`` is the job's owner's (its agents); ``node_view``
is for peer daemons, and any local user may ask it too (it says what ``clockwork node status`` already shows
everyone: how this node hears the others).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from clockwork.contracts.daemon_wire import NODE_VERDICTS, NODE_VIEW
from clockwork.contracts.node_verdict import NodeVerdict
from clockworkd.daemon_auth import Access, Caller, OpAccess
from clockworkd.daemon_component import OpsContext
from clockworkd.daemon_ops import OpSpec
from clockworkd.parked import Park

__all__ = ["NodeWatchOps", "VerdictSource"]


@runtime_checkable
class VerdictSource(Protocol):
    """The node watch, as the ops ``node_verdicts`` and ``node_view`` see it."""

    def verdicts_about(self, nodes: tuple[str, ...], after: int) -> list[NodeVerdict]: ...
    def latest_seq(self) -> int: ...
    def view(self, node: str) -> dict[str, Any]: ...


class NodeWatchOps:
    """The two ops, answered from the daemon's component ``"nodewatch"``."""

    def __init__(self, daemon: OpsContext) -> None:
        self.daemon = daemon

    def ops(self) -> list[OpSpec]:
        return [
            OpSpec(NODE_VERDICTS, OpAccess.of(Access.JOB_OWNER), self.node_verdicts),
            OpSpec(NODE_VIEW, OpAccess.of(Access.LOCAL_ANY, Access.PEER), self.node_view),
        ]

    def _source(self) -> VerdictSource | str:
        watch = self.daemon.components.get("nodewatch")
        if isinstance(watch, VerdictSource):
            return watch
        return watch if isinstance(watch, str) else "not configured"

    def node_verdicts(self, args: dict[str, Any], caller: Caller) -> dict[str, Any] | Park:
        """The node watch's verdicts about the job's nodes newer than ``after``; waits ``wait_ms`` for one."""
        job = self.daemon.job_of(args["job_id"])
        source = self._source()
        if isinstance(source, str):  # a follower learns it once and stops asking
            return {"enabled": False, "state": source, "verdicts": [], "seq": 0}
        after, nodes = args.get("after", 0), job.nodes

        def answer(final: bool) -> dict[str, Any] | None:
            found = source.verdicts_about(nodes, after)
            if not found and not final:
                return None
            return {"enabled": True, "verdicts": [v.to_wire() for v in found], "seq": source.latest_seq()}

        wait_s = args.get("wait_ms", 0) / 1000
        return answer(False) or (Park(answer, wait_s) if wait_s > 0 else answer(True) or {})

    def node_view(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """What this node hears of ``node``: asked by another daemon whose node watch suspects it dead."""
        source = self._source()
        if isinstance(source, str):
            return {
                "observer": self.daemon.node,
                "node": args["node"],
                "heard_ms": None,
                "echo_ms": None,
                "trusted": False,
                "why": f"node watch {source}",
            }
        return source.view(args["node"])
