"""What one heartbeat costs this machine, measured with LinkPass's own code over the kernel's loopback device,
and the cost model built on it (for ``bench/control_plane_scale.py``).

Measured per packet, on a synthetic fabric of N nodes x R rails with 64-character names (only loopback
addresses, 127.16.0.0/12: nothing leaves the machine):

* **send**: :meth:`LinkPass.send_due`, what the heartbeat thread runs (the path peers heard, one packet body per rail in
  Python; then in C, :mod:`linkpass.fastpath`, one tag per packet under the key of that pair of nodes, as with
  per-node key pairs, and ``sendmmsg`` per rail, every rail in one call) divided by the packets it sent. Over
  loopback the kernel delivers each datagram inside ``sendmmsg``, so this also carries the receiving kernel's
  work, which a NIC's interrupt charges to the receiver on a cluster;
* **receive**: :meth:`LinkPass.receive`, what the heartbeat thread runs once an interval (in C, every rail's socket
  in one call: ``recvmmsg``, the sender by source address, the tag check, the header checks; then filing in
  Python) per packet, each rail's socket drained when it holds as many packets as it does in the daemon (one per
  path peer);
* **tick**: the daemon loop's share each interval: LinkPass's decision over its path peers and the node
  watch's judge over every peer it hears (the path and watch peers).

The model: a node sends ``(path peers x rails + watch peers) / interval`` packets a second and, the sets being
symmetric, receives as many; CPU = out x send + in x receive + ticks (on a healthy fabric the once-a-second pass
judges only the path peers: no other peer's route can change with time alone, :attr:`LinkPass.unsettled`). The
pre-#47 behaviour (every node on every rail, names in the packets) is modelled with the same per-packet costs,
which flatters it (its packets were msgpack maps of names: 33 us to decode at 64 nodes, per the issue), and with
its own packet size.
"""

from __future__ import annotations

import hashlib
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgpack

from clockwork.contracts.config.nodewatch import NodeWatchConfig
from clockworkd.nodewatch.judge import Judge
from linkpass import hbio
from linkpass import peers as peer_choice
from linkpass.engine import LinkPass, PathState
from linkpass.fabric import FabricMap
from linkpass.settings import LinkPassConfig

KEY = b"k" * 32
PORT = 16991  # not LinkPass's: nothing else listens on these loopback addresses
IP_UDP = 28  # IPv4 + UDP headers on the wire
OLD_MAX_PACKET = 8192
#: Each per-packet cost is measured this many times and the median kept (one run of 400 intervals on a shared 2-core
#: machine varied by 30 %).
REPEATS = 5


def fabric(nodes: int, rails: int, name_len: int = 64) -> FabricMap:
    """N nodes x R rails, every address a loopback one."""
    doc = {}
    for i in range(nodes):
        hi, lo = divmod(i, 250)
        nics = {f"ib{r}": f"127.{16 + r}.{hi}.{lo + 1}" for r in range(rails)}
        doc[f"node{i:04d}".ljust(name_len, "x")] = {"addr": f"127.15.{hi}.{lo + 1}", "nics": nics}
    return FabricMap.parse({"nodes": doc})


def old_packet_bytes(nodes: int, rails: int, name_len: int) -> int:
    """The pre-#47 heartbeat (msgpack, every peer heard named on every rail, 16-byte tag) on a healthy fabric."""
    names = [f"node{i:04d}".ljust(name_len, "x") for i in range(nodes - 1)]
    body = msgpack.packb(
        {"v": 1, "n": "n" * name_len, "r": "ib0", "s": 2**31, "h": {f"ib{r}": names for r in range(rails)}, "d": []}
    )
    return len(body) + 16


@dataclass
class Costs:
    nodes: int
    rails: int
    packet_bytes: int
    send_us: float
    recv_us: float
    tick_us_per_peer: float  # LinkPass's decision each interval, per peer it judges
    judge_us_per_peer: float  # the node watch's judge each interval, per peer it hears
    samples: dict[str, int] = field(default_factory=dict)


class PairKeys:
    """A key per pair of nodes, looked up as the daemon's :class:`PairwiseKeys` does (derived once, a dict read per
    packet): every packet sent gets its own tag, as with per-node key pairs (one shared pair: one tag per rail)."""

    def __init__(self, me: str, peers: Sequence[str]) -> None:
        self.keys = {p: hashlib.sha256(KEY + "\0".join(sorted((me, p))).encode()).digest() for p in peers}
        self.version = 0

    def maybe_reload(self) -> None:
        return None

    def send_key(self, peer: str) -> bytes:
        return self.keys[peer]

    def accept_keys(self, peer: str) -> Sequence[bytes]:
        return (self.keys[peer],)


def _engine(fab: FabricMap, node: str, cfg: LinkPassConfig) -> LinkPass:
    keys = PairKeys(node, [p.name for p in fab.peers(node)])
    engine = LinkPass(cfg, node, fab, keys, lambda kind, fields: None)
    for name, peer in engine.peers.items():
        engine.paths[name] = {r: PathState(alive=True, alive_since=-1e9) for r in engine.rails if r in peer.nics}
    engine.nic_up.update(dict.fromkeys(engine.rails, True))
    return engine


def _bind(engine: LinkPass, port: int) -> None:
    for rail in engine.rails:
        sock, _granted = hbio.open_socket(engine.me.nics[rail], port, "lo", hbio.rcvbuf_for(4096, engine.packet_bytes))
        engine.sockets[rail] = sock


def measure(nodes: int, rails: int, rounds: int, cfg: LinkPassConfig) -> Costs:
    """Per-packet and per-tick costs on a fabric of ``nodes`` x ``rails`` (CPU time of this thread)."""
    fab = fabric(nodes, rails)
    names = sorted(fab.nodes)
    cfg = replace(cfg, heartbeat_port=PORT)
    sender = _engine(fab, names[0], cfg)
    receiver = _engine(fab, names[1], cfg)  # a ring neighbour: a path peer of the sender
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sink.bind(("0.0.0.0", PORT))  # everything not for the receiver
    sink.setblocking(False)
    try:
        _bind(sender, PORT)
        _bind(receiver, PORT)
        now = 1000.0
        # The heartbeat thread drains each rail's socket once an interval, when it holds one packet from each peer
        # that heartbeats this node on that rail: as many intervals of the one sender are read at once here.
        per_drain = max(1, len(receiver.path_peers))
        send_us, recv_us = [], []  # per packet, one figure per repeat: the median of REPEATS is reported
        sent = got = 0
        for _repeat in range(REPEATS):
            send_s = recv_s = 0.0
            sent = got = 0
            for k in range(rounds):
                now += 0.01
                before = sender.counters["sent"]
                t0 = time.thread_time()
                sender.send_due(now)
                send_s += time.thread_time() - t0
                sent += sender.counters["sent"] - before
                if k % per_drain != per_drain - 1:
                    continue
                t0 = time.thread_time()
                before = receiver.counters["received"]
                receiver.receive(receiver.sockets, now)
                recv_s += time.thread_time() - t0
                got += receiver.counters["received"] - before
                _drain(sink)
            assert receiver.counters["rejected"] == 0 and got > 0, "the receiver must accept the sender's heartbeats"
            send_us.append(1e6 * send_s / sent)
            recv_us.append(1e6 * recv_s / got)
        # The loop's share per interval: LinkPass deciding over its path peers, the node watch judging its peers.
        todo = sorted(sender.path_peers)
        t0 = time.thread_time()
        for _ in range(rounds):
            sender.update_paths(now, todo)
        tick_s = (time.thread_time() - t0) / rounds / len(todo)
        judge = Judge(NodeWatchConfig(), names[0], 0.01)
        heard = {n: now for n in names[1:65]}
        t0 = time.thread_time()
        for k in range(rounds):
            judge.tick(now + k * 1e-4, 1e9, heard, True)
        judge_per_peer = (time.thread_time() - t0) / rounds / len(heard)
        return Costs(
            nodes,
            rails,
            sender.packet_bytes,
            statistics.median(send_us),
            statistics.median(recv_us),
            1e6 * tick_s,
            1e6 * judge_per_peer,
            {"sent": sent, "received": got},
        )
    finally:
        sink.close()
        for engine in (sender, receiver):
            for sock in engine.sockets.values():
                sock.close()
            engine.sockets.clear()


def _drain(sock: socket.socket) -> None:
    while True:
        try:
            sock.recv(hbio.RECV_BYTES)
        except BlockingIOError:
            return


@dataclass(frozen=True)
class Model:
    nodes: int
    rails: int
    job_nodes: int
    path_peers: int
    watch_peers: int
    packets_per_s: float  # each way
    bytes_per_s: float  # each way, IP and UDP headers included
    cpu_pct: float  # of one core
    packet_bytes: int


def model(costs: Costs, cfg: LinkPassConfig, job_nodes: int, all_peers: bool = False) -> Model:
    """One node's heartbeat traffic and CPU on ``costs``'s fabric, running one job of ``job_nodes`` nodes."""
    n, rails = costs.nodes, costs.rails
    rate = 1000 / cfg.heartbeat_ms
    if all_peers:
        path, watch, size = n - 1, 0, old_packet_bytes(n, rails, 64)
    else:
        path = min(n - 1, peer_choice.bound(cfg.ring_neighbours, cfg.random_peers))
        # the job's other nodes that are not path peers (at worst none of them is)
        watch = max(0, job_nodes - 1)
        size = costs.packet_bytes
    pps = (path * rails + watch) * rate
    cpu_s = pps * (costs.send_us + costs.recv_us) / 1e6
    cpu_s += rate * (costs.tick_us_per_peer * path + costs.judge_us_per_peer * (path + watch)) / 1e6
    return Model(n, rails, job_nodes, path, watch, pps, pps * (size + IP_UDP), 100 * cpu_s, size)
