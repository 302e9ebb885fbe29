"""The node agents' mesh: heartbeats between agents, leader election, and the coordinator's replicated state.

Under Slurm every node runs one TorchPass agent and every agent runs a coordinator replica; exactly one
replica is active (the *leader*), so no single node's loss ends the job. This module is the part that decides
who that is and keeps the others ready to take over:

* **Heartbeats.** Every agent sends a small heartbeat to every other agent every
  ``agent_heartbeat_interval_s`` (ZeroMQ DEALER -> ROUTER, on the node addresses). A node that crashes
  sends nothing and resets nothing (its NICs are dark), so silence is the only evidence: an agent not heard
  for ``agent_timeout_s`` is lost. Heartbeats also carry the agent's own processes (worker id, role, exit
  status), so the leader learns of a rank that exited on a healthy node at once and of the processes a
  silent node took with it.
* **Election.** At the start agent 0 leads (term 0). When a follower finds the leader silent, the lowest
  agent it still hears (itself included) claims leadership with a higher term; everyone follows the highest
  term it hears, and of two claims in the same term the lower agent index wins. The new leader's coordinator
  takes over from the last replicated snapshot, counts the processes of every silent agent as dead and
  starts a fresh generation. The leader declares silent followers lost the same way.
* **Node verdicts.** The node daemon hears the job's other nodes every 10 ms (LinkPass); when it judges one dead
  (:mod:`torchpass.launch.node_verdicts`), :meth:`AgentMesh.node_verdict` counts that node's agent silent at once, and
  the same rules (the leader declares it lost, or the followers elect a new leader) act without waiting for
  ``agent_timeout_s``. A verdict about an agent heard after it was made is ignored.
* **A second opinion.** One agent's silence is not evidence enough: a stalled Python process (a long GC pause,
  a blocked GIL) or a link that only this agent lost would cost a healthy node and a spare. Every heartbeat
  carries the agents its sender does not hear (``silent``), and an agent silent past ``agent_timeout_s``
  without a node verdict is lost then only when a second agent that is itself heard agrees (or no other agent
  is left to ask). Without that agreement (``torchpass.agent_unconfirmed``), or while the node daemon still
  hears the agent's node on the fabric (``fabric_alive``: a stalled agent on a live node,
  ``torchpass.agent_stalled``), it is lost only after ``agent_stall_timeout_s``. The leader applies this to
  its followers, the followers to the leader before one claims leadership.
* **Replication.** After every change the active coordinator hands its state (a few KB: generation,
  members, spares, workers) to :meth:`AgentMesh.publish`; the leader sends it to each follower until that
  follower's heartbeat acknowledges the version. A follower that the leader has declared lost learns it from
  the snapshot (:attr:`AgentMesh.evicted`) and leaves the job: its processes were already replaced.

A note on partitions: this is failure detection by timeout with a second opinion, not a majority quorum,
chosen so that a job of two nodes survives the loss of either (with no other agent to ask, the timeout
alone decides). If the agents' network splits while every node stays alive, both sides
may elect a leader; the lower index wins as soon as they hear each other again, and the other side's
processes are evicted (their slots were given to spares). LinkPass's redundant rails are what make such a
split unlikely. This module imports no torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from clockwork.contracts.coordinator_wire import FailureKind, JobState
from torchpass.auth import connect_as_client, serve
from torchpass.config import TorchPassConfig
from torchpass.coordinator.records import worker_id
from torchpass.coordinator.service import Coordinator
from torchpass.events import EventSink, emit
from torchpass.launch.slurm_layout import SlurmLayout
from torchpass.socket_thread import SocketThread

__all__ = ["AgentMesh"]

log = logging.getLogger("clockwork.torchpass.mesh")

MAX_MESH_MESSAGE = 64 << 20


@dataclass
class _Peer:
    """What this agent knows of another agent."""

    index: int
    heard_mono: float | None = None  # last heartbeat (monotonic); None: never heard
    heard_wall: float | None = None
    version: tuple[int, int] = (-1, -1)  # snapshot version it acknowledged
    children: dict[str, dict[str, Any]] = field(default_factory=dict)  # wid -> {role, code}
    finished: bool = False
    silent_view: frozenset[int] = frozenset()  # the agents it does not hear, per its last heartbeat


class AgentMesh(SocketThread):
    """Heartbeats, leader election and snapshot replication for one node agent (a :class:`LeaderSeam`)."""

    def __init__(
        self,
        layout: SlurmLayout,
        config: TorchPassConfig,
        coordinator: Coordinator,
        *,
        event_sink: EventSink | None = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.me = layout.index
        self.config = config
        self.coordinator = coordinator
        self.event_sink = event_sink
        self.interval = config.agent_heartbeat_interval_s
        self.timeout = config.agent_timeout_s
        self.stall_timeout = max(config.agent_stall_timeout_s, config.agent_timeout_s)
        #: Whether the node daemon hears agent K's node on the fabric now (None: it cannot tell); set by the
        #: agent, asked from the mesh thread only for an agent silent past agent_timeout_s, at most once a second.
        self.fabric_alive: Callable[[int], bool | None] | None = None
        self._fabric_seen: dict[int, tuple[float, bool | None]] = {}  # agent -> (asked at, answer)
        self._held: dict[int, str] = {}  # agents silent past the timeout and not lost yet -> event told
        self.startup_timeout = max(config.agent_startup_timeout_s, config.agent_timeout_s)
        self.term = 0
        self.leader = 0
        self.dead: set[int] = set()
        self.evicted = threading.Event()
        self.finished = False  # set by the agent: the job ended and this agent's processes exited
        self.listeners: list[Callable[[int, int], None]] = []  # (leader, term) after every change of leader
        self._peers = {k: _Peer(k) for k in range(layout.agents) if k != self.me}
        self._children: dict[str, dict[str, Any]] = {}
        self._snapshot: dict[str, Any] | None = None
        self._version: tuple[int, int] = (-1, -1)
        self._counter = 0
        self._reported: set[str] = set()  # exits handed to our own coordinator while leading
        self._verdicts_in: dict[int, tuple[str, float, float]] = {}  # agent -> (why, last heard, judged at): wall
        self._verdicts: dict[int, tuple[str, float]] = {}  # the mesh thread's: agent -> (why, last heard)
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._router: zmq.Socket[bytes] | None = None
        self._dealers: dict[int, zmq.Socket[bytes]] = {}

    # ----- LeaderSeam ----------------------------------------------------------------------

    def endpoints(self) -> list[str]:
        """Coordinator endpoints, the leader first, then the other live agents in index order."""
        leader = self.layout.coordinator_endpoint(self.leader)
        live = [k for k in range(self.layout.agents) if k != self.leader and k not in self.dead]
        others = [self.layout.coordinator_endpoint(k) for k in live]
        return [leader, *others]

    def is_leader(self) -> bool:
        """Whether this agent's coordinator replica is the active one."""
        return self.leader == self.me

    def leader_endpoint(self) -> str:
        """The active coordinator's endpoint, as far as this agent knows."""
        return self.layout.coordinator_endpoint(self.leader)

    # ----- what the agent and the coordinator tell the mesh (thread-safe) ---------------------------

    def publish(self, snapshot: dict[str, Any]) -> None:
        """The active coordinator's state changed (called on its thread): replicate it to every follower."""
        with self._lock:
            self._counter += 1
            self._snapshot = snapshot
            self._version = (self.term, self._counter)
        self._wake()

    def child_update(self, wid: str, role: str, code: int | None) -> None:
        """One of this agent's processes started (``code`` None) or exited; the leader hears of it at once."""
        with self._lock:
            self._children[wid] = {"role": role, "code": code}
        if code is not None and self.is_leader():
            self._report_exit(wid, role, code)
        self._wake()

    def node_verdict(self, agent: int, why: str, last_heard: float, silent_s: float) -> None:
        """The node daemon judged ``agent``'s node dead (thread-safe): ``why``, and when it was last heard (wall
        clock) and how long it had been silent at the verdict. The mesh counts the agent silent at once."""
        if agent == self.me or agent not in self._peers:
            return
        with self._lock:
            self._verdicts_in[agent] = (why, last_heard, last_heard + silent_s)
        self._wake()

    def job_state(self) -> JobState:
        """The job's state in the newest replicated snapshot (forming before the first)."""
        with self._lock:
            return JobState(str(self._snapshot["state"])) if self._snapshot else JobState.FORMING

    def job_progressed(self) -> bool:
        """Whether the newest replicated snapshot shows a generation completed (training began)."""
        with self._lock:
            return bool(self._snapshot.get("progressed")) if self._snapshot else False

    def failure_reason(self) -> str:
        """Why the job failed, per the newest snapshot ('' when it did not)."""
        with self._lock:
            return str(self._snapshot.get("failure_reason", "")) if self._snapshot else ""

    def failure_kind(self) -> FailureKind:
        """What kind of failure it was, per the newest snapshot (:class:`FailureKind`; SCRIPT before any)."""
        with self._lock:
            kind = str(self._snapshot.get("failure_kind", "")) if self._snapshot else ""
        try:
            return FailureKind(kind)
        except ValueError:
            return FailureKind.SCRIPT

    def worker_alive(self, wid: str) -> bool | None:
        """Whether the leader counts ``wid`` alive (None: not in the snapshot yet)."""
        with self._lock:
            if not self._snapshot:
                return None
            worker = self._snapshot["workers"].get(wid)
        return None if worker is None else bool(worker["alive"])

    def slot_holders(self) -> tuple[dict[int, str], dict[int, str]]:
        """(slot -> its first generation's worker, slot -> its worker now) per the newest snapshot ({} before)."""
        with self._lock:
            snap = self._snapshot or {}
            initial, members = snap.get("initial") or {}, snap.get("members") or {}
        return {int(k): str(v) for k, v in initial.items()}, {int(k): str(v) for k, v in members.items()}

    def slot_parts(self) -> dict[int, str]:
        """Slot -> the part of the state its newest rank received, where the layout names one (a pipeline stage,
        a shard), per the newest snapshot."""
        with self._lock:
            parts = (self._snapshot or {}).get("parts") or {}
        return {int(k): str(v) for k, v in parts.items()}

    def lost_agents(self) -> frozenset[int]:
        """The agents counted lost so far (a copy: one C-level call, safe beside the mesh thread's updates)."""
        return frozenset(self.dead)

    def hears(self) -> frozenset[int]:
        """The other agents heard within ``agent_timeout_s`` (and not counted lost)."""
        now = time.monotonic()
        return frozenset(
            p.index
            for p in list(self._peers.values())
            if p.heard_mono is not None and p.index not in self.dead and now - p.heard_mono <= self.timeout
        )

    def live_peers_finished(self) -> bool:
        """Whether every agent not counted lost has said its processes exited after the job ended."""
        with self._lock:
            return all(p.finished or p.index in self.dead for p in self._peers.values())

    # ----- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Bind the mesh socket, connect to every peer, and run the heartbeat thread."""
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESH_MESSAGE)
        serve(router)
        router.bind(self.layout.mesh_endpoint(self.me))
        self._router = router
        for k in self._peers:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 64)  # a dead peer must not pile up snapshots
            dealer.setsockopt(zmq.IDENTITY, f"agent{self.me}".encode())
            connect_as_client(dealer)
            dealer.connect(self.layout.mesh_endpoint(k))
            self._dealers[k] = dealer
        self._start_thread(self._run, "torchpass-mesh")
        log.info(
            "agent %d of %d on %s (%s): mesh %s, coordinator replica %s",
            self.me,
            self.layout.agents,
            self.layout.node,
            self.layout.address,
            self.layout.mesh_endpoint(self.me),
            self.layout.coordinator_endpoint(self.me),
        )

    # ----- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        assert self._router is not None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stopping.is_set():
            ready = dict(poller.poll(int(max(0.0, next_tick - time.monotonic()) * 1000) + 1))
            if self._stopping.is_set():
                break
            send_now = False
            if ready.get(self._wake_r):
                self._drain_wake()
                send_now = True
            if ready.get(self._router):
                self._drain()
            if self._take_verdicts():
                self._evaluate(time.monotonic())
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + self.interval
                self._evaluate(now)
                send_now = True
            if send_now:
                self._send_heartbeats()

    def _drain(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                sender = int(msg["from"])
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                log.warning("dropping a malformed mesh message: %s", exc)
                continue
            if sender in self._peers and msg.get("op") == "ahb":
                self._on_heartbeat(self._peers[sender], msg)

    def _on_heartbeat(self, peer: _Peer, msg: dict[str, Any]) -> None:
        if peer.index not in self.dead:
            peer.heard_mono, peer.heard_wall = time.monotonic(), time.time()
            self._held.pop(peer.index, None)
        peer.silent_view = frozenset(int(a) for a in msg.get("silent", ()))
        peer.version = tuple(msg.get("version", (-1, -1)))  # type: ignore[assignment]
        peer.children = dict(msg.get("children", {}))
        peer.finished = bool(msg.get("finished"))
        term, leader = int(msg["term"]), int(msg["leader"])
        if term > self.term or (term == self.term and leader < self.leader):
            self._follow(leader, term)
        snap = msg.get("snap")
        if snap is not None and peer.index == self.leader and term == self.term:
            version = tuple(msg["snap_version"])
            with self._lock:
                if version > self._version:
                    self._snapshot, self._version = snap, version  # type: ignore[assignment]
            self.dead |= {int(a) for a in snap["dead_agents"]}
            if self.me in self.dead and not self.evicted.is_set():
                log.error("the leader counts this agent (%d) as lost: leaving the job", self.me)
                self.evicted.set()
        if self.is_leader() and peer.index not in self.dead:
            for wid, child in peer.children.items():
                if child.get("code") is not None:
                    self._report_exit(wid, str(child.get("role", "?")), int(child["code"]))

    def _report_exit(self, wid: str, role: str, code: int) -> None:
        if wid not in self._reported:
            self._reported.add(wid)
            self.coordinator.worker_exited(wid, role, code)

    def _follow(self, leader: int, term: int) -> None:
        was_leader = self.is_leader()
        changed = leader != self.leader
        self.term, self.leader = term, leader
        if was_leader and leader != self.me:
            self.coordinator.step_down(self.leader_endpoint())
        self.coordinator.leader_hint = self.leader_endpoint()
        if changed:
            log.warning("agent %d leads now (term %d): %s", leader, term, self.leader_endpoint())
            self._notify()

    def _notify(self) -> None:
        for listener in self.listeners:
            try:
                listener(self.leader, self.term)
            except Exception:
                log.exception("leader-change listener failed")

    # ----- liveness and election -------------------------------------------------------------

    def _take_verdicts(self) -> bool:
        """Adopt the node verdicts handed in since the last turn; whether any is new."""
        with self._lock:
            verdicts, self._verdicts_in = self._verdicts_in, {}
        new = False
        for agent, (why, last_heard, judged_at) in verdicts.items():
            peer = self._peers[agent]
            if agent in self.dead or agent in self._verdicts:
                continue
            if peer.heard_wall is not None and peer.heard_wall > judged_at:
                log.warning("ignoring a node verdict on agent %d: it was heard after the verdict (%s)", agent, why)
                continue
            self._verdicts[agent] = (why, last_heard)
            new = True
        return new

    def _silent(self, peer: _Peer, now: float) -> bool:
        if peer.index in self.dead or peer.index in self._verdicts:
            return True
        if peer.heard_mono is None:
            return now - self._started > self.startup_timeout
        return now - peer.heard_mono > self.timeout

    def _lost(self, peer: _Peer, now: float) -> bool:
        """Whether ``peer`` counts as lost now: a node verdict, or silence past ``agent_timeout_s`` that a second
        agent confirms, or past ``agent_stall_timeout_s`` (see the module docstring)."""
        if peer.index in self.dead or peer.index in self._verdicts:
            return True
        if not self._silent(peer, now):
            return False
        if peer.heard_mono is None:
            return True  # never heard within agent_startup_timeout_s: nobody to wait for
        silent_s = now - peer.heard_mono
        if silent_s > self.stall_timeout:
            return True
        if self._fabric(peer.index, now):
            self._hold(peer, now, "torchpass.agent_stalled", heard_by=["fabric"])
            return False
        witnesses = [
            p
            for p in self._peers.values()
            if p.index != peer.index and p.index not in self.dead and not self._silent(p, now)
        ]
        if not witnesses or any(peer.index in w.silent_view for w in witnesses):
            return True
        self._hold(peer, now, "torchpass.agent_unconfirmed", heard_by=sorted(w.index for w in witnesses))
        return False

    def _fabric(self, agent: int, now: float) -> bool:
        """Whether the node daemon hears ``agent``'s node (asked at most once a second per agent)."""
        if self.fabric_alive is None:
            return False
        asked, answer = self._fabric_seen.get(agent, (-1e9, None))
        if now - asked >= 1.0:
            try:
                answer = self.fabric_alive(agent)
            except Exception as exc:  # no evidence is not evidence of life
                log.warning("cannot ask the node daemon about agent %d's node: %s", agent, exc)
                answer = None
            self._fabric_seen[agent] = (now, answer)
        return bool(answer)

    def _hold(self, peer: _Peer, now: float, kind: str, heard_by: list[Any]) -> None:
        """Tell once per silence why ``peer`` is not counted lost yet."""
        if self._held.get(peer.index) == kind:
            return
        self._held[peer.index] = kind
        emit(
            self.event_sink,
            log,
            kind,
            agent=peer.index,
            node=self.layout.nodes[peer.index],
            silent_ms=self._silence_ms(peer, now),
            by=self.me,
            heard_by=heard_by,
            lost_after_s=self.stall_timeout,
        )

    def _hints(self, agent: int) -> dict[str, str]:
        """The processes ``agent`` ran, as its heartbeats said (its first one when it said nothing)."""
        children = {wid: str(c.get("role", "?")) for wid, c in self._peers[agent].children.items()}
        if not children:  # its first G processes, one per local index
            per_node = self.layout.ranks_per_node
            for local in range(per_node):
                children[worker_id(agent, local, local, per_node)] = self.layout.role_of(agent, local)
        return children

    def _silence_ms(self, peer: _Peer, now: float) -> float:
        since = peer.heard_mono if peer.heard_mono is not None else self._started
        return round(1000 * (now - since), 1)

    def _evaluate(self, now: float) -> None:
        if self.evicted.is_set():
            return
        if self.is_leader():
            for peer in self._peers.values():
                if peer.index not in self.dead and not peer.finished and self._lost(peer, now):
                    self._lose(peer, now)
            return
        if self.job_state().ended:
            return  # the job is over: a silent leader has simply exited
        leader = self._peers.get(self.leader)
        if leader is None or not self._lost(leader, now):
            return
        candidates = [self.me] + [p.index for p in self._peers.values() if not self._silent(p, now)]
        if min(candidates) == self.me:
            self._claim(leader, now)

    def _lose(self, peer: _Peer, now: float) -> None:
        self.dead.add(peer.index)
        why = f"agent {peer.index} ({self.layout.nodes[peer.index]}) silent for {self._silence_ms(peer, now):.0f} ms"
        at = peer.heard_wall if peer.heard_wall is not None else time.time()
        verdict = self._verdicts.get(peer.index)
        if verdict is not None:
            why, at = f"{why}; {verdict[0]}", verdict[1]
        emit(
            self.event_sink,
            log,
            "torchpass.agent_lost",
            agent=peer.index,
            node=self.layout.nodes[peer.index],
            silent_ms=self._silence_ms(peer, now),
            by=self.me,
            verdict=None if verdict is None else verdict[0],
            processes=self._hints(peer.index),
        )
        self.coordinator.agent_lost(peer.index, self._hints(peer.index), why, at)

    def _claim(self, old: _Peer, now: float) -> None:
        lost = {p.index for p in self._peers.values() if p.index not in self.dead and self._lost(p, now)}
        previous = self.leader
        self.term += 1
        self.leader = self.me
        self.dead |= lost
        hints: dict[str, str] = {}
        for agent in lost:
            hints.update(self._hints(agent))
        with self._lock:
            snapshot = self._snapshot
        self._reported.clear()
        why = (
            f"coordinator leader agent {previous} ({self.layout.nodes[previous]}) silent for "
            f"{self._silence_ms(old, now):.0f} ms; agent {self.me} takes over (term {self.term})"
        )
        verdict = self._verdicts.get(previous)
        if verdict is not None:
            why += f"; {verdict[0]}"
        emit(
            self.event_sink,
            log,
            "torchpass.leader_elected",
            agent=self.me,
            node=self.layout.node,
            term=self.term,
            previous=previous,
            lost=sorted(lost),
            silent_ms=self._silence_ms(old, now),
            snapshot_generation=None if snapshot is None else snapshot["gen"],
        )
        for agent in sorted(lost):
            peer = self._peers[agent]
            emit(
                self.event_sink,
                log,
                "torchpass.agent_lost",
                agent=agent,
                node=self.layout.nodes[agent],
                silent_ms=self._silence_ms(peer, now),
                by=self.me,
                verdict=self._verdicts[agent][0] if agent in self._verdicts else None,
                processes=self._hints(agent),
            )
        self.coordinator.leader_hint = self.leader_endpoint()
        at = old.heard_wall if old.heard_wall is not None else time.time()
        if verdict is not None:
            at = verdict[1]
        self.coordinator.take_over(snapshot, lost, hints, why, at)
        for peer in self._peers.values():  # exits that the lost leader may not have acted on
            if peer.index not in self.dead:
                for wid, child in peer.children.items():
                    if child.get("code") is not None:
                        self._report_exit(wid, str(child.get("role", "?")), int(child["code"]))
        with self._lock:
            own = dict(self._children)
        for wid, child in own.items():
            if child.get("code") is not None:
                self._report_exit(wid, str(child["role"]), int(child["code"]))
        self._notify()

    # ----- sending -------------------------------------------------------------------------

    def _send_heartbeats(self) -> None:
        now = time.monotonic()
        silent = sorted(p.index for p in self._peers.values() if p.index not in self.dead and self._silent(p, now))
        with self._lock:
            base = {
                "op": "ahb",
                "from": self.me,
                "term": self.term,
                "leader": self.leader,
                "version": list(self._version),
                "children": dict(self._children),
                "finished": self.finished,
                "silent": silent,
            }
            snapshot, version = self._snapshot, self._version
        plain = msgpack.packb(base, use_bin_type=True)
        with_snap: bytes | None = None
        for k, dealer in self._dealers.items():
            payload = plain
            if self.is_leader() and snapshot is not None and self._peers[k].version < version:
                if with_snap is None:
                    with_snap = msgpack.packb(
                        {**base, "snap": snapshot, "snap_version": list(version)}, use_bin_type=True
                    )
                payload = with_snap
            try:
                dealer.send(payload, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a peer that is gone: its queue is full; silence will tell
