"""The per-job coordinator: membership by generation, spares, and every recovery decision.

It owns no training state and sits on no data path: ranks talk to it only when membership changes (start,
failure, migration, end), never per step. It keeps, per generation, the map slot -> process, and makes a new
generation whenever that map must change:

* a member dies (the launcher saw its process exit, or its heartbeats stopped): its slot gets the first
  ready spare, the generation number goes up, and every member is told at once (a push its control thread
  turns into a local flag and, for a silently hung peer, into an abort of the broken collective);
* a rank reports a broken collective and no death explains it within ``broken_grace_s``: the same members
  rebuild their process group in a new generation;
* a planned migration (``clockwork migrate``): the spare takes the slot and the departing rank hands it its
  live state before leaving.

The rendezvous of each generation lives in the store server of one of its live members, preferably a
survivor, so no single process is the job's rendezvous for its whole life. In local mode this coordinator is
one thread in the launcher. Under Slurm a replica runs in every node's agent (:mod:`torchpass.agent`) and
only the leader's is *active*; the others are *passive*: they hold no decisions, answer the command line with
a redirect to the leader, and keep whatever a rank sends them until they lead. The active replica hands a
snapshot of its state to :attr:`replicate` after every change (the agent mesh copies it to every follower),
and a follower that takes over (:meth:`take_over`) starts from that snapshot: it declares the lost node's
processes dead and starts a fresh generation, numbered past anything its predecessor may have announced.
:class:`LeaderSeam` is the view of who leads.

This module imports no torch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from torchpass.auth import serve
from torchpass.config import TorchPassConfig
from torchpass.events import EventSink, emit
from torchpass.lockstep import CollectiveWait, MemberProgress, find_mismatch, parse_wait
from torchpass.protocol import GenerationInfo, Handoff, encode, router_messages
from torchpass.socket_thread import SocketThread

__all__ = ["Coordinator", "LeaderSeam", "StaticLeader"]

log = logging.getLogger("clockwork.torchpass.coordinator")

FORMING, RUNNING, DONE, FAILED = "forming", "running", "done", "failed"

#: How many times a snapshot someone asked for is planned when members skip it (still writing the last one).
SNAPSHOT_ATTEMPTS = 3


class LeaderSeam(Protocol):
    """Which coordinator replica leads, as seen by a rank or an agent.

    Local mode has exactly one coordinator (:class:`StaticLeader`). In Slurm mode every node agent runs a
    replica and :class:`torchpass.mesh.AgentMesh` elects the leader (agent 0 at the start, then the lowest agent
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


@dataclass
class _Worker:
    """What the coordinator knows of one rank or spare process."""

    wid: str
    role: str
    pid: int = 0
    host: str = ""
    store_port: int = 0
    alive: bool = True
    registered: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    step: int = -1
    rate: float = 0.0  # steps per second between its last two heartbeats (plans snapshot steps)
    step_seen_at: float = 0.0
    waiting: CollectiveWait | None = None  # the script's collective its latest heartbeat said it waits in
    notify_ident: bytes | None = None
    agent: int = -1  # Slurm mode: the node agent that runs it (its node's loss is this process's death)

    def __post_init__(self) -> None:
        if self.agent < 0:
            self.agent = _agent_of(self.wid)


@dataclass
class _Parked:
    """A long-poll request answered later (await_generation, finished)."""

    ident: bytes
    req_id: int
    op: str
    after: int = -1


@dataclass
class _Recovery:
    """Timestamps of the membership change in progress, for the recovered/migrated event."""

    evidence_at: float  # first sign of trouble: a death notice or a broken-collective report (wall clock)
    death_seen_at: float | None = None
    declared_at: float | None = None
    reasons: list[str] = field(default_factory=list)


def _agent_of(wid: str) -> int:
    """The agent index in a Slurm-mode worker id (``aK.N``), or -1 (local mode's ``wN``)."""
    head = wid.split(".", 1)[0]
    return int(head[1:]) if head.startswith("a") and head[1:].isdigit() else -1


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
    ) -> None:
        super().__init__()
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self.config = config
        self.event_sink = event_sink
        self.bind_host = bind_host
        self.port = port
        self.on_spare_taken = on_spare_taken
        self.on_spare_needed = on_spare_needed
        self.on_evict = on_evict
        self.state = FORMING
        self.failure_reason = ""
        self.gen = -1
        self.info: GenerationInfo | None = None
        self.members: dict[int, str] = {}  # slot -> wid of the current (or forming) membership
        self.vacant: set[int] = set()
        self.spares: list[str] = []
        self.failures = 0
        self.workers: dict[str, _Worker] = {}
        self._initial: dict[int, str] = {}
        self._parked: dict[str, _Parked] = {}
        self._joined: dict[str, dict[str, Any]] = {}
        self._finished: dict[str, int] = {}
        self._finished_at: dict[str, float] = {}  # monotonic
        self._progressed = False
        self._recovery: _Recovery | None = None
        self._grace: tuple[int, float] | None = None
        self._vacant_since: float | None = None
        self._pending_handoff: Handoff | None = None
        self._resets = 0  # consecutive rebuilds with no member lost at the same step (_reset_step)
        self._reset_step = -1
        self._last_error = ""  # the latest broken-collective report's error
        self._departing: str | None = None
        self._departed = False  # the departing rank reported its handoff (successful or not)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._sock: zmq.Socket[bytes] | None = None
        self.finished_event = threading.Event()
        self.endpoint = ""
        # Replication (Slurm mode): only an active replica decides; a passive one keeps rank messages in
        # _held until it leads, and points the command line at leader_hint.
        self.active = active
        self.replicate = replicate
        self.leader_hint = ""
        self.dead_agents: set[int] = set()
        self._held: list[tuple[bytes, dict[str, Any]]] = []
        self._exported: dict[str, Any] | None = None
        self._gen_floor = 0  # the next generation number is at least this (raised by a takeover)
        self._hold_declare = False  # batch several deaths into one generation
        self._dirty = True  # something replicated may have changed since the last snapshot
        # Training snapshots: steps every member is asked to snapshot after (pushed, and repeated in every
        # heartbeat answer until the slowest member passed them), and when the periodic one is next due.
        self.snapshot_steps: list[int] = []
        # Snapshot steps asked for by someone (not periodic) -> attempts so far: one that a member had to skip
        # (its previous snapshot was still being written) is planned again, up to SNAPSHOT_ATTEMPTS times.
        self._asked_snapshots: dict[int, int] = {}
        self._snapshot_due = time.monotonic() + config.snapshot_interval_s if config.snapshot_interval_s > 0 else None

    # ----- life cycle (thread-safe) ---------------------------------------------------------

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

    def worker_exited(self, wid: str, role: str, code: int | None) -> None:
        """The launcher saw process ``wid`` exit (thread-safe; handled on the coordinator's thread)."""
        self._inbox.put(("exited", (wid, role, code, time.time())))
        self._wake()

    def expect_worker(self, wid: str, role: str) -> None:
        """The launcher started ``wid`` (thread-safe); lets an exit before registration be attributed."""
        self._inbox.put(("expect", (wid, role)))
        self._wake()

    def take_over(
        self, snapshot: dict[str, Any] | None, dead_agents: set[int], hints: dict[str, str], why: str, at: float
    ) -> None:
        """Become the active replica (thread-safe): adopt the predecessor's ``snapshot``, count every process of
        ``dead_agents`` as dead (``hints``: wid -> role of processes the snapshot may not know yet; ``at``: when
        they were last heard, wall clock), and start a fresh generation."""
        self._inbox.put(("takeover", (snapshot, set(dead_agents), dict(hints), why, at)))
        self._wake()

    def fail_now(self, reason: str) -> None:
        """Fail the job at once with ``reason`` (thread-safe): e.g. no node could be borrowed and the user did
        not allow waiting for a standby spare, so waiting out ``spare_timeout_s`` would only hide the reason."""
        self._inbox.put(("fail", reason))
        self._wake()

    def step_down(self, leader: str) -> None:
        """Become passive again (thread-safe): another replica won the leadership."""
        self._inbox.put(("step_down", leader))
        self._wake()

    def agent_lost(self, agent: int, hints: dict[str, str], why: str, at: float) -> None:
        """Node agent ``agent`` went silent (thread-safe): every process it ran is dead (``hints``, ``at`` as
        for :meth:`take_over`)."""
        self._inbox.put(("agent_lost", (agent, dict(hints), why, at)))
        self._wake()

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
                self._check_heartbeats(now)
                next_check = now + min(1.0, self.config.heartbeat_interval_s)
                self._dirty = True  # timers may have changed something: compare once a second at most
            self._check_timers(now)
            if self._dirty:
                self._dirty = False
                self._maybe_replicate()

    def _next_timer(self) -> float:
        deadlines = [time.monotonic() + 1.0]
        if self._grace is not None:
            deadlines.append(self._grace[1])
        if self._vacant_since is not None:
            deadlines.append(self._vacant_since + self.config.spare_timeout_s)
        return min(deadlines)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._dirty = True
            if kind == "exited":
                wid, role, code, at = payload
                rec = self.workers.setdefault(wid, _Worker(wid=wid, role=role))
                if rec.alive:
                    self._on_death(wid, f"exited with code {code}", at)
            elif kind == "expect":
                wid, role = payload
                self.workers.setdefault(wid, _Worker(wid=wid, role=role))
            elif kind == "takeover":
                self._take_over(*payload)
            elif kind == "fail":
                if self.active:
                    self._fail(str(payload))
            elif kind == "step_down":
                if self.active:
                    log.warning("another replica leads (%s): this one turns passive", payload)
                self.active = False
                self.leader_hint = str(payload)
            elif kind == "agent_lost":
                agent, hints, why, at = payload
                if self.active:
                    self._lose_agents({agent}, hints, why, at)
                else:
                    self.dead_agents.add(agent)

    def _drain_socket(self) -> None:
        assert self._sock is not None
        for ident, _, msg in router_messages(self._sock, log):
            if not self.active:
                self._hold(ident, msg)
                continue
            if msg["op"] not in ("hb", "hello"):
                self._dirty = True  # heartbeats change nothing that is replicated: no snapshot per heartbeat
            try:
                self._handle(ident, msg)
            except Exception:  # one bad request must not take the job's coordinator down
                log.exception("error handling %s from %r", msg.get("op"), ident)
                self._reply_error(ident, msg, "internal coordinator error (see its log)")

    def _hold(self, ident: bytes, msg: dict[str, Any]) -> None:
        """Passive replica: the command line is pointed at the leader; a rank's message waits until we lead
        (a proxy only sends here once it believes this replica leads, so it will shortly)."""
        if not msg.get("wid"):
            hint = self.leader_hint or "unknown yet (an election is under way)"
            self._send(
                ident,
                encode("reply", id=msg.get("id"), ok=False, error=f"not the leader: the leader is {hint}", leader=hint),
            )
            return
        if len(self._held) < 100_000:
            self._held.append((ident, msg))

    # ----- replication (Slurm mode) ---------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        """Everything a successor needs to carry on (plain data for msgpack). Heartbeat times and steps are
        left out: they change all the time and mean nothing in another process."""
        return {
            "state": self.state,
            "failure_reason": self.failure_reason,
            "gen": self.gen,
            "info": None if self.info is None else self.info.to_wire(),
            "members": {int(k): v for k, v in self.members.items()},
            "vacant": sorted(self.vacant),
            "spares": list(self.spares),
            "failures": self.failures,
            "progressed": self._progressed,
            "resets": self._resets,
            "initial": {int(k): v for k, v in self._initial.items()},
            "departing": self._departing,
            "departed": self._departed,
            "dead_agents": sorted(self.dead_agents),
            "workers": {
                w.wid: {
                    "role": w.role,
                    "pid": w.pid,
                    "host": w.host,
                    "store_port": w.store_port,
                    "alive": w.alive,
                    "registered": w.registered,
                    "agent": w.agent,
                }
                for w in self.workers.values()
            },
        }

    def _import_state(self, snap: dict[str, Any]) -> None:
        self.state = str(snap["state"])
        self.failure_reason = str(snap["failure_reason"])
        self.gen = int(snap["gen"])
        self.info = None if snap["info"] is None else GenerationInfo.from_wire(snap["info"])
        self.members = {int(k): str(v) for k, v in snap["members"].items()}
        self.vacant = {int(v) for v in snap["vacant"]}
        self.spares = [str(v) for v in snap["spares"]]
        self.failures = int(snap["failures"])
        self._progressed = bool(snap["progressed"])
        self._resets = int(snap["resets"])
        self._initial = {int(k): str(v) for k, v in snap["initial"].items()}
        self._departing = snap["departing"]
        self._departed = bool(snap["departed"])
        self.dead_agents |= {int(a) for a in snap["dead_agents"]}
        now = time.monotonic()
        for wid, w in snap["workers"].items():
            rec = self.workers.setdefault(wid, _Worker(wid=wid, role=str(w["role"])))
            rec.role, rec.pid, rec.host = str(w["role"]), int(w["pid"]), str(w["host"])
            rec.store_port = int(w["store_port"])
            rec.alive = rec.alive and bool(w["alive"])
            rec.registered, rec.agent, rec.last_seen = bool(w["registered"]), int(w["agent"]), now

    def _maybe_replicate(self) -> None:
        if self.replicate is None:
            return
        snap = self.export_state()
        if snap != self._exported:
            self._exported = snap
            self.replicate(snap)

    def _take_over(
        self, snapshot: dict[str, Any] | None, dead: set[int], hints: dict[str, str], why: str, at: float
    ) -> None:
        if self.active:
            return
        if snapshot is not None:
            self._import_state(snapshot)
        self.active = True
        # Skip one number: the lost leader may have announced a generation it had no time to replicate.
        self._gen_floor = self.gen + 2
        log.warning("taking over as the job's coordinator (generation %d, state %s): %s", self.gen, self.state, why)
        if self.state == RUNNING:
            self._recovery = self._recovery or _Recovery(evidence_at=at, death_seen_at=time.time())
            self._lose_agents(dead, hints, why, at, force=True)
        elif self.state == FORMING:
            self._lose_agents(dead, hints, why, at)
            self._maybe_start()
        else:
            self.dead_agents |= dead
        held, self._held = self._held, []
        for ident, msg in held:
            try:
                self._handle(ident, msg)
            except Exception:
                log.exception("error handling a held %s", msg.get("op"))
        self._maybe_replicate()

    def _lose_agents(self, agents: set[int], hints: dict[str, str], why: str, at: float, force: bool = False) -> None:
        """Every process of ``agents`` is dead; one new generation covers them all (``force``: even when none
        of them was a member, so that nothing depends on what a lost leader was in the middle of)."""
        self.dead_agents |= agents
        for wid, role in hints.items():
            self.workers.setdefault(wid, _Worker(wid=wid, role=role))
        gen = self.gen
        self._hold_declare = True
        try:
            for rec in list(self.workers.values()):
                if rec.alive and rec.agent in agents:
                    self._on_death(rec.wid, why, at)
        finally:
            self._hold_declare = False
        if self.state != RUNNING:
            return
        if self.vacant or (force and self.gen == gen):
            if self._recovery is None:
                self._recovery = _Recovery(evidence_at=at, death_seen_at=time.time())
            if not self._recovery.reasons:
                self._recovery.reasons.append(why)
            self._try_declare()

    # ----- sending --------------------------------------------------------------------------

    def _send(self, ident: bytes, payload: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("could not send to %r: %s", ident, exc)

    def _reply(self, ident: bytes, req_id: Any, **fields: Any) -> None:
        self._send(ident, encode("reply", id=req_id, ok=True, **fields))

    def _reply_error(self, ident: bytes, msg: dict[str, Any], message: str, *, retry: bool = False) -> None:
        """Refuse a request; ``retry`` says the same request may succeed later (e.g. once a spare is ready)."""
        fields: dict[str, Any] = {"retry": True} if retry else {}
        self._send(ident, encode("reply", id=msg.get("id"), ok=False, error=message, **fields))

    def _push(self, wid: str, op: str, **fields: Any) -> None:
        rec = self.workers.get(wid)
        if rec is not None and rec.alive and rec.notify_ident is not None:
            self._send(rec.notify_ident, encode(op, **fields))

    # ----- requests -------------------------------------------------------------------------

    def _handle(self, ident: bytes, msg: dict[str, Any]) -> None:
        op = msg["op"]
        wid = str(msg.get("wid", ""))
        rec = self.workers.get(wid)
        if rec is not None:
            rec.last_seen = time.monotonic()
        if op in ("hello", "hb"):
            if rec is None:
                if not wid:
                    return
                rec = self.workers[wid] = _Worker(wid=wid, role="?")  # its register may still be in flight
            rec.notify_ident = ident
            self._note_step(rec, int(msg.get("step", rec.step)))
            rec.waiting = parse_wait(msg.get("uc"), time.monotonic())
            if rec.waiting is not None:
                self._check_lockstep()
            for step in msg.get("skipped") or ():
                self._on_snapshot_skipped(wid, int(step))
            if not rec.alive:
                self._send(ident, encode("stop", reason="evicted: the coordinator counts this process as dead"))
            else:
                self._send(ident, encode("hb_ack", gen=self.gen, state=self.state, snap=self._pending_snapshots()))
            return
        handler = {
            "register": self._on_register,
            "await_generation": self._on_await,
            "broken": self._on_broken,
            "joined": self._on_joined,
            "finished": self._on_finished,
            "migrate": self._on_migrate,
            "departed": self._on_departed,
            "fatal": self._on_fatal,
            "status": self._on_status,
            "snapshot": self._on_snapshot,
        }.get(op)
        if handler is None:
            self._reply_error(ident, msg, f"unknown op {op!r}")
            return
        if op not in ("register", "migrate", "status", "snapshot") and (rec is None or not rec.alive):
            self._reply(ident, msg.get("id"), stop=True, done=False, reason="evicted or unknown worker")
            return
        handler(ident, msg)

    def _on_register(self, ident: bytes, msg: dict[str, Any]) -> None:
        wid, role = str(msg["wid"]), str(msg["role"])
        rec = self.workers.setdefault(wid, _Worker(wid=wid, role=role))
        if not rec.alive:
            self._reply(ident, msg["id"], stop=True, done=False, reason="evicted")
            return
        rec.pid, rec.host, rec.store_port = int(msg["pid"]), str(msg["host"]), int(msg["store_port"])
        rec.registered, rec.role = True, role
        rec.agent = int(msg.get("agent", rec.agent if rec.agent >= 0 else _agent_of(wid)))
        log.info("registered %s (%s, pid %d, store %s:%d)", wid, role, rec.pid, rec.host, rec.store_port)
        if self.state in (DONE, FAILED):
            self._reply(ident, msg["id"], stop=True, done=self.state == DONE, reason=self.failure_reason)
            return
        self._reply(ident, msg["id"], world_size=self.world_size)
        if role == "spare":
            if wid in self.spares or wid in self.members.values():
                return  # registered again (through a proxy, after a leader change): nothing new
            self.spares.append(wid)
            if self.vacant and self.state == RUNNING:
                self._try_declare()
        elif self.state == FORMING:
            slot = int(role.split(":", 1)[1])
            self._initial[slot] = wid
            self._maybe_start()

    def _on_await(self, ident: bytes, msg: dict[str, Any]) -> None:
        wid, after = str(msg["wid"]), int(msg.get("after", -1))
        if self.state in (DONE, FAILED):
            self._reply(ident, msg["id"], stop=True, done=self.state == DONE, reason=self.failure_reason)
            return
        if self._entitled(wid) and self.info is not None and self.info.gen > after:
            self._reply(ident, msg["id"], generation=self.info.to_wire())
            return
        if wid == self._departing and not self._entitled(wid) and after >= 0:
            # Its slot went to a spare and the generation carrying the handoff is gone (a new leader took over
            # meanwhile): the spare got the state from a replica; this rank has nothing left to do.
            self._reply(ident, msg["id"], stop=True, done=True, reason="migrated away")
            return
        self._parked[wid] = _Parked(ident, msg["id"], "await", after)

    def _entitled(self, wid: str) -> bool:
        """Whether ``wid`` takes part in the current generation (a member, or the departing handoff source)."""
        info = self.info
        if info is None:
            return False
        return wid in info.members.values() or (info.handoff is not None and info.handoff.source == wid)

    def _on_broken(self, ident: bytes, msg: dict[str, Any]) -> None:
        gen = int(msg["gen"])
        self._reply(ident, msg["id"])
        if gen != self.gen or self.state != RUNNING or self.vacant:
            return
        now = time.time()
        self._last_error = str(msg.get("error", ""))[:300]
        if self._recovery is None:
            self._recovery = _Recovery(evidence_at=float(msg.get("at", now)))
        if self._grace is None:
            self._grace = (gen, time.monotonic() + self.config.broken_grace_s)
            emit(
                self.event_sink,
                log,
                "torchpass.collective_error",
                generation=gen,
                reporter=msg["wid"],
                slot=msg.get("slot"),
                step=msg.get("step"),
                error=str(msg.get("error", ""))[:300],
            )

    def _on_joined(self, ident: bytes, msg: dict[str, Any]) -> None:
        self._reply(ident, msg["id"])
        if int(msg["gen"]) != self.gen or self.info is None:
            return
        self._joined[str(msg["wid"])] = msg
        if set(self._joined) >= set(self.info.members.values()):
            self._generation_complete()

    def _on_finished(self, ident: bytes, msg: dict[str, Any]) -> None:
        wid, gen = str(msg["wid"]), int(msg["gen"])
        if self.state in (DONE, FAILED):
            self._reply(ident, msg["id"], stop=True, done=self.state == DONE, reason=self.failure_reason)
            return
        if self.info is not None and gen < self.gen and self._entitled(wid):
            self._reply(ident, msg["id"], generation=self.info.to_wire())
            return
        self._finished[wid] = int(msg["committed"])
        self._finished_at[wid] = time.monotonic()
        self._parked[wid] = _Parked(ident, msg["id"], "finished")
        if self.info is not None and not self.vacant and set(self._finished) >= set(self.info.members.values()):
            self._finish()

    def _on_migrate(self, ident: bytes, msg: dict[str, Any]) -> None:
        slot = int(msg["slot"])
        problem, retry = "", True
        if self.state != RUNNING or self.info is None or not self._progressed:
            problem = f"the job is not running a generation yet (state {self.state})"
        elif self.vacant or self._pending_handoff is not None or self._departing is not None:
            problem = "a membership change is already in progress"
        elif slot not in self.members:
            problem, retry = f"no slot {slot} (slots 0..{self.world_size - 1})", False
        elif not self.spares:
            problem = "no spare is ready"
        if problem:
            self._reply_error(
                ident, msg, f"cannot migrate slot {slot}: {problem}", retry=retry and self.state not in (DONE, FAILED)
            )
            return
        source = self.members.pop(slot)
        src = self.workers[source]
        self._departing = source
        self._departed = False
        self._pending_handoff = Handoff(slot, source, self.spares[0], src.host, src.store_port)
        self.vacant.add(slot)
        requester = str(msg.get("wid") or msg.get("requester") or "cli")
        self._recovery = _Recovery(evidence_at=time.time(), death_seen_at=time.time())
        self._recovery.reasons.append(f"migration of slot {slot} ({source}) requested by {requester}")
        emit(self.event_sink, log, "torchpass.migration_requested", slot=slot, source=source, by=requester)
        target, generation = self.spares[0], max(self.gen + 1, self._gen_floor)
        self._try_declare()  # before the answer: whoever reads the job after it sees the migration decided
        self._reply(ident, msg["id"], generation=generation, target=target)

    # ----- snapshots ------------------------------------------------------------------------

    def _note_step(self, rec: _Worker, step: int) -> None:
        now = time.monotonic()
        if step > rec.step >= 0 and now > rec.step_seen_at:
            rec.rate = (step - rec.step) / (now - rec.step_seen_at)
        if step != rec.step:
            rec.step, rec.step_seen_at = step, now

    def _pending_snapshots(self) -> list[int]:
        """Requested snapshot steps that some member may still reach (older ones are dropped)."""
        if not self.snapshot_steps:
            return []  # the common case, on every heartbeat: no walk over the members
        steps = [self.workers[w].step for w in self.members.values() if w in self.workers]
        slowest = min(steps) if steps else -1
        self.snapshot_steps = [s for s in self.snapshot_steps if s >= slowest]
        return list(self.snapshot_steps)

    def plan_snapshot(self, reason: str, *, asked: int = 0) -> int | None:
        """Choose the step every member snapshots after: ahead of the fastest member by what it may run
        before it hears of it (two heartbeat intervals at its observed pace, plus two steps), and push it.
        A snapshot already planned that no member can have reached serves instead (two snapshots a few steps
        apart would collide: a rank still writing the first one skips the second). None while no member's pace is
        known yet (fewer than two heartbeats with a step): a step planned then could already be behind the
        members, and a snapshot planned for a passed step never happens. ``asked``: how many times this
        snapshot was asked for, 0 for a periodic one (a skipped periodic snapshot waits for the next period)."""
        members = [self.workers[w] for w in self.members.values() if w in self.workers]
        newest = max((m.step for m in members), default=-1)
        rate = max((m.rate for m in members), default=0.0)
        if rate <= 0:
            return None
        # Where the fastest member may be by the time it hears of it (its last report is up to a heartbeat old).
        now = time.monotonic()
        reach = max(
            (m.step + m.rate * (now - m.step_seen_at + self.config.heartbeat_interval_s) for m in members),
            default=-1.0,
        )
        ahead = [s for s in self._pending_snapshots() if s > reach]
        if ahead:
            step, shared = ahead[0], {"shared": True}
        else:
            step, shared = max(0, newest) + int(rate * (2 * self.config.heartbeat_interval_s + 0.5)) + 2, {}
            self.snapshot_steps.append(step)
            for wid in self.members.values():
                self._push(wid, "snapshot", snap=[step])
        if asked:
            self._note_asked(step, max(asked, self._asked_snapshots.get(step, 0)))
        emit(self.event_sink, log, "torchpass.snapshot_requested", step=step, reason=reason, **shared)
        return step

    def _note_asked(self, step: int, attempt: int) -> None:
        """Record the attempt of the snapshot after ``step`` (-1: a skip of it was handled)."""
        self._asked_snapshots[step] = attempt
        while len(self._asked_snapshots) > 16:  # a skip is reported within a heartbeat: old entries are done
            del self._asked_snapshots[min(self._asked_snapshots)]

    def _on_snapshot_skipped(self, wid: str, step: int) -> None:
        """A member skipped the snapshot planned after ``step`` (still writing its previous one): the snapshot
        is incomplete. One that was asked for is planned again (once, whichever members skipped it)."""
        attempt = self._asked_snapshots.get(step, 0)
        if attempt < 0:
            return  # another member's report of the same snapshot was handled
        self._note_asked(step, -1)
        again = 0 < attempt < SNAPSHOT_ATTEMPTS and self.state == RUNNING
        emit(self.event_sink, log, "torchpass.snapshot_incomplete", step=step, skipped_by=wid, asked_again=again)
        if again:
            self.plan_snapshot(f"asked again: {wid} skipped the one after step {step}", asked=attempt + 1)

    def _on_snapshot(self, ident: bytes, msg: dict[str, Any]) -> None:
        if self.state != RUNNING or not self._progressed:
            self._reply_error(ident, msg, f"cannot snapshot now: the job is not training (state {self.state})")
            return
        requester = str(msg.get("requester") or msg.get("wid") or "cli")
        step = self.plan_snapshot(f"requested by {requester}", asked=1)
        if step is None:
            self._reply_error(
                ident,
                msg,
                "cannot snapshot yet: the job has just started and its pace is not known; ask again in a few seconds",
            )
            return
        self._reply(ident, msg["id"], step=step)

    def _on_departed(self, ident: bytes, msg: dict[str, Any]) -> None:
        self._reply(ident, msg["id"])
        if msg["wid"] == self._departing:
            self._departed = True
        emit(
            self.event_sink,
            log,
            "torchpass.departed",
            worker=msg["wid"],
            generation=msg.get("gen"),
            handoff_ok=bool(msg.get("handoff_ok")),
            handoff_ms=msg.get("handoff_ms"),
            handoff_bytes=int(msg.get("handoff_bytes") or 0),
        )

    def _on_fatal(self, ident: bytes, msg: dict[str, Any]) -> None:
        self._reply(ident, msg["id"])
        self._fail(f"{msg['wid']}: {msg.get('message', 'fatal error')}")

    def _on_status(self, ident: bytes, msg: dict[str, Any]) -> None:
        self._reply(ident, msg["id"], status=self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        """The coordinator's view: state, generation, members, spares, per-worker liveness and step."""
        return {
            "state": self.state,
            "generation": self.gen,
            "world_size": self.world_size,
            "members": {str(k): v for k, v in sorted(self.members.items())},
            "vacant": sorted(self.vacant),
            "spares": list(self.spares),
            "failures": self.failures,
            "failure_reason": self.failure_reason,
            "workers": {
                w.wid: {"role": w.role, "alive": w.alive, "pid": w.pid, "step": w.step} for w in self.workers.values()
            },
        }

    def unanswered(self) -> list[tuple[str, str]]:
        """(worker, op) of the requests received and not answered yet: long polls parked until their answer
        exists (a new generation, every member finished) and, on a passive replica, every rank request held
        until it leads. Safe to call from another thread (a moment's view: tests wait on it)."""
        held = [(str(msg.get("wid", "")), str(msg.get("op", ""))) for _, msg in list(self._held)]
        return held + [(wid, parked.op) for wid, parked in list(self._parked.items())]

    # ----- decisions ------------------------------------------------------------------------

    def _maybe_start(self) -> None:
        if self.state != FORMING:
            return
        if all(slot in self._initial or slot in self.vacant for slot in range(self.world_size)):
            self.state = RUNNING
            self.members = {s: w for s, w in self._initial.items() if self.workers[w].alive}
            self.vacant |= set(range(self.world_size)) - set(self.members)
            self._recovery = _Recovery(evidence_at=time.time())
            self._recovery.reasons.append("start")
            self._try_declare()

    def _on_death(self, wid: str, why: str, at: float) -> None:
        rec = self.workers[wid]
        rec.alive = False
        self._parked.pop(wid, None)
        if self.state in (DONE, FAILED):
            return  # processes leaving a finished job
        if wid in self.spares:
            self.spares.remove(wid)
            emit(self.event_sink, log, "torchpass.spare_lost", worker=wid, why=why)
            return
        if wid == self._departing:
            self._departing = None
            log.info("departing %s is gone (%s)", wid, why)
            info = self.info
            if not self._departed and info is not None and info.handoff is not None and info.handoff.source == wid:
                # It died before handing its state over: the spare must not wait for it. A new generation
                # without a handoff makes the spare take the state from a replica instead.
                self._recovery = self._recovery or _Recovery(evidence_at=at)
                self._recovery.reasons.append(f"departing {wid} {why} before its handoff")
                self._try_declare()
            return
        if self.state == FORMING:
            if rec.role.startswith("slot:"):
                slot = int(rec.role.split(":", 1)[1])
                self._initial.pop(slot, None)
                self.vacant.add(slot)
                self.failures += 1
                emit(self.event_sink, log, "torchpass.member_failed", slot=slot, worker=wid, why=why, generation=-1)
                self._maybe_start()
            return
        held = [s for s, w in self.members.items() if w == wid]
        if not held:
            return
        slot = held[0]
        del self.members[slot]
        self.vacant.add(slot)
        self.failures += 1
        if self._recovery is None:
            self._recovery = _Recovery(evidence_at=at)
        self._recovery.death_seen_at = self._recovery.death_seen_at or time.time()
        self._recovery.reasons.append(f"slot {slot} ({wid}) {why}")
        self._grace = None
        emit(
            self.event_sink,
            log,
            "torchpass.member_failed",
            slot=slot,
            worker=wid,
            why=why,
            generation=self.gen,
            last_step=rec.step,
            failures=self.failures,
        )
        if self.failures > self.config.max_failures:
            self._fail(
                f"{self.failures} member failures exceed max_failures={self.config.max_failures} "
                f"(the last: slot {slot} ({wid}) {why}, at step {rec.step})"
            )
            return
        if not self.members:
            self._fail("every member is gone: no replica holds the training state")
            return
        self._try_declare()

    def _try_declare(self) -> None:
        """Fill vacant slots with spares and announce a new generation (or wait for spares)."""
        if self.state != RUNNING or self._hold_declare:
            return
        if len(self.spares) < len(self.vacant):
            if self._vacant_since is None:
                self._vacant_since = time.monotonic()
                if self.on_spare_needed is not None:
                    self.on_spare_needed()  # the local launcher starts one; under Slurm: borrow or wait
                emit(
                    self.event_sink,
                    log,
                    "torchpass.waiting_for_spare",
                    vacant=sorted(self.vacant),
                    spares=len(self.spares),
                    generation=self.gen,
                )
            return
        replaced: dict[int, str] = {}
        for slot in sorted(self.vacant):
            if self._pending_handoff is not None and slot == self._pending_handoff.slot:
                wid = self._pending_handoff.target
                self.spares.remove(wid)
            else:
                wid = self.spares.pop(0)
            self.members[slot] = wid
            replaced[slot] = wid
            if self.on_spare_taken is not None:
                self.on_spare_taken(wid)  # the local launcher starts a new spare to refill the pool
        self.vacant.clear()
        self._vacant_since = None
        self._grace = None
        survivors = [s for s in sorted(self.members) if self.members[s] not in replaced.values()]
        host_slot = (survivors or sorted(self.members))[0]
        host = self.workers[self.members[host_slot]]
        recovery = self._recovery or _Recovery(evidence_at=time.time())
        recovery.declared_at = time.time()
        self._recovery = recovery
        self.gen = max(self.gen + 1, self._gen_floor)
        reason = "; ".join(recovery.reasons) or "collective error with no member lost: rebuild"
        recovery.reasons = []
        self.info = GenerationInfo(
            gen=self.gen,
            world_size=self.world_size,
            members=dict(self.members),
            store_host=host.host,
            store_port=host.store_port,
            reason=reason,
            expect_state=self._progressed,
            replaced=replaced,
            handoff=self._pending_handoff,
        )
        self._pending_handoff = None
        self._joined = {}
        self._finished = {}
        self._finished_at = {}
        emit(
            self.event_sink,
            log,
            "torchpass.generation",
            generation=self.gen,
            reason=reason,
            members={str(k): v for k, v in sorted(self.members.items())},
            replaced={str(k): v for k, v in replaced.items()},
            store=f"{host.host}:{host.store_port} (slot {host_slot})",
            handoff=None if self.info.handoff is None else self.info.handoff.source,
        )
        wire = self.info.to_wire()
        notify = set(self.members.values())
        if self.info.handoff is not None:
            notify.add(self.info.handoff.source)
        for wid in notify:
            self._push(wid, "generation", gen=self.gen)
        for wid, parked in list(self._parked.items()):
            if wid not in notify:
                continue
            if parked.op == "await" and parked.after >= self.gen:
                continue
            del self._parked[wid]
            self._reply(parked.ident, parked.req_id, generation=wire)

    def _generation_complete(self) -> None:
        """Every member of the current generation resumed: record how long the change took."""
        assert self.info is not None
        info, rec = self.info, self._recovery
        self._recovery = None
        reports = list(self._joined.values())
        now = time.time()

        def worst(key: str) -> float:
            return round(max((float(r.get(key) or 0.0) for r in reports), default=0.0), 1)

        newcomers = [r for r in reports if r["wid"] in info.replaced.values()]
        fields: dict[str, Any] = {
            "generation": info.gen,
            "reason": info.reason,
            "step": max(int(r["resume_step"]) for r in reports),
            "slots": sorted(info.replaced),
            "source_slots": sorted({int(r["source"]) for r in reports if r.get("source") is not None}),
            "received_by": sorted(int(r["slot"]) for r in reports if r.get("received")),
            "rebuild_ms": worst("rebuild_ms"),
            "transfer_ms": worst("transfer_ms"),
            "transfer_bytes": int(max((r.get("transfer_bytes") or 0) for r in reports)),
        }
        if rec is not None and rec.declared_at is not None:
            # The first sign of the failure: the launcher/daemon seeing the exit, a rank's broken report, or a
            # survivor's collective failing (which can come first: a closed socket is seen in microseconds).
            first_error = [float(r["first_error_at"]) for r in reports if r.get("first_error_at")]
            evidence = min([rec.evidence_at, *first_error])
            known = rec.death_seen_at or rec.declared_at
            fields["detect_ms"] = round(1000 * (known - evidence), 1)
            fields["decide_ms"] = round(1000 * (rec.declared_at - known), 1)
            if newcomers:
                fields["spare_ready_ms"] = round(
                    1000 * (max(float(r["arrived_at"]) for r in newcomers) - rec.declared_at), 1
                )
            fields["total_ms"] = round(1000 * (now - evidence), 1)
        if info.handoff is not None:
            kind = "torchpass.migrated"
            fields["handoff_ok"] = any(r.get("handoff_ok") for r in newcomers)
        elif not self._progressed:
            kind = "torchpass.started"
        else:
            kind = "torchpass.recovered"
        self._progressed = True
        emit(self.event_sink, log, kind, **fields)

    def _finish(self) -> None:
        assert self.info is not None
        self.state = DONE
        steps = sorted(set(self._finished.values()))
        emit(
            self.event_sink,
            log,
            "torchpass.finished",
            generation=self.gen,
            committed=steps,
            failures=self.failures,
        )
        self._stop_all(done=True, reason="job finished")

    def _fail(self, reason: str) -> None:
        if self.state in (DONE, FAILED):
            return
        self.state = FAILED
        self.failure_reason = reason
        emit(self.event_sink, log, "torchpass.failed", reason=reason, generation=self.gen, failures=self.failures)
        self._stop_all(done=False, reason=reason)

    def _stop_all(self, *, done: bool, reason: str) -> None:
        for parked in self._parked.values():
            self._reply(parked.ident, parked.req_id, stop=True, done=done, reason=reason)
        self._parked.clear()
        for wid in self.workers:
            self._push(wid, "stop", done=done, reason=reason)
        self.finished_event.set()

    # ----- timers ---------------------------------------------------------------------------

    def _check_heartbeats(self, now: float) -> None:
        if self.state in (DONE, FAILED):
            return  # processes are exiting; their silence means nothing now
        limit = self.config.heartbeat_timeout_s
        for rec in list(self.workers.values()):
            if rec.alive and rec.registered and now - rec.last_seen > limit:
                log.warning("%s silent for %.1f s: counting it as dead", rec.wid, now - rec.last_seen)
                self._on_death(rec.wid, f"silent for {now - rec.last_seen:.1f} s (no heartbeat)", time.time())
                if self.on_evict is not None:
                    self.on_evict(rec.wid)

    def _check_lockstep(self) -> None:
        """Fail the job at once when a member waits in a collective its peers went past (torchpass.lockstep)."""
        if self.state != RUNNING or self.vacant or self.info is None:
            return
        members = [
            MemberProgress(slot, rec.step, rec.step_seen_at, rec.waiting, self._finished_at.get(wid))
            for slot, wid in sorted(self.members.items())
            if (rec := self.workers.get(wid)) is not None
        ]
        verdict = find_mismatch(members, max(1.0, 1.5 * self.config.heartbeat_interval_s))
        if verdict is not None:
            self._fail(verdict)

    def _check_timers(self, now: float) -> None:
        self._check_lockstep()
        if self._snapshot_due is not None and now >= self._snapshot_due:
            self._snapshot_due = now + self.config.snapshot_interval_s
            if self.state == RUNNING and self._progressed and not self.vacant:
                if self.plan_snapshot("periodic") is None:  # pace not known yet: try again soon
                    self._snapshot_due = now + self.config.heartbeat_interval_s
        if self._grace is not None and now >= self._grace[1]:
            gen, _ = self._grace
            self._grace = None
            if gen == self.gen and self.state == RUNNING and not self.vacant:
                step = max((self.workers[w].step for w in self.members.values() if w in self.workers), default=-1)
                if step != self._reset_step:
                    self._resets, self._reset_step = 0, step
                self._resets += 1
                if self._resets > self.config.max_resets:
                    self._fail(
                        f"after {self._resets - 1} rebuild(s) at step {step} with no member lost, a collective "
                        f"failed again (the last error: {self._last_error or 'none reported'}): the "
                        "same collective keeps failing there. Either it outlasts collective_timeout_s="
                        f"{self.config.collective_timeout_s:g}, or the ranks' collectives do not line up (e.g. the "
                        "script's own, gated on a counter of its own, which TorchPass does not restore)"
                    )
                    return
                if self._recovery is None:
                    self._recovery = _Recovery(evidence_at=time.time())
                self._recovery.reasons.append("collective error with no member lost: rebuild")
                self._try_declare()
        if self._vacant_since is not None and now - self._vacant_since > self.config.spare_timeout_s:
            self._fail(f"no spare for slot(s) {sorted(self.vacant)} within {self.config.spare_timeout_s:g} s")
