"""The per-job coordinator: its socket, its thread, and the core that makes every decision.

It owns no training state and sits on no data path: ranks talk to it only when membership changes (start,
failure, migration, end), never per step. What it decides, and why, is :mod:`torchpass.coordinator.membership` (the
generations), :mod:`torchpass.coordinator.snapshot_plan` (snapshot steps) and :mod:`torchpass.coordinator.core`
(dispatch, timers, leadership), all pure. This module is the shell around them: one ROUTER socket and one thread.
Whatever happens (a message on the socket, a call from another thread, a timer) becomes a typed event
(:mod:`torchpass.coordinator.records`) handed to the core with the time, and the decisions that come back are
carried out in order: messages sent, events emitted, the launcher's callbacks called.

In local mode this coordinator is one thread in the launcher. Under Slurm a replica runs in every node's agent
(:mod:`torchpass.launch.agent`) and only the leader's is *active*. The active replica hands a snapshot of its state to
:attr:`Coordinator.replicate` after every change (the agent mesh copies it to every follower), and a follower
that takes over (:meth:`Coordinator.take_over`) starts from that snapshot. :class:`LeaderSeam` is the view of
who leads.

This module imports no torch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from clockwork.contracts.coordinator_replies import Refusal
from clockwork.contracts.coordinator_requests import Heartbeat, parse_request
from clockwork.contracts.coordinator_wire import UNKNOWN, FailureKind, GenerationInfo, JobState, ProtocolError, Role
from torchpass.auth import serve
from torchpass.config import TorchPassConfig
from torchpass.coordinator.core import CoordinatorCore
from torchpass.coordinator.records import (
    AgentLost,
    CheckHeartbeats,
    Decision,
    Emit,
    Event,
    Evict,
    FailNow,
    HeartbeatIn,
    JobEnded,
    Now,
    RequestIn,
    Send,
    SpareNeeded,
    SpareTaken,
    StepDown,
    TakeOver,
    Tick,
    WorkerExited,
    WorkerExpected,
    WorkerRecord,
)
from torchpass.events import EventSink, emit
from torchpass.socket_thread import SocketThread, router_messages

__all__ = ["DONE", "FAILED", "FORMING", "RUNNING", "Coordinator", "LeaderSeam", "StaticLeader"]

log = logging.getLogger("clockwork.torchpass.coordinator")

FORMING, RUNNING, DONE, FAILED = JobState.FORMING, JobState.RUNNING, JobState.DONE, JobState.FAILED


class LeaderSeam(Protocol):
    """Which coordinator replica leads, as seen by a rank or an agent.

    Local mode has exactly one coordinator (:class:`StaticLeader`). In Slurm mode every node agent runs a
    replica and :class:`torchpass.launch.mesh.AgentMesh` elects the leader (agent 0 at the start, then the lowest agent
    still heard); ranks never choose: their agent's proxy forwards to :meth:`endpoints`' first entry and
    replays their pending requests when it changes. The command line uses the other entries when the first
    does not answer.
    """

    def endpoints(self) -> list[str]:
        """Coordinator endpoints to try, the presumed leader first."""
        ...

    def is_leader(self) -> bool:
        """Whether the replica in this process leads (only the leader declares generations)."""
        ...


@dataclass(frozen=True)
class StaticLeader:
    """The local-mode answer: one coordinator, always the leader."""

    endpoint: str

    def endpoints(self) -> list[str]:
        """The one endpoint."""
        return [self.endpoint]

    def is_leader(self) -> bool:
        """Always True."""
        return True


def _now() -> Now:
    return Now(time.monotonic(), time.time())


def _role(text: str) -> Role:
    """A role as launchers and agents name it; one this side cannot read is unknown (not an error)."""
    try:
        return Role.parse(text)
    except ProtocolError:
        return UNKNOWN


class Coordinator(SocketThread):
    """Membership and recovery decisions for one job (thread-safe entry points marked so)."""

    def __init__(
        self,
        world_size: int,
        config: TorchPassConfig,
        *,
        event_sink: EventSink | None = None,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        on_spare_taken: Callable[[str], None] | None = None,
        on_spare_needed: Callable[[], None] | None = None,
        on_evict: Callable[[str], None] | None = None,
        active: bool = True,
        replicate: Callable[[dict[str, Any]], None] | None = None,
        node_names: dict[int, str] | None = None,
        domains: dict[int, str] | None = None,
    ) -> None:
        super().__init__()
        self.core = CoordinatorCore(world_size, config, _now(), active=active)
        self.core.membership.node_names = dict(node_names or {})  # Slurm mode: events name a rank's node
        self.core.membership.domains = dict(domains or {})  # and spares avoid the domains that lost a node
        self.config = config
        self.event_sink = event_sink
        self.bind_host = bind_host
        self.port = port
        self.on_spare_taken = on_spare_taken
        self.on_spare_needed = on_spare_needed
        self.on_evict = on_evict
        # Slurm mode: the active replica's state goes here after every change (the agents' mesh copies it).
        self.replicate = replicate
        self.finished_event = threading.Event()
        self.endpoint = ""
        self._inbox: queue.Queue[Event] = queue.Queue()
        self._sock: zmq.Socket[bytes] | None = None
        self._exported: dict[str, Any] | None = None
        self._dirty = True  # something replicated may have changed since the last snapshot

    # ----- what the core knows (a moment's view from another thread) ----------------------------

    @property
    def world_size(self) -> int:
        """The job's number of training slots."""
        return self.core.membership.world_size

    @property
    def state(self) -> JobState:
        """Forming, running, done or failed."""
        return self.core.membership.state

    @property
    def failure_reason(self) -> str:
        """Why the job failed ('' unless it did)."""
        return self.core.membership.failure_reason

    @property
    def gen(self) -> int:
        """The newest generation declared (-1 before the first)."""
        return self.core.membership.gen

    @property
    def info(self) -> GenerationInfo | None:
        """The newest generation declared."""
        return self.core.membership.info

    @property
    def members(self) -> dict[int, str]:
        """Slot -> worker id of the current (or forming) membership."""
        return self.core.membership.members

    @property
    def spares(self) -> list[str]:
        """Spares ready for a slot, first to be used first."""
        return self.core.membership.spares

    @property
    def vacant(self) -> set[int]:
        """Slots waiting for a spare."""
        return self.core.membership.vacant

    @property
    def failures(self) -> int:
        """Member failures so far."""
        return self.core.membership.failures

    @property
    def workers(self) -> dict[str, WorkerRecord]:
        """Every process the coordinator heard of."""
        return self.core.membership.workers

    @property
    def dead_agents(self) -> set[int]:
        """Node agents counted lost (Slurm mode)."""
        return self.core.membership.dead_agents

    @property
    def active(self) -> bool:
        """Whether this replica decides (the leader's, or local mode's only one)."""
        return self.core.active

    @property
    def leader_hint(self) -> str:
        """Where a passive replica points the command line (the mesh keeps it current)."""
        return self.core.leader_hint

    @leader_hint.setter
    def leader_hint(self, endpoint: str) -> None:
        self.core.leader_hint = endpoint

    # ----- life cycle and events from other threads (thread-safe) ------------------------------

    def start(self) -> str:
        """Bind (port 0: a free port) and serve in a background thread; returns the endpoint."""
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        serve(sock)
        if self.port:
            sock.bind(f"tcp://{self.bind_host}:{self.port}")
        else:
            self.port = sock.bind_to_random_port(f"tcp://{self.bind_host}")
        self._sock = sock
        self.endpoint = f"tcp://{self.bind_host}:{self.port}"
        self._start_thread(self._serve, "torchpass-coordinator")
        log.info("coordinator for %d slot(s) listening on %s", self.world_size, self.endpoint)
        return self.endpoint

    def _post(self, event: Event) -> None:
        self._inbox.put(event)
        self._wake()

    def worker_exited(self, wid: str, role: str, code: int | None) -> None:
        """The launcher saw process ``wid`` exit (thread-safe; handled on the coordinator's thread)."""
        self._post(WorkerExited(wid, _role(role), code, time.time()))

    def expect_worker(self, wid: str, role: str) -> None:
        """The launcher started ``wid`` (thread-safe); lets an exit before registration be attributed."""
        self._post(WorkerExpected(wid, _role(role)))

    def take_over(
        self, snapshot: dict[str, Any] | None, dead_agents: set[int], hints: dict[str, str], why: str, at: float
    ) -> None:
        """Become the active replica (thread-safe): adopt the predecessor's ``snapshot``, count every process of
        ``dead_agents`` as dead (``hints``: wid -> role of processes the snapshot may not know yet; ``at``: when
        they were last heard, wall clock), and start a fresh generation."""
        roles = {wid: _role(role) for wid, role in hints.items()}
        self._post(TakeOver(snapshot, frozenset(dead_agents), roles, why, at))

    def fail_now(self, reason: str, kind: FailureKind = FailureKind.SCRIPT) -> None:
        """Fail the job at once with ``reason`` (thread-safe): e.g. no node could be borrowed and the user did
        not allow waiting for a standby spare, so waiting out ``spare_timeout_s`` would only hide the reason."""
        self._post(FailNow(reason, kind))

    def step_down(self, leader: str) -> None:
        """Become passive again (thread-safe): another replica won the leadership."""
        self._post(StepDown(leader))

    def agent_lost(self, agent: int, hints: dict[str, str], why: str, at: float) -> None:
        """Node agent ``agent`` is gone (thread-safe): every process it ran is dead. Whoever can tell says so:
        the agents' mesh when the agent's heartbeats stop. ``hints``: wid -> role of its processes; ``why``: the
        evidence, for the job's story; ``at``: when it was last heard (wall clock)."""
        self._post(AgentLost(agent, {wid: _role(role) for wid, role in hints.items()}, why, at))

    # ----- views (a moment's view from any thread: tests wait on them) ------------------------

    def export_state(self) -> dict[str, Any]:
        """Everything a successor needs to carry on (plain data for msgpack; :meth:`Membership.export`)."""
        return self.core.membership.export()

    def snapshot(self) -> dict[str, Any]:
        """The coordinator's view: state, generation, members, spares, per-worker liveness and step."""
        return self.core.status()

    def unanswered(self) -> list[tuple[str, str]]:
        """(worker, op) of the requests received and not answered yet: long polls parked until their answer
        exists (a new generation, every member finished) and, on a passive replica, every rank request held
        until it leads."""
        return self.core.unanswered()

    def plan_snapshot(self, reason: str, *, asked: int = 0) -> int | None:
        """Plan a snapshot now (on the coordinator's thread, or before :meth:`start`); the step, or None while
        the members' pace is not known yet (:meth:`torchpass.coordinator.snapshot_plan.SnapshotPlanner.plan`)."""
        step, decisions = self.core.plan_snapshot(reason, _now(), asked=asked)
        self._carry_out(decisions)
        return step

    # ----- the loop -------------------------------------------------------------------------

    def _serve(self) -> None:
        assert self._sock is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_check = time.monotonic()
        while not self._stopping.is_set():
            # A standby replica has no heartbeats to check: only its timers (and messages) wake it. Waiting
            # for a past ``next_check`` there would spin the loop at the poll's 1 ms granularity.
            due = min(next_check, self._next_timer()) if self.active else self._next_timer()
            timeout = max(0.0, due - time.monotonic())
            ready = dict(poller.poll(int(timeout * 1000) + 1))
            if self._stopping.is_set():
                break
            if ready.get(self._wake_r):
                self._drain_wake()
            self._drain_inbox()
            if ready.get(self._sock):
                self._drain_socket()
            if not self.active:
                continue
            now = time.monotonic()
            if now >= next_check:
                self._run(CheckHeartbeats())
                next_check = now + min(1.0, self.config.heartbeat_interval_s)
                self._dirty = True  # timers may have changed something: compare once a second at most
            self._run(Tick())
            if self._dirty:
                self._dirty = False
                self._maybe_replicate()

    def _next_timer(self) -> float:
        soonest = time.monotonic() + 1.0
        deadline = self.core.next_deadline()
        return soonest if deadline is None else min(soonest, deadline)

    def _drain_inbox(self) -> None:
        while True:
            try:
                event = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._dirty = True
            self._run(event)

    def _drain_socket(self) -> None:
        assert self._sock is not None
        for ident, _, msg in router_messages(self._sock, log):
            try:
                parsed = parse_request(msg)
            except ProtocolError as exc:
                log.warning("refusing a bad request from %r: %s", ident, exc)
                self._send(ident, Refusal(msg.get("id"), str(exc)).to_wire())
                continue
            if isinstance(parsed, Heartbeat):
                self._run(HeartbeatIn(ident, parsed))
                continue
            if self.active:
                self._dirty = True  # heartbeats change nothing that is replicated: no snapshot per heartbeat
            self._run(RequestIn(ident, parsed))

    def _run(self, event: Event) -> None:
        self._carry_out(self.core.handle(event, _now()))

    def _carry_out(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            match decision:
                case Send(to, message):
                    self._send(to, message.to_wire())
                case Emit(kind, fields):
                    emit(self.event_sink, log, kind, **fields)
                case SpareTaken(wid):
                    if self.on_spare_taken is not None:
                        self.on_spare_taken(wid)  # the local launcher starts a new spare to refill the pool
                case SpareNeeded():
                    if self.on_spare_needed is not None:
                        self.on_spare_needed()  # the local launcher starts one; under Slurm: borrow or wait
                case Evict(wid):
                    if self.on_evict is not None:
                        self.on_evict(wid)
                case JobEnded():
                    self.finished_event.set()

    def _send(self, ident: bytes, payload: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("could not send to %r: %s", ident, exc)

    def _maybe_replicate(self) -> None:
        if self.replicate is None:
            return
        snap = self.export_state()
        if snap != self._exported:
            self._exported = snap
            self.replicate(snap)
