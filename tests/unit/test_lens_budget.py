"""Fleet Lens's probe budget: a node never sends more than probe_budget_per_s, and every link stays covered."""

from __future__ import annotations

import pytest

from clockworkd.lens import budget, peers
from clockworkd.lens.topology import Topology
from tests.unit.test_lens_topology import sandbox_fabric


def test_no_budget_keeps_the_configured_plan_and_interval() -> None:
    topo = Topology.fat_tree(64, 8, 4, rails=2)
    sched = budget.schedule(topo, 16, 10.0, 0)
    assert sched.plan == peers.plan(topo, 16) and sched.interval_ms == 10.0
    assert sched.probes_per_s == 2 * (16 + 1) * 100  # 16 peers and the coded pair's second probe per NIC


@pytest.mark.parametrize(
    ("nodes", "per_leaf", "spines", "rails", "budget_per_s"),
    [(64, 8, 4, 8, 4000.0), (64, 8, 4, 8, 500.0), (128, 16, 4, 2, 1000.0), (48, 8, 2, 4, 100.0)],
)
def test_a_budget_is_kept_and_every_link_still_covered(
    nodes: int, per_leaf: int, spines: int, rails: int, budget_per_s: float
) -> None:
    topo = Topology.fat_tree(nodes, per_leaf, spines, rails=rails)
    unbudgeted = budget.schedule(topo, 16, 10.0, 0)
    assert unbudgeted.probes_per_s > budget_per_s  # the budget binds
    sched = budget.schedule(topo, 16, 10.0, budget_per_s)
    assert budget.busiest(sched.plan, 1) * 1000 / sched.interval_ms <= budget_per_s * (1 + 1e-9)
    assert sched.peers_per_nic >= budget.MIN_PEERS and sched.interval_ms >= 10.0
    report = peers.coverage(topo, sched.plan)
    assert report["unprobed"] == [] and report["ok"], report["weak"][:5]


def test_a_budget_the_sandbox_never_reaches_changes_nothing() -> None:
    topo = Topology.from_fabric(sandbox_fabric())
    assert budget.schedule(topo, 16, 10.0, 4000.0).plan == peers.plan(topo, 16)
