"""Failure domains: where a node's rack comes from, the peer-copy ring that keeps a shard's copies out of its rack,
the ring every member of a generation agrees on, and the spares a recovery prefers.

The ring's guarantee is a property, checked over drawn layouts (hypothesis): with at least r + 1 domains and no
domain holding more than n / (r + 1) of the n slots, no slot's r ring successors (the ranks keeping its
``peer_copies = r`` copies) share its domain. The agreement runs over a real c10d store (``HashStore``), as the
generation's rendezvous store is one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from torchpass.failure_domains import (
    DomainError,
    Place,
    node_domains,
    parse_site_map,
    parse_topology_conf,
    rank_domain,
    ring_order,
    ring_successors,
    spares_outside,
    topology_addr_domain,
)
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.sharded import peer_ring
from torchpass.sharded.peer_copy import ring_holders


def _places(domains: list[str]) -> list[Place]:
    return [Place(f"node{i}", d) for i, d in enumerate(domains)]


# ----- the ring ----------------------------------------------------------------------------------------


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[str], int]:
    """Domains of n slots (shuffled) and r, with at least r + 1 domains, none over n / (r + 1) slots."""
    copies = draw(st.integers(1, 2))
    domains = draw(st.integers(copies + 1, 6))
    n = draw(st.integers(domains, 24))
    cap = n // (copies + 1)
    if cap < 1:
        cap = 1
    sizes = [1] * domains
    for _ in range(n - domains):
        room = [i for i, size in enumerate(sizes) if size < cap]
        if not room:
            break
        sizes[draw(st.sampled_from(room))] += 1
    names = [f"rack{i}" for i, size in enumerate(sizes) for _ in range(size)]
    return draw(st.permutations(names)), copies


@settings(max_examples=400, deadline=None)
@given(_layouts())
def test_no_shard_shares_its_domain_with_a_copy(layout: tuple[list[str], int]) -> None:
    domains, copies = layout
    if max(domains.count(d) for d in set(domains)) > len(domains) // (copies + 1):
        return  # the drawing could not spread the slots that thin: no ring can keep every copy out
    order = ring_order(_places(domains))
    assert sorted(order) == list(range(len(domains)))
    for shard in range(len(domains)):
        for holder in ring_successors(order, shard, copies):
            assert domains[holder] != domains[shard], (domains, order, shard, holder)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 8), st.integers(1, 8))
def test_ranks_of_one_node_keep_each_others_copies_never(nodes: int, per_node: int) -> None:
    """No topology (every domain unknown): the node is the domain, so G ranks of a node are spread over the ring
    and a node crash never takes a shard with its only copy."""
    places = [Place(f"n{k}") for k in range(nodes) for _ in range(per_node)]
    order = ring_order(places)
    for shard in range(len(places)):
        (holder,) = ring_successors(order, shard, 1)
        assert places[holder].node != places[shard].node


def test_without_domains_the_ring_is_the_slot_order() -> None:
    assert ring_order([Place("w")] * 5) == (0, 1, 2, 3, 4)  # local mode: one machine
    assert ring_order([Place(f"node{i}") for i in (7, 3, 9, 1)]) == (0, 1, 2, 3)  # a node each: as before
    assert ring_order([Place("")] * 3) == (0, 1, 2)  # failure_domains = "off"
    assert ring_holders(3, 4, 1) == [0] and ring_holders(1, 4, 2) == [2, 3]  # no order: the shard order


def test_two_racks_in_hostlist_order_are_interleaved() -> None:
    """node2, node3 in rack A and node4, node5 in rack B (hostlist order): slot s's successor in the slot order
    is in its own rack for s = 0 and 2; the ring alternates the racks."""
    order = ring_order(_places(["A", "A", "B", "B"]))
    assert order == (0, 2, 1, 3)
    assert [ring_successors(order, s, 1) for s in range(4)] == [[2], [3], [1], [0]]


def test_the_sandbox_layout() -> None:
    """What the sandbox test runs: slots on node2 (rack0), node3, node4 (rack1), node5 (rack0)."""
    places = [Place("node2", "rack0"), Place("node3", "rack1"), Place("node4", "rack1"), Place("node5", "rack0")]
    order = ring_order(places)
    assert order == (0, 1, 3, 2)
    assert peer_ring.separated(order, places, 1)
    assert not peer_ring.separated((0, 1, 2, 3), places, 1)  # slot 1's copy in slot 2, both in rack1


def test_racks_of_nodes_of_several_ranks() -> None:
    """2 racks x 2 nodes x 2 ranks: every copy in the other rack, hence on another node."""
    places = [Place(f"n{k}", f"r{k // 2}") for k in range(4) for _ in range(2)]
    order = ring_order(places)
    assert peer_ring.separated(order, places, 1)


# ----- where domains come from -------------------------------------------------------------------------

TOPOLOGY = """
# a fat tree
SwitchName=leaf0 Nodes=node[1-2,5-6] LinkSpeed=100
switchname=leaf1 nodes=node[3-4]
SwitchName=spine Switches=leaf[0-1]
"""


def test_topology_conf_tree_and_block() -> None:
    assert parse_topology_conf(TOPOLOGY) == {
        "node1": "leaf0",
        "node2": "leaf0",
        "node5": "leaf0",
        "node6": "leaf0",
        "node3": "leaf1",
        "node4": "leaf1",
    }
    assert parse_topology_conf("BlockName=b1 Nodes=gpu[01-02]\nBlockSizes=2") == {"gpu01": "b1", "gpu02": "b1"}
    with pytest.raises(DomainError, match=r"topology.conf:1"):
        parse_topology_conf("SwitchName=x Nodes=node[1-")


def test_topology_addr() -> None:
    assert topology_addr_domain("top.rack1.node3", "switch.switch.node") == "rack1"
    assert topology_addr_domain("rack1.node3") == "rack1"
    assert topology_addr_domain("node3", "node") == ""


def test_site_map() -> None:
    text = "# node -> rack\nnode[01-02] rack-a\nnode03 = rack-b\n\n"
    assert parse_site_map(text) == {"node01": "rack-a", "node02": "rack-a", "node03": "rack-b"}
    with pytest.raises(DomainError, match=r"map:2: expected 'HOSTLIST DOMAIN'"):
        parse_site_map("node1 a\nnode2\n", "map")


def test_a_ranks_domain(tmp_path: Path) -> None:
    (tmp_path / "topology.conf").write_text(TOPOLOGY)
    slurm = {"SLURM_CONF": str(tmp_path / "slurm.conf"), "SLURMD_NODENAME": "node3"}
    assert rank_domain("auto", slurm) == Place("node3", "leaf1")  # topology.conf beside slurm.conf
    addr = dict(slurm, SLURM_TOPOLOGY_ADDR="spine.leaf9.node3", SLURM_TOPOLOGY_ADDR_PATTERN="switch.switch.node")
    assert rank_domain("auto", addr) == Place("node3", "leaf9")  # the task's own address first
    assert rank_domain("nodes", addr) == Place("node3")
    assert rank_domain("off", addr) == Place("")
    site = tmp_path / "racks.map"
    site.write_text("node[1-4] row7\n")
    assert rank_domain(str(site), addr) == Place("node3", "row7")
    assert node_domains("auto", {"SLURM_CONF": str(tmp_path / "none" / "slurm.conf")}) == {}
    with pytest.raises(DomainError, match="cannot read"):
        node_domains(str(tmp_path / "missing.map"), {})


# ----- the agreement through the store -----------------------------------------------------------------


def test_the_first_generation_computes_the_ring_and_newcomers_take_it() -> None:
    places = ["node2 rack0", "node3 rack1", "node4 rack1", "node5 rack0"]
    store = dist.HashStore()
    for slot, where in enumerate(places):  # every member's listener and place (peer_ring.exchange)
        store.set(f"peercopy/{slot}", f"10.0.0.{slot} {7000 + slot} {where}")
    listeners, read = peer_ring.exchange(store, 0, 4, ("10.0.0.0", 7000), Place("node2", "rack0"))
    assert listeners[3] == ("10.0.0.3", 7003) and read[1] == Place("node3", "rack1")
    rings, fresh = peer_ring.decide(store, [], read, 1, 4)
    assert rings == [(0, 1, 3, 2)] and fresh

    # A later generation: the survivors publish the ring; a newcomer on a node of another rack takes it.
    later = dist.HashStore()
    peer_ring.publish(later, rings)
    moved = {**read, 1: Place("node6", "rack0")}
    assert peer_ring.decide(later, [], moved, 1, 4) == ([(0, 1, 3, 2)], False)
    assert peer_ring.decide(later, rings, moved, 1, 4) == (rings, False)


def test_the_lost_shard_message_names_the_ring_holders() -> None:
    layout = ShardedReplicas(1, 4, peer_copies=1)
    assert layout.copy_holders(1) == [2]
    layout.rings[:] = [(0, 1, 3, 2)]
    assert layout.copy_holders(1) == [3]


# ----- spares ------------------------------------------------------------------------------------------


def test_spares_outside_the_lost_domains() -> None:
    domains = {0: "rack1", 4: "rack1", 5: "rack0", 6: "rack2"}
    spares = ["a4.0", "a5.0", "a6.0", "a7.0"]  # agent 7's domain is unknown: never suspect
    assert spares_outside(spares, 1, domains, {0}) == ["a5.0", "a6.0", "a7.0"]
    assert spares_outside(spares, 3, domains, {0}) == ["a5.0", "a6.0", "a7.0"]
    assert spares_outside(spares, 4, domains, {0}) == spares  # too few outside: every spare, as before
    assert spares_outside(spares, 1, domains, set()) == spares
    assert spares_outside(spares, 1, {}, {0}) == spares  # no domains known (local mode, no topology)
