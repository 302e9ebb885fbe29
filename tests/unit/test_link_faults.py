"""The health check's drain rule for fabric links (slurm_hooks.link_faults): a fault that Fleet Lens shows on the
links of several nodes of one switch is that switch's and drains none of them; a node's own link fault drains it;
a NIC down that Lens watches but has not judged yet waits, for a bounded time (its downtime recorded from one run of
the check to the next); without Lens's evidence each node is judged alone.

The Lens snapshots are shaped as the daemon's ``lens`` reply is (every raised suspect of the fabric with its
switch, the paths this node receives), and the NIC faults are read by the health check's own reader from a
fake /sys/class/net."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slurm_hooks.healthcheck import lens_faults, nic_faults, nics_down_for
from slurm_hooks.link_faults import LinkFault, judge_links

DOWN = LinkFault("ib1", "ib1 down (down, carrier 0)")


def _suspect(node: str, nic: str, switch: str, kinds: tuple[str, ...] = ("dead",)) -> dict[str, Any]:
    return {
        "link": f"{node}/{nic} <-> {switch}",
        "links": [],
        "switch": switch,
        "port": f"p-{node}",
        "nic": f"{node}/{nic}",
        "direction": "both",
        "kinds": list(kinds),
        "confidence": 0.9,
        "evidence": {},
        "since": 0.0,
    }


def _lens(*suspects: dict[str, Any], watched: tuple[str, ...] = ("node2/ib0", "node2/ib1")) -> dict[str, Any]:
    paths = [{"src": f"node9/{nic.split('/')[1]}", "dst": nic, "received": 0} for nic in watched]
    paths.append({"src": "node9/ib0", "dst": "node2/ib0", "received": 90})  # Lens hears other nodes
    return {"node": "node2", "enabled": True, "suspects": list(suspects), "paths": paths}


def test_a_leaf_switch_that_takes_four_nodes_links_down_drains_none_of_them() -> None:
    lens = _lens(*(_suspect(f"node{i}", "ib1", "leaf-ib1-a") for i in (1, 2, 3, 4)))
    for node in ("node1", "node2", "node3", "node4"):
        judged = judge_links(node, [DOWN], lens, switch_fault_nodes=2)
        assert judged.drain == [] and judged.deferred == {}
        (line,) = judged.switch_faults
        assert "switch leaf-ib1-a fault, 4 nodes' links on it fail together (node1, node2, node3, node4)" in line


def test_one_nodes_own_link_drains_it() -> None:
    lens = _lens(_suspect("node2", "ib1", "leaf-ib1-a"), _suspect("node7", "ib0", "leaf-ib0-b"))
    judged = judge_links("node2", [DOWN], lens, switch_fault_nodes=2)
    assert judged.drain == ["ib1 down (down, carrier 0)"] and not judged.switch_faults


def test_two_ends_of_the_only_bad_paths_are_not_a_switch_fault() -> None:
    """With two daemons up and node2's NIC dead, the only bad paths run between node1 and node2: Lens names both
    ends at a quarter's confidence (seen on the sandbox). That is one fault with two candidate ends, not two
    nodes' links failing together: node2, whose kernel reads its NIC down, is drained."""
    both = _lens(*(_suspect(n, "ib1", "rail1") | {"confidence": 0.25} for n in ("node1", "node2")))
    judged = judge_links("node2", [DOWN], both, switch_fault_nodes=2)
    assert judged.drain == [DOWN.text] and not judged.switch_faults and not judged.deferred
    sure = _lens(*(_suspect(n, "ib1", "rail1") | {"confidence": 0.5} for n in ("node1", "node2")))
    assert judge_links("node2", [DOWN], sure, switch_fault_nodes=2).switch_faults


def test_two_nodes_on_different_switches_are_two_node_faults() -> None:
    lens = _lens(_suspect("node2", "ib1", "leaf-ib1-a"), _suspect("node5", "ib1", "leaf-ib1-b"))
    assert judge_links("node2", [DOWN], lens, switch_fault_nodes=2).drain == [DOWN.text]


def test_the_threshold_is_the_admins() -> None:
    lens = _lens(*(_suspect(f"node{i}", "ib1", "leaf-ib1-a") for i in (2, 3)))
    assert judge_links("node2", [DOWN], lens, switch_fault_nodes=3).drain == [DOWN.text]
    assert judge_links("node2", [DOWN], lens, switch_fault_nodes=2).drain == []
    assert judge_links("node2", [DOWN], lens, switch_fault_nodes=0).drain == [DOWN.text]  # 0: each node alone


def test_a_nic_down_that_lens_has_not_judged_yet_waits_for_its_verdict() -> None:
    judged = judge_links("node2", [DOWN], _lens(), switch_fault_nodes=2)
    assert judged.drain == [] and judged.switch_faults == []
    assert judged.deferred == {"ib1": "ib1 down (down, carrier 0): waiting for Fleet Lens's verdict on node2/ib1"}


def test_the_wait_for_lens_is_bounded_and_a_verdict_still_wins_after_it() -> None:
    """Lens may not judge a NIC it watches (its probes lost, its daemon stalled): once the NIC has been down for the
    wait, the node is drained; a switch verdict still spares it, however long the NIC is down."""
    unjudged = _lens()
    for waited, deferred in ((0.0, True), (59.9, True), (60.0, False), (3600.0, False)):
        judged = judge_links("node2", [DOWN], unjudged, 2, {"ib1": waited}, verdict_wait_s=60.0)
        assert bool(judged.deferred) == deferred, waited
        assert judged.drain == ([] if deferred else ["ib1 down (down, carrier 0), no Fleet Lens verdict within 60 s"])
    assert judge_links("node2", [DOWN], unjudged, 2, {"ib0": 3600.0}, verdict_wait_s=60.0).deferred  # another NIC's
    assert judge_links("node2", [DOWN], unjudged, 2, {}, verdict_wait_s=0.0).drain == [  # 0: never wait
        "ib1 down (down, carrier 0), no Fleet Lens verdict within 0 s"
    ]
    switch = _lens(*(_suspect(f"node{i}", "ib1", "leaf-ib1-a") for i in (2, 3)))
    judged = judge_links("node2", [DOWN], switch, 2, {"ib1": 3600.0}, verdict_wait_s=60.0)
    assert judged.drain == [] and len(judged.switch_faults) == 1


def _deaf() -> dict[str, Any]:
    """A Lens that hears no other node (their daemons not running): no evidence."""
    lens = _lens()
    lens["paths"] = [p for p in lens["paths"] if not p["received"]]
    return lens


@pytest.mark.parametrize(
    "lens",
    [None, _lens(watched=("node2/ib0",)), _deaf()],
    ids=["no-lens", "nic-not-probed", "lens-hears-nobody"],
)
def test_without_lens_evidence_each_node_is_judged_alone(lens: dict[str, Any] | None) -> None:
    assert judge_links("node2", [DOWN], lens, switch_fault_nodes=2).drain == [DOWN.text]


def test_lens_suspects_of_the_nodes_own_link_follow_the_same_rule(tmp_path: Path) -> None:
    """With drain_suspect_nodes, a suspect on the node's own link is a fault too: drained when it is the node's,
    not when the switch's; a NIC the kernel reads as down is judged from /sys."""
    for name, state, carrier in (("ib0", "up", "1"), ("ib1", "down", "0")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "operstate").write_text(f"{state}\n")
        (tmp_path / name / "carrier").write_text(f"{carrier}\n")
    assert nic_faults(["ib0", "ib1", "ib2"], tmp_path) == [DOWN, LinkFault("ib2", "ib2 missing")]
    alone = _lens(_suspect("node2", "ib0", "leaf-ib0-a", ("loss",)))
    (fault,) = lens_faults(alone, "node2")
    assert fault == LinkFault("ib0", "lens suspects node2/ib0 link (loss, both)", from_lens=True)
    assert judge_links("node2", [fault], alone, 2).drain == [fault.text]
    shared = _lens(*(_suspect(f"node{i}", "ib0", "leaf-ib0-a", ("loss",)) for i in (1, 2, 3)))
    (fault,) = lens_faults(shared, "node2")
    assert judge_links("node2", [fault], shared, 2).drain == []
    assert lens_faults(None, "node2") == []


def test_a_nics_downtime_is_remembered_from_one_check_to_the_next(tmp_path: Path) -> None:
    """Each run of the health check is a new process: the first sighting of a NIC down is kept in a record, a NIC
    up again is forgotten (its next fault waits afresh), Lens's suspects are not downtime, and a damaged record
    only restarts the count."""
    record = tmp_path / "health" / "nics_down.json"
    ib0 = LinkFault("ib0", "ib0 down (down, carrier 0)")
    suspect = LinkFault("ib2", "lens suspects node2/ib2 link (loss, both)", from_lens=True)
    assert nics_down_for(record, [DOWN, suspect], now=1000.0) == {"ib1": 0.0}
    assert nics_down_for(record, [DOWN, ib0], now=1030.0) == {"ib1": 30.0, "ib0": 0.0}
    assert nics_down_for(record, [ib0], now=1100.0) == {"ib0": 70.0}  # ib1 came back
    assert nics_down_for(record, [DOWN, ib0], now=1110.0) == {"ib1": 0.0, "ib0": 80.0}
    assert json.loads(record.read_text()) == {"ib0": 1030.0, "ib1": 1110.0}
    record.write_text("{not json")
    assert nics_down_for(record, [DOWN], now=1200.0) == {"ib1": 0.0}
    assert nics_down_for(record, [DOWN], now=1260.0) == {"ib1": 60.0}
    assert nics_down_for(record, [], now=1300.0) == {} and json.loads(record.read_text()) == {}
