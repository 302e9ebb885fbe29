"""The LinkPass engine: watch every NIC and every (peer, rail) path, route around what is dead, fail back.

Evidence comes from two places. Netlink says at once when a local NIC loses carrier or goes admin
down. Heartbeats (every ``heartbeat_ms`` to every peer on every rail, each saying which peers the
sender hears on which rail) reveal what carrier cannot: a switch port that silently drops, a one-way
failure, a peer's dead NIC. A path is dead after ``dead_after_ms`` without either direction, or at
once when the peer sends a down notice for its NIC.

Decisions are per peer: traffic to a peer's node address uses its home rail while that path is
healthy, otherwise every healthy rail (one route, or ECMP over several, never everything piled on one
when more remain), and returns home after the path has been healthy for a hold-down that doubles
each time the path fails again within a minute (flap damping). Routes keep ``src`` = node address,
so established TCP connections (gloo, NCCL's bootstrap, TCPStore) survive the move.

The engine runs inside the daemon's single event loop: it exposes file descriptors to poll, a
deadline for its next tick, and never blocks.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkpass import heartbeat, sysctls
from linkpass.fabric import FabricMap
from linkpass.hca import SysfsHcas
from linkpass.keyring import KeyRing, SharedKey, retag
from linkpass.routes import Kernel, LinkState
from linkpass.settings import LinkPassConfig

log = logging.getLogger("clockwork.linkpass")

SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)
FLAP_WINDOW_S = 60.0
NEVER = -1e18

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
        # Each peer's home rail, kept across daemon restarts: a daemon restarted while a route is failed over
        # must not take the failed-over rail for home (the kernel's route is then not the admin's). Written
        # durably: a rename without fsync may leave an empty file after a power loss, and a daemon that then
        # takes the failed-over rail for home never fails back.
        self.home_file = home_file
        self.write_file = write_file
        self.me = fabric.node(node)
        self.peers = {p.name: p for p in fabric.peers(node)}
        self.rails = sorted(self.me.nics)
        # Per-peer MAC keys (pairwise: a node can sign only its own heartbeats); bytes = one key for every peer.
        self.keys: KeyRing = SharedKey(key) if isinstance(key, bytes) else key
        # (rail, source address) -> the peer whose NIC that is: the key a packet must carry depends on its sender.
        self.sender_of = {(rail, ip): p.name for p in self.peers.values() for rail, ip in p.nics.items()}
        self.refused_logged: dict[tuple[str, str], float] = {}  # (source, why) -> last warning (one a minute)
        # netdev -> HCA (``ib3`` -> ``mlx5_3``): what NCCL's NCCL_IB_HCA names; sysfs by default, a fake tree in tests
        self.hca_of = hca_of if hca_of is not None else SysfsHcas().hca_of
        self.emit = emit
        self.clock = clock
        self.dead = cfg.dead_after_ms / 1000
        self.interval = cfg.heartbeat_ms / 1000
        self.kernel: Kernel | None = None
        self.sockets: dict[str, socket.socket] = {}
        self.ifindex: dict[str, int] = {}
        self.nic_up: dict[str, bool] = {}
        self.nic_down_reason: dict[str, str] = {}
        self.paths: dict[str, dict[str, PathState]] = {}
        self.home: dict[str, str] = {}
        self.current: dict[str, tuple[str, ...]] = {}
        self.heard_from: set[str] = set()  # peers that ever sent a heartbeat: only those are managed
        self.seq = 0
        self.next_send = 0.0
        self.dirty = False  # new evidence arrived: decide once every readable socket has been read
        self.flush_pending: set[str] = set()  # dead NICs whose neighbour entries go once routes moved
        self.gray: dict[tuple[str, str], str] = {}  # (peer, rail) -> why Fleet Lens says the path is gray
        self.counters = {
            "sent": 0,
            "received": 0,
            "rejected": 0,
            "refused": 0,  # of the rejected: from a peer's address, not signed by that peer for itself (forged)
            "send_errors": 0,
            "failovers": 0,
            "failbacks": 0,
        }
        self.sysctl_problems: dict[str, str] = {}
        self.note = ""

    # ----- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
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
        for rail in self.rails:
            self.sockets[rail] = self._open_socket(rail)
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
        log.info(
            "linkpass on %s: rails %s, %d peers, heartbeat %d ms, dead after %d ms",
            self.me.name,
            ",".join(self.rails),
            len(self.peers),
            self.cfg.heartbeat_ms,
            self.cfg.dead_after_ms,
        )

    def _load_homes(self) -> dict[str, str]:
        if self.home_file is None:
            return {}
        try:
            data = json.loads(self.home_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("%s: ignoring %s: %s", self.me.name, self.home_file, exc)
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _save_homes(self) -> None:
        if self.home_file is None or self.write_file is None:
            return
        try:
            self.home_file.parent.mkdir(parents=True, exist_ok=True)
            self.write_file(self.home_file, json.dumps(self.home, sort_keys=True).encode())
        except OSError as exc:
            log.warning("%s: cannot record the home rails in %s: %s", self.me.name, self.home_file, exc)

    def _open_socket(self, rail: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, rail.encode())
        sock.bind((self.me.nics[rail], self.cfg.heartbeat_port))
        sock.setblocking(False)
        return sock

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
        if self.kernel is not None:
            self.kernel.close()
            self.kernel = None

    # ----- event loop hooks -----------------------------------------------------------------

    def fds(self) -> list[int]:
        # Only the kernel's link events wake the loop (a lost carrier acts at once). Heartbeats are read in
        # batches at each tick: one wake-up per interval instead of one per arriving packet (hundreds a
        # second on a large fabric), at the price of at most one interval added to a silent path's verdict.
        assert self.kernel is not None
        return [self.kernel.fileno()]

    def next_deadline(self) -> float:
        return min(self.next_send, self.clock()) if self.dirty else self.next_send

    def on_readable(self, fd: int) -> None:
        assert self.kernel is not None
        if fd == self.kernel.fileno():
            for state in self.kernel.link_events():
                self._on_link(state)
            self.dirty = True  # decided in tick(), after the heartbeats that arrived meanwhile are read

    def tick(self) -> None:
        for rail, sock in self.sockets.items():
            self._receive(rail, sock)
        now = self.clock()
        if now >= self.next_send:
            self._send_all()
            self.next_send = now + self.interval
        self.dirty = False
        self.evaluate()

    # ----- evidence -------------------------------------------------------------------------

    def _on_link(self, state: LinkState) -> None:
        rail = state.name
        if rail not in self.nic_up or self.nic_up[rail] == state.usable:
            return
        self.nic_up[rail] = state.usable
        if state.usable:
            log.info("%s: %s is up again (carrier back)", self.me.name, rail)
            self.nic_down_reason.pop(rail, None)
            return
        reason = f"{rail} {'carrier lost' if state.admin_up else 'admin down'}"
        self.nic_down_reason[rail] = reason
        log.warning("%s: %s", self.me.name, reason)
        self.flush_pending.add(rail)  # after the routes have moved (see evaluate)
        self._send_all(down=[rail])  # tell the peers now, over the rails that still work

    def _receive(self, rail: str, sock: socket.socket) -> None:
        now = self.clock()
        while True:
            try:
                data, (src, _port) = sock.recvfrom(heartbeat.MAX_PACKET + 1)
            except BlockingIOError:
                return
            except OSError:
                return
            sender = self.sender_of.get((rail, src))
            if sender is None:
                self.counters["rejected"] += 1
                continue
            hb, why = self._authentic(data, sender)
            if hb is None or hb.node != sender or hb.rail != rail:
                # A packet from a peer's address that its key does not sign, or that the peer signed for someone
                # else: a forgery (or a key out of step during a rotation). Refused, and said.
                why = why or f"signed by {sender} but claims to be {hb.node if hb else '?'} on {hb.rail if hb else '?'}"
                self._refuse(src, rail, sender, why)
                continue
            self.counters["received"] += 1
            paths = self.paths[hb.node]
            if hb.node not in self.heard_from:
                # First word from this peer's daemon: give every rail one dead interval to hear from it
                # (and to be heard by it) before judging, or a start-up race would look like a failure.
                self.heard_from.add(hb.node)
                for path in paths.values():
                    path.last_in = path.last_out_ok = now
            paths[rail].last_in = now
            for heard_rail, heard in hb.heard.items():
                if heard_rail in paths and self.me.name in heard:
                    paths[heard_rail].last_out_ok = now
            for lost in hb.down:
                if lost in paths:
                    paths[lost].last_in = paths[lost].last_out_ok = NEVER
                    paths[lost].reason = f"{hb.node} reported {lost} down"
            if hb.down:
                self.dirty = True

    def _authentic(self, data: bytes, sender: str) -> tuple[heartbeat.Heartbeat | None, str]:
        """The heartbeat under one of the keys ``sender``'s packets may carry now, or (None, why not)."""
        why = "no key for this peer"
        for key in self.keys.accept_keys(sender):
            try:
                return heartbeat.decode(data, key), ""
            except heartbeat.PacketError as exc:
                why = str(exc)
        return None, why

    def _refuse(self, src: str, rail: str, sender: str, why: str) -> None:
        self.counters["rejected"] += 1
        self.counters["refused"] += 1
        now = self.clock()
        if now - self.refused_logged.get((src, why), NEVER) >= 60.0:
            self.refused_logged[(src, why)] = now
            log.warning("%s: heartbeat from %s (%s's %s) refused: %s", self.me.name, src, sender, rail, why)

    def _send_all(self, down: list[str] | None = None) -> None:
        now = self.clock()
        heard = {
            rail: sorted(
                p for p, paths in self.paths.items() if rail in paths and now - paths[rail].last_in < self.dead
            )
            for rail in self.rails
        }
        self.seq += 1
        for rail, sock in self.sockets.items():
            if not self.nic_up.get(rail, False):
                continue
            # One encoding per rail; each peer's copy carries the tag of that peer's key.
            packet = heartbeat.encode(heartbeat.Heartbeat(self.me.name, rail, self.seq, heard, down or []), b"\0")
            for peer in self.peers.values():
                ip = peer.nics.get(rail)
                if ip is None:
                    continue
                try:
                    sock.sendto(retag(packet, self.keys.send_key(peer.name)), (ip, self.cfg.heartbeat_port))
                    self.counters["sent"] += 1
                except OSError:
                    self.counters["send_errors"] += 1

    # ----- decisions ------------------------------------------------------------------------

    def set_gray(self, peer: str, rail: str, reason: str | None) -> bool:
        """Fleet Lens's verdict on a path that still passes heartbeats (loss, delay, a degraded link).

        A gray path counts as dead (traffic moves off it) until Lens clears it (``reason`` None); the
        usual hold-down then applies before traffic returns. Returns False for a path LinkPass does not
        manage (unknown peer or rail).
        """
        if rail not in self.paths.get(peer, {}):
            return False
        if reason is None:
            self.gray.pop((peer, rail), None)
        else:
            self.gray[(peer, rail)] = reason
        self.dirty = True
        return True

    def _path_alive(self, peer: str, rail: str, path: PathState, now: float) -> tuple[bool, str, bool]:
        """(alive, reason, hard): hard evidence (carrier, a down notice, a Lens suspect) is believed at once."""
        if not self.nic_up.get(rail, False):
            return False, self.nic_down_reason.get(rail, f"{rail} down"), True
        if (peer, rail) in self.gray:
            return False, f"gray: {self.gray[(peer, rail)]}", True
        if path.last_in == NEVER and path.reason:
            return False, path.reason, True  # the peer reported this NIC down
        if now - path.last_in >= self.dead:
            return False, f"no heartbeat on {rail} for {self.cfg.dead_after_ms} ms", False
        if now - path.last_out_ok >= self.dead:
            return False, f"peer does not hear us on {rail}", False
        return True, "", False

    def _update_paths(self, now: float) -> dict[str, str]:
        """Refresh every path's alive flag; returns peer -> reason for paths that just died.

        Silence is only evidence against one rail when another rail to the same peer is fresh: when
        every rail of a peer goes quiet at once, the peer (or this daemon) stalled or the node died,
        and there is no better rail to move to anyway (a dead node is TorchPass's business).
        """
        died: dict[str, str] = {}
        for peer, paths in self.paths.items():
            managed = peer in self.heard_from
            fresh = {r for r, p in paths.items() if now - p.last_in < self.dead and now - p.last_out_ok < self.dead}
            for rail, path in paths.items():
                alive, reason, hard = self._path_alive(peer, rail, path, now)
                if not alive and not hard and not (fresh - {rail}):
                    alive = path.alive  # no comparison possible: keep the last verdict
                if not managed and self.nic_up.get(rail, False):
                    alive = True  # no heartbeats from this peer ever (no daemon there): judge by carrier only
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

    def _eligible(self, path: PathState, now: float) -> bool:
        return path.alive and now - path.alive_since >= path.holddown

    def evaluate(self) -> None:
        if self.kernel is None:
            return
        now = self.clock()
        died = self._update_paths(now)
        # (kind, old rails, new rails, reason) -> [(peer, route_ms)]: one event per kind of move, not per peer
        moves: dict[tuple[str, tuple[str, ...], tuple[str, ...], str], list[tuple[str, float]]] = defaultdict(list)
        for peer, paths in self.paths.items():
            home = self.home[peer]
            if self._eligible(paths[home], now):
                want: tuple[str, ...] = (home,)
            else:
                # Healthy rails past their hold-down first; a rail still in hold-down beats staying on a
                # dead one (hold-down delays going back, never escaping); nothing alive: leave the route.
                want = (
                    tuple(r for r in sorted(paths) if self._eligible(paths[r], now))
                    or tuple(r for r in sorted(paths) if paths[r].alive)
                    or self.current[peer]
                )
            old = self.current[peer]
            if want == old:
                continue
            t0 = self.clock()
            try:
                self._program(peer, want)
            except Exception as exc:
                log.error("%s: cannot route %s via %s: %s", self.me.name, peer, ",".join(want), exc)
                continue
            kind = "link.failback" if want == (home,) else "link.failover"
            reason = died.get(peer) or paths[old[0]].reason or "path healthy again"
            moves[(kind, old, want, reason)].append((peer, (self.clock() - t0) * 1000))
            self.current[peer] = want
        if moves:
            self.kernel.flush_route_cache()
        # Only now, with no route left through them, drop the neighbour entries the moved traffic used
        # on the rails it left: a segment queued on such an entry (waiting for an ARP answer that
        # cannot come) is held for seconds and TCP will not retransmit it while it is held. Flushing
        # before the routes moved would only create fresh entries for the packets still sent there.
        for (kind, old, _new, _reason), done in moves.items():
            if kind != "link.failover":
                continue  # a fail-back leaves a healthy rail: its entries are fine
            for rail in old:
                for peer, _ms in done:
                    self.kernel.delete_neighbour(self.ifindex[rail], self.peers[peer].nics[rail])
        for rail in sorted(self.flush_pending):
            dropped = self.kernel.flush_neighbours(self.ifindex[rail])
            log.info("%s: flushed %d neighbour entries of %s", self.me.name, dropped, rail)
        self.flush_pending.clear()
        for (kind, old, new, reason), done in moves.items():
            self.counters["failovers" if kind == "link.failover" else "failbacks"] += 1
            peers = sorted(peer for peer, _ in done)
            fields = {
                "nic": ",".join(old),
                "via": ",".join(new),
                "peers": peers,
                "reason": reason,
                "route_ms": round(max(ms for _, ms in done), 3),
                "avoid_nics": self.avoid_nics(),
                "avoid_hcas": self.avoid_hcas(),
            }
            log.warning(
                "%s: %s %s -> %s for %s (%s)",
                self.me.name,
                kind,
                fields["nic"],
                fields["via"],
                ",".join(peers),
                reason,
            )
            self.emit(kind, fields)

    def _program(self, peer: str, rails: tuple[str, ...]) -> None:
        assert self.kernel is not None
        target = self.peers[peer]
        hops = [(target.nics[r], self.ifindex[r]) for r in rails]
        self.kernel.set_route(target.addr, self.me.addr, hops)

    # ----- reporting ------------------------------------------------------------------------

    def last_heard(self) -> dict[str, float]:
        """Peer -> when its newest heartbeat arrived, on any rail (this engine's clock), for every peer whose daemon
        was ever heard: the node daemon's node-silent verdicts start from it (silence on every rail at once is a
        dead or stopped node, not a link, and LinkPass leaves it alone)."""
        return {
            peer: max(path.last_in for path in paths.values())
            for peer, paths in self.paths.items()
            if peer in self.heard_from
        }

    def usable_nics(self) -> list[str]:
        """This node's fabric NICs that are up with carrier."""
        return [rail for rail in self.rails if self.nic_up.get(rail, False)]

    def down_nics(self) -> dict[str, str]:
        """This node's fabric NICs that are down, each with why (the GPU health watch's view of a NIC fault)."""
        return {rail: self.nic_down_reason.get(rail, "") for rail in self.rails if not self.nic_up.get(rail, False)}

    def avoid_nics(self) -> list[str]:
        """Local NICs a new communicator should not use (NCCL: NCCL_IB_HCA=^...): down, or no live path."""
        out = []
        for rail in self.rails:
            paths = [p[rail] for name, p in self.paths.items() if rail in p and name in self.heard_from]
            if not self.nic_up.get(rail, False) or (paths and not any(p.alive for p in paths)):
                out.append(rail)
        return out

    def avoid_reasons(self) -> dict[str, str]:
        """:meth:`avoid_nics`, each with why: down (carrier, admin), or every managed path dead (heartbeats, a Lens
        suspect marking the path gray, a peer's down notice)."""
        out = {}
        for rail in self.avoid_nics():
            if not self.nic_up.get(rail, False):
                out[rail] = self.nic_down_reason.get(rail) or f"{rail} down"
                continue
            reasons = sorted({p[rail].reason for p in self.paths.values() if rail in p and p[rail].reason})
            out[rail] = f"no live path on {rail}" + (f" ({'; '.join(reasons)})" if reasons else "")
        return out

    def avoid_hcas(self) -> dict[str, str]:
        """HCA -> why, for the :meth:`avoid_nics` that have an RDMA device behind them (``mlx5_3`` for ``ib3``):
        what a new NCCL communicator on this node must exclude (``NCCL_IB_HCA=^mlx5_3``)."""
        out = {}
        for rail, reason in self.avoid_reasons().items():
            hca = self.hca_of(rail)
            if hca is not None:
                out[hca] = f"{rail}: {reason}"
        return out

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "enabled": True,
            "node": self.me.name,
            "note": self.note,
            "nics": {
                r: {"up": self.nic_up.get(r, False), "reason": self.nic_down_reason.get(r, "")} for r in self.rails
            },
            "routes": {peer: list(rails) for peer, rails in sorted(self.current.items())},
            "paths": {
                peer: {
                    r: "alive" if self._eligible(p, now) else ("holddown" if p.alive else f"dead: {p.reason}")
                    for r, p in sorted(paths.items())
                }
                for peer, paths in sorted(self.paths.items())
            },
            "avoid_nics": self.avoid_nics(),
            "avoid_hcas": self.avoid_hcas(),
            "hcas": {r: self.hca_of(r) or "" for r in self.rails},
            "gray": {f"{peer}/{rail}": reason for (peer, rail), reason in sorted(self.gray.items())},
            "failovers": self.counters["failovers"],
            "failbacks": self.counters["failbacks"],
            "heartbeats": {k: self.counters[k] for k in ("sent", "received", "rejected", "refused", "send_errors")},
            "sysctls": sysctls.read(list(sysctls.parse(self.cfg.sysctls))),
            "sysctl_problems": self.sysctl_problems,
        }
