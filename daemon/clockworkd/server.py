"""The node daemon proper: one ZeroMQ event loop serving the local control plane and the peer plane.

Sockets (:mod:`clockworkd.daemon_sockets` binds them; ``RUN_DIR`` = ``[daemon] run_dir`` with ``{node}`` expanded):

- ``ipc://RUN_DIR/control.sock`` (ROUTER, mode 0666): requests from local clients (CLI, hooks,
  TorchPass). Anyone may connect, so every request is authorised by the *kernel's* credentials of
  the connecting process (:mod:`clockworkd.daemon_auth`). Nothing the client sends about itself is believed.
- ``ipc://RUN_DIR/events.sock`` (PUB, root and slurm_user only): every recorded event, topic
  ``b"JOBID."``. A PUB socket cannot tell its subscribers apart, so it is not world-accessible;
  users read their own job's events through ``job_events`` on the control socket.
- ``tcp://BIND_ADDR:listen_port`` (ROUTER, ZeroMQ CURVE): daemon-to-daemon requests (``ping``,
  ``post_event`` relays, ``node_view``: what this node hears of a peer another daemon suspects dead). A
  ZAP handler accepts only clients presenting one of the admin-installed public keys. Without usable keys
  the daemon runs without this socket and says why in ``status``.

Who may run an op is declared with the op, by the component that answers it (:mod:`clockworkd.daemon_ops`): the
daemon core's ops in :meth:`Daemon.ops` here, the hosted components' in their ``ops`` modules
(:mod:`clockworkd.lens.ops`, :mod:`clockworkd.gpuhealth.ops`, :mod:`clockworkd.nodewatch.ops`,
:mod:`clockworkd.borrow.ops`; LinkPass answers no op of its own). The daemon builds its table from those
declarations and refuses to start when an op of the wire schema has none; :mod:`clockworkd.daemon_auth` applies
them before any handler runs (deny by default). Today: root and ``slurm_user`` may do everything locally. Any
other uid may ``ping``; ``status`` and ``jobs`` show it only its own jobs (like Slurm's PrivateData=jobs); it may
``post_event``, ``job_events`` and ``unregister_job`` only for jobs registered with its uid, and never
``register_job``. A denial is answered with error ``forbidden`` and logged. ``node_verdicts`` (a job's agents
waiting for the node watch's verdicts on its nodes) is a long poll: its request is parked (:mod:`clockworkd.parked`)
and answered from the loop as soon as a verdict exists, or at its deadline.

What is here: the daemon's life cycle, the loop, reading and dispatching requests, the ops on the job registry and
the node's status, and recording and publishing events.

One thread, one :class:`zmq.Poller`; no thread per client (the ZAP authenticator runs in its own
thread, as pyzmq provides it). A malformed, oversized or unauthorised message is answered with an
error (or dropped when it cannot even be addressed), counted and logged; it never stops the loop.
What can block runs off the loop (GPU reads: :mod:`clockworkd.gpuhealth.guarded`; LinkPass's heartbeats:
:mod:`linkpass.hbio`), and every part is watched (:mod:`clockworkd.watchdog`): ``status`` names a stuck part and
for how long, and the watchdog's thread logs it, with where it is stuck, even while the loop itself is.
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
from typing import Any

import zmq

from clockwork import __version__
from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.daemon_wire import (
    BAD_REQUEST,
    DEFAULT_EVENTS_PER_REPLY,
    FORBIDDEN,
    INTERNAL,
    JOB_EVENTS,
    JOBS,
    PING,
    POST_EVENT,
    QUOTA,
    REGISTER_JOB,
    STATUS,
    TOO_LARGE,
    UNKNOWN_JOB,
    UNREGISTER_JOB,
    ProtocolError,
    decode_request,
    encode_error,
    encode_event,
    encode_ok,
)
from clockwork.contracts.errors import DaemonError
from clockwork.contracts.instance_lock import InstanceLock, socket_in_use
from clockworkd.borrow.ops import BorrowOps
from clockworkd.daemon_auth import Access, Caller, OpAccess, authorise, caller_of
from clockworkd.daemon_component import Component, OpsContext
from clockworkd.daemon_ops import OpSpec, op_table
from clockworkd.daemon_sockets import DaemonSockets, recv_capped
from clockworkd.gpuhealth.ops import HealthOps
from clockworkd.lens.ops import LensOps
from clockworkd.nodewatch.ops import NodeWatchOps
from clockworkd.parked import Park, ParkedRequests
from clockworkd.registry import ENDED, RUNNING, EventLogFullError, JobRecord, Registry, UnknownJobError
from clockworkd.watchdog import Watchdog

__all__ = ["Daemon"]

log = logging.getLogger("clockwork.daemon")

# Messages handled per socket per loop turn, so one busy client cannot starve the other plane.
BATCH = 64
ENDED_JOBS_IN_STATUS = 20
# A job_events reply stops adding events past this many bytes (``more`` tells the client to page on).
EVENTS_REPLY_BYTES = 8 * 1024 * 1024
RECENT_EVENTS_IN_STATUS = 20


def _resolve_uid(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


class Daemon:
    """One node's daemon: registry + sockets + the loop. ``start`` → ``serve`` → ``close``."""

    def __init__(self, cfg: DaemonConfig, paths: DaemonPaths) -> None:
        self.cfg = cfg
        self.paths = paths
        self.node = paths.node
        self.max_bytes = cfg.max_message_bytes
        self.registry: Registry | None = None
        self.slurm_uid = _resolve_uid(cfg.slurm_user)
        self.sockets = DaemonSockets(cfg, paths, self.slurm_uid)
        self._lock = InstanceLock(paths.pid_file)
        self._stopping = False
        self._started_wall = 0.0
        self._started_mono = 0.0
        self.counters = {"requests": 0, "errors": 0, "denied": 0, "malformed": 0}
        #: Hosted components by name (e.g. "linkpass"), or a string saying why one is not running.
        self.components: dict[str, Component | str] = {}
        #: Which part (the loop, a component's call, a worker thread) is stuck, and for how long (``status``).
        self.watchdog = Watchdog(self.node)
        self._parked = ParkedRequests()
        hosted = OpsContext(self.node, self.components, self.job)
        #: Every op, from the declarations of the core (:meth:`ops`) and of each hosted component.
        self.op_table: dict[str, OpSpec] = op_table(
            [self, LensOps(hosted), HealthOps(hosted), NodeWatchOps(hosted), BorrowOps(hosted)]
        )
        self._access = {op: spec.access for op, spec in self.op_table.items()}

    def ops(self) -> list[OpSpec]:
        """The daemon core's ops: the job registry, the node's status, events."""
        return [
            OpSpec(PING, OpAccess.of(Access.LOCAL_ANY, Access.PEER), self._op_ping),
            OpSpec(STATUS, OpAccess.of(Access.LOCAL_ANY), self._op_status),
            OpSpec(JOBS, OpAccess.of(Access.LOCAL_ANY), self._op_jobs),
            OpSpec(REGISTER_JOB, OpAccess.of(Access.PRIVILEGED), self._op_register_job),
            OpSpec(UNREGISTER_JOB, OpAccess.of(Access.JOB_OWNER), self._op_unregister_job),
            # ``node`` (where the event happened) is a relaying daemon's to say: a peer's, or root's.
            OpSpec(
                POST_EVENT, OpAccess.of(Access.JOB_OWNER, Access.PEER, privileged_fields=("node",)), self._op_post_event
            ),
            OpSpec(JOB_EVENTS, OpAccess.of(Access.JOB_OWNER), self._op_job_events),
        ]

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
            self.sockets.bind()
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
            self.sockets.peer_plane,
        )

    def request_stop(self, *_: object) -> None:
        """Ask the loop to finish (signal handler: only sets a flag; the wake-up fd interrupts the poll)."""
        self._stopping = True

    def serve(self) -> None:
        """Run the event loop until SIGTERM/SIGINT (or :meth:`request_stop`), then close everything."""
        control, peer, monitor = self.sockets.control, self.sockets.peer, self.sockets.peer_monitor
        assert control is not None
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
        poller.register(control, zmq.POLLIN)
        if peer is not None:
            poller.register(peer, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        poller.register(wake_r.fileno(), zmq.POLLIN)
        named = {name: c for name, c in self.components.items() if not isinstance(c, str)}
        hosted = list(named.values())
        owner: dict[int, tuple[str, Component]] = {}
        for name, component in named.items():
            for fd in component.fds():
                owner[fd] = (name, component)
                poller.register(fd, zmq.POLLIN)
        dog = self.watchdog
        loop_beat = [time.monotonic()]
        dog.watch("loop", lambda: time.monotonic() - loop_beat[0])
        dog.start()
        try:
            while not self._stopping:
                now = loop_beat[0] = time.monotonic()
                parked = self._parked.next_deadline()
                deadlines = [c.next_deadline() for c in hosted] + ([parked] if parked is not None else [])
                wait_ms = min([1000.0, *((d - now) * 1000 for d in deadlines)])
                # Round up: truncating would poll(0) for the last millisecond before every deadline (a spin).
                ready = dict(poller.poll(max(0, math.ceil(wait_ms))))
                for fd, (name, component) in owner.items():
                    if fd in ready:
                        with dog.working(name):
                            component.on_readable(fd)
                now = time.monotonic()
                for name, component in named.items():
                    if now >= component.next_deadline():
                        with dog.working(name):
                            component.tick()
                self._parked.answer_ready(time.monotonic(), self._send)
                if wake_r.fileno() in ready:
                    try:
                        wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                if control in ready:
                    self._drain(control, "local")
                if peer is not None and peer in ready:
                    self._drain(peer, "peer")
                if monitor is not None and monitor in ready:
                    self.counters["denied"] += self.sockets.log_refused_peers(BATCH)
            log.info("node %s: stopping (signal or request)", self.node)
        finally:
            dog.stop()
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
        self.sockets.close()
        if self.registry is not None:
            self.registry.close()  # every event written is made durable before the daemon goes
        self._lock.release()

    # ----- receiving ------------------------------------------------------------------------

    def _drain(self, sock: zmq.Socket[bytes], plane: str) -> None:
        for _ in range(BATCH):
            try:
                frames, complete = recv_capped(sock)
            except zmq.Again:
                return
            try:
                self._serve_one(sock, plane, frames, complete)
            except Exception:  # never let one message take the daemon down
                self.counters["errors"] += 1
                log.exception("node %s: unexpected failure serving a %s message (ignored)", self.node, plane)

    def _serve_one(self, sock: zmq.Socket[bytes], plane: str, frames: list[zmq.Frame], complete: bool) -> None:
        self.counters["requests"] += 1
        identity = frames[0]
        rest = frames[1:]
        envelope = [identity.bytes]
        if rest and len(rest[0]) == 0:  # REQ or DEALER with an empty delimiter frame
            envelope.append(b"")
            rest = rest[1:]
        caller = caller_of(plane, rest[0] if rest else identity, self.slurm_uid)
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
        with self.watchdog.working(f"{plane} request"):
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
            log.log(level, "node %s: bad request from %s: %s: %s", self.node, caller.describe(), exc.code, exc)
            return encode_error(exc.code, exc.message)
        try:
            authorise(request, caller, self._access, self.job, self.cfg.slurm_user)  # refuses undeclared ops
            reply = self.op_table[request.op].handler(request.args, caller)
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

    @property
    def _registry(self) -> Registry:
        assert self.registry is not None
        return self.registry

    def job(self, job_id: int) -> JobRecord:
        """The registered job ``job_id``; UnknownJobError (answered ``unknown_job``) when there is none."""
        job = self._registry.get(job_id)
        if job is None:
            raise UnknownJobError(job_id)
        return job

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
            "peer_plane": self.sockets.peer_plane,
            "caller": {"uid": caller.uid, "privileged": caller.privileged},
            "jobs_running": sum(1 for j in jobs if j.state == RUNNING),
            "jobs_total": len(jobs),
            "jobs": [j.to_dict() for j in sorted(shown, key=lambda j: j.job_id)],
            "recent_events": recent[-RECENT_EVENTS_IN_STATUS:],
            "counters": dict(self.counters),
            "watchdog": self.watchdog.report(),
            **{
                name: ({"enabled": False, "state": c} if isinstance(c, str) else c.status())
                for name, c in self.components.items()
            },
        }

    def _op_jobs(self, args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"jobs": [j.to_dict() for j in self._registry.jobs() if self._visible(j, caller)]}

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
        events = self.sockets.events
        if events is None:
            return
        try:
            events.send_multipart(encode_event(event), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # PUB drops for slow subscribers; anything else is only logged
            log.warning("job %d (node %s): event not published: %s", event["job_id"], self.node, exc)
