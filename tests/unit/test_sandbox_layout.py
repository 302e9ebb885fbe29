"""The sandbox layout: every name and address, computed from the configuration alone (no root, no I/O)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from clockwork.contracts.config.core import SandboxConfig
from clockwork.contracts.errors import ConfigError
from clockwork.sandbox.layout import Layout, build_layout


@pytest.fixture
def layout() -> Layout:
    return build_layout(SandboxConfig(nodes=4, nics=2))


def test_node_names_and_addresses(layout: Layout) -> None:
    assert [n.name for n in layout.nodes] == ["node1", "node2", "node3", "node4"]
    for i, node in enumerate(layout.nodes, start=1):
        assert node.index == i
        assert node.node_addr == f"198.18.0.{i}"
        assert node.mgmt_ip == f"198.19.0.{i}"
        assert node.mgmt_prefixlen == 24
        assert node.mgmt_port == f"n{i}-mgmt"
    assert layout.ctl_ip == "198.19.0.254"
    assert layout.mgmt_prefixlen == 24


def test_rails_and_switch_ports(layout: Layout) -> None:
    assert layout.rails == 2
    for i, node in enumerate(layout.nodes, start=1):
        assert [nic.name for nic in node.nics] == ["nic0", "nic1"]
        for r, nic in enumerate(node.nics):
            assert nic.rail == r
            assert nic.ip == f"198.18.{r + 1}.{i}"
            assert nic.prefixlen == 24
            assert nic.cidr == f"198.18.{r + 1}.{i}/24"
            assert nic.port == f"n{i}-nic{r}"
            assert nic.bridge == f"rail{r}"


def test_every_address_is_unique(layout: Layout) -> None:
    addrs = [layout.ctl_ip]
    for node in layout.nodes:
        addrs += [node.node_addr, node.mgmt_ip, *(nic.ip for nic in node.nics)]
    assert len(addrs) == len(set(addrs))
    ports = [nic.port for node in layout.nodes for nic in node.nics] + [node.mgmt_port for node in layout.nodes]
    assert len(ports) == len(set(ports))


def test_port_numbers() -> None:
    layout = build_layout(SandboxConfig(port_base=20000))
    assert (layout.slurmctld_port, layout.slurmd_port, layout.slurmdbd_port, layout.mariadb_port) == (
        20000,
        20001,
        20002,
        20003,
    )
    default = build_layout(SandboxConfig())
    assert default.slurmctld_port == 16817
    assert default.mariadb_port == 16820


def test_lookups(layout: Layout) -> None:
    assert layout.node("node3").index == 3
    assert layout.node("node3").nic("nic1").ip == "198.18.2.3"


def test_unknown_node_lists_the_nodes(layout: Layout) -> None:
    with pytest.raises(ConfigError) as err:
        layout.node("node9")
    assert str(err.value) == "no sandbox node 'node9' (nodes: node1, node2, node3, node4)"


def test_unknown_nic_lists_the_nics(layout: Layout) -> None:
    with pytest.raises(ConfigError) as err:
        layout.node("node2").nic("nic2")
    assert str(err.value) == "node2 has no NIC 'nic2' (NICs: nic0, nic1)"


def test_three_nics_make_three_rails() -> None:
    layout = build_layout(SandboxConfig(nodes=2, nics=3))
    assert layout.rails == 3
    node = layout.node("node2")
    assert [(n.name, n.bridge, n.cidr) for n in node.nics] == [
        ("nic0", "rail0", "198.18.1.2/24"),
        ("nic1", "rail1", "198.18.2.2/24"),
        ("nic2", "rail2", "198.18.3.2/24"),
    ]


def test_custom_networks() -> None:
    cfg = replace(
        SandboxConfig(nodes=2),
        node_net="10.0.0.0/24",
        rail_net="10.{rail}0.0.0/16",
        mgmt_net="192.168.7.0/28",
    )
    layout = build_layout(cfg)
    assert layout.ctl_ip == "192.168.7.14"
    assert layout.mgmt_prefixlen == 28
    node = layout.node("node2")
    assert node.node_addr == "10.0.0.2"
    assert node.mgmt_ip == "192.168.7.2"
    assert [n.cidr for n in node.nics] == ["10.10.0.2/16", "10.20.0.2/16"]


def test_mgmt_net_too_small_names_the_key() -> None:
    # A /29 has hosts .1-.6: .6 is the controller, so 5 nodes fit and 6 do not.
    assert build_layout(SandboxConfig(nodes=5, mgmt_net="198.19.0.0/29")).ctl_ip == "198.19.0.6"
    with pytest.raises(ConfigError) as err:
        build_layout(SandboxConfig(nodes=6, mgmt_net="198.19.0.0/29"))
    assert str(err.value).startswith("[sandbox] mgmt_net: 198.19.0.0/29 has no room for 6 nodes")


def test_node_net_too_small_names_the_key() -> None:
    assert build_layout(SandboxConfig(nodes=6, node_net="198.18.0.0/29")).node("node6").node_addr == "198.18.0.6"
    with pytest.raises(ConfigError) as err:
        build_layout(SandboxConfig(nodes=7, node_net="198.18.0.0/29"))
    assert str(err.value) == "[sandbox] node_net: 198.18.0.0/29 has no room for host 7"


def test_rail_net_too_small_names_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        build_layout(SandboxConfig(nodes=3, rail_net="198.18.{rail}.0/30"))
    assert str(err.value) == "[sandbox] rail_net: 198.18.1.0/30 has no room for host 3"


def test_rail_net_without_rail_field() -> None:
    with pytest.raises(ConfigError) as err:
        build_layout(SandboxConfig(rail_net="198.18.1.0/24"))
    assert str(err.value) == "[sandbox] rail_net: invalid value '198.18.1.0/24' (expected a '{rail}' field)"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("node_net", "198.18.0.1/24"),  # host bits set
        ("mgmt_net", "not-a-network"),
        ("rail_net", "198.18.{rail}.0/33"),
    ],
)
def test_invalid_network_names_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_layout(replace(SandboxConfig(), **{key: value}))
    assert str(err.value).startswith(f"[sandbox] {key}: invalid value ")


def test_too_many_rails_for_the_rail_pattern() -> None:
    with pytest.raises(ConfigError, match=r"^\[sandbox\] rail_net: invalid value '198\.18\.256\.0/24'"):
        build_layout(SandboxConfig(nodes=1, nics=256))


def test_a_tag_keeps_namespaces_and_the_root_veth_apart_but_not_host_names() -> None:
    plain = build_layout(SandboxConfig(nodes=2))
    tagged = build_layout(SandboxConfig(nodes=2, tag="w3"))
    assert plain.namespaces == ["cw-fabric", "node1", "node2"]
    assert (plain.root_dev, plain.cgroup_name) == ("cwsb0", "clockwork-sandbox")
    assert tagged.namespaces == ["w3-cw-fabric", "w3-node1", "w3-node2"]
    assert (tagged.root_dev, tagged.cgroup_name) == ("cwsb-w3", "clockwork-sandbox-w3")
    assert [n.name for n in tagged.nodes] == ["node1", "node2"]  # host and Slurm node names stay plain
    assert [n.node_addr for n in tagged.nodes] == [n.node_addr for n in plain.nodes]


@pytest.mark.parametrize("tag", ["W1", "a-b", "toolongtag", "x y"])
def test_a_bad_tag_is_refused(tag: str) -> None:
    with pytest.raises(ConfigError, match=r"\[sandbox\] tag: invalid value"):
        build_layout(SandboxConfig(tag=tag))
