"""Pairwise heartbeat keys: each node's own CURVE key pair, a key per pair of nodes, so a node speaks only for
itself; two keys accepted while a node changes its pair.

The engines here are real LinkPass engines exchanging real UDP heartbeats over loopback addresses (127.0.0.x
are the nodes' NIC addresses); only the kernel part (routes, netlink) is left out, as no route moves here.
"""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path

import pytest

from clockwork.contracts.curve_keys import generate
from clockwork.contracts.pairwise_keys import NEXT_SUFFIX, PREVIOUS_SUFFIX, PairwiseKeys
from linkpass import heartbeat
from linkpass.engine import LinkPass, PathState
from linkpass.fabric import FabricMap
from linkpass.keyring import SharedKey
from linkpass.outbox import Outbox
from linkpass.settings import LinkPassConfig
from tests.conftest import until

NODES = ("node1", "node2", "node3")
LABEL = b"clockwork-linkpass"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def install(tmp_path: Path) -> dict[str, Path]:
    """Per-node key pairs made in one place, then each node's folder: its own secret and every public key."""
    made = tmp_path / "made"
    for node in NODES:
        generate(made, node)
    folders = {}
    for node in NODES:
        folder = tmp_path / node
        folder.mkdir()
        for other in NODES:
            shutil.copy(made / f"{other}.key", folder / f"{other}.key")
        shutil.copy(made / f"{node}.key_secret", folder / f"{node}.key_secret")
        (folder / f"{node}.key_secret").chmod(0o600)
        folders[node] = folder
    return folders


def ring(folders: dict[str, Path], node: str, clock: Clock | None = None) -> PairwiseKeys:
    peers = [n for n in NODES if n != node]
    return PairwiseKeys(LABEL, folders[node] / f"{node}.key_secret", folders[node], peers, clock=clock or Clock())


def test_each_pair_has_a_key_no_third_node_can_derive(tmp_path: Path) -> None:
    folders = install(tmp_path)
    one, two, three = (ring(folders, n) for n in NODES)
    assert one.send_key("node2") == two.send_key("node1")
    assert one.send_key("node3") == three.send_key("node1")
    assert one.send_key("node2") != one.send_key("node3")
    # node3 holds its own secret only: none of its keys is node1's key with node2
    assert one.send_key("node2") not in {three.send_key("node1"), three.send_key("node2")}
    assert one.accept_keys("node2") == (two.send_key("node1"),)


def test_one_shared_pair_still_works(tmp_path: Path) -> None:
    """The set-up the docs called the only working one: the same daemon.key pair on every node."""
    generate(tmp_path, "daemon")
    (tmp_path / "daemon.key_secret").chmod(0o600)
    a = PairwiseKeys(LABEL, tmp_path / "daemon.key_secret", tmp_path, ["node2"])
    b = PairwiseKeys(LABEL, tmp_path / "daemon.key_secret", tmp_path, ["node1"])
    assert a.send_key("node2") == b.send_key("node1")


def test_rotation_accepts_both_keys_during_the_change(tmp_path: Path) -> None:
    folders = install(tmp_path)
    clock1, clock2 = Clock(), Clock()
    one, two = ring(folders, "node1", clock1), ring(folders, "node2", clock2)

    def later() -> None:
        clock1.now += 2
        clock2.now += 2

    def both_ways() -> None:
        later()
        assert two.send_key("node1") in one.accept_keys("node2")
        assert one.send_key("node2") in two.accept_keys("node1")

    generate(tmp_path / "new", "node2")
    new_public, new_secret = tmp_path / "new" / "node2.key", tmp_path / "new" / "node2.key_secret"
    # 1. node2's next public key reaches every node
    shutil.copy(new_public, folders["node1"] / f"node2{NEXT_SUFFIX}")
    both_ways()
    # 2. node2 changes its secret, keeping the old one as .previous
    secret2 = folders["node2"] / "node2.key_secret"
    shutil.copy(secret2, Path(str(secret2) + PREVIOUS_SUFFIX))
    Path(str(secret2) + PREVIOUS_SUFFIX).chmod(0o600)
    shutil.copy(new_secret, secret2)
    secret2.chmod(0o600)
    shutil.copy(new_public, folders["node2"] / "node2.key")
    both_ways()
    assert len(one.accept_keys("node2")) == 2 and len(two.accept_keys("node1")) == 2
    # 3. every node takes the new public key as current; node2 drops the old secret
    shutil.copy(new_public, folders["node1"] / "node2.key")
    (folders["node1"] / f"node2{NEXT_SUFFIX}").unlink()
    Path(str(secret2) + PREVIOUS_SUFFIX).unlink()
    both_ways()
    assert len(one.accept_keys("node2")) == 1
    # The old pair's key is refused from now on.
    assert ring(install(tmp_path / "old"), "node2").send_key("node1") not in one.accept_keys("node2")


def test_a_bad_key_file_keeps_the_old_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folders = install(tmp_path)
    clock = Clock()
    one = ring(folders, "node1", clock)
    before = one.send_key("node2")
    (folders["node1"] / "node1.key_secret").chmod(0o644)
    clock.now += 2
    with caplog.at_level(logging.ERROR, "clockwork.keys"):
        assert one.send_key("node2") == before
    assert "readable by other users" in caplog.text


def test_each_peer_gets_the_heartbeat_tagged_under_its_own_key(tmp_path: Path) -> None:
    """One body per rail, one tag per peer: node2 opens node1's packet under their pair's key, node3 under its own,
    and neither packet opens under the other pair's key."""
    folders = install(tmp_path)
    one, two, three = (ring(folders, n) for n in NODES)
    fabric = FabricMap.parse(
        {"nodes": {n: {"addr": f"10.9.0.{k}", "nics": {"nic0": f"127.0.0.{k}"}} for k, n in enumerate(NODES, 1)}}
    )
    index = heartbeat.FabricIndex.of(fabric)
    box = Outbox(index, one, "node1", {p.name: p.nics for p in fabric.peers("node1")})
    sent = {ip: packet for _rail, packet, ip in box.heartbeats(["nic0"], box.heard({}), ["node2", "node3"], [])}
    to_two, to_three = sent["127.0.0.2"], sent["127.0.0.3"]
    assert to_two[: -heartbeat.TAG_BYTES] == to_three[: -heartbeat.TAG_BYTES] and to_two != to_three
    assert heartbeat.decode(to_two, index, two.send_key("node1")).node == index.node_number("node1")
    assert heartbeat.decode(to_three, index, three.send_key("node1")).node == index.node_number("node1")
    with pytest.raises(heartbeat.NotAuthentic):
        heartbeat.decode(to_two, index, three.send_key("node1"))
    # A key shared by every peer: one tag per rail, the same packet for both.
    shared = Outbox(index, SharedKey(b"k" * 32), "node1", {p.name: p.nics for p in fabric.peers("node1")})
    packets = {packet for _rail, packet, _ip in shared.heartbeats(["nic0"], shared.heard({}), ["node2", "node3"], [])}
    assert len(packets) == 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine(node: str, fabric: FabricMap, keys: PairwiseKeys | SharedKey, port: int) -> LinkPass:
    """A LinkPass engine with its heartbeat socket and path table, without the kernel part (no route moves)."""
    lp = LinkPass(LinkPassConfig(heartbeat_port=port, apply_sysctls=False), node, fabric, keys, lambda k, f: None)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((fabric.node(node).nics["nic0"], port))
    sock.setblocking(False)
    lp.sockets = {"nic0": sock}
    lp.nic_up = {"nic0": True}
    lp.paths = {peer: {"nic0": PathState(alive=True)} for peer in lp.peers}
    return lp


def drain(lp: LinkPass) -> None:
    """What the heartbeat thread does once an interval: file everything the socket holds."""
    batch = []
    while True:
        try:
            data, (src, _port) = lp.sockets["nic0"].recvfrom(65536)
        except BlockingIOError:
            break
        batch.append((data, src))
    if batch:
        lp.absorb("nic0", batch, lp.clock())


def test_forged_heartbeats_are_refused_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folders = install(tmp_path)
    port = free_port()
    fabric = FabricMap.parse(
        {"nodes": {n: {"addr": f"10.9.0.{k}", "nics": {"nic0": f"127.0.0.{k}"}} for k, n in enumerate(NODES, 1)}}
    )
    one, two, three = (engine(n, fabric, ring(folders, n), port) for n in NODES)
    try:
        two.send_due(two.clock())  # node2's real heartbeat to node1 (and node3)
        index = one.index
        # node3 signs, with its own key for node1, a heartbeat that says it is node2 (with a down notice) ...
        forged = heartbeat.Heartbeat(
            index.node_number("node2"),
            index.rail_number("nic0"),
            99,
            ((index.node_number("node1"), 0b1),),
            down=1,
            flags=heartbeat.FLAG_NOTICE,
        )
        packet = heartbeat.encode(forged, index, three.keys.send_key("node1"))
        three.sockets["nic0"].sendto(packet, ("127.0.0.1", port))
        # ... and sends one from node2's address (spoofed source), under the only key it can make for node1
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as spoof:
            spoof.bind(("127.0.0.2", 0))
            spoof.sendto(packet, ("127.0.0.1", port))
        with caplog.at_level(logging.WARNING, "clockwork.linkpass"):
            until(
                "node1 to file the three packets",
                lambda: drain(one) or one.counters["received"] + one.counters["refused"] >= 3,
                10,
                0.01,
            )
        assert one.counters["received"] == 1 and one.counters["refused"] == 2
        assert one.status()["heartbeats"]["refused"] == 2
        assert one.heard_from == {"node2"}
        assert not one.paths["node2"]["nic0"].reason  # the forged down notice did nothing
        assert "refused: signed by node3 but claims to be node2 on nic0" in caplog.text
        assert "refused: bad authentication tag" in caplog.text
    finally:
        for lp in (one, two, three):
            lp.close()
