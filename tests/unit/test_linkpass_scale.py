"""LinkPass at scale: fixed-size heartbeats whatever the names, bounded symmetric peer sets, the heartbeat thread.

What fails without issue 47's changes: a name-based packet of 1,024 nodes x 8 rails is far over IPoIB's MTU (and
over the old 8 KB limit with 16-character names); every node heartbeated every node; heartbeats ran in the
daemon's loop, so a blocked loop silenced the node.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable

import pytest

from linkpass import hbio, heartbeat, peers
from linkpass.engine import NEVER, NOTICE_TTL_S, LinkPass, PathState
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


def test_a_heartbeat_is_as_small_at_1024_nodes_x_8_rails_with_64_character_names_as_at_8() -> None:
    """A heartbeat lists the sender's path peers (bounded), not every node: its size depends on neither the
    names nor the fabric's size (version 3's bitmaps over every node were 1,060 bytes at 1,024 x 8)."""
    big = fabric(1024)
    index = heartbeat.FabricIndex.of(big)
    assert max(len(n) for n in index.nodes) == 64
    me = index.nodes[513]
    box = Outbox(index, SharedKey(KEY), me, {p.name: p.nics for p in big.peers(me)})
    path = peers.path_peers(index.nodes, me, 1, 2, index.fingerprint)
    heard = box.heard({name: sorted(big.node(name).nics) for name in path})
    (first, *_rest) = box.heartbeats(sorted(big.node(me).nics), heard, path, [])
    assert len(first[1]) == heartbeat.packet_size(len(path)) == 54 < heartbeat.MAX_PACKET  # 4 path peers
    got = heartbeat.decode(first[1], index, KEY)
    assert heartbeat.sender(first[1]) == 513 and got.seq == 1
    assert all(got.hears(index.node_number(name), r) for name in path for r in range(8))
    assert not got.hears(0, 0) and got.hears_mask(0) == 0  # not a path peer: not listed
    small = fabric(8, name_len=9)
    index8 = heartbeat.FabricIndex.of(small)
    hb = heartbeat.Heartbeat(1, 7, 2**32 - 1, tuple((n, 0xFF) for n in (0, 2, 3, 7)), 0b1, 0b10)
    assert len(heartbeat.encode(hb, index8, KEY)) == len(first[1])


def test_a_heartbeat_listing_more_peers_than_one_datagram_carries_is_refused() -> None:
    index = heartbeat.FabricIndex.of(fabric(8, rails=2, name_len=8))
    full = tuple((i % 8, 1) for i in range(heartbeat.MAX_ENTRIES))
    assert len(heartbeat.encode_body(heartbeat.Heartbeat(0, 0, 1, full), index)) + heartbeat.TAG_BYTES <= 4092 - 28
    with pytest.raises(ValueError, match="at most"):
        heartbeat.encode_body(heartbeat.Heartbeat(0, 0, 1, (*full, (1, 1))), index)
    big = fabric(2100, rails=2, name_len=8)  # settings that make every node a path peer: refused at start
    with pytest.raises(ValueError, match=r"2099 path peers .* at most 1006"):
        LinkPass(LinkPassConfig(ring_neighbours=1050), sorted(big.nodes)[0], big, KEY, lambda kind, fields: None)


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
    sock, granted = hbio.open_socket("127.0.0.1", 0, "lo", hbio.rcvbuf_for(1024, heartbeat.MAX_PACKET))
    assert granted >= hbio.rcvbuf_for(1024, heartbeat.MAX_PACKET)  # root: SO_RCVBUFFORCE past rmem_max
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


class _Routes:
    """The kernel's routing calls LinkPass makes, recorded (peer address -> the NIC addresses of its next hops)."""

    def __init__(self) -> None:
        self.routes: dict[str, list[str]] = {}

    def set_route(self, dst: str, src: str, hops: list[tuple[str, int]]) -> None:
        self.routes[dst] = [ip for ip, _ifindex in hops]

    def flush_route_cache(self) -> None:
        return None

    def delete_neighbour(self, ifindex: int, ip: str) -> None:
        return None

    def flush_neighbours(self, ifindex: int) -> int:
        return 0


def test_the_once_a_second_pass_judges_the_unsettled_peers_not_the_whole_fabric() -> None:
    """A healthy fabric's once-a-second pass costs as much at 1,024 nodes as at 8: it judges the path peers and the
    peers whose routes may change with time alone. A notice still expires: its peer's route goes home again."""
    fab = fabric(64, rails=2, name_len=20)
    now = [100.0]
    names = sorted(fab.nodes)
    a, far = _engine(fab, names[0], now), _engine(fab, names[32], now)
    kernel = _Routes()
    a.kernel = kernel  # type: ignore[assignment]
    a.ifindex = {"ib0": 1, "ib1": 2}
    for name in a.peers:  # routed over ib1 for now, at home on ib0 (what start() learns from the kernel)
        a.home[name], a.current[name] = "ib0", ("ib1",)
    judged: list[set[str]] = []
    update = a.update_paths

    def spy(at: float, peers: Iterable[str] | None = None) -> dict[str, str]:
        judged.append(set(a.paths if peers is None else peers))
        return update(at, peers)

    a.update_paths = spy  # type: ignore[method-assign,assignment]
    a.evaluate()  # the first decision judges every peer and moves each route home
    assert judged[-1] == set(names[1:])
    now[0] += 1.5
    a.evaluate()  # the peers just moved are judged once more (a route the kernel refused is tried again)
    assert judged[-1] == set(names[1:])
    now[0] += 1.5
    a.evaluate()
    assert judged[-1] == a.path_peers and len(a.path_peers) == 2  # healthy: nothing else to judge
    far_addr = fab.node(names[32]).addr
    home = kernel.routes[far_addr]
    assert home == [fab.node(names[32]).nics["ib0"]]
    # far's home NIC dies: its notice moves a's route to far off that NIC, until the notice expires
    far.nic_up["ib0"] = False
    _deliver(far, far.outbox.notices(["ib1"], far.outbox.heard({}), ["ib0"], []), a, now[0])
    a.evaluate()  # an event: every peer
    assert judged[-1] == set(names[1:]) and kernel.routes[far_addr] != home
    now[0] += 1.5
    a.evaluate()
    assert judged[-1] == a.path_peers | {names[32]}  # the notice has not expired: far stays unsettled
    for _ in range(int(NOTICE_TTL_S) + 5):  # once a second until the notice has expired and the hold-down ended
        now[0] += 1.0
        a.evaluate()
        if kernel.routes[far_addr] == home:
            break
    assert kernel.routes[far_addr] == home
    for _ in range(2):  # judged once more after its move, then settled
        now[0] += 1.5
        a.evaluate()
    assert judged[-1] == a.path_peers
