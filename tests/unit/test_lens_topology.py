"""Fleet Lens topology: inferred rails, topology files (and their errors), fat trees, probe paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from clockwork.contracts import lens_model as model
from clockworkd.lens.topology import Attachment, Topology, TopologyError
from linkpass.fabric import FabricMap


def sandbox_fabric(nodes: int = 4) -> FabricMap:
    """The sandbox's shape: node1..nodeN, each with nic0 and nic1 (one rail each)."""
    return FabricMap.parse(
        {
            "nodes": {
                f"node{i}": {"addr": f"198.18.0.{i}", "nics": {"nic0": f"198.18.1.{i}", "nic1": f"198.18.2.{i}"}}
                for i in range(1, nodes + 1)
            }
        }
    )


# ----- inferred from the fabric map -----------------------------------------------------------------


def test_fabric_map_gives_one_switch_per_rail() -> None:
    topo = Topology.from_fabric(sandbox_fabric())
    assert topo.nics() == tuple(f"node{i}/nic{r}" for i in range(1, 5) for r in range(2))
    assert topo.attachment("node3/nic1") == Attachment("rail:nic1", "node3/nic1")
    assert topo.switches() == ("rail:nic0", "rail:nic1")
    assert topo.path("node3/nic1", "node1/nic1") == ("node3/nic1>rail:nic1", "rail:nic1>node1/nic1")
    assert topo.same_rail_peers("node3/nic1") == ("node1/nic1", "node2/nic1", "node4/nic1")


def test_no_path_across_rails_to_itself_or_to_unknown_nics() -> None:
    topo = Topology.from_fabric(sandbox_fabric())
    assert topo.path("node1/nic0", "node2/nic1") is None
    assert topo.path("node1/nic0", "node1/nic0") is None
    assert topo.path("node1/nic0", "node9/nic0") is None


def test_physical_link_of_a_nic_names_the_cable_port_and_direction() -> None:
    topo = Topology.from_fabric(sandbox_fabric())
    up = topo.physical("node3/nic1>rail:nic1")
    down = topo.physical("rail:nic1>node3/nic1")
    assert up.name == down.name == "node3/nic1 <-> rail:nic1"
    assert (up.switch, up.port, up.nic) == ("rail:nic1", "node3/nic1", "node3/nic1")
    assert (up.direction, down.direction) == (model.UPLINK, model.DOWNLINK)
    assert up.reverse == "rail:nic1>node3/nic1" and down.reverse == "node3/nic1>rail:nic1"
    with pytest.raises(KeyError, match="nope>rail:nic1"):
        topo.physical("nope>rail:nic1")


def test_links_are_every_nic_both_ways() -> None:
    topo = Topology.from_fabric(sandbox_fabric())
    assert len(topo.links()) == len(set(topo.links())) == 16
    assert {topo.uplink(n) for n in topo.nics()} | {topo.downlink(n) for n in topo.nics()} == set(topo.links())


# ----- fat trees ------------------------------------------------------------------------------------


def test_fat_tree_shape_and_names() -> None:
    topo = Topology.fat_tree(100, 32, 4, rails=2)
    assert len(topo.nics()) == 200
    assert topo.switch_of("n00000/nic0") == "r0-leaf0"
    assert topo.switch_of("n00099/nic1") == "r1-leaf3"  # 100 nodes over leafs of 32: 4 leafs
    assert topo.neighbors("r0-leaf1") == tuple(sorted(f"r0-spine{j}" for j in range(4)))
    assert topo.neighbors("r1-spine2") == tuple(sorted(f"r1-leaf{i}" for i in range(4)))
    assert len(topo.links()) == 2 * 200 + 2 * (2 * 4 * 4)
    assert len(topo.rail_group("n00005/nic1")) == 100


def test_same_leaf_path_is_uplink_then_downlink() -> None:
    topo = Topology.fat_tree(64, 32, 4)
    assert topo.path("n00001/nic0", "n00031/nic0") == ("n00001/nic0>r0-leaf0", "r0-leaf0>n00031/nic0")


def test_cross_leaf_path_goes_through_the_hashed_spine() -> None:
    topo = Topology.fat_tree(64, 32, 4)
    src, dst = "n00001/nic0", "n00040/nic0"
    spines = sorted(f"r0-spine{j}" for j in range(4))
    spine = spines[zlib.crc32(f"{src}>{dst}".encode()) % 4]
    assert topo.path(src, dst) == (
        f"{src}>r0-leaf0",
        f"r0-leaf0>{spine}",
        f"{spine}>r0-leaf1",
        f"r0-leaf1>{dst}",
    )


def test_ecmp_spreads_pairs_over_every_spine() -> None:
    topo = Topology.fat_tree(64, 32, 8)
    paths = [topo.path(f"n{i:05d}/nic0", f"n{32 + j:05d}/nic0") for i in range(32) for j in range(32)]
    used = {path[1] for path in paths if path is not None}
    assert used == {f"r0-leaf0>r0-spine{j}" for j in range(8)}


def test_paths_do_not_depend_on_the_process_hash_seed() -> None:
    code = (
        "from clockworkd.lens.topology import Topology\n"
        "t = Topology.fat_tree(256, 16, 8)\n"
        "print([t.path(a, b) for a in t.nics()[:40] for b in t.nics()[100:140]])\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1 and "spine" in outputs.pop()


def test_inter_switch_links_have_one_cable_name_with_the_spine_as_upper_end() -> None:
    topo = Topology.fat_tree(64, 32, 4)
    up, down = topo.physical("r0-leaf1>r0-spine2"), topo.physical("r0-spine2>r0-leaf1")
    assert up.name == down.name == "r0-leaf1 <-> r0-spine2"
    assert (up.switch, up.port, up.nic, up.direction) == ("r0-spine2", "r0-leaf1", None, model.INTER_SWITCH)
    assert up.reverse == "r0-spine2>r0-leaf1"


def test_rails_of_a_fat_tree_are_separate() -> None:
    topo = Topology.fat_tree(64, 32, 4, rails=2)
    assert topo.path("n00001/nic0", "n00040/nic1") is None
    assert all(peer.endswith("/nic1") for peer in topo.same_rail_peers("n00001/nic1"))


def test_unlinked_leafs_are_unreachable() -> None:
    topo = Topology.fat_tree(64, 32, 0)
    assert topo.path("n00001/nic0", "n00040/nic0") is None
    assert "n00040/nic0" not in topo.same_rail_peers("n00001/nic0")


# ----- topology files -------------------------------------------------------------------------------

DOC = {
    "nics": {
        "node1/nic1": {"switch": "leaf0", "port": "Ethernet1"},
        "node2/nic1": {"switch": "leaf0", "port": "Ethernet2"},
        "node3/nic1": {"switch": "leaf1", "port": "Ethernet12"},
        "node4/nic1": {"switch": "leaf1"},
    },
    "links": [["leaf0", "spine0"], {"ends": ["leaf1", "spine0"], "ports": {"spine0": "Ethernet49"}}],
}


def test_file_names_switches_ports_and_links_and_the_rest_is_inferred(tmp_path: Path) -> None:
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(DOC))
    topo = Topology.load(path, sandbox_fabric())
    assert topo.attachment("node3/nic1") == Attachment("leaf1", "Ethernet12")
    assert topo.attachment("node4/nic1") == Attachment("leaf1", "node4/nic1")  # port defaults to the NIC
    assert topo.attachment("node4/nic0") == Attachment("rail:nic0", "node4/nic0")  # not in the file: inferred
    assert topo.path("node1/nic1", "node3/nic1") == (
        "node1/nic1>leaf0",
        "leaf0>spine0",
        "spine0>leaf1",
        "leaf1>node3/nic1",
    )
    assert topo.physical("spine0>leaf1").port == "Ethernet49"
    assert topo.physical("spine0>leaf0").port == "leaf0"
    assert topo.physical("node3/nic1>leaf1").port == "Ethernet12"


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "topology.toml"
    path.write_text(
        'links = [["leaf0", "spine0"], ["leaf1", "spine0"]]\n'
        '[nics."node1/nic1"]\nswitch = "leaf0"\nport = "Ethernet1"\n'
        '[nics."node3/nic1"]\nswitch = "leaf1"\n'
    )
    topo = Topology.load(path, sandbox_fabric())
    assert topo.attachment("node1/nic1") == Attachment("leaf0", "Ethernet1")
    assert topo.path("node1/nic1", "node3/nic1") == (
        "node1/nic1>leaf0",
        "leaf0>spine0",
        "spine0>leaf1",
        "leaf1>node3/nic1",
    )
    assert topo.path("node1/nic1", "node2/nic1") is None  # node2/nic1 stayed on the inferred rail switch


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"nics": {}, "spines": []}, "'spines'"),
        ({"nics": {"node1/nic1": {"swtich": "leaf0"}}}, "'swtich'"),
        ({"nics": {"node1/nic1": "leaf0"}}, "nics.'node1/nic1'"),
        ({"nics": {"node9/nic1": {"switch": "leaf0"}}}, "nics.'node9/nic1'"),
        ({"nics": {"node1-nic1": {"switch": "leaf0"}}}, "nics.'node1-nic1'"),
        ({"nics": {"node1/nic1": {"switch": "leaf>0"}}}, "'leaf>0'"),
        ({"nics": {"node1/nic1": {"switch": "leaf0", "port": 7}}}, "port"),
        ({"nics": []}, "'nics'"),
        ({"links": [["leaf0"]]}, "links[0]"),
        ({"links": [["leaf0", "spine0"], ["spine0", "leaf0"]]}, "links[1]"),
        ({"links": [["leaf0", "leaf0"]]}, "links[0]"),
        ({"links": [{"ends": ["leaf0", "spine0"], "port": {}}]}, "'port'"),
        ({"links": [{"ends": ["leaf0", "spine0"], "ports": {"spine9": "Eth1"}}]}, "'spine9'"),
        ({"links": "leaf0-spine0"}, "'links'"),
        (["leaf0"], "expected"),
    ],
)
def test_bad_documents_name_the_file_and_the_offending_key(tmp_path: Path, doc: object, needle: str) -> None:
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TopologyError) as info:
        Topology.load(path, sandbox_fabric())
    assert str(path) in str(info.value)
    assert needle in str(info.value)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="no topology file"):
        Topology.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nics:")
    with pytest.raises(TopologyError, match=r"bad\.json: not valid JSON"):
        Topology.load(tmp_path / "bad.json")
    (tmp_path / "bad.toml").write_text("nics = [")
    with pytest.raises(TopologyError, match=r"bad\.toml: not valid TOML"):
        Topology.load(tmp_path / "bad.toml")


def test_without_a_fabric_only_the_file_nics_exist() -> None:
    topo = Topology.from_doc(DOC, None, "doc")
    assert topo.nics() == ("node1/nic1", "node2/nic1", "node3/nic1", "node4/nic1")
    assert len(topo.links()) == 2 * 4 + 2 * 2
