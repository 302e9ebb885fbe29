"""The local ranks' door to the job's coordinator, wherever it currently leads (Slurm mode).

A rank talks to one coordinator endpoint for its whole life (``TORCHPASS_COORDINATOR``), exactly as in local
mode. Under Slurm that endpoint is this proxy in the rank's own node agent; the proxy forwards every message
to the leading coordinator replica and every answer back, so the ranks need to know nothing of replicas and
elections. Since a rank dies with its agent (``PR_SET_PDEATHSIG``), the proxy can never be the thing that
fails while its rank survives.

When the mesh reports a new leader, the proxy reconnects and replays what the new leader must see:

* each rank's ``register`` (a new leader that took over from a slightly old snapshot learns the process;
  registering twice is harmless: the coordinator treats it as the same process);
* the request each rank is waiting on (``await_generation``, ``finished``, ``joined``, ...): a request keeps
  its id, so whichever leader answers, the rank matches the answer to its question and ignores a duplicate;
* the last heartbeat of each rank's control socket, so the new leader can push generations to it at once.

Sockets: one ROUTER for the local ranks (on the node address, a free port), and per rank socket one DEALER
to the leader carrying the same identity (``WID.r`` / ``WID.n``), so the coordinator sees the rank itself.
This module imports no torch.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

import zmq

from clockwork.contracts.coordinator_wire import MAX_MESSAGE_BYTES, ProtocolError, decode
from torchpass.auth import connect_as_client, serve
from torchpass.socket_thread import SocketThread, router_messages

__all__ = ["CoordinatorProxy"]

log = logging.getLogger("clockwork.torchpass.proxy")


class CoordinatorProxy(SocketThread):
    """Forwards the local ranks' coordinator traffic to the leader, and replays it when the leader changes."""

    def __init__(self, bind_host: str, leader_endpoint: Callable[[], str]) -> None:
        super().__init__()
        self.bind_host = bind_host
        self.leader_endpoint = leader_endpoint
        self.endpoint = ""
        self.switches = 0
        self._forget: queue.Queue[str] = queue.Queue()
        self._front: zmq.Socket[bytes] | None = None

    def start(self) -> str:
        """Bind the ranks' socket and start forwarding; returns the endpoint to give the ranks."""
        self._ctx = zmq.Context()
        front = self._ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        front.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        serve(front)
        port = front.bind_to_random_port(f"tcp://{self.bind_host}")
        self._front = front
        self.endpoint = f"tcp://{self.bind_host}:{port}"
        self._start_thread(self._run, "torchpass-proxy")
        return self.endpoint

    def leader_changed(self) -> None:
        """The mesh elected another leader (thread-safe): reconnect and replay."""
        self._wake()

    def forget(self, wid: str) -> None:
        """Process ``wid`` exited (thread-safe): never replay its messages to a new leader."""
        self._forget.put(wid)
        self._wake()

    # ----- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        assert self._front is not None and self._ctx is not None
        front = self._front
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        upstream: dict[bytes, zmq.Socket[bytes]] = {}
        owner: dict[zmq.Socket[bytes], bytes] = {}
        registration: dict[bytes, bytes] = {}
        pending: dict[bytes, tuple[Any, bytes]] = {}
        control: dict[bytes, bytes] = {}
        target = self.leader_endpoint()

        def up(ident: bytes) -> zmq.Socket[bytes]:
            sock = upstream.get(ident)
            if sock is None:
                assert self._ctx is not None
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                sock.setsockopt(zmq.IDENTITY, ident)
                connect_as_client(sock)
                sock.connect(target)
                upstream[ident] = sock
                owner[sock] = ident
                poller.register(sock, zmq.POLLIN)
            return sock

        def send(ident: bytes, payload: bytes) -> None:
            try:
                up(ident).send(payload, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("could not forward for %r: %s", ident, exc)

        def drop(ident: bytes) -> None:
            sock = upstream.pop(ident, None)
            if sock is not None:
                poller.unregister(sock)
                del owner[sock]
                sock.close(0)

        while not self._stopping.is_set():
            ready = dict(poller.poll(1000))
            if self._stopping.is_set():
                break
            if ready.get(self._wake_r):
                self._drain_wake()
                while True:
                    try:
                        wid = self._forget.get_nowait()
                    except queue.Empty:
                        break
                    for ident in (f"{wid}.r".encode(), f"{wid}.n".encode()):
                        registration.pop(ident, None)
                        pending.pop(ident, None)
                        control.pop(ident, None)
                        drop(ident)
                new = self.leader_endpoint()
                if new != target:
                    log.warning("coordinator leader moved %s -> %s: replaying rank messages", target, new)
                    target = new
                    self.switches += 1
                    for ident in list(upstream):
                        drop(ident)
                    for ident in sorted(set(registration) | set(pending) | set(control)):
                        if ident in registration and pending.get(ident, (None, b""))[1] != registration[ident]:
                            send(ident, registration[ident])
                        if ident in pending:
                            send(ident, pending[ident][1])
                        if ident in control:
                            send(ident, control[ident])
            if ready.get(front):
                for ident, payload, msg in router_messages(front, log):
                    if ident.endswith(b".r"):
                        if msg["op"] == "register":
                            registration[ident] = payload
                        pending[ident] = (msg.get("id"), payload)
                    else:
                        control[ident] = payload
                    send(ident, payload)
            for sock, ident in list(owner.items()):
                if not ready.get(sock):
                    continue
                while True:
                    try:
                        payload = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if ident in pending:
                        try:
                            answered = decode(payload).get("id") == pending[ident][0]
                        except ProtocolError:
                            answered = False
                        if answered:
                            del pending[ident]
                    try:
                        front.send_multipart([ident, payload], zmq.NOBLOCK)
                    except zmq.ZMQError as exc:
                        log.debug("could not deliver to %r: %s", ident, exc)
