"""The job story behind ``clockwork report``: incidents paired with their resolutions, in time order across
nodes, and the savings against checkpoint-restart."""

from __future__ import annotations

from typing import Any

import pytest

from clockwork.cli.job_story import build_story


def _event(seq: int, at: float, node: str, kind: str, **fields: Any) -> dict[str, Any]:
    return {"seq": seq, "time": at, "node": node, "kind": kind, "fields": fields, "job_id": 9}


EVENTS = [  # deliberately out of order, from three nodes
    _event(
        7,
        130.0,
        "node1",
        "torchpass.recovered",
        slots=[1],
        source_slots=[0],
        total_ms=2250.0,
        detect_ms=2100.0,
        transfer_ms=16.1,
        rebuild_ms=113.6,
        step=35,
    ),
    _event(
        3,
        100.0,
        "node2",
        "link.failover",
        nic="nic1",
        via="nic2",
        peers=["node3"],
        reason="carrier lost",
        route_ms=41.0,
    ),
    _event(6, 128.0, "node1", "torchpass.member_failed", slot=1, why="agent 1 (node3) silent for 2100 ms"),
    _event(1, 90.0, "node1", "job.registered"),
    _event(4, 110.0, "node2", "lens.suspect", link="node2/nic1>rail1", direction="up", kinds=["loss"]),
    _event(5, 112.0, "node2", "lens.suspect", link="node2/nic1>rail1", direction="both", kinds=["loss"]),
    _event(8, 140.0, "node2", "lens.clear", link="node2/nic1>rail1"),
    _event(9, 150.0, "node1", "torchpass.migrated", slots=[2], total_ms=180.0, step=60, handoff_ok=True),
    _event(10, 160.0, "node1", "torchpass.member_failed", slot=0, why="exited with code -9"),
]


def test_incidents_are_paired_with_their_resolution_in_time_order() -> None:
    story = build_story(9, EVENTS, {"source": "sacct"}, nodes=4, checkpoint_interval_s=1800, restart_cost_s=600)
    assert [i.what for i in story.incidents] == [
        "link failover",
        "gray failure",
        "rank replaced",
        "rank migrated",
        "rank replaced",
    ]
    failover, gray, replaced, migrated, still_open = story.incidents
    assert failover.duration_s == pytest.approx(0.041) and "nic1 -> nic2" in failover.detail
    assert gray.duration_s == pytest.approx(30.0) and "healthy again" in gray.resolution  # one suspicion, updated
    assert replaced.duration_s == pytest.approx(2.25) and "state from rank 0" in replaced.resolution
    assert "step 35" in replaced.resolution and "node3" in replaced.detail
    assert migrated.duration_s == pytest.approx(0.18) and migrated.saved_node_h == 0  # planned: nothing saved
    assert still_open.resolution == "open" and still_open.saved_node_h == 0  # no recovery recorded
    assert story.events == len(EVENTS)


def test_savings_count_half_an_interval_plus_the_restart_minus_the_repair_per_node() -> None:
    story = build_story(9, EVENTS, {}, nodes=4, checkpoint_interval_s=1800, restart_cost_s=600)
    failover, _, replaced, *_ = story.incidents
    assert failover.saved_node_h == pytest.approx((900 + 600 - 0.041) * 4 / 3600)
    assert replaced.saved_node_h == pytest.approx((900 + 600 - 2.25) * 4 / 3600)
    assert story.saved_node_h == pytest.approx(failover.saved_node_h + replaced.saved_node_h)
    assert story.faults == 3  # two resolved, one still open
    doc = story.to_dict()
    assert doc["saved_node_h"] == round(story.saved_node_h, 3) and len(doc["incidents"]) == 5


def test_a_repair_slower_than_a_restart_saves_nothing_and_a_rollback_is_shown() -> None:
    events = [
        _event(1, 1.0, "n1", "torchpass.member_failed", slot=0, why="x"),
        _event(2, 2.0, "n1", "torchpass.recovered", slots=[0], total_ms=5_000_000.0),
        _event(3, 3.0, "n1", "torchpass.restored", step=40, folder="/snap/step-40"),
        _event(4, 3.1, "n2", "torchpass.restored", step=40, folder="/snap/step-40"),  # every rank says so
    ]
    story = build_story(1, events, {}, nodes=2, checkpoint_interval_s=60, restart_cost_s=10)
    assert story.incidents[0].saved_node_h == 0
    assert [i.what for i in story.incidents] == ["rank replaced", "rollback"]
    assert "snapshot" in story.incidents[1].resolution and "step 40" in story.incidents[1].detail


def test_fleet_summary_counts_faults_by_kind_node_and_link() -> None:
    from clockwork.cli.job_story import fleet_summary

    first = build_story(9, EVENTS, {}, nodes=4, checkpoint_interval_s=1800, restart_cost_s=600)
    second = build_story(
        10,
        [
            _event(1, 500.0, "node2", "link.failover", nic="nic1", via="nic2", peers=["node1"], route_ms=30.0),
            _event(2, 600.0, "node4", "torchpass.restored", step=7, folder="/snap/step-7"),
            _event(3, 5000.0, "node4", "link.failover", nic="nic2", via="nic1", route_ms=30.0),  # after the window
        ],
        {},
        nodes=2,
    )
    summary = fleet_summary([first, second], since=0.0, until=3600.0)
    assert summary.jobs == 2 and summary.faults == 3 and summary.rollbacks == 1
    assert summary.by_kind["link failover"] == 2 and summary.by_kind["rank replaced"] == 2
    assert summary.by_node["node2"] == 3  # two failovers and one (updated) gray failure
    assert summary.worst_links[0] == ("node2/nic1", 2)
    assert summary.compute_once_ratio == pytest.approx(3 / 4) and summary.mtbf_h == pytest.approx(1 / 4)
    assert summary.saved_node_h == pytest.approx(first.saved_node_h + second.incidents[0].saved_node_h)
    empty = fleet_summary([], since=0.0, until=10.0)
    assert empty.mtbf_h is None and empty.compute_once_ratio is None and empty.to_dict()["faults"] == 0


def test_a_borrowed_node_is_part_of_the_story_and_saves_nothing_by_itself() -> None:
    events = [
        {"time": 10.0, "node": "node2", "seq": 1, "kind": "torchpass.member_failed", "fields": {"slot": 1, "why": "x"}},
        {
            "time": 11.0,
            "node": "node2",
            "seq": 2,
            "kind": "borrow.acquired",
            "fields": {
                "node": "node5",
                "from_job": 500,
                "from_user": "bob",
                "from_partition": "low",
                "holder": 900,
                "lost_node": "node3",
                "preempt_ms": 640.0,
                "total_ms": 900.0,
            },
        },
        {"time": 12.0, "node": "node1", "seq": 3, "kind": "borrow.refused", "fields": {"by": "uid 9", "reason": "x"}},
        {"time": 13.0, "node": "node4", "seq": 4, "kind": "borrow.failed", "fields": {"request": 2, "reason": "limit"}},
    ]
    story = build_story(9, events, {}, nodes=4)
    borrowed = [i for i in story.incidents if i.what == "node borrowed"]
    assert len(borrowed) == 1 and borrowed[0].duration_s == 0.9
    assert borrowed[0].detail == "node5 from job 500 (bob, partition low), for lost node node3"
    assert "holder job 900" in borrowed[0].resolution and "640.0 ms" in borrowed[0].resolution
    assert [i.detail for i in story.incidents if i.what == "borrow failed"] == ["limit"]  # not the intruder's try
    assert borrowed[0].saved_node_h == 0.0 and story.faults == 1  # the rank replaced is the one fault


def test_a_sharded_job_says_which_shard_moved_from_whom() -> None:
    moved = {"part": 1, "what": "shard 1 of the 2x2 mesh", "source": 3, "target": 1, "bytes": 1_200_000, "ms": 15.2}
    handed = {**moved, "source": 2, "target": 2, "what": "shard 0 of the 2x2 mesh", "handoff": True}
    events = [
        _event(1, 10.0, "node1", "torchpass.member_failed", slot=1, why="exited with code -9"),
        _event(2, 11.0, "node1", "torchpass.recovered", slots=[1], source_slots=[3], total_ms=80.0, moves=[moved]),
        _event(3, 20.0, "node1", "torchpass.migrated", slots=[2], total_ms=90.0, step=9, moves=[handed]),
    ]
    replaced, migrated = build_story(9, events, {}, nodes=4, checkpoint_interval_s=1800, restart_cost_s=600).incidents
    assert "with shard 1 of the 2x2 mesh from rank 3 (1.2 MB in 15.2 ms)" in replaced.resolution
    assert "shard 0 of the 2x2 mesh handed over by the departing rank" in migrated.resolution


def test_a_rollback_to_a_peer_copy_is_told_with_the_steps_computed_again() -> None:
    """Pure FSDP: rank 2's shard from rank 3's peer copy, rank 0's from its own copy, 2 steps done again."""
    from_copy = {"part": 2, "what": "shard 2 of the 1x4 mesh", "source": 3, "target": 2, "bytes": 12_000, "ms": 4.0}
    own = {**from_copy, "part": 0, "what": "shard 0 of the 1x4 mesh", "source": 0, "target": 0}
    events = [
        _event(1, 10.0, "node1", "torchpass.member_failed", slot=2, why="exited with code -9"),
        _event(2, 11.0, "node1", "torchpass.recovered", slots=[2], total_ms=80.0, step=4, recomputed_steps=2,
               moves=[own, from_copy]),
    ]  # fmt: skip
    (replaced,) = build_story(9, events, {}, nodes=4).incidents
    assert "with shard 2 of the 1x4 mesh from rank 3" in replaced.resolution
    assert replaced.resolution.endswith("resumed at step 4; rolled back in memory, 2 step(s) computed again")


def test_a_rank_of_a_many_gpu_node_is_named_by_its_node_and_local_index() -> None:
    """A node of G ranks: the story says on which node and which local index (GPU) a rank failed."""
    failed = _event(1, 10.0, "node1", "torchpass.member_failed", slot=5, why="agent 2 (node3) silent")
    failed["fields"].update(node="node3", local=1)  # where the rank ran (the event's own node is the leader's)
    events = [failed, _event(2, 11.0, "node1", "torchpass.recovered", slots=[5], source_slots=[1], total_ms=80.0)]
    (replaced,) = build_story(9, events, {}, nodes=4).incidents
    assert replaced.detail == "rank 5 on node3 local 1: agent 2 (node3) silent"


def test_a_replacement_and_a_move_say_where_the_rank_runs_now() -> None:
    """Under Slurm the recovered and migrated events place each slot (node, local index): the story names it."""
    events = [
        {**_event(1, 10.0, "node2", "torchpass.member_failed"),
         "fields": {"slot": 3, "why": "exited with -9", "node": "node3", "local": 1}},
        _event(2, 11.0, "node2", "torchpass.recovered", slots=[3], total_ms=50.0, step=7,
               placed={"3": {"node": "node5", "local": 0}}),
        _event(3, 20.0, "node2", "torchpass.migrated", slots=[4], total_ms=90.0, step=9,
               placed={"4": {"node": "node5", "local": 1}}),
    ]  # fmt: skip
    replaced, migrated = build_story(9, events, {}, nodes=5).incidents
    assert "rank 3 on node3 local 1" in replaced.detail
    assert replaced.resolution.startswith("a spare on node5 local 0 took rank 3"), replaced.resolution
    assert migrated.detail == "ranks 4 to node5 local 1 moved live", migrated.detail
