"""LinkPass's pure parts: heartbeat authentication and decoding, the fabric map, sysctl settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass import heartbeat, sysctls
from linkpass.fabric import FabricError, FabricMap

KEY = b"k" * 32
FABRIC = {
    "nodes": {
        "node1": {"addr": "198.18.0.1", "nics": {"nic0": "198.18.1.1", "nic1": "198.18.2.1"}},
        "node2": {"addr": "198.18.0.2", "nics": {"nic0": "198.18.1.2", "nic1": "198.18.2.2"}},
    }
}


INDEX = heartbeat.FabricIndex.of(FabricMap.parse(FABRIC))


def _beat(seq: int = 7, down: int = 0) -> heartbeat.Heartbeat:
    return heartbeat.Heartbeat(0, 0, seq, ((1, 0b01),), down)  # node 0 hears node 1 on rail 0


def test_heartbeat_round_trip() -> None:
    hb = _beat(down=0b10)
    got = heartbeat.decode(heartbeat.encode(hb, INDEX, KEY), INDEX, KEY)
    assert got == hb and got.hears(1, 0) and not got.hears(1, 1) and not got.hears(0, 0)


def test_heartbeat_with_another_key_or_tampered_is_rejected() -> None:
    packet = heartbeat.encode(_beat(1), INDEX, KEY)
    with pytest.raises(heartbeat.PacketError, match="authentication"):
        heartbeat.decode(packet, INDEX, b"x" * 32)
    tampered = bytearray(packet)
    tampered[3] ^= 0x01
    with pytest.raises(heartbeat.PacketError, match="authentication"):
        heartbeat.decode(bytes(tampered), INDEX, KEY)


def test_authentic_but_malformed_bodies_are_rejected() -> None:
    body = heartbeat.encode_body(_beat(), INDEX)
    other = heartbeat.FabricIndex(INDEX.nodes, INDEX.rails, INDEX.fingerprint ^ 1)

    def patched(offset: int, value: int) -> bytes:
        out = bytearray(body)
        out[offset] = value
        return heartbeat.seal(bytes(out), KEY)

    cases = {
        "unknown version": patched(0, 9),
        "another fabric map": heartbeat.encode(_beat(), other, KEY),
        "out of range": patched(7, 5),  # the sender's node number (low byte)
        "node or rail out of range": patched(heartbeat.HEADER_BYTES + 1, 9),  # a listed peer's node number
        "bad size": heartbeat.seal(body + b"\0", KEY),
        "bad size ": heartbeat.seal(body + b"\0\0\0\0", KEY),  # an entry more than the header counts
    }
    for message, packet in cases.items():
        with pytest.raises(heartbeat.PacketError, match=message):
            heartbeat.decode(packet, INDEX, KEY)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        heartbeat.decode(data, INDEX, KEY)
    except heartbeat.PacketError:
        pass


def test_fabric_map_loads_and_answers(tmp_path: Path) -> None:
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps(FABRIC))
    fabric = FabricMap.load(path)
    assert [p.name for p in fabric.peers("node1")] == ["node2"]
    assert fabric.node("node2").nics["nic1"] == "198.18.2.2"
    assert fabric.by_address("198.18.1.2").name == "node2"
    assert fabric.by_address("10.0.0.1") is None
    with pytest.raises(FabricError, match="node 'node9' is not in the fabric map"):
        fabric.node("node9")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, "expected"),
        ({"nodes": {"a": {"addr": "1.2.3.4"}}}, "needs 'addr' and a non-empty 'nics'"),
        ({"nodes": {"a": {"addr": "1.2.3", "nics": {"nic0": "1.1.1.1"}}}}, "node 'a'"),
        ({"nodes": {"a": {"addr": "1.2.3.4", "nics": {"nic0": "nope"}}}}, "node 'a'"),
    ],
)
def test_bad_fabric_maps_name_the_problem(doc: object, message: str) -> None:
    with pytest.raises(FabricError, match=message):
        FabricMap.parse(doc)


def test_missing_fabric_file(tmp_path: Path) -> None:
    with pytest.raises(FabricError, match="no fabric file at"):
        FabricMap.load(tmp_path / "none.json")


def test_sysctl_parsing_and_reading() -> None:
    assert sysctls.parse("a.b=1, c.d = 2,") == {"a.b": "1", "c.d": "2"}
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        sysctls.parse("a.b")
    values = sysctls.read(["net.ipv4.ip_forward", "net.ipv4.no_such_setting"])
    assert values["net.ipv4.ip_forward"] in ("0", "1") and values["net.ipv4.no_such_setting"] is None


def test_home_rails_go_through_the_hosts_durable_writer(tmp_path: Path) -> None:
    """linkpass imports nothing of clockworkd: its host hands it the one atomic writer, which must be used."""
    from clockwork.contracts import atomic_file
    from linkpass.engine import LinkPass
    from linkpass.settings import LinkPassConfig

    fabric = FabricMap.parse(FABRIC)
    home_file = tmp_path / "state" / "linkpass-home.json"
    written: list[Path] = []

    def write(path: Path, data: bytes) -> None:
        written.append(path)
        atomic_file.write_bytes(path, data)

    engine = LinkPass(
        LinkPassConfig(), "node1", fabric, KEY, lambda kind, fields: None, home_file=home_file, write_file=write
    )
    engine.home = {"node2": "nic1"}
    engine._save_homes()
    assert written == [home_file]
    assert sorted(p.name for p in home_file.parent.iterdir()) == ["linkpass-home.json"]
    assert engine._load_homes() == {"node2": "nic1"}
    with pytest.raises(ValueError, match="write_file"):
        LinkPass(LinkPassConfig(), "node1", fabric, KEY, lambda kind, fields: None, home_file=home_file)
