"""The node daemon proper: one ZeroMQ event loop serving the local control plane and the peer plane.

Sockets (``RUN_DIR`` = ``[daemon] run_dir`` with ``{node}`` expanded):

- ``ipc://RUN_DIR/control.sock`` (ROUTER, mode 0666): requests from local clients (CLI, hooks,
  TorchPass). Anyone may connect, so every request is authorised by the *kernel's* credentials of
  the connecting process: libzmq reads ``SO_PEERCRED`` when the connection is accepted and exposes
  it as the message property ``Peer-Address`` = ``"HOST:UID:GID:PID"``. Nothing the client sends
  about itself is believed.
- ``ipc://RUN_DIR/events.sock`` (PUB, root and slurm_user only): every recorded event, topic
  ``b"JOBID."``. A PUB socket cannot tell its subscribers apart, so it is not world-accessible;
  users read their own job's events through ``job_events`` on the control socket.
- ``tcp://BIND_ADDR:listen_port`` (ROUTER, ZeroMQ CURVE): daemon-to-daemon requests (``ping``,
  ``post_event`` relays, ``node_view``: what this node hears of a peer another daemon suspects dead). A
  ZAP handler accepts only clients presenting one of the admin-installed public keys. Without usable keys
  the daemon runs without this socket and says why in ``status``.

Authorisation on the control socket: root and ``slurm_user`` may do everything. Any other uid may
``ping``; ``status`` and ``jobs`` show it only its own jobs (like Slurm's PrivateData=jobs); it may
``post_event``, ``job_events`` and ``unregister_job`` only for jobs registered with its uid, and never
``register_job``. A denial is answered with error ``forbidden`` and logged. ``node_verdicts`` (a job's agents
waiting for the node watch's verdicts on its nodes) is a long poll: its request is parked (:mod:`clockworkd.parked`)
and answered from the loop as soon as a verdict exists, or at its deadline.

One thread, one :class:`zmq.Poller`; no thread per client (the ZAP authenticator runs in its own
thread, as pyzmq provides it). A malformed, oversized or unauthorised message is answered with an
error (or dropped when it cannot even be addressed), counted and logged; it never stops the loop.
"""

from __future__ import annotations

import logging
import math
import os
import pwd
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from clockworkd import __version__
from clockworkd.borrow.manager import BorrowManager, BorrowRefused
from clockworkd.config.schema import DaemonConfig
from clockworkd.curve_keys import CurveKeyError, load_daemon_keys
from clockworkd.daemon_paths import DaemonPaths
from clockworkd.errors import DaemonError
from clockworkd.instance_lock import InstanceLock, socket_in_use
from clockworkd.node_verdict import NodeVerdict
from clockworkd.parked import Park, ParkedRequests
from clockworkd.protocol import (
    BAD_REQUEST,
    DEFAULT_EVENTS_PER_REPLY,
    FORBIDDEN,
    INTERNAL,
    QUOTA,
    TOO_LARGE,
    UNKNOWN_JOB,
    ProtocolError,
    Request,
    decode_request,
    encode_error,
    encode_event,
    encode_ok,
)
from clockworkd.registry import ENDED, RUNNING, EventLogFullError, JobRecord, Registry, UnknownJobError

log = logging.getLogger("clockwork.daemon")

ZAP_DOMAIN = "clockwork"
# At most this many frames of one message are kept (envelope + delimiter + body); the rest is dropped.
MAX_FRAMES = 4
# Messages handled per socket per loop turn, so one busy client cannot starve the other plane.
BATCH = 64
# Ops a peer daemon may send over TCP.
PEER_OPS = frozenset({"ping", "post_event", "node_view"})
# Ops that act on one job; a non-privileged caller must own it.
JOB_OPS = frozenset(
    {"unregister_job", "post_event", "job_events", "borrow", "borrow_status", "borrow_release", "node_verdicts"}
)
ENDED_JOBS_IN_STATUS = 20
# A job_events reply stops adding events past this many bytes (``more`` tells the client to page on).
EVENTS_REPLY_BYTES = 8 * 1024 * 1024
RECENT_EVENTS_IN_STATUS = 20
# What a refused peer handshake means, by monitor event (zmq.Event is an IntFlag: int keys match).
_REFUSALS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key not in the admin-installed set",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not a CURVE client of this protocol",
}


def hard_message_limit(max_message_bytes: int) -> int:
    """Frames above this are never read: libzmq disconnects the sender (ZMQ_MAXMSGSIZE)."""
    return max(4 * max_message_bytes, 1024 * 1024)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the kernel (local) or CURVE (peer) established it."""

    plane: str  # "local" or "peer"
    uid: int = -1
    gid: int = -1
    pid: int = -1
    address: str = ""
    key: str = ""
    privileged: bool = False

    def describe(self) -> str:
        if self.plane == "peer":
            return f"peer {self.address or '?'} key {self.key[:8] or '?'}"
        return f"uid {self.uid} pid {self.pid}"


def parse_peer_credentials(value: str) -> tuple[int, int, int] | None:
    """(uid, gid, pid) from libzmq's IPC ``Peer-Address`` property ``"HOST:UID:GID:PID"``."""
    parts = value.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[1]), int(parts[2]), int(parts[3])


def _frame_property(frame: zmq.Frame, name: str) -> str:
    try:
        value = frame.get(name)
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""
    return value if isinstance(value, str) else ""


def _resolve_uid(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def _resolve_address(node: str) -> str:
    """The IPv4 address ``node`` resolves to (what the peers connect to)."""
    infos = socket.getaddrinfo(node, None, socket.AF_INET, socket.SOCK_STREAM)
    return str(infos[0][4][0])


class Component(Protocol):
    """Something the daemon hosts in its loop (LinkPass, Lens, GPU health): fds to poll, a tick deadline."""

    def fds(self) -> list[int]: ...
    def on_readable(self, fd: int) -> None: ...
    def next_deadline(self) -> float: ...
    def tick(self) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


@runtime_checkable
class VerdictSource(Protocol):
    """The node watch, as the ops ``node_verdicts`` and ``node_view`` see it."""

    def verdicts_about(self, nodes: tuple[str, ...], after: int) -> list[NodeVerdict]: ...
    def latest_seq(self) -> int: ...
    def view(self, node: str) -> dict[str, Any]: ...


class Daemon:
    """One node's daemon: registry + sockets + the loop. ``start`` → ``serve`` → ``close``."""

    def __init__(self, cfg: DaemonConfig, paths: DaemonPaths) -> None:
        self.cfg = cfg
        self.paths = paths
        self.node = paths.node
        self.max_bytes = cfg.max_message_bytes
        self.context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.control: zmq.Socket[bytes] | None = None
        self.events: zmq.Socket[bytes] | None = None
        self.peer: zmq.Socket[bytes] | None = None
        self.peer_monitor: zmq.Socket[bytes] | None = None
        self.peer_plane = "disabled: not started"
        self.registry: Registry | None = None
        self._auth: ThreadAuthenticator | None = None
        self._lock = InstanceLock(paths.pid_file)
        self._bound: list[Path] = []  # socket files this daemon made (and so removes)
        self._stopping = False
        self._started_wall = 0.0
        self._started_mono = 0.0
        self.slurm_uid = _resolve_uid(cfg.slurm_user)
        self.counters = {"requests": 0, "errors": 0, "denied": 0, "malformed": 0}
        #: Hosted components by name (e.g. "linkpass"), or a string saying why one is not running.
        self.components: dict[str, Component | str] = {}
        self._parked = ParkedRequests()
        self._ops: dict[str, Callable[[dict[str, Any], Caller], dict[str, Any] | Park]] = {
            "ping": self._op_ping,
            "status": self._op_status,
            "jobs": self._op_jobs,
            "register_job": self._op_register_job,
            "unregister_job": self._op_unregister_job,
            "post_event": self._op_post_event,
            "job_events": self._op_job_events,
            "lens": self._op_lens,
            "gpus": self._op_gpus,
            "borrow": self._op_borrow,
            "borrow_status": self._op_borrow_status,
            "borrow_release": self._op_borrow_release,
            "node_verdicts": self._op_node_verdicts,
            "node_view": self._op_node_view,
        }

    # ----- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Take the node's pid-file lock, load the registry and bind the sockets."""
        self.paths.run_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        if self.paths.run_dir.stat().st_mode & 0o022:
            log.warning(
                "node %s: run_dir %s is writable by other users, who could replace the daemon's sockets; "
                "make it root-owned, mode 0755",
                self.node,
                self.paths.run_dir,
            )
        self._lock.acquire()
        try:
            if socket_in_use(self.paths.control_socket):
                raise DaemonError(
                    f"a process already serves {self.paths.control_socket} without holding {self.paths.pid_file}; "
                    "stop it first",
                    code="already_running",
                )
            for leftover in (self.paths.control_socket, self.paths.events_socket):
                if leftover.exists() or leftover.is_symlink():
                    log.info("node %s: removing stale socket %s of a previous daemon", self.node, leftover)
                    leftover.unlink()
            self.paths.state_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            self.paths.reports_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            self.registry = Registry(self.paths.state_dir, self.node)
            self.registry.load()
            self.context = zmq.Context()
            self._bind_local()
            self.peer_plane = self._bind_peer()
        except (OSError, zmq.ZMQError) as exc:
            self.close()
            raise DaemonError(f"node {self.node}: cannot start: {exc}", code="start_failed") from None
        except BaseException:
            self.close()
            raise
        self._started_wall = time.time()
        self._started_mono = time.monotonic()
        if self.slurm_uid is None:
            log.warning(
                "node %s: slurm_user %r is not a known user; only root is privileged", self.node, self.cfg.slurm_user
            )
        log.info(
            "node %s: clockworkd %s ready (pid %d): control %s, events %s, peer plane %s",
            self.node,
            __version__,
            os.getpid(),
            self.paths.control_socket,
            self.paths.events_socket,
            self.peer_plane,
        )

    def _bind_local(self) -> None:
        assert self.context is not None
        control = self.context.socket(zmq.ROUTER)
        control.setsockopt(zmq.LINGER, 0)
        control.setsockopt(zmq.MAXMSGSIZE, hard_message_limit(self.max_bytes))
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
        peer.setsockopt(zmq.MAXMSGSIZE, hard_message_limit(self.max_bytes))
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

    def _log_peer_handshakes(self) -> None:
        """Say which peers were refused (wrong key, not CURVE, ...): ZAP itself only logs at debug level."""
        assert self.peer_monitor is not None
        for _ in range(BATCH):
            try:
                event = recv_monitor_message(self.peer_monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters["denied"] += 1
            kind = _REFUSALS.get(event["event"], "handshake failed")
            endpoint = event.get("endpoint", b"")
            where = endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else str(endpoint)
            log.warning("node %s: refused a peer on %s: %s (code %s)", self.node, where, kind, event["value"])

    def request_stop(self, *_: object) -> None:
        """Ask the loop to finish (signal handler: only sets a flag; the wake-up fd interrupts the poll)."""
        self._stopping = True

    def serve(self) -> None:
        """Run the event loop until SIGTERM/SIGINT (or :meth:`request_stop`), then close everything."""
        assert self.control is not None
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        in_main = threading.current_thread() is threading.main_thread()  # signals: main thread only
        old_handlers: dict[signal.Signals, Any] = {}
        old_wakeup = -1
        if in_main:
            for sig in (signal.SIGTERM, signal.SIGINT):
                old_handlers[sig] = signal.signal(sig, self.request_stop)
            old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        if self.peer is not None:
            poller.register(self.peer, zmq.POLLIN)
        if self.peer_monitor is not None:
            poller.register(self.peer_monitor, zmq.POLLIN)
        poller.register(wake_r.fileno(), zmq.POLLIN)
        hosted = [c for c in self.components.values() if not isinstance(c, str)]
        owner: dict[int, Component] = {}
        for component in hosted:
            for fd in component.fds():
                owner[fd] = component
                poller.register(fd, zmq.POLLIN)
        try:
            while not self._stopping:
                now = time.monotonic()
                parked = self._parked.next_deadline()
                deadlines = [c.next_deadline() for c in hosted] + ([parked] if parked is not None else [])
                wait_ms = min([1000.0, *((d - now) * 1000 for d in deadlines)])
                # Round up: truncating would poll(0) for the last millisecond before every deadline (a spin).
                ready = dict(poller.poll(max(0, math.ceil(wait_ms))))
                for fd, component in owner.items():
                    if fd in ready:
                        component.on_readable(fd)
                now = time.monotonic()
                for component in hosted:
                    if now >= component.next_deadline():
                        component.tick()
                self._parked.answer_ready(time.monotonic(), self._send)
                if wake_r.fileno() in ready:
                    try:
                        wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                if self.control in ready:
                    self._drain(self.control, "local")
                if self.peer is not None and self.peer in ready:
                    self._drain(self.peer, "peer")
                if self.peer_monitor is not None and self.peer_monitor in ready:
                    self._log_peer_handshakes()
            log.info("node %s: stopping (signal or request)", self.node)
        finally:
            if in_main:
                signal.set_wakeup_fd(old_wakeup)
                for sig, handler in old_handlers.items():
                    signal.signal(sig, handler)
            wake_r.close()
            wake_w.close()
            self.close()

    def close(self) -> None:
        """Close every socket, remove the socket files and the pid file (safe to call twice)."""
        self._parked.clear()
        for name, component in list(self.components.items()):
            if not isinstance(component, str):
                component.close()
                self.components[name] = "stopped"
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
        self._lock.release()

    # ----- receiving ------------------------------------------------------------------------

    def _drain(self, sock: zmq.Socket[bytes], plane: str) -> None:
        for _ in range(BATCH):
            try:
                frames, complete = self._recv(sock)
            except zmq.Again:
                return
            try:
                self._serve_one(sock, plane, frames, complete)
            except Exception:  # never let one message take the daemon down
                self.counters["errors"] += 1
                log.exception("node %s: unexpected failure serving a %s message (ignored)", self.node, plane)

    @staticmethod
    def _recv(sock: zmq.Socket[bytes]) -> tuple[list[zmq.Frame], bool]:
        """One message, frame by frame, keeping at most MAX_FRAMES (a flood of frames is not buffered)."""
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

    def _caller(self, plane: str, frame: zmq.Frame) -> Caller | None:
        if plane == "peer":
            return Caller(
                plane="peer",
                address=_frame_property(frame, "Peer-Address"),
                key=_frame_property(frame, "User-Id"),
                privileged=True,
            )
        creds = parse_peer_credentials(_frame_property(frame, "Peer-Address"))
        if creds is None:
            return None
        uid, gid, pid = creds
        privileged = uid == 0 or (self.slurm_uid is not None and uid == self.slurm_uid)
        return Caller(plane="local", uid=uid, gid=gid, pid=pid, privileged=privileged)

    def _serve_one(self, sock: zmq.Socket[bytes], plane: str, frames: list[zmq.Frame], complete: bool) -> None:
        self.counters["requests"] += 1
        identity = frames[0]
        rest = frames[1:]
        envelope = [identity.bytes]
        if rest and len(rest[0]) == 0:  # REQ or DEALER with an empty delimiter frame
            envelope.append(b"")
            rest = rest[1:]
        caller = self._caller(plane, rest[0] if rest else identity)
        if not complete or len(rest) != 1:
            self.counters["malformed"] += 1
            count = "too many" if not complete else str(len(rest))
            message = f"expected one request frame after the envelope, got {count}"
            log.warning(
                "node %s: malformed %s message from %s: %s",
                self.node,
                plane,
                caller.describe() if caller else "?",
                message,
            )
            self._send(sock, [*envelope, encode_error(BAD_REQUEST, message)])
            return
        if caller is None:
            self.counters["denied"] += 1
            log.warning("node %s: request without kernel credentials on the control socket refused", self.node)
            self._send(sock, [*envelope, encode_error(FORBIDDEN, "the caller's credentials cannot be determined")])
            return
        reply = self.handle(rest[0].bytes, caller)
        if isinstance(reply, Park):
            self._parked.add(sock, envelope, reply, time.monotonic(), self._send)
        else:
            self._send(sock, [*envelope, reply])

    def _send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # the client stopped reading: drop rather than block everyone else
            log.warning("node %s: reply dropped, the client's queue is full", self.node)
        except zmq.ZMQError as exc:
            log.warning("node %s: reply not sent: %s", self.node, exc)

    # ----- requests -------------------------------------------------------------------------

    def handle(self, data: bytes, caller: Caller) -> bytes | Park:
        """Decode, authorise and execute one request; a reply frame, or a :class:`Park` for a long poll."""
        try:
            request = decode_request(data, self.max_bytes)
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            level = logging.WARNING if exc.code in (BAD_REQUEST, TOO_LARGE) else logging.INFO
            log.log(level, "node %s: bad request from %s: %s", self.node, caller.describe(), exc)
            return encode_error(exc.code, exc.message)
        try:
            self._authorise(request, caller)
            reply = self._ops[request.op](request.args, caller)
            return reply if isinstance(reply, Park) else encode_ok(**reply)
        except ProtocolError as exc:
            if exc.code == FORBIDDEN:
                self.counters["denied"] += 1
                log.warning("node %s: denied: %s", self.node, exc.message)
            return encode_error(exc.code, exc.message)
        except UnknownJobError as exc:
            return encode_error(UNKNOWN_JOB, f"{exc} (node {self.node})")
        except EventLogFullError as exc:
            log.warning("node %s: %s", self.node, exc)
            return encode_error(QUOTA, str(exc))
        except Exception as exc:
            self.counters["errors"] += 1
            log.exception("node %s: %s from %s failed", self.node, request.op, caller.describe())
            return encode_error(INTERNAL, f"{request.op} failed on node {self.node}: {exc}")

    def _authorise(self, request: Request, caller: Caller) -> None:
        """Raise ProtocolError(forbidden) unless ``caller`` may run ``request``."""
        op, args = request.op, request.args
        if caller.plane == "peer":
            if op not in PEER_OPS:
                raise ProtocolError(
                    FORBIDDEN,
                    f"{caller.describe()} may not {op}: the daemon-to-daemon socket serves only "
                    + ", ".join(sorted(PEER_OPS)),
                )
            return
        if caller.privileged:
            return
        if op == "register_job":
            raise ProtocolError(
                FORBIDDEN,
                f"uid {caller.uid} may not register job {args['job_id']}: only root and the Slurm user "
                f"({self.cfg.slurm_user}) register jobs",
            )
        if op == "post_event" and "node" in args:
            raise ProtocolError(
                FORBIDDEN,
                f"uid {caller.uid} may not set 'node' of an event of job {args['job_id']} (peer daemons only)",
            )
        if op in JOB_OPS:
            job = self._registry.get(args["job_id"])
            if job is None:
                raise UnknownJobError(args["job_id"])
            if job.uid != caller.uid:
                raise ProtocolError(
                    FORBIDDEN,
                    f"uid {caller.uid} (pid {caller.pid}) may not {op} job {job.job_id}: it belongs to uid {job.uid}",
                )

    @property
    def _registry(self) -> Registry:
        assert self.registry is not None
        return self.registry

    def _visible(self, job: JobRecord, caller: Caller) -> bool:
        return caller.privileged or job.uid == caller.uid

    def _op_ping(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"node": self.node, "pid": os.getpid(), "version": __version__, "time": time.time()}

    def _op_status(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        jobs = self._registry.jobs()
        visible = [j for j in jobs if self._visible(j, caller)]
        running = [j for j in visible if j.state == RUNNING]
        ended = sorted((j for j in visible if j.state == ENDED), key=lambda j: j.ended_at or 0)
        shown = running + ended[-ENDED_JOBS_IN_STATUS:]
        visible_ids = {j.job_id for j in visible}
        recent = [e for e in self._registry.recent_events() if e["job_id"] in visible_ids]
        return {
            "node": self.node,
            "pid": os.getpid(),
            "version": __version__,
            "started_at": self._started_wall,
            "uptime_s": round(time.monotonic() - self._started_mono, 3),
            "control": str(self.paths.control_socket),
            "events": str(self.paths.events_socket),
            "state_dir": str(self.paths.state_dir),
            "peer_plane": self.peer_plane,
            "caller": {"uid": caller.uid, "privileged": caller.privileged},
            "jobs_running": sum(1 for j in jobs if j.state == RUNNING),
            "jobs_total": len(jobs),
            "jobs": [j.to_dict() for j in sorted(shown, key=lambda j: j.job_id)],
            "recent_events": recent[-RECENT_EVENTS_IN_STATUS:],
            "counters": dict(self.counters),
            **{
                name: ({"enabled": False, "state": c} if isinstance(c, str) else c.status())
                for name, c in self.components.items()
            },
        }

    def _op_jobs(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"jobs": [j.to_dict() for j in self._registry.jobs() if self._visible(j, caller)]}

    def _op_lens(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        lens = self.components.get("lens")
        if lens is None or isinstance(lens, str):
            return {"node": self.node, "enabled": False, "state": lens or "not configured"}
        snapshot = getattr(lens, "snapshot", None)
        return dict(snapshot()) if callable(snapshot) else {"node": self.node, "enabled": False}

    def _op_gpus(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """The GPU health watch's view; ranks and migrations only of the jobs the caller may see."""
        health = self.components.get("health")
        if health is None or isinstance(health, str):
            return {"node": self.node, "enabled": False, "state": health or "not configured", "gpus": []}
        snapshot = getattr(health, "snapshot", None)
        if not callable(snapshot):
            return {"node": self.node, "enabled": False, "state": "no snapshot", "gpus": []}

        def visible(job_id: int) -> bool:
            job = self._registry.get(job_id)
            return job is not None and self._visible(job, caller)

        return dict(snapshot(visible))

    def _op_register_job(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        record, created = self._registry.register(
            args["job_id"], args["uid"], args["user"], args["nodes"], args["options"], by=caller.describe()
        )
        log.info(
            "job %d (node %s): %s by %s: uid %d (%s), nodes %s, options %s",
            record.job_id,
            self.node,
            "registered" if created else "registered again (no change)",
            caller.describe(),
            record.uid,
            record.user,
            ",".join(record.nodes),
            record.options,
        )
        if created:
            self._publish_latest(record.job_id)
        return {"job": record.to_dict(), "created": created}

    def _op_unregister_job(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        before = self._registry.get(args["job_id"])
        record = self._registry.unregister(args["job_id"], by=caller.describe())
        if before is not None and before.state == RUNNING:
            log.info("job %d (node %s): unregistered by %s", record.job_id, self.node, caller.describe())
            self._publish_latest(record.job_id)
        return {"job": record.to_dict()}

    def _op_post_event(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        event = self._registry.append_event(
            args["job_id"], args["kind"], args.get("fields", {}), node=args.get("node"), by=caller.describe()
        )
        log.info(
            "job %d (node %s): event %s #%d from %s",
            event["job_id"],
            event["node"],
            event["kind"],
            event["seq"],
            caller.describe(),
        )
        self._publish(event)
        return {"seq": event["seq"], "time": event["time"]}

    def _op_job_events(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        events, more = self._registry.events(
            args["job_id"],
            since=args.get("since"),
            after=args.get("after"),
            limit=args.get("limit", DEFAULT_EVENTS_PER_REPLY),
            max_bytes=EVENTS_REPLY_BYTES,
        )
        job = self._registry.get(args["job_id"])
        return {"job": job.to_dict() if job else None, "events": events, "more": more}

    def _verdict_source(self) -> VerdictSource | str:
        watch = self.components.get("nodewatch")
        if isinstance(watch, VerdictSource):
            return watch
        return watch if isinstance(watch, str) else "not configured"

    def _op_node_verdicts(self, args: dict[str, Any], caller: Caller) -> dict[str, Any] | Park:
        """The node watch's verdicts about the job's nodes newer than ``after``; waits ``wait_ms`` for one."""
        job = self._registry.get(args["job_id"])
        if job is None:
            raise UnknownJobError(args["job_id"])
        source = self._verdict_source()
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

    def _op_node_view(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """What this node hears of ``node``: asked by another daemon whose node watch suspects it dead."""
        source = self._verdict_source()
        if isinstance(source, str):
            return {
                "observer": self.node,
                "node": args["node"],
                "heard_ms": None,
                "echo_ms": None,
                "trusted": False,
                "why": f"node watch {source}",
            }
        return source.view(args["node"])

    def _borrower(self) -> BorrowManager:
        manager = self.components.get("borrow")
        if not isinstance(manager, BorrowManager):
            reason = manager if isinstance(manager, str) else "not configured on this node"
            raise ProtocolError(FORBIDDEN, f"borrowing is not available on node {self.node}: {reason}")
        return manager

    def _op_borrow(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        job = self._registry.get(args["job_id"])
        if job is None:
            raise UnknownJobError(args["job_id"])
        try:
            return self._borrower().request(job, by=caller.describe(), lost_node=args.get("lost_node", ""))
        except BorrowRefused as exc:
            raise ProtocolError(FORBIDDEN, f"borrow for job {job.job_id} refused: {exc}") from None

    def _op_borrow_status(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        manager = self._borrower()
        manager.drain()  # an outcome the requester sees is already in the job's events
        return manager.requests_of(args["job_id"], args.get("request"))

    def _op_borrow_release(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        why = args.get("why") or f"released by {caller.describe()}"
        manager = self._borrower()
        released = manager.release(args["job_id"], why)
        manager.drain()  # recorded before the answer: the Epilog gathers the job's events right after
        return {"released": released}

    def record_event(self, job_id: int, kind: str, fields: dict[str, Any]) -> None:
        """Record an event of this node's own making (a borrow's outcome) and publish it."""
        event = self._registry.append_event(job_id, kind, fields, by=f"clockworkd on {self.node}")
        log.info("job %d (node %s): event %s #%d", job_id, self.node, kind, event["seq"])
        self._publish(event)

    def emit_node_event(self, kind: str, fields: dict[str, Any], by: str) -> None:
        """Record a node-level event (a link failover) in every running job's log, and publish it."""
        for job in self._registry.jobs():
            if job.state != RUNNING:
                continue
            try:
                event = self._registry.append_event(job.job_id, kind, fields, by=by)
            except Exception as exc:  # a full log must not stop the node's other work
                log.warning("job %d (node %s): %s not recorded: %s", job.job_id, self.node, kind, exc)
                continue
            self._publish(event)

    def emit_job_event(self, job_id: int, kind: str, fields: dict[str, Any], by: str) -> None:
        """Record an event of this node's own (the GPU health watch) in one job's log, and publish it."""
        try:
            event = self._registry.append_event(job_id, kind, fields, by=by)
        except Exception as exc:  # an unknown job or a full log must not stop the node's other work
            log.warning("job %d (node %s): %s not recorded: %s", job_id, self.node, kind, exc)
            return
        self._publish(event)

    def _publish_latest(self, job_id: int) -> None:
        recent = [e for e in self._registry.recent_events() if e["job_id"] == job_id]
        if recent:
            self._publish(recent[-1])

    def _publish(self, event: dict[str, Any]) -> None:
        if self.events is None:
            return
        try:
            self.events.send_multipart(encode_event(event), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # PUB drops for slow subscribers; anything else is only logged
            log.warning("job %d (node %s): event not published: %s", event["job_id"], self.node, exc)
