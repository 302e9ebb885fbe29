"""Who sends which part of the state to whom when a generation forms (torchpass.rank.transfer_plan), by table.

Each row is the agreement's table (what every slot holds: per part, the committed step of its copy, or None)
and the plan that must come out of it. Pure: no torch, no sockets."""

from __future__ import annotations

import pytest

from torchpass.rank.transfer_plan import (
    Holdings,
    PartLayout,
    Replicated,
    ShardedReplicas,
    StateLost,
    Transfer,
    TransferPlan,
    plan_transfers,
)

DDP = Replicated()
HSDP = ShardedReplicas(replicas=2, shards=2)  # slots 0,1 = replica 0 shards 0,1; slots 2,3 = replica 1
FSDP = ShardedReplicas(replicas=1, shards=3)
HSDP3 = ShardedReplicas(replicas=3, shards=2)  # slots (0,1), (2,3), (4,5): replicas 0, 1, 2
# HSDP with peer copies: slot (r, s) keeps the copy of (r, s - 1)'s shard, so in 2 x 2 slot 0 holds slot 1's
# shard 1, slot 1 slot 0's shard 0, slot 2 slot 3's shard 1 and slot 3 slot 2's shard 0.
HSDPC = ShardedReplicas(replicas=2, shards=2, peer_copies=1)


def _held(*steps: int | None) -> Holdings:
    return Holdings(tuple(steps))


def _t(part: int, source: int, target: int) -> Transfer:
    return Transfer(part, source, target)


PLANS: list[tuple[str, PartLayout, list[Holdings], bool, TransferPlan]] = [
    (
        "fresh start: slot 0's initial weights go to everyone, as DDP broadcasts them",
        DDP,
        [_held(None), _held(None), _held(None)],
        False,
        TransferPlan(-1, (_t(0, 0, 1), _t(0, 0, 2)), fresh=True),
    ),
    ("one rank alone: nothing to move", DDP, [_held(None)], False, TransferPlan(-1, (), fresh=True)),
    (
        "every member up to date (a rebuild with nobody lost)",
        DDP,
        [_held(7), _held(7)],
        True,
        TransferPlan(7, ()),
    ),
    (
        "a newcomer gets the state of the lowest replica",
        DDP,
        [_held(5), _held(5), _held(None)],
        True,
        TransferPlan(5, (_t(0, 0, 2),)),
    ),
    (
        "two newcomers are fed by two sources in parallel",
        DDP,
        [_held(5), _held(5), _held(None), _held(None)],
        True,
        TransferPlan(5, (_t(0, 0, 2), _t(0, 1, 3))),
    ),
    (
        "a survivor that had not committed the step receives its result instead of recomputing it",
        DDP,
        [_held(5), _held(4), _held(None)],
        True,
        TransferPlan(5, (_t(0, 0, 1), _t(0, 0, 2))),
    ),
    (
        "the newest step wins even when only a higher slot committed it",
        DDP,
        [_held(4), _held(5)],
        True,
        TransferPlan(5, (_t(0, 1, 0),)),
    ),
    (
        "a rank whose receive broke (has no state) before the first step: the fresh state again",
        DDP,
        [_held(-1), _held(None)],
        False,
        TransferPlan(-1, (_t(0, 0, 1),)),
    ),
    (
        "HSDP: a newcomer in slot (1, 1) receives shard 1 from the holder of shard 1 in the other replica",
        HSDP,
        [_held(5, None), _held(None, 5), _held(5, None), _held(None, None)],
        True,
        TransferPlan(5, (_t(1, 1, 3),)),
    ),
    (
        "HSDP: two newcomers of different shards, each from its own shard's holder",
        HSDP,
        [_held(None, None), _held(None, 5), _held(5, None), _held(None, None)],
        True,
        TransferPlan(5, (_t(0, 2, 0), _t(1, 1, 3))),
    ),
    (
        "HSDP fresh start: each shard's initial values from its lowest slot",
        HSDP,
        [_held(None, None)] * 4,
        False,
        TransferPlan(-1, (_t(0, 0, 2), _t(1, 1, 3)), fresh=True),
    ),
    (
        "HSDP 3x2: the two shards of a lost replica are sent by the two other replicas, not both by one",
        HSDP3,
        [_held(None, None), _held(None, None), _held(5, None), _held(None, 5), _held(5, None), _held(None, 5)],
        True,
        TransferPlan(5, (_t(0, 2, 0), _t(1, 5, 1))),
    ),
    (
        "HSDP 3x2: three newcomers over two parts, each replica sending once where it can",
        HSDP3,
        [_held(None, None), _held(None, None), _held(5, None), _held(None, 5), _held(None, None), _held(None, 5)],
        True,
        TransferPlan(5, (_t(0, 2, 0), _t(0, 2, 4), _t(1, 5, 1))),
    ),
    (
        "FSDP: a lost shard comes back from the peer copy in its neighbour's host memory",
        FSDP,
        [_held(5, None, 5), _held(None, None, None), _held(None, 5, 5)],
        True,
        TransferPlan(5, (_t(1, 2, 1),)),
    ),
    (
        "FSDP, copies every 4 steps: the lost shard's copy is of step 3, so everyone rolls back to 3, each from the "
        "copy of its own shard it keeps; slot 2 also serves the copy it holds of slot 1's",
        FSDP,
        [
            Holdings((6, None, 3), ((3,), (), ())),
            Holdings((None, None, None)),
            Holdings((None, 3, 6), ((), (), (3,))),
        ],
        True,
        TransferPlan(3, (_t(0, 0, 0), _t(1, 2, 1), _t(2, 2, 2))),
    ),
    (
        "FSDP: a survivor one step behind, whose copies still hold the step everyone else rolls back to",
        FSDP,
        [
            Holdings((7, None, 4), ((4, 5), (), ())),
            Holdings((None, None, None)),
            Holdings((None, 4, 6), ((), (), (4, 5))),
        ],
        True,
        TransferPlan(4, (_t(0, 0, 0), _t(1, 2, 1), _t(2, 2, 2))),
    ),
    (
        "HSDP: the survivor that committed the step a dead holder did not finish rolls back from the replica",
        HSDP,
        [_held(5, None), _held(None, 4), _held(4, None), _held(None, None)],
        True,
        TransferPlan(4, (_t(0, 2, 0), _t(1, 1, 3))),
    ),
    (
        "HSDP with peer copies: a lost rank's shard comes from the live replica (slot 1), not from the copy in slot "
        "0 or 2, though both hold the same step and slot 0 comes first",
        HSDPC,
        [
            Holdings((5, 5), ((5, 4), (4,))),
            Holdings((5, 5), ((4,), (5, 4))),
            Holdings((5, 5), ((5, 4), (4,))),
            Holdings((None, None)),
        ],
        True,
        TransferPlan(5, (_t(1, 1, 3),)),
    ),
    (
        "HSDP with peer copies: no rollback while a replica holds the committed step, though every copy is older",
        HSDPC,
        [
            Holdings((6, 5), ((5, 4), (4,))),
            Holdings((5, 6), ((4,), (5, 4))),
            Holdings((6, 5), ((5, 4), (4,))),
            Holdings((None, None)),
        ],
        True,
        TransferPlan(6, (_t(1, 1, 3),)),
    ),
    (
        "HSDP with peer copies: both holders of shard 1 died at once; each newcomer gets it from the copy kept in "
        "a survivor's host memory, one per replica",
        HSDPC,
        [Holdings((6, 6), ((6, 5), (5,))), Holdings((None, None)), Holdings((6, 6), ((6, 5), (5,))), _held(None, None)],
        True,
        TransferPlan(6, (_t(1, 0, 1), _t(1, 2, 3))),
    ),
    (
        "HSDP with peer copies: both holders of shard 1 died and its copies are of step 5: the job rolls back to 5, "
        "each survivor from its own copy of shard 0",
        HSDPC,
        [Holdings((6, 5), ((6, 5), (4,))), Holdings((None, None)), Holdings((6, 5), ((6, 5), (4,))), _held(None, None)],
        True,
        TransferPlan(5, (_t(0, 0, 0), _t(0, 2, 2), _t(1, 0, 1), _t(1, 2, 3))),
    ),
]


@pytest.mark.parametrize(
    ("layout", "table", "expect_state", "plan"), [row[1:] for row in PLANS], ids=[r[0] for r in PLANS]
)
def test_plan(layout: PartLayout, table: list[Holdings], expect_state: bool, plan: TransferPlan) -> None:
    assert plan_transfers(table, layout, expect_state=expect_state) == plan


LOST: list[tuple[str, PartLayout, list[Holdings], str]] = [
    (
        "training progressed and nobody holds the state",
        DDP,
        [_held(None), _held(None)],
        "no member holds the training state any more",
    ),
    (
        "HSDP: both holders of shard 1 lost",
        HSDP,
        [_held(5, None), _held(None, None), _held(5, None), _held(None, None)],
        "no member holds shard 1 of the 2x2 mesh any more (at step 5): its holders (slots 1, 3) were all lost, and "
        "this HSDP job keeps no peer copies (peer_copies_in_hsdp",
    ),
    (
        "HSDP with peer copies: both holders of shard 1 lost, and its copies older than any step the survivors kept",
        HSDPC,
        [Holdings((9, 4), ((9, 8, 7), ())), _held(None, None), Holdings((9, 4), ((9, 8, 7), ())), _held(None, None)],
        "shard 1 of the 2x2 mesh any more (at step 9): its holders (slots 1, 3) and its peer copies (peer_copies=1: "
        "slots 0, 2) were all lost, or hold no step",
    ),
    (
        "FSDP: the only peer copy is a step behind the other shards",
        FSDP,
        [_held(5, None, 5), _held(None, None, None), _held(None, 4, 5)],
        "shard 1 of the 1x3 mesh any more (at step 5)",
    ),
    (
        "FSDP: the copy of the lost shard is older than every copy the others kept of their own",
        FSDP,
        [Holdings((9, None, 8), ((8,), (), ())), _held(None, None, None), Holdings((None, 4, 9), ((), (), (8,)))],
        "shard 1 of the 1x3 mesh any more (at step 9)",
    ),
]


@pytest.mark.parametrize(("layout", "table", "message"), [row[1:] for row in LOST], ids=[r[0] for r in LOST])
def test_state_lost(layout: PartLayout, table: list[Holdings], message: str) -> None:
    with pytest.raises(StateLost, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_transfers(table, layout, expect_state=True)


def test_who_takes_part_in_what() -> None:
    plan = plan_transfers([_held(5), _held(5), _held(None), _held(None)], DDP, expect_state=True)
    assert plan.involving(0) == (_t(0, 0, 2),) and plan.involving(3) == (_t(0, 1, 3),)
    assert (plan.source_of(2), plan.source_of(3), plan.source_of(0)) == (0, 1, None)
    assert plan.sources() == [0, 1]


def test_holdings_on_the_wire_are_the_pair_every_rank_sent() -> None:
    """One part encodes as (has state, committed step), the agreement row ranks have always exchanged."""
    assert Holdings.whole(True, 7).encode() == [1, 7]
    assert Holdings.whole(False, 3).encode() == [0, -1]
    assert Holdings.whole(True, -1, parts=2).encode() == [1, -1, 1, -1]
    for held in (_held(None), _held(-1), _held(3, None, 9)):
        assert Holdings.decode(held.encode()) == held
    with pytest.raises(ValueError, match="pairs"):
        Holdings.decode([1, 2, 3])


def test_older_copies_travel_in_a_fixed_width() -> None:
    """With ``depth``, every member sends the same number of integers, padded, whatever copies it keeps."""
    held = Holdings((6, None, 3), ((3, 2), (), ()))
    assert held.encode(2) == [1, 6, 0, -1, 1, 3, 1, 3, 1, 2, 0, -1, 0, -1, 0, -1, 0, -1]
    assert Holdings.decode(held.encode(2), 2) == held
    assert len(Holdings((None, None, None)).encode(2)) == len(held.encode(2))
    assert held.holds(0, 3) and held.holds(0, 6) and not held.holds(1, 3)
    with pytest.raises(ValueError, match="2 older copies of part 0"):
        held.encode(1)


def test_a_table_that_does_not_fit_the_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="slot 1 reports 1 part"):
        plan_transfers([_held(1, 1), _held(1)], HSDP, expect_state=True)
    with pytest.raises(ValueError, match=">= 1"):
        ShardedReplicas(0, 2)
    assert [HSDP.slot(r, s) for r in range(2) for s in range(2)] == [0, 1, 2, 3]
    assert [HSDP.parts_of(slot) for slot in range(4)] == [(0,), (1,), (0,), (1,)]


def test_a_shard_lost_with_its_peer_copies_says_why() -> None:
    """Slots 1 and 2 of a 1 x 4 job with one copy each (slot 1's in slot 2) die together: the reason names
    the copies' slot and the fallback."""
    layout = ShardedReplicas(1, 4, peer_copies=1)
    table = [Holdings((5, None, None, 5)), _held(None, None, None, None), _held(None, None, None, None)]
    table.append(Holdings((None, None, 5, 5)))
    with pytest.raises(StateLost, match=r"shard 1 of the 1x4 mesh any more \(at step 5\): its peer copies "):
        plan_transfers(table, layout, expect_state=True)
    with pytest.raises(StateLost, match=r"peer_copies=1: slot 2\) were lost with it.*snapshot"):
        plan_transfers(table, layout, expect_state=True)
