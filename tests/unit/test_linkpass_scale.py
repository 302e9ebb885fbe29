"""LinkPass at scale: fixed-size heartbeats whatever the names, bounded symmetric peer sets, the heartbeat thread.

What fails without issue 47's changes: a name-based packet of 1,024 nodes x 8 rails is far over IPoIB's MTU (and
over the old 8 KB limit with 16-character names); every node heartbeated every node; heartbeats ran in the
daemon's loop, so a blocked loop silenced the node.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from linkpass import hbio, heartbeat, peers
from linkpass.engine import NEVER, LinkPass, PathState
from linkpass.fabric import FabricMap
from linkpass.keyring import SharedKey
from linkpass.outbox import NOTICE_RAILS, Outbox
from linkpass.settings import LinkPassConfig

KEY = b"k" * 32


def fabric(n: int, rails: int = 8, name_len: int = 64) -> FabricMap:
    nodes = {}
    for i in range(n):
        name = f"node{i:04d}".ljust(name_len, "x")
        nics = {f"ib{r}": f"10.{r}.{i // 256}.{i % 256}" for r in range(rails)}
        nodes[name] = {"addr": f"10.100.{i // 256}.{i % 256}", "nics": nics}
    return FabricMap.parse({"nodes": nodes})


def test_a_heartbeat_of_1024_nodes_x_8_rails_with_64_character_names_fits_ipoib() -> None:
    big = fabric(1024)
    index = heartbeat.FabricIndex.of(big)
    assert max(len(n) for n in index.nodes) == 64
    assert index.size == heartbeat.packet_size(1024, 8) == 1060 <= heartbeat.MAX_PACKET < 4092
    assert heartbeat.FabricIndex.of(fabric(1024, name_len=9)).size == index.size  # names never travel
    everyone = set(range(1024))
    hb = heartbeat.Heartbeat(513, 7, 2**32 - 1, tuple(heartbeat.bitmap(index, everyone) for _ in range(8)), 0b1, 0b10)
    packet = heartbeat.encode(hb, index, KEY)
    assert len(packet) == index.size
    got = heartbeat.decode(packet, index, KEY)
    assert got == hb and heartbeat.sender(packet) == 513
    assert all(got.hears(i, r) for i in (0, 511, 1023) for r in range(8))


def test_a_fabric_whose_heartbeats_would_not_fit_one_datagram_is_refused() -> None:
    with pytest.raises(ValueError, match="IPoIB"):
        heartbeat.FabricIndex.of(fabric(4100, rails=8, name_len=8))


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 16, 64, 257, 1024])
def test_path_peers_are_bounded_symmetric_and_include_the_ring_neighbours(n: int) -> None:
    names = [f"n{i:04d}" for i in range(n)]
    limit = peers.bound(1, 4)
    chosen = {me: peers.path_peers(names, me, 1, 4, seed=1234) for me in names}
    for i, me in enumerate(names):
        assert me not in chosen[me]
        assert len(chosen[me]) <= min(limit, n - 1)
        assert {names[(i + 1) % n], names[(i - 1) % n]} - {me} <= set(chosen[me])  # the ring neighbours
        for other in chosen[me]:
            assert me in chosen[other], f"{me} heartbeats {other} but not the other way round"
    if n - 1 <= limit // 2:
        assert all(len(chosen[me]) == n - 1 for me in names)  # small fabrics: all to all


def test_the_random_offsets_depend_on_the_fabric_and_stay_bounded_with_large_settings() -> None:
    assert peers.offsets(1024, 1, 4, 1) != peers.offsets(1024, 1, 4, 2)
    names = [f"n{i}" for i in range(9)]
    assert len(peers.path_peers(names, "n0", 10, 10, 0)) == 8  # never more than everyone


def test_outbox_sends_path_peers_every_rail_and_watch_peers_one_rail_in_turn() -> None:
    fab = fabric(64, rails=8, name_len=12)
    index = heartbeat.FabricIndex.of(fab)
    me = index.nodes[0]
    box = Outbox(index, SharedKey(KEY), me, {p.name: p.nics for p in fab.peers(me)})
    rails = sorted(fab.node(me).nics)
    path = peers.path_peers(index.nodes, me, 1, 4, index.fingerprint)
    watch = set(index.nodes[10:20]) - set(path)
    heard = box.heard({})
    first = box.heartbeats(rails, heard, path, watch)
    assert len(first) == len(path) * 8 + len(watch)
    watch_rails = {ip for _rail, _p, ip in first if any(ip in fab.node(w).nics.values() for w in watch)}
    second = box.heartbeats(rails, heard, path, watch)
    moved = {ip for _rail, _p, ip in second if any(ip in fab.node(w).nics.values() for w in watch)}
    assert watch_rails.isdisjoint(moved)  # the next interval uses another rail for each watch peer
    notice = box.notices(rails[1:], heard, [rails[0]], [])
    assert len(notice) == 63 * NOTICE_RAILS and all(rail != rails[0] for rail, _p, _ip in notice)


def _engine(fab: FabricMap, node: str, now: list[float]) -> LinkPass:
    engine = LinkPass(LinkPassConfig(random_peers=0), node, fab, KEY, lambda kind, fields: None, clock=lambda: now[0])
    for name, peer in engine.peers.items():
        engine.paths[name] = {r: PathState(alive=True, alive_since=-1e9) for r in engine.rails if r in peer.nics}
        engine.nic_up.update({r: True for r in engine.rails})
    return engine


def _deliver(sender: LinkPass, out: list[tuple[str, bytes, str]], receiver: LinkPass, now: float) -> int:
    mine = set(receiver.me.nics.values())
    got = 0
    for rail, packet, ip in out:
        if ip in mine:
            receiver.absorb(rail, [(packet, sender.me.nics[rail])], now)
            got += 1
    return got


def test_heartbeats_between_path_peers_prove_both_directions_and_notices_reach_the_others() -> None:
    fab = fabric(8, rails=2, name_len=20)
    now = [100.0]
    names = sorted(fab.nodes)
    a, b, far = (_engine(fab, n, now) for n in (names[0], names[1], names[4]))
    assert names[1] in a.path_peers and names[4] not in a.path_peers  # ring neighbours only (random_peers = 0)
    assert _deliver(a, a.outgoing(now[0]), b, now[0]) == 2  # one per rail
    assert all(p.last_in == now[0] for p in b.paths[names[0]].values())
    assert not any(p.last_out_ok == now[0] for p in a.paths[names[1]].values())  # a does not know b hears it
    _deliver(b, b.outgoing(now[0]), a, now[0])  # b says it hears a on both rails
    assert all(p.last_out_ok == now[0] for p in a.paths[names[1]].values())
    assert a.last_heard() == {names[1]: now[0]}
    assert _deliver(far, far.outgoing(now[0]), a, now[0]) == 0  # far does not heartbeat a
    # far's ib1 dies: its notice reaches a, which does not heartbeat far, and a routes around far's ib1
    far.nic_up["ib1"] = False
    assert _deliver(far, far.outbox.notices(["ib0"], far.outbox.heard({}), ["ib1"], []), a, now[0]) == 1
    path = a.paths[names[4]]["ib1"]
    assert path.notice_until > now[0] and "reported ib1 down" in path.reason
    a.update_paths(now[0])
    assert not a.paths[names[4]]["ib1"].alive and a.paths[names[4]]["ib0"].alive
    # the up notice clears it at once
    _deliver(far, far.outbox.notices(["ib0", "ib1"], far.outbox.heard({}), [], ["ib1"]), a, now[0])
    assert path.notice_until == NEVER
    a.update_paths(now[0] + 0.001)
    assert a.paths[names[4]]["ib1"].alive


def test_watch_peers_are_heard_for_the_node_watch_and_dropped_when_the_job_ends() -> None:
    fab = fabric(8, rails=2, name_len=20)
    now = [50.0]
    names = sorted(fab.nodes)
    a, job_peer = _engine(fab, names[0], now), _engine(fab, names[4], now)
    a.set_watch_peers([names[4]])
    job_peer.set_watch_peers([names[0]])
    assert _deliver(job_peer, job_peer.outgoing(now[0]), a, now[0]) == 1  # one rail, not every rail
    assert a.last_heard()[names[4]] == now[0]
    a.set_watch_peers([])
    assert names[4] not in a.last_heard()


class _Echo:
    """A stand-in engine: sends one datagram to its own socket per interval and counts what it reads."""

    def __init__(self, sock: socket.socket, target: tuple[str, int]) -> None:
        self.sock, self.target = sock, target
        self.sent = self.read = 0
        self.done = threading.Event()

    def receive(self, sockets: dict[str, socket.socket], now: float) -> None:
        for sock in sockets.values():
            while True:
                try:
                    sock.recv(hbio.RECV_BYTES)
                except BlockingIOError:
                    break
                self.read += 1
        if self.read >= 20:
            self.done.set()

    def send_due(self, now: float) -> float:
        self.sock.sendto(b"hb", self.target)
        self.sent += 1
        return now + 0.001


def test_the_heartbeat_thread_keeps_sending_and_reading_while_its_caller_is_blocked() -> None:
    sock, granted = hbio.open_socket("127.0.0.1", 0, "lo", hbio.rcvbuf_for(1024, 1060))
    assert granted >= hbio.rcvbuf_for(1024, 1060)  # root: SO_RCVBUFFORCE past rmem_max
    engine = _Echo(sock, sock.getsockname())
    thread = hbio.HeartbeatThread(engine, {"lo": sock}, time.monotonic)
    thread.start()
    try:
        # This thread now blocks (as a hung NVML call would block the daemon's loop): the other goes on.
        assert engine.done.wait(timeout=30), f"sent {engine.sent}, read {engine.read}"
        assert thread.alive() and thread.errors == 0
    finally:
        thread.stop()
        sock.close()
