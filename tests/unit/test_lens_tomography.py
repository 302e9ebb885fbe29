"""Fleet Lens tomography: from bad and good path verdicts to the faulty links, noise and all."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from clockwork.contracts import lens_model as model
from clockwork.contracts.lens_model import PathVerdict
from clockworkd.lens import peers
from clockworkd.lens.tomography import Localizer, localize
from clockworkd.lens.topology import Topology
from tests.unit.test_lens_topology import sandbox_fabric


def judge(
    topology: Topology,
    plan: Mapping[str, Iterable[str]],
    faulty: Mapping[str, str],
    flip: Iterable[tuple[str, str]] = (),
) -> list[PathVerdict]:
    """A verdict for every planned path: bad (with the fault's kind) when it crosses a faulty link.

    ``flip`` lists pairs judged wrongly (noise): bad when healthy, good when faulty.
    """
    flipped = set(flip)
    out = []
    for src in sorted(plan):
        for dst in plan[src]:
            path = topology.path(src, dst) or ()
            kinds = tuple(sorted({faulty[link] for link in path if link in faulty}))
            bad = bool(kinds) != ((src, dst) in flipped)
            out.append(PathVerdict(src, dst, bad, kinds=(kinds or ("loss",)) if bad else ()))
    return out


def sandbox() -> tuple[Topology, dict[str, tuple[str, ...]]]:
    topo = Topology.from_fabric(sandbox_fabric())
    return topo, peers.plan(topo)


# ----- the sandbox: four nodes, two rails --------------------------------------------------------


def test_a_nic_bad_both_ways_is_one_suspect_in_both_directions() -> None:
    topo, plan = sandbox()
    faulty = {"node3/nic1>rail:nic1": "loss", "rail:nic1>node3/nic1": "loss"}
    suspects = localize(topo, judge(topo, plan, faulty))
    assert len(suspects) == 1
    suspect = suspects[0]
    assert suspect.direction == model.BOTH
    assert suspect.nic == "node3/nic1"
    assert suspect.link == suspect.key == "node3/nic1 <-> rail:nic1"
    assert suspect.links == ("node3/nic1>rail:nic1", "rail:nic1>node3/nic1")
    assert (suspect.switch, suspect.port) == ("rail:nic1", "node3/nic1")
    assert suspect.kinds == ("loss",)
    assert suspect.evidence["bad_paths"] == 6 and suspect.evidence["good_paths"] == 0
    assert suspect.evidence["examples"] == [
        "node1/nic1 -> node3/nic1",
        "node2/nic1 -> node3/nic1",
        "node3/nic1 -> node1/nic1",
        "node3/nic1 -> node2/nic1",
    ]
    assert 0.7 < suspect.confidence <= 1.0


def test_uplink_only_fault_is_an_uplink_suspect() -> None:
    topo, plan = sandbox()
    suspects = localize(topo, judge(topo, plan, {"node3/nic1>rail:nic1": "delay"}))
    assert [(s.nic, s.direction, s.links, s.kinds) for s in suspects] == [
        ("node3/nic1", model.UPLINK, ("node3/nic1>rail:nic1",), ("delay",))
    ]
    assert suspects[0].evidence["bad_paths"] == 3


def test_downlink_only_fault_is_a_downlink_suspect() -> None:
    topo, plan = sandbox()
    suspects = localize(topo, judge(topo, plan, {"rail:nic0>node2/nic0": "dead"}))
    assert [(s.nic, s.direction) for s in suspects] == [("node2/nic0", model.DOWNLINK)]


def test_a_dead_node_is_one_suspect_per_rail() -> None:
    topo, plan = sandbox()
    faulty = {link: "dead" for nic in ("node2/nic0", "node2/nic1") for link in (topo.uplink(nic), topo.downlink(nic))}
    suspects = localize(topo, judge(topo, plan, faulty))
    assert sorted((s.nic, s.direction, s.kinds) for s in suspects) == [
        ("node2/nic0", model.BOTH, ("dead",)),
        ("node2/nic1", model.BOTH, ("dead",)),
    ]


def test_healthy_fabric_or_no_verdicts_has_no_suspects() -> None:
    topo, plan = sandbox()
    assert localize(topo, judge(topo, plan, {})) == []
    assert localize(topo, []) == []


def test_one_misjudged_path_is_noise_not_a_suspect() -> None:
    topo, plan = sandbox()
    diagnosis = Localizer(topo, plan).diagnose(judge(topo, plan, {}, flip=[("node1/nic0", "node4/nic0")]))
    assert diagnosis.suspects == ()
    assert diagnosis.unexplained == (("node1/nic0", "node4/nic0"),)
    assert (diagnosis.bad_paths, diagnosis.good_paths) == (1, 23)


def test_kinds_are_the_union_of_the_bad_paths_kinds() -> None:
    topo, plan = sandbox()
    verdicts = judge(topo, plan, {"node3/nic1>rail:nic1": "loss"})
    verdicts = [
        PathVerdict(v.src, v.dst, True, kinds=("delay", "jitter")) if v.bad and v.dst == "node4/nic1" else v
        for v in verdicts
    ]
    assert localize(topo, verdicts)[0].kinds == ("delay", "jitter", "loss")


def test_paths_without_verdicts_are_unknown_not_good() -> None:
    topo, plan = sandbox()
    faulty = {"node3/nic1>rail:nic1": "loss"}
    bad_only = [v for v in judge(topo, plan, faulty) if v.bad]
    full = localize(topo, judge(topo, plan, faulty))
    sparse = localize(topo, bad_only)
    assert [s.links for s in sparse] == [s.links for s in full] == [("node3/nic1>rail:nic1",)]
    # Without good paths the other links on those paths are not exonerated: less certain.
    assert sparse[0].confidence < full[0].confidence
    assert sparse[0].evidence["good_paths"] == 0


def test_the_last_verdict_for_a_pair_wins() -> None:
    topo, plan = sandbox()
    verdicts = judge(topo, plan, {"node3/nic1>rail:nic1": "loss"})
    cleared = [PathVerdict(v.src, v.dst, False) for v in verdicts if v.bad]
    assert localize(topo, verdicts + cleared) == []


def test_two_nodes_alone_cannot_tell_which_end_and_say_so() -> None:
    topo = Topology.from_fabric(sandbox_fabric(2))
    verdicts = [PathVerdict("node1/nic0", "node2/nic0", True, kinds=("loss",))]
    suspects = localize(topo, [*verdicts, PathVerdict("node2/nic0", "node1/nic0", False)])
    assert len(suspects) == 1
    assert suspects[0].confidence <= 0.5


# ----- a fat tree ------------------------------------------------------------------------------------


def fat_tree() -> tuple[Topology, dict[str, tuple[str, ...]], Localizer]:
    topo = Topology.fat_tree(256, 16, 4)
    plan = peers.plan(topo, k=16)
    return topo, plan, Localizer(topo, plan)


def test_an_inter_switch_link_in_a_fat_tree() -> None:
    topo, plan, localizer = fat_tree()
    for link in ("r0-leaf2>r0-spine1", "r0-spine3>r0-leaf7"):
        suspects = localizer.localize(judge(topo, plan, {link: "loss"}))
        assert [(s.links, s.direction, s.nic) for s in suspects] == [((link,), model.INTER_SWITCH, None)]
        assert suspects[0].switch == topo.physical(link).switch and suspects[0].switch.startswith("r0-spine")
        assert suspects[0].evidence["bad_paths"] >= 2
        assert suspects[0].confidence > 0.9


def test_both_directions_of_a_switch_link_are_one_suspect() -> None:
    topo, plan, localizer = fat_tree()
    suspects = localizer.localize(judge(topo, plan, {"r0-leaf2>r0-spine1": "dead", "r0-spine1>r0-leaf2": "dead"}))
    assert [(s.link, s.links, s.direction) for s in suspects] == [
        ("r0-leaf2 <-> r0-spine1", ("r0-leaf2>r0-spine1", "r0-spine1>r0-leaf2"), model.INTER_SWITCH)
    ]


def test_two_faults_at_once_are_both_found() -> None:
    topo, plan, localizer = fat_tree()
    faulty = {"n00017/nic0>r0-leaf1": "loss", "r0-spine2>r0-leaf9": "delay"}
    suspects = localizer.localize(judge(topo, plan, faulty))
    assert sorted(link for s in suspects for link in s.links) == sorted(faulty)


def test_noise_does_not_move_or_add_suspects() -> None:
    topo, plan, localizer = fat_tree()
    rng = random.Random(7)
    pairs = [(src, dst) for src in sorted(plan) for dst in plan[src]]
    fault = "r0-leaf5>n00090/nic0"
    through = [p for p in pairs if fault in (topo.path(*p) or ())]
    noise = rng.sample([p for p in pairs if p not in through], 12)  # ~0.3 % of healthy paths look bad
    missed = through[:2]  # and two of the 16 bad ones look fine
    diagnosis = localizer.diagnose(judge(topo, plan, {fault: "loss"}, flip=noise + missed))
    assert [s.links for s in diagnosis.suspects] == [(fault,)]
    assert diagnosis.suspects[0].evidence == {
        "bad_paths": len(through) - 2,
        "good_paths": 2,
        "examples": diagnosis.suspects[0].evidence["examples"],
    }
    assert set(diagnosis.unexplained) == set(noise)


def test_a_link_mostly_on_good_paths_is_exonerated() -> None:
    topo, plan, localizer = fat_tree()
    fault = "n00100/nic0>r0-leaf6"
    through = [(s, d) for s in sorted(plan) for d in plan[s] if fault in (topo.path(s, d) or ())]
    # Only a third of its paths are bad: not enough to blame it.
    verdicts = judge(topo, plan, {fault: "loss"}, flip=through[: 2 * len(through) // 3])
    assert all(fault not in s.links for s in localizer.localize(verdicts))


def test_localizer_is_reusable_and_accepts_pairs_outside_the_plan() -> None:
    topo, plan, localizer = fat_tree()
    first = localizer.localize(judge(topo, plan, {"r0-leaf2>r0-spine1": "loss"}))
    healthy = localizer.localize(judge(topo, plan, {}))
    assert first and healthy == []
    extra = [PathVerdict("n00000/nic0", dst, True, kinds=("dead",)) for dst in ("n00200/nic0", "n00201/nic0")]
    before = localizer.paths
    suspects = localizer.localize(judge(topo, plan, {"n00000/nic0>r0-leaf0": "dead"}) + extra)
    assert localizer.paths == before + sum(1 for v in extra if v.dst not in plan["n00000/nic0"])
    assert [s.links for s in suspects] == [("n00000/nic0>r0-leaf0",)]


def test_a_large_fabric_names_the_one_bad_link() -> None:
    """4,096 nodes, one lossy spine-to-leaf link and one flipped verdict. How long it takes is measured by
    bench/lens_scale.py, not here."""
    topo = Topology.fat_tree(4096, 32, 16)
    plan = peers.plan(topo, k=16)
    localizer = Localizer(topo, plan)
    verdicts = judge(topo, plan, {"r0-spine4>r0-leaf77": "loss"}, flip=[("n00001/nic0", plan["n00001/nic0"][0])])
    suspects = localizer.localize(verdicts)
    assert [s.links for s in suspects] == [("r0-spine4>r0-leaf77",)]
