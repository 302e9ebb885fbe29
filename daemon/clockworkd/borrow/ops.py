"""The node daemon's borrow ops: ``borrow``, ``borrow_status`` and ``borrow_release``, served by the borrow manager.

Apart from the daemon's loop (:mod:`clockworkd.server`) because they are the borrow manager's side of the control
socket: a training job's agent asks for a node to borrow after a loss, follows the request, and the Epilog gives
what the job holds back. All three are declared ``job-owner`` (:meth:`BorrowOps.ops`), so the daemon has already
checked that the caller owns the job, or is root or the Slurm user (:func:`clockworkd.daemon_auth.authorise`);
what is left here is the manager's policy, whose refusal is answered
``forbidden`` with its reason. The manager is found among the daemon's components on each request: where
borrowing is off, the reason it is off is the answer.
"""

from __future__ import annotations

from typing import Any

from clockwork.contracts.daemon_wire import BORROW, BORROW_RELEASE, BORROW_STATUS, FORBIDDEN, ProtocolError
from clockworkd.borrow.manager import BorrowManager, BorrowRefused
from clockworkd.daemon_auth import Access, Caller, OpAccess
from clockworkd.daemon_component import OpsContext
from clockworkd.daemon_ops import OpSpec

__all__ = ["BorrowOps"]


class BorrowOps:
    """The three ops, served by the daemon's component ``"borrow"``."""

    def __init__(self, daemon: OpsContext) -> None:
        self.daemon = daemon

    def ops(self) -> list[OpSpec]:
        owner = OpAccess.of(Access.JOB_OWNER)
        return [
            OpSpec(BORROW, owner, self.borrow),
            OpSpec(BORROW_STATUS, owner, self.borrow_status),
            OpSpec(BORROW_RELEASE, owner, self.borrow_release),
        ]

    def _manager(self) -> BorrowManager:
        manager = self.daemon.components.get("borrow")
        if not isinstance(manager, BorrowManager):
            reason = manager if isinstance(manager, str) else "not configured on this node"
            raise ProtocolError(f"borrowing is not available on node {self.daemon.node}: {reason}", code=FORBIDDEN)
        return manager

    def borrow(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """Ask the manager for a node for the job (``lost_node``: the node it replaces, for the record)."""
        job = self.daemon.job_of(args["job_id"])
        try:
            return self._manager().request(job, by=caller.describe(), lost_node=args.get("lost_node", ""))
        except BorrowRefused as exc:
            raise ProtocolError(f"borrow for job {job.job_id} refused: {exc}", code=FORBIDDEN) from None

    def borrow_status(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """The job's borrow requests (or one, ``request``) and where each stands."""
        manager = self._manager()
        manager.drain()  # an outcome the requester sees is already in the job's events
        return manager.requests_of(args["job_id"], args.get("request"))

    def borrow_release(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """Give back every node the job borrowed (``why``: recorded with the release)."""
        why = args.get("why") or f"released by {caller.describe()}"
        manager = self._manager()
        released = manager.release(args["job_id"], why)
        manager.drain()  # recorded before the answer: the Epilog gathers the job's events right after
        return {"released": released}
