"""The node daemon's sockets: what each one is, who may connect to it, how a message is read, and taking them down.

Apart from the loop and the request handling (:mod:`clockworkd.server`) because these are the daemon's security
boundary, which reads best in one place (``RUN_DIR`` = ``[daemon] run_dir`` with ``{node}`` expanded):

- ``ipc://RUN_DIR/control.sock`` (ROUTER, mode 0666): anyone may connect, because every request is then
  authorised by the kernel's credentials of the connecting process (:mod:`clockworkd.daemon_auth`).
- ``ipc://RUN_DIR/events.sock`` (PUB, mode 0600, owned by ``slurm_user``): a PUB socket cannot tell its
  subscribers apart, so only root and the Slurm user may read every job's events here.
- ``tcp://BIND_ADDR:listen_port`` (ROUTER, ZeroMQ CURVE): a ZAP handler admits only clients presenting one of the
  admin-installed public keys, and the socket refuses everyone when no handler answers. A peer plane that
  cannot be set up (no keys, a node name that does not resolve, a port in use) is not fatal: the daemon runs
  without it and ``status`` says why (:attr:`DaemonSockets.peer_plane`).

Frames above :func:`hard_message_limit` are never read (libzmq disconnects the sender), and one message is read
frame by frame keeping at most :data:`MAX_FRAMES` (:func:`recv_capped`), so a flood is never buffered.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.curve_keys import CurveKeyError, load_daemon_keys
from clockwork.contracts.daemon_paths import DaemonPaths

__all__ = ["MAX_FRAMES", "ZAP_DOMAIN", "DaemonSockets", "hard_message_limit", "recv_capped"]

log = logging.getLogger("clockwork.daemon")

ZAP_DOMAIN = "clockwork"
# At most this many frames of one message are kept (envelope + delimiter + body); the rest is dropped.
MAX_FRAMES = 4
# What a refused peer handshake means, by monitor event (zmq.Event is an IntFlag: int keys match).
_REFUSALS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key not in the admin-installed set",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not a CURVE client of this protocol",
}


def hard_message_limit(max_message_bytes: int) -> int:
    """Frames above this are never read: libzmq disconnects the sender (ZMQ_MAXMSGSIZE)."""
    return max(4 * max_message_bytes, 1024 * 1024)


def _resolve_address(node: str) -> str:
    """The IPv4 address ``node`` resolves to (what the peers connect to)."""
    infos = socket.getaddrinfo(node, None, socket.AF_INET, socket.SOCK_STREAM)
    return str(infos[0][4][0])


def recv_capped(sock: zmq.Socket[bytes]) -> tuple[list[zmq.Frame], bool]:
    """One message, frame by frame, keeping at most MAX_FRAMES (a flood of frames is not buffered); whether it
    came whole. zmq.Again when none is waiting."""
    frames: list[zmq.Frame] = []
    complete = True
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    while True:
        if len(frames) < MAX_FRAMES:
            frames.append(frame)
        else:
            complete = False
        if not frame.more:
            return frames, complete
        try:  # libzmq delivers a multipart message whole, so the next frame is there already
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return frames, False


class DaemonSockets:
    """One daemon's ZeroMQ context and sockets: :meth:`bind`, then :meth:`close` (safe to call twice)."""

    def __init__(self, cfg: DaemonConfig, paths: DaemonPaths, slurm_uid: int | None) -> None:
        self.cfg = cfg
        self.paths = paths
        self.node = paths.node
        self.slurm_uid = slurm_uid
        self.context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.control: zmq.Socket[bytes] | None = None
        self.events: zmq.Socket[bytes] | None = None
        self.peer: zmq.Socket[bytes] | None = None
        self.peer_monitor: zmq.Socket[bytes] | None = None
        #: The peer socket's endpoint, or "disabled: WHY" (shown by ``status``).
        self.peer_plane = "disabled: not started"
        self._auth: ThreadAuthenticator | None = None
        self._bound: list[Path] = []  # socket files these sockets made (and so remove)

    def bind(self) -> None:
        """Bind the control and events sockets (OSError, ZMQError when they cannot be) and the peer socket (run
        without it when it cannot be)."""
        self.context = zmq.Context()
        self._bind_local()
        self.peer_plane = self._bind_peer()

    def _bind_local(self) -> None:
        assert self.context is not None
        control = self.context.socket(zmq.ROUTER)
        control.setsockopt(zmq.LINGER, 0)
        control.setsockopt(zmq.MAXMSGSIZE, hard_message_limit(self.cfg.max_message_bytes))
        self.control = control
        control.bind(self.paths.control_endpoint)
        self._bound.append(self.paths.control_socket)
        os.chmod(self.paths.control_socket, 0o666)
        events = self.context.socket(zmq.PUB)
        events.setsockopt(zmq.LINGER, 0)
        events.setsockopt(zmq.MAXMSGSIZE, 1024)  # subscribers send only subscriptions
        self.events = events
        events.bind(self.paths.events_endpoint)
        self._bound.append(self.paths.events_socket)
        os.chmod(self.paths.events_socket, 0o600)
        if self.slurm_uid not in (None, 0) and os.geteuid() == 0:
            os.chown(self.paths.events_socket, self.slurm_uid, -1)

    def _bind_peer(self) -> str:
        """Bind the CURVE TCP socket; on any problem run without it and return why (shown by ``status``)."""
        assert self.context is not None
        try:
            keys = load_daemon_keys(self.paths)
        except CurveKeyError as exc:
            log.error("node %s: daemon-to-daemon socket disabled: %s", self.node, exc)
            return f"disabled: {exc}"
        try:
            address = self.cfg.bind_addr or _resolve_address(self.node)
        except OSError as exc:
            log.error("node %s: daemon-to-daemon socket disabled: cannot resolve %r: %s", self.node, self.node, exc)
            return f"disabled: cannot resolve node name {self.node!r}: {exc}"
        auth = ThreadAuthenticator(self.context, log=logging.getLogger("clockwork.daemon.zap"))
        auth.start()
        self._auth = auth
        try:
            auth.configure_curve(domain=ZAP_DOMAIN, location=str(self.paths.curve_keys_dir))
        except (OSError, ValueError) as exc:
            log.error("node %s: daemon-to-daemon socket disabled: public keys unreadable: %s", self.node, exc)
            return f"disabled: cannot read the public keys in {self.paths.curve_keys_dir}: {exc}"
        peer = self.context.socket(zmq.ROUTER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.MAXMSGSIZE, hard_message_limit(self.cfg.max_message_bytes))
        peer.curve_secretkey = keys.secret
        peer.curve_publickey = keys.public
        peer.curve_server = True
        peer.zap_domain = ZAP_DOMAIN.encode()
        try:  # a CURVE socket must never fall back to "accept everyone" when no ZAP handler answers
            peer.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        except (zmq.ZMQError, AttributeError):
            pass
        port = str(self.cfg.listen_port) if self.cfg.listen_port else "*"
        host = f"[{address}]" if ":" in address else address
        try:
            peer.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            peer.close(0)
            log.error("node %s: daemon-to-daemon socket disabled: bind tcp://%s:%s: %s", self.node, host, port, exc)
            return f"disabled: cannot bind tcp://{host}:{port}: {exc}"
        self.peer = peer
        self.peer_monitor = peer.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        endpoint = peer.getsockopt_string(zmq.LAST_ENDPOINT)
        return endpoint

    def log_refused_peers(self, most: int) -> int:
        """Say which peers were refused (wrong key, not CURVE, ...; ZAP itself only logs at debug level), at most
        ``most`` of those waiting; how many."""
        assert self.peer_monitor is not None
        for refused in range(most):
            try:
                event = recv_monitor_message(self.peer_monitor, zmq.NOBLOCK)
            except zmq.Again:
                return refused
            kind = _REFUSALS.get(event["event"], "handshake failed")
            endpoint = event.get("endpoint", b"")
            where = endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else str(endpoint)
            log.warning("node %s: refused a peer on %s: %s (code %s)", self.node, where, kind, event["value"])
        return most

    def close(self) -> None:
        """Close every socket, stop the ZAP handler and remove the socket files these sockets made."""
        if self.peer is not None and self.peer_monitor is not None:
            self.peer.disable_monitor()
        for sock in (self.control, self.events, self.peer_monitor, self.peer):
            if sock is not None:
                sock.close(0)
        self.control = self.events = self.peer = self.peer_monitor = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self.context is not None:
            self.context.term()
            self.context = None
        for path in self._bound:  # never another daemon's: a refused start bound nothing
            path.unlink(missing_ok=True)
        self._bound.clear()
