"""LinkPass's C heartbeat path (linkpass._hbfast through linkpass.fastpath) against the Python reference
(linkpass.heartbeat, linkpass.inbox), over real UDP sockets on loopback addresses (127.0.0.x are the nodes' NIC
addresses; no route moves, so the kernel part of the engine is left out).

What must hold: the C tag is heartbeat.py's byte for byte; what C sends decodes in Python and what Python seals
C accepts, with the same fields; a forged packet (a wrong key, or signed by one node naming another) is refused,
counted and logged as the Python path does; truncated, oversized, other-map and unknown-source packets are
dropped without being called forged; a key rotation (two accepted keys, then a new send key) keeps working.
"""

from __future__ import annotations

import hashlib
import logging
import socket
from collections.abc import Iterator, Sequence

import pytest

from linkpass import _hbfast, heartbeat
from linkpass.engine import LinkPass, PathState
from linkpass.fabric import FabricMap
from linkpass.fastpath import KEY_BYTES, KEY_SLOTS, FastPath
from linkpass.keyring import SharedKey
from linkpass.settings import LinkPassConfig
from tests.conftest import until

NODES = ("node1", "node2", "node3")
FABRIC = FabricMap.parse(
    {"nodes": {n: {"addr": f"10.9.0.{k}", "nics": {"nic0": f"127.0.0.{k}"}} for k, n in enumerate(NODES, 1)}}
)


def pair(a: str, b: str, epoch: int = 0) -> bytes:
    return hashlib.blake2b("\0".join(sorted((a, b))).encode(), digest_size=32, salt=bytes([epoch]) * 16).digest()


class PairKeys:
    """A key per pair of nodes (as per-node key pairs give), with a rotation: ``epoch`` sends, ``accepted`` open."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.version = 0
        self.send_epoch = 0
        self.accepted: tuple[int, ...] = (0,)

    def rotate(self, send_epoch: int, accepted: tuple[int, ...]) -> None:
        self.send_epoch, self.accepted = send_epoch, accepted
        self.version += 1

    def maybe_reload(self) -> None:
        return None

    def send_key(self, peer: str) -> bytes:
        return pair(self.me, peer, self.send_epoch)

    def accept_keys(self, peer: str) -> Sequence[bytes]:
        return tuple(pair(self.me, peer, e) for e in self.accepted)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine(node: str, port: int, keys: PairKeys | SharedKey | None = None) -> LinkPass:
    lp = LinkPass(
        LinkPassConfig(heartbeat_port=port, apply_sysctls=False),
        node,
        FABRIC,
        keys or PairKeys(node),
        lambda k, f: None,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((FABRIC.node(node).nics["nic0"], port))
    sock.setblocking(False)
    lp.sockets = {"nic0": sock}
    lp.nic_up = {"nic0": True}
    lp.paths = {peer: {"nic0": PathState(alive=True)} for peer in lp.peers}
    return lp


def receive_until(lp: LinkPass, count: int) -> None:
    """What the heartbeat thread does each interval (read in C), until ``count`` packets were filed or rejected."""

    def filed() -> bool:
        lp.receive(lp.sockets, lp.clock())
        return lp.counters["received"] + lp.counters["rejected"] >= count

    until(f"{lp.me.name} to file {count} packets", filed, 10, 0.01)


@pytest.fixture
def three() -> Iterator[tuple[LinkPass, LinkPass, LinkPass]]:
    port = free_port()
    engines = (engine("node1", port), engine("node2", port), engine("node3", port))
    yield engines
    for lp in engines:
        lp.close()


def test_the_c_tag_is_heartbeat_pys_keyed_blake2b_of_the_body() -> None:
    body = bytes(range(200))
    key = b"k" * 32
    assert _hbfast.tag(body, key, 0, 0) == hashlib.blake2b(body, key=key, digest_size=16).digest()
    table = bytes(KEY_SLOTS * KEY_BYTES) + key + b"o" * KEY_BYTES + bytes((KEY_SLOTS - 2) * KEY_BYTES)
    assert _hbfast.tag(body, table, 1, 1) == heartbeat.seal(body, b"o" * 32)[-16:]
    assert _hbfast.tag(body, table, 0, 0) is None  # an all-zero slot is no key
    with pytest.raises(ValueError):
        _hbfast.tag(body, b"k" * 65, 0, 0)


def test_what_c_sends_is_what_python_seals_and_decodes(three: tuple[LinkPass, LinkPass, LinkPass]) -> None:
    one, two, _three = three
    one.send_due(one.clock())
    data, (src, _port) = two.sockets["nic0"].recvfrom(65536)
    assert src == "127.0.0.1"
    # Byte for byte the packet the Python reference seals for node2 ...
    expected = [
        p
        for rail, p, ip in one.outbox.seal(one.outbox.heartbeat_batches(["nic0"], one._heard(0.0), ["node2"], []))
        if ip == "127.0.0.2"
    ]
    index = one.index
    hb = heartbeat.decode(data, index, pair("node1", "node2"))
    assert data[:12] == expected[0][:12] and data[16:-16] == expected[0][16:-16]  # all but seq and the tag
    assert heartbeat.seal(data[:-16], pair("node1", "node2")) == data  # the C tag is Python's, byte for byte
    assert (hb.node, hb.rail, hb.down, hb.up, hb.flags) == (index.node_number("node1"), 0, 0, 0, 0)
    # ... and under node2's pair key only: node3's key does not open it
    with pytest.raises(heartbeat.NotAuthentic):
        heartbeat.decode(data, index, pair("node1", "node3"))


def test_what_python_seals_c_accepts_with_the_same_fields(three: tuple[LinkPass, LinkPass, LinkPass]) -> None:
    one, two, _three = three
    index = one.index
    me = index.node_number("node1")
    hb = heartbeat.Heartbeat(index.node_number("node2"), 0, 77, ((me, 0b1),), down=0, up=1, flags=heartbeat.FLAG_NOTICE)
    two.sockets["nic0"].sendto(
        heartbeat.encode(hb, index, pair("node1", "node2")), ("127.0.0.1", one.cfg.heartbeat_port)
    )
    until("the packet", lambda: _pending(one), 10, 0.01)
    accepted, rejected, errors = one.fast.receive(one.sockets)
    assert rejected == [] and errors == 0
    assert accepted == [(0b1, hb.node, 77, 0, 1, heartbeat.FLAG_NOTICE, hb.hears_mask(me))] and hb.hears_mask(me) == 1


def _pending(lp: LinkPass) -> bool:
    return _queued(lp.sockets["nic0"])


def test_heartbeats_sent_and_read_in_c_prove_both_directions(three: tuple[LinkPass, LinkPass, LinkPass]) -> None:
    one, two, _three = three
    two.send_due(two.clock())
    receive_until(one, 1)
    assert one.counters == {**one.counters, "received": 1, "rejected": 0}
    assert one.heard_from == {"node2"} and "node2" in one.last_heard()
    one.send_due(one.clock())  # node1 now says it hears node2
    receive_until(two, 1)
    two.clock = lambda: 1e6
    one.send_due(one.clock())
    receive_until(two, 2)
    assert two.paths["node1"]["nic0"].last_out_ok == 1e6  # node1 hears node2: filed from the C "hears" mask
    two.paths["node1"]["nic0"].last_out_ok = 0.0
    one.paths["node2"]["nic0"].last_in = -1e18  # node1 no longer hears node2 ...
    one.send_due(one.clock())
    receive_until(two, 3)
    assert two.paths["node1"]["nic0"].last_out_ok == 0.0  # ... and says so


def test_forged_heartbeats_are_refused_counted_and_logged(
    three: tuple[LinkPass, LinkPass, LinkPass], caplog: pytest.LogCaptureFixture
) -> None:
    one, _two, third = three
    index = one.index
    port = one.cfg.heartbeat_port
    forged = heartbeat.Heartbeat(index.node_number("node2"), 0, 99, ((0, 0b1),), down=1, flags=heartbeat.FLAG_NOTICE)
    packet = heartbeat.encode(forged, index, pair("node1", "node3"))  # node3's own key with node1, naming node2
    third.sockets["nic0"].sendto(packet, ("127.0.0.1", port))  # from node3's address: signed by 3, claims 2
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as spoof:
        spoof.bind(("127.0.0.2", 0))
        spoof.sendto(packet, ("127.0.0.1", port))  # from node2's address, under a key node2 does not use
    with caplog.at_level(logging.WARNING, "clockwork.linkpass"):
        receive_until(one, 2)
    assert one.counters["received"] == 0 and one.counters["refused"] == 2 == one.counters["rejected"]
    assert one.heard_from == set() and not one.paths["node2"]["nic0"].reason  # the forged notice did nothing
    assert "refused: signed by node3 but claims to be node2 on nic0" in caplog.text
    assert "refused: bad authentication tag" in caplog.text
    caplog.clear()
    third.sockets["nic0"].sendto(packet, ("127.0.0.1", port))
    with caplog.at_level(logging.WARNING, "clockwork.linkpass"):
        receive_until(one, 3)
    assert one.counters["refused"] == 3 and "refused" not in caplog.text  # logged once a minute per source


def test_truncated_oversized_other_map_and_unknown_packets_are_dropped_not_refused(
    three: tuple[LinkPass, LinkPass, LinkPass], caplog: pytest.LogCaptureFixture
) -> None:
    one, two, _third = three
    index = one.index
    port = one.cfg.heartbeat_port
    key = pair("node1", "node2")
    good = heartbeat.encode(heartbeat.Heartbeat(1, 0, 5, ((0, 0b1),)), index, key)
    other = heartbeat.FabricIndex(index.nodes, index.rails, index.fingerprint ^ 1)
    packets = [
        good[:-1],  # truncated
        good + b"x",  # oversized
        heartbeat.encode(heartbeat.Heartbeat(1, 0, 5, ((0, 0b1),)), other, key),  # another map
        heartbeat.seal(good[:-16] + bytes(4), key),  # an entry more than its header counts
        heartbeat.seal(b"\x02" + good[1:-16], key),  # another version
    ]
    for p in packets:
        two.sockets["nic0"].sendto(p, ("127.0.0.1", port))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        stranger.bind(("127.0.0.9", 0))
        stranger.sendto(good, ("127.0.0.1", port))  # no node has that address
    with caplog.at_level(logging.WARNING, "clockwork.linkpass"):
        receive_until(one, 6)
    assert one.counters["rejected"] == 6 and one.counters["refused"] == 0 and one.counters["received"] == 0
    assert "bad size" in caplog.text and "refused" not in caplog.text  # said once for node2's address


def test_a_key_rotation_keeps_heartbeats_flowing(three: tuple[LinkPass, LinkPass, LinkPass]) -> None:
    one, two, _third = three
    assert isinstance(one.keys, PairKeys) and isinstance(two.keys, PairKeys)
    one.keys.rotate(0, (0, 1))  # node1 accepts the old and the new key of each pair
    two.keys.rotate(1, (1, 0))  # node2 sends under the new one already
    two.send_due(two.clock())
    receive_until(one, 1)
    assert one.counters["received"] == 1
    one.keys.rotate(1, (1,))  # node1 finished: the new key only
    one.send_due(one.clock())
    receive_until(two, 1)
    assert two.counters["received"] == 1
    two.keys.rotate(1, (1,))
    one.keys.rotate(2, (2,))  # a key node2 does not know yet: refused
    one.send_due(one.clock())
    receive_until(two, 2)
    assert two.counters["refused"] == 1


def test_a_key_shared_by_every_peer_works_in_c() -> None:
    port = free_port()
    one, two = engine("node1", port, SharedKey(b"s" * 40)), engine("node2", port, SharedKey(b"s" * 40))
    try:
        two.send_due(two.clock())
        receive_until(one, 1)
        assert one.counters["received"] == 1
        assert FastPath(one.index, SharedKey(b"s" * 40), "node1", {}).key == b"s" * 40
    finally:
        one.close()
        two.close()


def test_one_intervals_packets_on_every_rail_are_filed_once_with_the_rails_they_came_on() -> None:
    """The C path hands a path peer's packets of one interval (one per rail, the same words) to the engine as one
    entry with the mask of their rails, sorted by seq: Python files a peer once an interval, not once per rail."""
    fab = FabricMap.parse(
        {
            "nodes": {
                n: {"addr": f"10.9.0.{k}", "nics": {"nic0": f"127.0.1.{k}", "nic1": f"127.0.2.{k}"}}
                for k, n in enumerate(NODES[:2], 1)
            }
        }
    )
    port = free_port()
    one, two = (
        LinkPass(LinkPassConfig(heartbeat_port=port, apply_sysctls=False), n, fab, PairKeys(n), lambda k, f: None)
        for n in NODES[:2]
    )
    try:
        for lp in (one, two):
            lp.nic_up = {"nic0": True, "nic1": True}
            lp.paths = {peer: {r: PathState(alive=True) for r in ("nic0", "nic1")} for peer in lp.peers}
            for rail, ip in fab.node(lp.me.name).nics.items():
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((ip, port))
                sock.setblocking(False)
                lp.sockets[rail] = sock
        two.send_due(two.clock())
        two.send_due(two.clock())  # two intervals wait on each rail
        queued = lambda: all(_queued(sock) for sock in one.sockets.values())  # noqa: E731
        until("both rails' packets", queued, 10, 0.01)
        accepted, rejected, errors = one.fast.receive(one.sockets)
        assert rejected == [] and errors == 0
        node = one.index.node_number("node2")
        assert [(rails, n) for rails, n, *_ in accepted] == [(0b11, node), (0b11, node)]
        assert accepted[0][2] + 1 == accepted[1][2]  # seq order
        two.send_due(two.clock())
        until("both rails' packets", queued, 10, 0.01)
        one.receive(one.sockets, 123.0)
        assert one.counters["received"] == 2  # packets, not entries
        assert {r: p.last_in for r, p in one.paths["node2"].items()} == {"nic0": 123.0, "nic1": 123.0}
    finally:
        for lp in (one, two):
            lp.close()


def _queued(sock: socket.socket) -> bool:
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    return True
