"""Fleet Lens probe plan: all peers on small rails, K spread peers on large ones, links singled out."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter

import pytest

from clockworkd.lens import peers
from clockworkd.lens.topology import Topology
from tests.unit.test_lens_topology import sandbox_fabric


def _pairs(plan: dict[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    return [(src, dst) for src in plan for dst in plan[src]]


def test_small_cluster_probes_every_same_rail_peer() -> None:
    topo = Topology.from_fabric(sandbox_fabric())
    plan = peers.plan(topo, k=16)
    assert plan["node3/nic1"] == ("node1/nic1", "node2/nic1", "node4/nic1")
    assert plan["node1/nic0"] == ("node2/nic0", "node3/nic0", "node4/nic0")
    assert len(_pairs(plan)) == 2 * 4 * 3


def test_a_rail_of_exactly_k_plus_one_still_probes_everyone() -> None:
    topo = Topology.fat_tree(17, 4, 2)
    plan = peers.plan(topo, k=16)
    assert all(len(p) == 16 for p in plan.values())


def test_large_rail_gets_k_distinct_same_rail_peers() -> None:
    topo = Topology.fat_tree(256, 16, 4, rails=2)
    plan = peers.plan(topo, k=16)
    assert set(plan) == set(topo.nics())
    for nic, chosen in plan.items():
        assert len(chosen) == len(set(chosen)) == 16
        assert nic not in chosen
        assert set(chosen) <= set(topo.same_rail_peers(nic))


def test_large_rail_mixes_same_leaf_and_cross_leaf_peers() -> None:
    topo = Topology.fat_tree(256, 16, 4)
    plan = peers.plan(topo, k=16)
    for nic, chosen in plan.items():
        leafs = Counter(topo.switch_of(peer) for peer in chosen)
        assert leafs[topo.switch_of(nic)] >= 1
        assert len(leafs) >= 8  # spread over the other leafs, not piled on one


@pytest.mark.parametrize(
    "shape",
    [(256, 16, 4, 1), (1024, 32, 16, 1), (200, 3, 8, 1), (300, 32, 2, 1), (2000, 64, 32, 2), (100, 100, 0, 1)],
)
def test_every_link_lies_on_two_probed_paths_that_differ_elsewhere(shape: tuple[int, int, int, int]) -> None:
    topo = Topology.fat_tree(*shape)
    plan = peers.plan(topo, k=16)
    report = peers.coverage(topo, plan)
    assert report["weak"] == [] and report["unprobed"] == [] and report["ok"]
    assert report["min_paths"] >= 2
    assert report["links"] == len(topo.links())
    assert report["paths"] == len(_pairs(plan))


def test_uniform_fat_tree_is_probed_evenly() -> None:
    topo = Topology.fat_tree(1024, 32, 16)
    inverse = peers.probed_by(peers.plan(topo, k=16))
    assert Counter(len(srcs) for srcs in inverse.values()) == {16: 1024}


def test_coverage_reports_links_the_plan_cannot_single_out() -> None:
    topo = Topology.from_fabric(sandbox_fabric())
    thin = {nic: () for nic in topo.nics()} | {"node1/nic0": ("node2/nic0",), "node3/nic0": ("node2/nic0",)}
    report = peers.coverage(topo, thin)
    # node1/nic0's uplink is on one path only; node2/nic0's downlink on two that share nothing else.
    assert "node1/nic0>rail:nic0" in report["weak"]
    assert "rail:nic0>node2/nic0" not in report["weak"]
    assert "node4/nic0>rail:nic0" in report["unprobed"]
    assert report["min_paths"] == 0 and not report["ok"]


def test_coverage_sees_a_shared_link_as_weak_even_with_two_paths() -> None:
    topo = Topology.fat_tree(64, 32, 2)
    dst = "n00040/nic0"
    by_spine: dict[str, list[str]] = {}
    for i in range(32):
        path = topo.path(f"n{i:05d}/nic0", dst)
        assert path is not None
        by_spine.setdefault(path[2], []).append(f"n{i:05d}/nic0")
    spine_link, (a, b, *_) = next((link, srcs) for link, srcs in sorted(by_spine.items()) if len(srcs) >= 2)
    plan = {nic: () for nic in topo.nics()} | {a: (dst,), b: (dst,)}
    report = peers.coverage(topo, plan)
    # Both probes into n00040 come down the same spine: its downlink cannot be told from that spine link.
    assert f"r0-leaf1>{dst}" in report["weak"]
    assert spine_link in report["weak"]
    assert f"r0-leaf1>{dst}" not in report["unprobed"]


def test_plan_is_deterministic_and_seeded() -> None:
    topo = Topology.fat_tree(512, 32, 8)
    first = peers.plan(topo, k=16)
    assert peers.plan(Topology.fat_tree(512, 32, 8), k=16) == first
    assert peers.plan(topo, k=16, seed=1) != first
    assert peers.coverage(topo, peers.plan(topo, k=16, seed=1))["ok"]


def test_plan_does_not_depend_on_the_process_hash_seed() -> None:
    code = (
        "import hashlib\n"
        "from clockworkd.lens import peers\n"
        "from clockworkd.lens.topology import Topology\n"
        "print(hashlib.sha256(repr(peers.plan(Topology.fat_tree(200, 3, 8), k=16)).encode()).hexdigest())\n"
    )
    env = dict(os.environ)
    digests = set()
    for seed in ("1", "2", "3"):
        env["PYTHONHASHSEED"] = seed
        digests.add(
            subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
        )
    here = hashlib.sha256(repr(peers.plan(Topology.fat_tree(200, 3, 8), k=16)).encode()).hexdigest()
    assert digests == {here + "\n"}


def test_probed_by_inverts_the_plan() -> None:
    topo = Topology.fat_tree(256, 16, 4)
    plan = peers.plan(topo, k=16)
    inverse = peers.probed_by(plan)
    assert sorted((src, dst) for dst, srcs in inverse.items() for src in srcs) == sorted(_pairs(plan))
    assert all(srcs == tuple(sorted(srcs)) for srcs in inverse.values())


def test_k_must_be_positive() -> None:
    with pytest.raises(ValueError, match="k must be"):
        peers.plan(Topology.fat_tree(8, 4, 1), k=0)
