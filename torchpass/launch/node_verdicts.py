"""Following the node daemon's node-silent verdicts for one job (Slurm mode; no torch here).

Every node's ``clockworkd`` hears every peer on every fabric rail every 10 ms and judges a node dead when it
falls silent on all of them, its kernel stops answering, and another daemon agrees (``clockworkd.nodewatch``):
in about a tenth of a second, where the agents' own heartbeats take ``agent_timeout_s`` (2 s). A node agent
follows those verdicts on its own node's daemon through the control socket, which authorises the agent by
its kernel credentials (the job's owner), in a long poll: the daemon answers the moment a verdict on one of the
job's nodes exists. Each verdict is handed to ``on_verdict(node, reason, last_heard, silent_ms)``; the agent
maps the node to its agent index and tells its mesh.

Nothing here can fail the job: while the daemon is unreachable the thread retries once a second, and the
agents' heartbeats still find a dead node on their own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["FABRIC_ALIVE_MS", "VerdictFollower", "node_heard"]

log = logging.getLogger("clockwork.torchpass.verdicts")

WAIT_S = 10.0  # one long poll; the daemon answers at once when a verdict exists
RETRY_S = 1.0

OnVerdict = Callable[[str, str, float, float], None]

#: A node its daemon heard on the fabric this recently is alive (the node watch hears every node every 10 ms).
FABRIC_ALIVE_MS = 1000.0


def node_heard(control_socket: str, node: str, timeout_s: float = 0.3) -> bool | None:
    """Whether this node's daemon hears ``node`` on the fabric now (its node watch's ``node_view``): True when
    its trusted evidence heard the node within :data:`FABRIC_ALIVE_MS`, False when not, None when it cannot tell
    (node watch off, its own NICs unusable). The agent mesh asks it of an agent silent past agent_timeout_s: a
    silent agent on a node the fabric still hears is a stalled process, not a lost node."""
    from clockwork.contracts.daemon_client import DaemonClient  # lazy: torchpass -> clockworkd client only

    with DaemonClient(Path(control_socket), timeout_s=timeout_s) as client:
        view = client.request("node_view", node=node)
    heard = view.get("heard_ms")
    if not view.get("trusted") or heard is None:
        return None
    return float(heard) <= FABRIC_ALIVE_MS


class VerdictFollower:
    """A thread waiting on this node's daemon for verdicts about ``job_id``'s nodes."""

    def __init__(self, job_id: int, control_socket: str, on_verdict: OnVerdict) -> None:
        self.job_id = job_id
        self.control_socket = Path(control_socket)
        self.on_verdict = on_verdict
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchpass-node-verdicts", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop following (the thread ends within one long poll; it is a daemon thread, nobody waits for it)."""
        self._stop.set()

    def _run(self) -> None:
        from clockwork.contracts.daemon_client import DaemonClient  # lazy: torchpass -> clockworkd client only

        after: int | None = None
        failures = 0
        with DaemonClient(self.control_socket, timeout_s=2.0) as client:
            while not self._stop.is_set():
                try:
                    if after is None:  # verdicts from before this agent started are not news
                        first = client.node_verdicts(self.job_id)
                        if not first.enabled:
                            log.warning(
                                "no node verdicts on this node (node watch %s): the agents' heartbeats alone "
                                "find a dead node",
                                first.state,
                            )
                            return
                        after = first.seq
                        continue
                    asked = time.monotonic()
                    answer = client.node_verdicts(self.job_id, after, WAIT_S)
                    if not answer.verdicts and time.monotonic() - asked < WAIT_S / 2:
                        self._stop.wait(RETRY_S)  # answered early with nothing (its parking is full): no spinning
                except Exception as exc:  # unreachable, refused, not registered: the heartbeats still work
                    failures += 1
                    if failures == 1 or failures % 60 == 0:
                        log.warning(
                            "no node verdicts from clockworkd (%d tries): %s: %s", failures, type(exc).__name__, exc
                        )
                    self._stop.wait(RETRY_S)
                    continue
                failures = 0
                for verdict in answer.verdicts:
                    if self._stop.is_set():
                        return
                    try:
                        self.on_verdict(verdict.node, verdict.reason, verdict.last_heard, verdict.silent_ms)
                    except Exception:
                        log.exception("acting on the verdict on %s failed", verdict.node)
                after = max([answer.seq, after, *(v.seq for v in answer.verdicts)])
