"""The oracle for peer copies: pure FSDP (1 x 4, no replica, 1 spare) survives a SIGKILL at a random point,
its lost shard rebuilt from the copy in a ring neighbour's host memory, and ends bitwise equal on every slot to
the same job run without a fault and without peer copies.

The rank script is tests/unit/test_torchpass_fsdp.py's (dropout, AdamW, ``clip_grad_norm_`` over DTensors, an LR
scheduler, a parameter that does not split evenly); its kill points are described there. What is checked here:

* K = 1 (``peer_copy_every_steps=1``, the default): the victim is killed at a random step, phase and layer once
  its neighbours acknowledged the copy of its last commit (the script waits for that condition): no step is
  computed twice, and the recovery event says ``recomputed_steps: 0``.
* K = 1, a crash right after the victim's update (the ``updated`` kill point), before the copy of that step
  exists: the one window overlapped copies leave. The job recomputes exactly that step and says so
  (``recomputed_steps: 1``).
* K = 1 with ``peer_copy_sync``: a step commits only once every copy of it is acknowledged. Killed in that same
  window, or at a random moment of a random step (a timer, wherever the victim then is): no committed step is
  recomputed (``recomputed_steps: 0``, and no journal commits a step twice).
* K = 4: killed at a random point with no such wait: the job rolls back in memory to the newest step every shard
  is held at, recomputes the steps after it, and still ends bitwise equal; the recovery event's
  ``recomputed_steps`` is what the journals show (each slot's commits, rolled back and done again).
* Two adjacent ranks (slots 1 and 2) killed in one crash, in the same step: with ``peer_copies=1`` slot 1's only
  copy died with slot 2, so the job stops and the reason names the copies; with ``peer_copies=2`` slot 3 holds it
  too and the job ends bitwise equal.
* HSDP 2 x 2 with ``peer_copies_in_hsdp``: both holders of shard 1 (slots 1 and 3) killed in one crash at a random
  step, phase and layer, two spares: the newcomers get shard 1 from the copies in slots 0 and 2 (each replica's
  row is its ring), rolling back in memory when those are older than the committed step, and every slot ends
  bitwise equal to the same job without a fault and without copies (HSDP's default).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal, load_final
from tests.unit.test_torchpass_fsdp import LAYERS, NPROC, STEPS, _journal, _run

SEED = int(os.environ.get("CW_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
print(f"test_torchpass_fsdp_peercopy: CW_TEST_SEED={SEED}")
_draw = random.Random(SEED)


def _kill_point(victims: list[int]) -> str:
    """The victims, at one random step (not the first two or the last two), phase and layer."""
    step, layer = _draw.randrange(2, STEPS - 2), _draw.randrange(LAYERS)
    phase = _draw.choice(["allgather", "reducescatter", "optimizer"])
    return ",".join(f"{v}:{step}:{phase}:{-1 if phase == 'optimizer' else layer}" for v in victims)


def _recomputed_in_journals(run: FinishedJob) -> int:
    """Per slot, replay the journal: commits in order; an adopted state may roll back (the steps after it are
    committed again). The most steps any slot committed twice."""
    most = 0
    for slot in range(NPROC):
        entries, next_step, again = _journal(run, slot), 0, 0
        for kind, _gen, step, _pid in entries:
            if kind == "commit":
                assert step == next_step, f"slot {slot}: committed {step}, expected {next_step}: {entries}"
            else:
                assert step <= next_step, f"slot {slot}: adopted {step} ahead of {next_step}: {entries}"
                again = max(again, next_step - 1 - step)
            next_step = step + 1
        assert next_step == STEPS, f"slot {slot} ended at {next_step}: {entries}"
        most = max(most, again)
    return most


def _check(run: FinishedJob, reference: FinishedJob, kill: str) -> dict[str, Any]:
    """The faulted run: every fault injected, bitwise equal to the reference on every slot, the victims taken
    over by spares, and the recovery event's count of recomputed steps true to the journals."""
    run.check_ok()
    for spec in kill.split(","):
        assert (run.out / ("killed-" + spec.replace(":", "-"))).exists(), f"the fault {spec} was not injected"
    expected = load_final(reference.out, 0)
    assert expected["committed"] == STEPS - 1
    for slot in range(NPROC):
        assert_bitwise_equal(load_final(run.out, slot), expected, f"slot {slot}")
    for victim in {int(spec.split(":")[0]) for spec in kill.split(",")}:
        assert len({pid for *_, pid in _journal(run, victim)}) == 2, f"slot {victim} was not taken over"
    recovered = run.of_kind("torchpass.recovered")
    assert recovered, run.output[-4000:]
    assert max(r["recomputed_steps"] for r in recovered) == _recomputed_in_journals(run), recovered
    return recovered[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-fsdp-peercopy")


@pytest.fixture(scope="module")
def reference(base: Path) -> FinishedJob:
    """Pure FSDP without a fault and without peer copies: the copies must change nothing in the training."""
    run = _run(base, "reference", mesh="1x4", settings=("peer_copies=0",))
    run.check_ok()
    return run


def test_k1_rebuilds_the_shard_from_the_neighbour_without_recomputing(base: Path, reference: FinishedJob) -> None:
    victim = _draw.randrange(NPROC)
    kill = _kill_point([victim])
    if kill.split(":")[2] == "optimizer":  # the others may finish that step without it: it would be redone
        kill = kill.replace(":optimizer:-1", f":reducescatter:{_draw.randrange(LAYERS)}")
    print(f"kill {kill}")
    run = _run(base, "k1", mesh="1x4", kill=kill, after_copy=True)
    fields = _check(run, reference, kill)
    assert fields["recomputed_steps"] == 0, fields
    (move,) = [m for m in fields["moves"] if m["target"] == victim]
    assert move["source"] == (victim + 1) % NPROC and move["bytes"] > 0, fields  # its ring successor's copy


def test_k1_a_crash_right_after_an_update_recomputes_that_one_step(base: Path, reference: FinishedJob) -> None:
    kill = f"{_draw.randrange(NPROC)}:{_draw.randrange(2, STEPS - 2)}:updated:-1"
    print(f"kill {kill}")
    run = _run(base, "k1_window", mesh="1x4", kill=kill)
    fields = _check(run, reference, kill)
    assert fields["recomputed_steps"] == 1, fields  # the survivors committed it; its copy was still to be made
    assert fields["step"] == int(kill.split(":")[1]), fields  # resumed after the step before: redone from there


@pytest.mark.parametrize("phase", ["updated", "moment"])
def test_k1_sync_never_recomputes_a_committed_step(base: Path, reference: FinishedJob, phase: str) -> None:
    victim, step = _draw.randrange(NPROC), _draw.randrange(2, STEPS - 2)
    kill = f"{victim}:{step}:{phase}:{_draw.randrange(1000) if phase == 'moment' else -1}"
    print(f"kill {kill}")
    run = _run(base, f"k1_sync_{phase}", mesh="1x4", kill=kill, settings=("peer_copy_sync=true",))
    fields = _check(run, reference, kill)  # and no journal commits a step twice (recomputed_steps is theirs)
    assert fields["recomputed_steps"] == 0, fields
    (move,) = [m for m in fields["moves"] if m["target"] == victim]
    assert move["source"] == (victim + 1) % NPROC and move["bytes"] > 0, fields  # its ring successor's copy


def test_k4_rolls_back_in_memory_and_reports_the_recomputed_steps(base: Path, reference: FinishedJob) -> None:
    victim = _draw.randrange(NPROC)
    kill = _kill_point([victim])
    print(f"kill {kill}")
    run = _run(base, "k4", mesh="1x4", kill=kill, settings=("peer_copy_every_steps=4",))
    fields = _check(run, reference, kill)
    assert 0 <= fields["recomputed_steps"] <= 2 * 4, fields
    step = int(kill.split(":")[1])
    assert fields["step"] <= step + 1 and fields["step"] % 4 == 0, fields  # resumes after a copy's step (3, 7, ...)


def _adjacent_kill() -> str:
    """Slots 1 and 2 at a random step, both before the step's first collective. The runs use ``together``: slot 2
    may still be between the step's collectives (its optimizer step, its copies) when slot 1 reaches the point, and
    a recovery begun in that gap would rebuild slot 1 from slot 2 before slot 2 dies (a fresh-clone CI run did)."""
    step = _draw.randrange(2, STEPS - 2)
    return f"1:{step}:allgather:0,2:{step}:allgather:0"


def test_two_adjacent_losses_with_one_copy_stop_with_the_reason(base: Path) -> None:
    kill = _adjacent_kill()
    run = _run(base, "adjacent_r1", mesh="1x4", kill=kill, spares=2, together=True)
    assert run.returncode != 0
    failed = run.of_kind("torchpass.failed")
    assert failed, run.output[-4000:]
    reason = failed[0]["reason"]
    assert "no member holds shard 1 of the 1x4 mesh" in reason and "peer_copies=1: slot 2" in reason, reason
    assert "snapshot" in reason, reason


def test_two_adjacent_losses_with_two_copies_recover(base: Path, reference: FinishedJob) -> None:
    kill = _adjacent_kill()
    print(f"kill {kill}")
    run = _run(base, "adjacent_r2", mesh="1x4", kill=kill, spares=2, together=True, settings=("peer_copies=2",))
    fields = _check(run, reference, kill)
    sources = {m["target"]: m["source"] for r in run.of_kind("torchpass.recovered") for m in r["moves"]}
    assert sources.get(1) == 3, fields  # slot 1's second copy, in slot 3
    assert sources.get(2) in (3, 0), fields  # slot 2's copies: slots 3 and 0


@pytest.fixture(scope="module")
def reference_hsdp(base: Path) -> FinishedJob:
    """HSDP 2 x 2 without a fault, and without peer copies (off by default under HSDP)."""
    run = _run(base, "hsdp_reference", mesh="2x2")
    run.check_ok()
    return run


def test_hsdp_both_holders_of_a_shard_lost_at_once_rebuilt_from_the_copies(
    base: Path, reference_hsdp: FinishedJob
) -> None:
    step, layer = _draw.randrange(2, STEPS - 2), _draw.randrange(LAYERS)
    phase = _draw.choice(["allgather", "reducescatter", "allreduce", "optimizer"])
    kill = ",".join(f"{v}:{step}:{phase}:{-1 if phase == 'optimizer' else layer}" for v in (1, 3))
    print(f"kill {kill}")
    run = _run(
        base, "hsdp_both", mesh="2x2", kill=kill, spares=2, together=True, settings=("peer_copies_in_hsdp=true",)
    )
    fields = _check(run, reference_hsdp, kill)  # bitwise per slot; recomputed_steps true to the journals
    both = [r for r in run.of_kind("torchpass.recovered") if {1, 3} <= set(r["slots"])]
    assert both, f"slots 1 and 3 were not rebuilt in one recovery: {run.of_kind('torchpass.recovered')}"
    moves = {m["target"]: m for m in both[0]["moves"] if m["target"] in (1, 3)}
    assert set(moves) == {1, 3}, both[0]
    for move in moves.values():  # shard 1 from a copy in a survivor of shard 0: no live holder was left
        assert move["part"] == 1 and move["source"] in (0, 2) and move["bytes"] > 0, both[0]
    print(f"recovered at step {fields['step']}, recomputed_steps {both[0]['recomputed_steps']}")
