"""Fleet Lens's probe budget: how many peers each NIC probes, and how often, so a node sends at most
``probe_budget_per_s`` probes a second while every link of the fabric stays covered.

Why both knobs: the plan (:mod:`clockworkd.lens.peers`) works in levels, as Pingmesh does: a few peers on the
NIC's own leaf (its switch's ports and uplink), the rest spread over the other leafs (the spine links), then a
repair that makes every directed link lie on two probed paths that differ elsewhere. Fewer peers per NIC cost
fewer probes but, below some number that depends on the topology (two at least), some link is on no probed
path, or on one only, and can no longer be singled out. So the budget first lowers the peers per NIC to what it
affords, raises it again one at a time until the plan covers every link (checked with
:func:`clockworkd.lens.peers.coverage`), and only then lengthens the probe interval: the coverage stays whole;
the links are probed less often and a verdict needs proportionally more time.

Every node computes the same schedule from the same topology (the plan is deterministic), and the interval is
the same on all of them: the busiest node's probes set it, so no node exceeds the budget and every receiver
expects the interval its senders use. One probe is one packet (a coded pair is two); it carries the echo of the
reverse path, so echoes cost nothing extra. Trains (``train_interval_ms``) and summaries are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from clockwork.contracts.lens_model import split_nic
from clockworkd.lens import peers
from clockworkd.lens.topology import Topology

__all__ = ["MIN_PEERS", "Schedule", "schedule"]

#: A link can be singled out only on two probed paths that differ elsewhere: two peers per NIC at least.
MIN_PEERS = 2


@dataclass(frozen=True)
class Schedule:
    """The probe plan and pace every node uses."""

    plan: peers.Plan
    peers_per_nic: int  # the k the plan was built with
    interval_ms: float
    probes_per_s: float  # of the busiest node (every node sends at most this)
    budget_per_s: float  # 0: none

    def to_dict(self) -> dict[str, float | int]:
        return {
            "peers_per_nic": self.peers_per_nic,
            "interval_ms": round(self.interval_ms, 3),
            "probes_per_s": round(self.probes_per_s, 1),
            "budget_per_s": self.budget_per_s,
        }


def busiest(plan: peers.Plan, pair_every: int = 0) -> float:
    """The most probes one node sends per interval under ``plan``: one per peer, and where ``pair_every`` > 0 the
    second probe of each probing NIC's coded pair every ``pair_every`` intervals."""
    per_node: dict[str, float] = {}
    for nic, chosen in plan.items():
        node = split_nic(nic)[0]
        pairs = 1 / pair_every if pair_every > 0 and chosen else 0.0
        per_node[node] = per_node.get(node, 0.0) + len(chosen) + pairs
    return max(per_node.values(), default=0.0)


def schedule(
    topology: Topology, peers_per_nic: int, interval_ms: float, budget_per_s: float, pair_every: int = 1
) -> Schedule:
    """The plan and interval for ``budget_per_s`` probes a second per node (0: no budget, the configured ones)."""
    if budget_per_s <= 0:
        plan = peers.plan(topology, peers_per_nic)
        return Schedule(plan, peers_per_nic, interval_ms, busiest(plan, pair_every) * 1000 / interval_ms, 0)
    nics = max((len([n for n in topology.nics() if split_nic(n)[0] == node]) for node in _nodes(topology)), default=1)
    affordable = int((budget_per_s * interval_ms / 1000 - nics / max(pair_every, 1)) / max(nics, 1))
    k = max(MIN_PEERS, min(peers_per_nic, affordable))
    plan = peers.plan(topology, k)
    # Fewer peers may leave a spine link on no probed path (or on one only): add peers until none is, up to the
    # configured number (coverage the unbudgeted plan lacks, no budget can give).
    while k < peers_per_nic and not peers.coverage(topology, plan)["ok"]:
        k += 1
        plan = peers.plan(topology, k)
    per_interval = busiest(plan, pair_every)
    # A repair may give a NIC k + 1 peers, and MIN_PEERS may be over the budget: then the interval gives way.
    interval = max(interval_ms, per_interval * 1000 / budget_per_s)
    return Schedule(plan, k, interval, per_interval * 1000 / interval, budget_per_s)


def _nodes(topology: Topology) -> set[str]:
    return {split_nic(nic)[0] for nic in topology.nics()}
