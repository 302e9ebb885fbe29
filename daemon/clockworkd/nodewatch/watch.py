"""The node watch as the daemon hosts it: LinkPass's heartbeats and kernel echoes in, verdicts out to the jobs.

It ticks with LinkPass's heartbeat interval inside the daemon's one loop: tells LinkPass which nodes to heartbeat
for it (the other nodes of the jobs running here; LinkPass's own thread sends and stamps them, so a slow loop
delays a verdict but never makes one up), reads the echo answers, lets the
:class:`~clockworkd.nodewatch.judge.Judge` decide, sends the echoes it asks for, hands confirmations to the
:class:`~clockworkd.nodewatch.confirm.ConfirmWorker`, and delivers each verdict:

* into the event log of every running job registered here whose nodes include the dead one (``node.silent``;
  ``node.heard_again`` when it is heard again), which also publishes it;
* to the jobs' TorchPass agents, which wait for verdicts on the control socket (op ``node_verdicts``, a long
  poll authorised by the caller's kernel credentials, like every op on that socket): the server answers them
  from :meth:`NodeWatch.verdicts_about` as soon as one exists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from clockwork.contracts.config.nodewatch import NodeWatchConfig
from clockwork.contracts.node_verdict import NodeVerdict
from clockworkd.nodewatch.confirm import ConfirmWorker
from clockworkd.nodewatch.echo import EchoProber
from clockworkd.nodewatch.judge import Answer, Judge, Outcome
from clockworkd.registry import RUNNING, JobRecord
from linkpass.engine import LinkPass

__all__ = ["NodeWatch"]

log = logging.getLogger("clockwork.nodewatch")

Record = Callable[[int, str, dict[str, Any], str], None]


class NodeWatch:
    """One node's node watch: a component of the daemon's loop (fds, tick, status, close)."""

    def __init__(
        self,
        cfg: NodeWatchConfig,
        linkpass: LinkPass,
        prober: EchoProber,
        confirm: ConfirmWorker | None,
        *,
        jobs: Callable[[], list[JobRecord]],
        record: Record,
        no_confirm_reason: str = "",
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.linkpass = linkpass
        self.prober = prober
        self.confirm = confirm
        self.jobs = jobs
        self.record = record
        self.no_confirm_reason = no_confirm_reason
        self.clock = clock
        self.wall = wall
        self.node = linkpass.me.name
        self.interval = linkpass.interval
        self.judge = Judge(cfg, self.node, self.interval)
        self.by_address = {addr: peer.name for peer in linkpass.peers.values() for addr in peer.nics.values()}
        self.next_tick = clock()

    # ----- component ---------------------------------------------------------------------------

    def fds(self) -> list[int]:
        return [self.confirm.fileno()] if self.confirm is not None else []

    def on_readable(self, fd: int) -> None:
        if self.confirm is not None and fd == self.confirm.fileno():
            for answer in self.confirm.results():
                self._on_answer(answer)

    def next_deadline(self) -> float:
        return self.next_tick

    def tick(self) -> None:
        now = self.clock()
        self._follow_jobs()
        for _rail, source in self.prober.answers():
            peer = self.by_address.get(source)
            if peer is not None:
                self.judge.echo_reply(peer, now)
        step = self.judge.tick(now, self.wall(), self.linkpass.last_heard(), bool(self.linkpass.usable_nics()))
        for peer in step.echo:
            for rail, address in self.linkpass.peers[peer].nics.items():
                self.prober.send(rail, address)
        for suspect, observers in step.ask:
            if self.confirm is not None:
                self.confirm.ask(suspect, observers)
            else:
                why = f"no second observer can be asked: {self.no_confirm_reason}"
                self.judge.answer(Answer(suspect, Outcome.NO_ANSWER, "", why), now, self.wall())
        for verdict in step.verdicts:
            self._deliver(verdict)
        for peer in step.cleared:
            self._heard_again(peer)
        self.next_tick = now + self.interval

    def _follow_jobs(self) -> None:
        """Heartbeat the other nodes of the jobs running here (LinkPass's watch peers), and know who shares a job."""
        mates: dict[str, set[str]] = {}
        for job in self.jobs():
            if job.state == RUNNING and self.node in job.nodes:
                for node in job.nodes:
                    mates.setdefault(node, set()).update(job.nodes)
        mates.pop(self.node, None)
        self.linkpass.set_watch_peers(mates)
        self.judge.mates = mates

    def status(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "silent_after_ms": self.cfg.silent_after_ms,
            "probe_after_ms": self.cfg.probe_after_ms,
            "second_observer": "CURVE daemon socket" if self.confirm is not None else f"off: {self.no_confirm_reason}",
            "echo": dict(self.prober.counters),
            **self.judge.status(self.clock()),
        }

    def close(self) -> None:
        if self.confirm is not None:
            self.confirm.close()
        self.prober.close()

    # ----- what the server asks --------------------------------------------------------------------

    def view(self, node: str) -> dict[str, Any]:
        """What this node hears of ``node`` (op ``node_view``, asked by another daemon's node watch)."""
        return self.judge.view(node, self.clock()).to_wire()

    def verdicts_about(self, nodes: Sequence[str], after: int) -> list[NodeVerdict]:
        """Verdicts in force about any of ``nodes`` newer than ``after`` (op ``node_verdicts``)."""
        wanted = set(nodes)
        return sorted((v for v in self.judge.verdicts.values() if v.node in wanted and v.seq > after), key=_seq)

    def latest_seq(self) -> int:
        return self.judge.seq

    # ----- delivery -------------------------------------------------------------------------------

    def _on_answer(self, answer: Answer) -> None:
        verdict = self.judge.answer(answer, self.clock(), self.wall())
        if verdict is not None:
            self._deliver(verdict)
        elif answer.outcome is Outcome.VETOED:
            log.info("%s: no verdict on %s: %s", self.node, answer.node, answer.detail)

    def _deliver(self, verdict: NodeVerdict) -> None:
        log.warning("%s: %s", self.node, verdict.reason)
        fields = {k: v for k, v in verdict.to_wire().items() if k != "seq"}
        self._record_for(verdict.node, "node.silent", fields)

    def _heard_again(self, peer: str) -> None:
        log.warning("%s: node %s is heard again", self.node, peer)
        self._record_for(peer, "node.heard_again", {"node": peer})

    def _record_for(self, node: str, kind: str, fields: dict[str, Any]) -> None:
        for job in self.jobs():
            if job.state == RUNNING and node in job.nodes:
                self.record(job.job_id, kind, fields, f"nodewatch on {self.node}")


def _seq(verdict: NodeVerdict) -> int:
    return verdict.seq
