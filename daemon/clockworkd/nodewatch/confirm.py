"""Asking a second observer: other daemons say what they hear of a suspect, over the CURVE daemon socket.

The daemon's loop must never wait on the network (LinkPass's heartbeats run in it), so the questions go out
from a thread of this module's own: the loop hands it (suspect, daemons to ask) and is woken through a
socket pair when the answer is in. The daemons are asked one after the other, each with a deadline, until one
gives a definite answer (it hears the suspect: veto; it does not: confirmed). The channel is the daemons'
existing one (``tcp://NODE_ADDRESS:listen_port``, ZeroMQ CURVE with the admin-installed keys, op
``node_view``), so only a daemon holding one of the cluster's keys can take part.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable

from clockwork.contracts.curve_keys import CurveKeys
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.errors import ClockworkError
from clockworkd.nodewatch.judge import Answer, Outcome, PeerView

__all__ = ["ConfirmWorker", "PeerDirectory"]

log = logging.getLogger("clockwork.nodewatch")


class PeerDirectory:
    """Where each other daemon listens and which server key it must show."""

    def __init__(self, endpoints: dict[str, str], keys: CurveKeys, server_keys: dict[str, bytes]) -> None:
        self.endpoints = dict(endpoints)
        self.keys = keys
        self.server_keys = dict(server_keys)

    def client(self, node: str, timeout_s: float) -> DaemonClient:
        return DaemonClient.for_peer(self.endpoints[node], self.keys, self.server_keys[node], timeout_s)


class ConfirmWorker:
    """The thread that asks other daemons; :meth:`ask` from the loop, :meth:`results` when :meth:`fileno` is
    readable."""

    def __init__(
        self, peers: PeerDirectory, timeout_s: float, judge: Callable[[PeerView], tuple[Outcome, str]]
    ) -> None:
        self.peers = peers
        self.timeout_s = timeout_s
        self.judge = judge
        self._asks: queue.Queue[tuple[str, list[str]] | None] = queue.Queue()
        self._answers: queue.Queue[Answer] = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="nodewatch-confirm", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        return self._wake_r.fileno()

    def ask(self, suspect: str, observers: list[str]) -> None:
        self._asks.put((suspect, list(observers)))

    def results(self) -> list[Answer]:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        out = []
        while True:
            try:
                out.append(self._answers.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._asks.put(None)
        self._thread.join(timeout=2 * self.timeout_s + 1)
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        clients: dict[str, DaemonClient] = {}
        try:
            while (item := self._asks.get()) is not None:
                suspect, observers = item
                self._answers.put(self._ask(clients, suspect, observers))
                try:
                    self._wake_w.send(b"!")
                except (BlockingIOError, OSError):
                    pass  # the loop has wake-ups pending already, or it is closing
        finally:
            for client in clients.values():
                client.close()

    def _ask(self, clients: dict[str, DaemonClient], suspect: str, observers: list[str]) -> Answer:
        details = []
        for observer in observers:
            if observer not in self.peers.endpoints:
                details.append(f"{observer}: address unknown")
                continue
            if observer not in clients:
                clients[observer] = self.peers.client(observer, self.timeout_s)
            try:
                reply = clients[observer].request("node_view", node=suspect)
                outcome, detail = self.judge(PeerView.from_wire(reply))
            except ClockworkError as exc:
                details.append(f"{observer}: {exc}")
                continue
            except (KeyError, TypeError, ValueError) as exc:
                details.append(f"{observer}: malformed answer ({exc})")
                continue
            if outcome is not Outcome.NO_ANSWER:
                return Answer(suspect, outcome, observer, detail)
            details.append(detail)
        log.info("no daemon could say whether %s is silent: %s", suspect, "; ".join(details))
        return Answer(suspect, Outcome.NO_ANSWER, "", "; ".join(details) or "nobody to ask")
