"""The coordinator's verdict on ranks whose own collectives do not line up (torchpass.coordinator.lockstep), by
table."""

from __future__ import annotations

import pytest

from torchpass.coordinator.lockstep import CollectiveWait, MemberProgress, find_mismatch, parse_wait

MARGIN = 1.0


def _wait(step: int, at: float, ordinal: int = 1) -> CollectiveWait:
    return CollectiveWait(step, ordinal, "dist.all_reduce", at)


@pytest.mark.parametrize(
    ("members", "culprit"),
    [
        # slot 1 waits in step 12's collective; slot 0 reached step 13 well before slot 1's report
        ([MemberProgress(0, 13, 10.0), MemberProgress(1, 12, 5.0, _wait(12, 11.5))], "slot 0 has gone on to step 13"),
        # a peer that finished the job, well before the report
        ([MemberProgress(0, 12, 5.0, finished_at=10.0), MemberProgress(1, 12, 5.0, _wait(12, 11.2))], "has finished"),
        # the peer moved on just now: the collective may be completing as it does (no verdict yet)
        ([MemberProgress(0, 13, 10.9), MemberProgress(1, 12, 5.0, _wait(12, 11.5))], None),
        # everyone in the same step: a slow peer, not a mismatch
        ([MemberProgress(0, 12, 1.0), MemberProgress(1, 12, 1.0, _wait(12, 50.0))], None),
        # both wait in the same step's collective: it will complete
        ([MemberProgress(0, 12, 1.0, _wait(12, 50.0)), MemberProgress(1, 12, 1.0, _wait(12, 50.0))], None),
        # a peer behind (still at step 11) is not past the collective
        ([MemberProgress(0, 11, 1.0), MemberProgress(1, 12, 1.0, _wait(12, 50.0))], None),
        # nobody waits
        ([MemberProgress(0, 13, 1.0), MemberProgress(1, 12, 1.0)], None),
    ],
    ids=["peer-ahead", "peer-finished", "peer-just-moved", "same-step", "both-waiting", "peer-behind", "none"],
)
def test_find_mismatch(members: list[MemberProgress], culprit: str | None) -> None:
    verdict = find_mismatch(members, MARGIN)
    if culprit is None:
        assert verdict is None
    else:
        assert verdict is not None and culprit in verdict and "slot 1 waits in dist.all_reduce" in verdict


@pytest.mark.parametrize(
    "value",
    [None, [], [12, 1], ["12", 1, "x"], [12, 1, 3], [-1, 1, "x"], {"step": 12}, "12,1,x", [12, 1, "x", 4]],
)
def test_a_malformed_heartbeat_field_reads_as_not_waiting(value: object) -> None:
    assert parse_wait(value, 1.0) is None


def test_a_wait_report_is_parsed_and_its_name_bounded() -> None:
    assert parse_wait([12, 2, "dist.all_reduce"], 3.0) == CollectiveWait(12, 2, "dist.all_reduce", 3.0)
    parsed = parse_wait([1, 1, "x" * 500], 0.0)
    assert parsed is not None and len(parsed.name) == 80
