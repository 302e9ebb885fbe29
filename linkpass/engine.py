"""The LinkPass engine: watch every NIC and the (peer, rail) paths, route around what is dead, fail back.

Evidence: netlink (a local NIC's carrier, at once); heartbeats every ``heartbeat_ms`` on every rail to a bounded,
symmetric set of path peers (:mod:`linkpass.peers`), each saying which nodes the sender hears on which rail, which
reveal a silently dropping port, a one-way failure, a peer's dead NIC; and notices to the whole fabric when a NIC
goes down or comes back (repeated while it stays down). A path to a path peer is dead after ``dead_after_ms``
without either direction, or at once on a down notice; a path to another peer while this node's NIC is down or
the peer's notice says its NIC is.

Decisions are per peer: its home rail while that path is healthy, otherwise every healthy rail (one route, or
ECMP), back home after a hold-down that doubles each time the path fails again within a minute. Routes keep
``src`` = node address, so established TCP connections survive the move. Heartbeats are sent and read on a
thread of their own (:mod:`linkpass.hbio`), so a slow daemon loop never silences or blinds this node; the loop
decides every interval under :attr:`LinkPass.lock` and programs routes outside it. Each peer's copy of a
heartbeat is tagged under the key of that pair of nodes (:mod:`linkpass.keyring`), and a packet counts only when
the peer whose address sent it signed it for itself (:mod:`linkpass.inbox`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkpass import hbio, heartbeat, homes, moves, report, sysctls
from linkpass import peers as peer_choice
from linkpass.fabric import FabricMap
from linkpass.fastpath import FastPath
from linkpass.hca import SysfsHcas
from linkpass.inbox import Inbox, Refused
from linkpass.keyring import KeyRing, SharedKey
from linkpass.outbox import Batch, Outbox, Outgoing
from linkpass.routes import Kernel, LinkState
from linkpass.settings import LinkPassConfig

log = logging.getLogger("clockwork.linkpass")

FLAP_WINDOW_S = 60.0
FULL_PASS_S = 1.0  # every unsettled peer's paths judged at least this often (notices expire, hold-downs end)
NEVER = -1e18
#: A NIC that stays down is announced to the whole fabric again this often...
NOTICE_REPEAT_S = 10.0
#: ... and a peer's down notice holds a path it does not heartbeat dead this long after the last one.
NOTICE_TTL_S = 3 * NOTICE_REPEAT_S

Emit = Callable[[str, dict[str, Any]], None]
#: Replaces a file durably (old or new content after a crash, never half). The host gives it:
#: linkpass imports nothing of clockworkd, whose :func:`clockwork.contracts.atomic_file.write_bytes` is the one way.
WriteFile = Callable[[Path, bytes], None]


@dataclass
class PathState:
    """One (peer, rail) path as seen from this node."""

    last_in: float = NEVER  # last heartbeat from the peer on this rail
    last_out_ok: float = NEVER  # last time the peer said it hears us on this rail
    alive: bool = False
    alive_since: float = NEVER
    failures: list[float] = field(default_factory=list)
    holddown: float = 0.0
    reason: str = ""
    notice_until: float = NEVER  # a peer we do not heartbeat said this NIC is down: dead until then


class LinkPass:
    """One node's LinkPass. ``start`` -> (``fds``/``on_readable``/``tick``)* -> ``close``."""

    def __init__(
        self,
        cfg: LinkPassConfig,
        node: str,
        fabric: FabricMap,
        key: bytes | KeyRing,
        emit: Emit,
        clock: Callable[[], float] = time.monotonic,
        home_file: Path | None = None,
        write_file: WriteFile | None = None,
        hca_of: Callable[[str], str | None] | None = None,
    ) -> None:
        if home_file is not None and write_file is None:
            raise ValueError("LinkPass: a home_file needs a write_file to replace it durably")
        self.cfg = cfg
        # Each peer's home rail, kept across daemon restarts, durably (:mod:`linkpass.homes` says why).
        self.home_file = home_file
        self.write_file = write_file
        self.me = fabric.node(node)
        self.peers = {p.name: p for p in fabric.peers(node)}
        self.rails = sorted(self.me.nics)
        self.index = heartbeat.FabricIndex.of(fabric)
        self.my_number = self.index.node_number(node)
        self.by_number = {self.index.node_number(name): name for name in self.peers}
        self.rail_number = {rail: self.index.rail_number(rail) for rail in self.rails}
        self.path_peers = frozenset(
            peer_choice.path_peers(
                self.index.nodes, node, cfg.ring_neighbours, cfg.random_peers, self.index.fingerprint
            )
        )
        if len(self.path_peers) > heartbeat.MAX_ENTRIES:
            raise ValueError(
                f"{len(self.path_peers)} path peers (ring_neighbours, random_peers): a heartbeat lists at most "
                f"{heartbeat.MAX_ENTRIES} in one datagram"
            )
        self.watch_peers: frozenset[str] = frozenset()  # the node watch's: other nodes of the jobs running here
        # Per-peer MAC keys (pairwise: a node can sign only its own heartbeats); bytes = one key for every peer.
        self.keys: KeyRing = SharedKey(key) if isinstance(key, bytes) else key
        peer_nics = {name: p.nics for name, p in self.peers.items()}
        self.outbox = Outbox(self.index, self.keys, node, peer_nics)
        self.inbox = Inbox(self.index, self.keys, node, peer_nics)
        self.fast = FastPath(self.index, self.keys, node, peer_nics)  # what the heartbeat thread sends and reads with
        # netdev -> HCA (``ib3`` -> ``mlx5_3``): what NCCL's NCCL_IB_HCA names; sysfs by default, a fake tree in tests
        self.hca_of = hca_of if hca_of is not None else SysfsHcas().hca_of
        self.emit = emit
        self.clock = clock
        self.dead = cfg.dead_after_ms / 1000
        self.interval = cfg.heartbeat_ms / 1000
        # The heartbeat thread and the daemon's loop share the evidence below; each holds this briefly.
        self.lock = threading.RLock()
        self.kernel: Kernel | None = None
        self.sockets: dict[str, socket.socket] = {}
        self.rcvbuf: dict[str, int] = {}
        self.io: hbio.HeartbeatThread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.ifindex: dict[str, int] = {}
        self.nic_up: dict[str, bool] = {}
        self.nic_down_reason: dict[str, str] = {}
        self.paths: dict[str, dict[str, PathState]] = {}
        self.last_any: dict[str, float] = {}  # peer -> its newest packet on any rail
        self.home: dict[str, str] = {}
        self.current: dict[str, tuple[str, ...]] = {}
        self.hears_seq: dict[str, int] = {}  # path peer -> the newest seq whose "hears" bits were filed
        self.heard_from: set[str] = set()  # path peers that ever sent a heartbeat: only those are judged by them
        self.next_send = 0.0
        self.next_notice = NEVER
        self.next_tick = 0.0
        self.dirty = False  # new evidence arrived: decide at once
        self.full_pass = True  # judge every peer at the next decision, not only the path peers
        self.next_full = 0.0
        # Peers whose routes may change with time alone (a notice to expire, a hold-down to end, a route not home):
        # the once-a-second pass judges these and the path peers, so a healthy fabric's cost does not grow with it.
        self.unsettled: set[str] = set()
        self.flush_pending: set[str] = set()  # dead NICs whose neighbour entries go once routes moved
        self.gray: dict[tuple[str, str], str] = {}  # (peer, rail) -> why Fleet Lens says the path is gray
        self.counters = {
            "sent": 0,
            "received": 0,
            "rejected": 0,
            "refused": 0,  # of the rejected: from a peer's address, not signed by that peer for itself (forged)
            "send_errors": 0,
            "receive_errors": 0,
            "notices_sent": 0,
            "failovers": 0,
            "failbacks": 0,
        }
        self.sysctl_problems: dict[str, str] = {}
        self.note = ""

    # ----- life cycle -----------------------------------------------------------------------

    def start(self, io_thread: bool = True) -> None:
        """Open the sockets, learn the routes, start the heartbeat thread (``io_thread`` False: the caller drives
        :meth:`absorb` and :meth:`send_due` itself, as a benchmark or a test does)."""
        self.kernel = Kernel()
        links = self.kernel.links()
        missing = [r for r in self.rails if r not in links]
        if missing:
            raise RuntimeError(f"NICs {', '.join(missing)} of the fabric map do not exist on {self.me.name}")
        for rail in self.rails:
            self.ifindex[rail] = links[rail].index
            self.nic_up[rail] = links[rail].usable
        if len(self.rails) < 2:
            self.note = f"{self.me.name} has one NIC ({self.rails[0]}): nothing to fail over to"
            log.warning("%s; a dead NIC makes this node a failing node for TorchPass", self.note)
        if self.cfg.apply_sysctls:
            self.sysctl_problems = sysctls.apply(sysctls.parse(self.cfg.sysctls))
        # Room for a notice from every node at once (a whole rail's switch died) and four intervals of heartbeats.
        bound = peer_choice.bound(self.cfg.ring_neighbours, self.cfg.random_peers)
        want = hbio.rcvbuf_for(max(len(self.peers), 4 * bound) + 64, heartbeat.packet_size(bound))
        for rail in self.rails:
            sock, granted = hbio.open_socket(self.me.nics[rail], self.cfg.heartbeat_port, rail, want)
            self.sockets[rail], self.rcvbuf[rail] = sock, granted
            if granted < want:
                log.warning(
                    "%s: %s's heartbeat socket got %d of %d bytes of receive buffer (net.core.rmem_max)",
                    self.me.name,
                    rail,
                    granted,
                    want,
                )
        now = self.clock()
        by_index = {index: rail for rail, index in self.ifindex.items()}
        known = self._load_homes()
        for name, peer in self.peers.items():
            oif = self.kernel.route_oif(peer.addr)
            shared = [r for r in self.rails if r in peer.nics]
            routed = by_index.get(oif, shared[0]) if oif in by_index else shared[0]
            self.home[name] = known[name] if known.get(name) in shared else routed
            self.current[name] = (routed,)  # where the kernel sends it now: the first decision moves it home
            self.paths[name] = {r: PathState(alive=True, alive_since=now - 1e9) for r in shared}
            if routed != self.home[name]:
                self.dirty = True
        self._save_homes()
        if not all(self.nic_up.values()):
            self.next_notice = now  # tell the fabric what is down from the start
        if io_thread:
            self.io = hbio.HeartbeatThread(self, self.sockets, self.clock)
            self.io.start()
        log.info(
            "linkpass on %s: rails %s, %d peers (%d heartbeated on every rail), heartbeat %d ms, dead after %d ms, "
            "%d-byte packets",
            self.me.name,
            ",".join(self.rails),
            len(self.peers),
            len(self.path_peers),
            self.cfg.heartbeat_ms,
            self.cfg.dead_after_ms,
            self.packet_bytes,
        )

    @property
    def packet_bytes(self) -> int:
        """The size of this node's heartbeats (they list its path peers)."""
        return heartbeat.packet_size(len(self.path_peers))

    def _load_homes(self) -> dict[str, str]:
        return {} if self.home_file is None else homes.load(self.home_file, self.me.name)

    def _save_homes(self) -> None:
        if self.home_file is not None and self.write_file is not None:
            homes.save(self.home_file, self.write_file, self.home, self.me.name)

    def close(self) -> None:
        if self.io is not None:
            self.io.stop()
            self.io = None
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
        if self.kernel is not None:
            self.kernel.close()
            self.kernel = None
        self._wake_r.close()
        self._wake_w.close()

    # ----- event loop hooks -----------------------------------------------------------------

    def fds(self) -> list[int]:
        # The kernel's link events (a lost carrier acts at once) and the heartbeat thread's wake-up (a peer's down
        # notice acts at once); everything else is decided at each tick.
        assert self.kernel is not None
        return [self.kernel.fileno(), self._wake_r.fileno()]

    def next_deadline(self) -> float:
        return min(self.next_tick, self.clock()) if self.dirty else self.next_tick

    def on_readable(self, fd: int) -> None:
        assert self.kernel is not None
        if fd == self._wake_r.fileno():
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
            return
        if fd == self.kernel.fileno():
            for state in self.kernel.link_events():
                self._on_link(state)
            self.dirty = self.full_pass = True

    def tick(self) -> None:
        if self.io is not None and not self.io.alive():
            log.error("%s: the heartbeat thread stopped; starting another", self.me.name)
            self.io = hbio.HeartbeatThread(self, self.sockets, self.clock)
            self.io.start()
        self.dirty = False
        self.evaluate()
        self.next_tick = self.clock() + self.interval

    def set_watch_peers(self, names: Iterable[str]) -> None:
        """The node watch's peers (the other nodes of the jobs running here): heartbeated on one rail in turn."""
        wanted = frozenset(n for n in names if n in self.peers)
        if wanted != self.watch_peers:
            with self.lock:
                self.watch_peers = wanted

    # ----- evidence (the heartbeat thread) -----------------------------------------------------

    def _on_link(self, state: LinkState) -> None:
        rail = state.name
        if rail not in self.nic_up or self.nic_up[rail] == state.usable:
            return
        with self.lock:
            self.nic_up[rail] = state.usable
            if state.usable:
                log.info("%s: %s is up again (carrier back)", self.me.name, rail)
                self.nic_down_reason.pop(rail, None)
                if all(self.nic_up.values()):
                    self.next_notice = NEVER
            else:
                reason = f"{rail} {'carrier lost' if state.admin_up else 'admin down'}"
                self.nic_down_reason[rail] = reason
                log.warning("%s: %s", self.me.name, reason)
                self.flush_pending.add(rail)  # after the routes have moved (see evaluate)
                self.next_notice = self.clock() + NOTICE_REPEAT_S
            out = self._notice([] if state.usable else [rail], [rail] if state.usable else [])
        self._send(out)  # tell the whole fabric now, over the rails that still work

    def receive(self, sockets: dict[str, socket.socket], now: float) -> None:
        """Read, check (in C, every rail in one call: :mod:`linkpass.fastpath`) and file all ``sockets`` (rail ->
        its socket) hold."""
        self._fresh_keys()
        accepted, rejected, errors = self.fast.receive(sockets)
        wake = False
        rails = self.index.rails
        with self.lock:
            for arrived, node, seq, down, up, _flags, hears in accepted:
                wake |= self._file(arrived, self.by_number[node], seq, hears, down, up, now)
            for r, src, _peer, code, named_node, named_rail in rejected:
                self.counters["rejected"] += 1
                self.counters["refused"] += self.inbox.explain(rails[r], src, code, named_node, named_rail, now)
            self.counters["receive_errors"] += errors
        self._woken(wake)

    def absorb(self, rail: str, batch: list[tuple[bytes, str]], now: float) -> None:
        """File packets that arrived on ``rail``'s socket (``(data, source address)`` each), checked in Python
        (:class:`linkpass.inbox.Inbox`: the reference; tests feed packets of their own making here)."""
        wake = False
        with self.lock:
            for data, src in batch:
                try:
                    name, hb = self.inbox.open(rail, src, data, now)
                except heartbeat.PacketError as exc:
                    self.counters["rejected"] += 1
                    self.counters["refused"] += isinstance(exc, Refused)
                    continue
                arrived = 1 << self.rail_number[rail]
                wake |= self._file(arrived, name, hb.seq, hb.hears_mask(self.my_number), hb.down, hb.up, now)
        self._woken(wake)

    def _woken(self, wake: bool) -> None:
        if not wake:
            return
        with self.lock:
            self.dirty = self.full_pass = True
        try:
            self._wake_w.send(b"!")
        except OSError:
            pass  # the loop has a wake-up pending already, or it is closing

    def _file(self, arrived: int, name: str, seq: int, hears: int, down: int, up: int, now: float) -> bool:
        """File an authentic heartbeat of peer ``name`` that arrived on the rails of mask ``arrived`` (bit = rail
        index: the C path hands one interval's same packets on several rails over at once); ``hears``: the rails on
        which it hears this node. True when it carried a notice (the loop decides at once)."""
        self.counters["received"] += arrived.bit_count()
        self.last_any[name] = now
        paths = self.paths[name]
        numbers = self.rail_number
        if name in self.path_peers:
            if name not in self.heard_from:
                # First word from this peer's daemon: give every rail one dead interval to hear from it
                # (and to be heard by it) before judging, or a start-up race would look like a failure.
                self.heard_from.add(name)
                for path in paths.values():
                    path.last_in = path.last_out_ok = now
            # A peer's packets of one interval say the same on every rail: file the newest interval once (a seq
            # far below the last one is a restarted peer or a wrapped counter, and counts as newer).
            last = self.hears_seq.get(name, -1)
            if seq > last or seq < last - 64:
                self.hears_seq[name] = seq
                for r, path in paths.items():
                    if hears >> numbers[r] & 1:  # it hears us on r
                        path.last_out_ok = now
        for r, path in paths.items():
            if arrived >> numbers[r] & 1:
                path.last_in = now
                path.notice_until = NEVER  # it speaks on this rail: whatever it said before, this NIC works
        if not (down or up):
            return False
        changed = False
        for bit, lost in enumerate(self.index.rails):
            if lost not in paths:
                continue
            if down >> bit & 1:
                changed = True
                path = paths[lost]
                path.reason = f"{name} reported {lost} down"
                if name in self.path_peers:
                    path.last_in = path.last_out_ok = NEVER
                else:
                    path.notice_until = now + NOTICE_TTL_S
            elif up >> bit & 1 and paths[lost].notice_until != NEVER:
                changed = True
                paths[lost].notice_until = NEVER
        return changed

    def _heard(self, now: float) -> heartbeat.Heard:
        return self.outbox.heard(
            {name: [r for r, p in self.paths[name].items() if now - p.last_in < self.dead] for name in self.path_peers}
        )

    def _usable(self) -> list[str]:
        return [r for r in self.rails if self.nic_up.get(r, False)]

    def send_due(self, now: float) -> float:
        """Send this interval's heartbeats (and a repeated down notice when due); returns when the next are due."""
        with self.lock:
            out = self.outbox.heartbeat_batches(self._usable(), self._heard(now), self.path_peers, self.watch_peers)
            if now >= self.next_notice != NEVER:
                out += self._notice([r for r in self.rails if not self.nic_up.get(r, False)], [])
                self.next_notice = now + NOTICE_REPEAT_S
        self._send(out)
        self.next_send = max(self.next_send + self.interval, now)
        return self.next_send

    def outgoing(self, now: float) -> Outgoing:
        """One interval's heartbeats, sealed in Python (see :class:`linkpass.outbox.Outbox`; :meth:`send_due`
        sends the same in C)."""
        return self.outbox.heartbeats(self._usable(), self._heard(now), self.path_peers, self.watch_peers)

    def _notice(self, down: list[str], up: list[str]) -> list[Batch]:
        out = self.outbox.notice_batches(self._usable(), self._heard(self.clock()), down, up)
        self.counters["notices_sent"] += sum(len(nodes) for _rail, _body, nodes in out)
        return out

    def _fresh_keys(self) -> None:
        if self.fast.refresh():
            log.info("%s: heartbeat keys (re)loaded into the C path", self.me.name)

    def _send(self, out: list[Batch]) -> None:
        """Tag and send in C (:mod:`linkpass.fastpath`): one call for every rail, under the keys of the moment."""
        self._fresh_keys()
        sockets = self.sockets
        sent, failed = self.fast.send(
            self.cfg.heartbeat_port, [(sockets[r], r, body, nodes) for r, body, nodes in out if r in sockets]
        )
        self.counters["sent"] += sent
        self.counters["send_errors"] += failed

    # ----- decisions ------------------------------------------------------------------------

    def set_gray(self, peer: str, rail: str, reason: str | None) -> bool:
        """Fleet Lens's verdict on a path that still passes heartbeats (loss, delay, a degraded link).

        A gray path counts as dead (traffic moves off it) until Lens clears it (``reason`` None); the
        usual hold-down then applies before traffic returns. Returns False for a path LinkPass does not
        manage (unknown peer or rail).
        """
        if rail not in self.paths.get(peer, {}):
            return False
        with self.lock:
            if reason is None:
                self.gray.pop((peer, rail), None)
            else:
                self.gray[(peer, rail)] = reason
            self.dirty = self.full_pass = True
        return True

    def _path_alive(self, peer: str, rail: str, path: PathState, now: float) -> tuple[bool, str, bool]:
        """(alive, reason, hard): hard evidence (carrier, a down notice, a Lens suspect) is believed at once."""
        if not self.nic_up.get(rail, False):
            return False, self.nic_down_reason.get(rail, f"{rail} down"), True
        if (peer, rail) in self.gray:
            return False, f"gray: {self.gray[(peer, rail)]}", True
        if peer not in self.path_peers or peer not in self.heard_from:
            # Not heartbeated on this rail (or no daemon there): carrier, Lens and the peer's notices only, a notice
            # until it expires (it never heard a packet on that rail: its last_in says nothing).
            if now < path.notice_until:
                return False, path.reason, True
            return True, "", False
        if path.last_in == NEVER and path.reason:
            return False, path.reason, True  # the peer reported this NIC down
        if now - path.last_in >= self.dead:
            return False, f"no heartbeat on {rail} for {self.cfg.dead_after_ms} ms", False
        if now - path.last_out_ok >= self.dead:
            return False, f"peer does not hear us on {rail}", False
        return True, "", False

    def update_paths(self, now: float, peers: Iterable[str] | None = None) -> dict[str, str]:
        """Refresh every path's alive flag; returns peer -> reason for paths that just died.

        Silence is only evidence against one rail when another rail to the same peer is fresh: when
        every rail of a peer goes quiet at once, the peer (or this daemon) stalled or the node died,
        and there is no better rail to move to anyway (a dead node is TorchPass's business).
        """
        died: dict[str, str] = {}
        for peer in self.paths if peers is None else peers:
            paths = self.paths[peer]
            fresh = {r for r, p in paths.items() if now - p.last_in < self.dead and now - p.last_out_ok < self.dead}
            for rail, path in paths.items():
                alive, reason, hard = self._path_alive(peer, rail, path, now)
                if not alive and not hard and not (fresh - {rail}):
                    alive = path.alive  # no comparison possible: keep the last verdict
                if path.alive and not alive:
                    path.alive = False
                    path.failures = [t for t in path.failures if now - t < FLAP_WINDOW_S] + [now]
                    path.holddown = min(self.cfg.holddown_max_s, self.cfg.holddown_s * 2 ** (len(path.failures) - 1))
                    path.reason = reason
                    died[peer] = reason
                elif alive and not path.alive:
                    path.alive = True
                    path.alive_since = now
                    path.reason = ""
        return died

    def eligible(self, path: PathState, now: float) -> bool:
        return path.alive and now - path.alive_since >= path.holddown

    def evaluate(self) -> None:
        if self.kernel is None:
            return
        # Decide under the lock, program the routes outside it: the heartbeat thread never waits on netlink.
        with self.lock:
            plan = self._decide(self.clock())
        self._apply(plan)

    def _decide(self, now: float) -> list[tuple[str, tuple[str, ...], str, str]]:
        """(peer, rails it should use, kind, reason) for every peer whose route should change.

        Every peer after an event (a link change, a notice, a Lens verdict); once a second the peers left
        unsettled (hold-downs ending, notices expiring, a route away from home); otherwise only the path peers,
        whose heartbeats may stop at any moment. On a healthy fabric neither a tick nor the once-a-second pass
        grows with the fabric.
        """
        periodic = self.full_pass or now >= self.next_full
        if self.full_pass:
            todo = list(self.paths)
        else:
            todo = sorted(self.path_peers | self.unsettled if periodic else self.path_peers)
        if periodic:
            self.full_pass, self.next_full = False, now + FULL_PASS_S
        died = self.update_paths(now, todo)
        plan = []
        for peer in todo:
            paths = self.paths[peer]
            home = self.home[peer]
            if self.eligible(paths[home], now):
                want: tuple[str, ...] = (home,)
            else:
                # Healthy rails past their hold-down first; a rail still in hold-down beats staying on a
                # dead one (hold-down delays going back, never escaping); nothing alive: leave the route.
                want = (
                    tuple(r for r in sorted(paths) if self.eligible(paths[r], now))
                    or tuple(r for r in sorted(paths) if paths[r].alive)
                    or self.current[peer]
                )
            old = self.current[peer]
            if peer not in self.path_peers:  # path peers are judged every tick: no need to track them
                quiet = all(self.eligible(p, now) and now >= p.notice_until for p in paths.values())
                (self.unsettled.discard if want == (home,) == old and quiet else self.unsettled.add)(peer)
            if want == old:
                continue
            kind = "link.failback" if want == (home,) else "link.failover"
            plan.append((peer, want, kind, died.get(peer) or paths[old[0]].reason or "path healthy again"))
        return plan

    def _apply(self, plan: list[tuple[str, tuple[str, ...], str, str]]) -> None:
        moves.apply(self, plan)

    # ----- reporting ------------------------------------------------------------------------

    def last_heard(self) -> dict[str, float]:
        """Peer -> when its newest heartbeat arrived, on any rail (this engine's clock), for every peer heartbeated
        (a path or watch peer) and ever heard: the node daemon's node-silent verdicts start from it (silence on every
        rail at once is a dead or stopped node, not a link, and LinkPass leaves it alone)."""
        with self.lock:
            watched = self.path_peers | self.watch_peers
            return {peer: t for peer, t in self.last_any.items() if peer in watched}

    def usable_nics(self) -> list[str]:
        """This node's fabric NICs that are up with carrier."""
        return [rail for rail in self.rails if self.nic_up.get(rail, False)]

    def down_nics(self) -> dict[str, str]:
        """This node's fabric NICs that are down, each with why (the GPU health watch's view of a NIC fault)."""
        return {rail: self.nic_down_reason.get(rail, "") for rail in self.rails if not self.nic_up.get(rail, False)}

    def avoid_nics(self) -> list[str]:
        """Local NICs a new communicator should not use (NCCL: NCCL_IB_HCA=^...): down, or no live path."""
        return report.avoid_nics(self)

    def avoid_reasons(self) -> dict[str, str]:
        """:meth:`avoid_nics`, each with why (down; or every managed path dead, and why)."""
        return report.avoid_reasons(self)

    def avoid_hcas(self) -> dict[str, str]:
        """HCA -> why, for the :meth:`avoid_nics` with an RDMA device behind them (``mlx5_3`` for ``ib3``): what a new
        NCCL communicator on this node must exclude (``NCCL_IB_HCA=^mlx5_3``)."""
        return report.avoid_hcas(self)

    def status(self) -> dict[str, Any]:
        with self.lock:
            return report.status(self, self.clock())
