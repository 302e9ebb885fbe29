"""The oracle for snapshots of sharded models: a pure FSDP (1 x 4) and an HSDP (2 x 2) job snapshot every shard,
and a job restored from a mid-run snapshot ends bitwise equal, on every slot, to the run that wrote it; a loss no
peer copy covers stops the job with a reason naming the snapshot, from which the job then restarts.

The rank script is tests/unit/test_torchpass_fsdp.py's (dropout, AdamW, ``clip_grad_norm_`` over DTensors, an LR
scheduler, a parameter that does not split evenly). What is checked here:

* A job with ``snapshot_every_steps`` writes complete snapshots (every tensor of every shard, verified by
  ``clockwork``'s own reader); a second job started with ``restore=<one mid-run snapshot>`` (drawn at random)
  restores it on every slot, commits only the steps after it, and ends bitwise equal to the first on every slot.
* The same under HSDP 2 x 2 (each shard's tensors written by one of its two replicas).
* A 2 x 2 job asked to restore a 1 x 4 snapshot fails, naming both shapes.
* Pure FSDP with ``peer_copies=1``: slots 1 and 2 killed in one step (at random, once a snapshot is complete):
  slot 1's only copy died with slot 2, so the job stops, and its reason names the newest snapshot; the job started
  again with ``restore=latest`` ends bitwise equal to the fault-free run.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest

from clockwork.contracts.snapshots.store import list_snapshots, load_manifest, verify_snapshot
from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal, load_final
from tests.unit.test_torchpass_fsdp import NPROC, STEPS, _journal, _run

SEED = int(os.environ.get("CW_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
print(f"test_torchpass_fsdp_snapshot: CW_TEST_SEED={SEED}")
_draw = random.Random(SEED)

EVERY = 4  # snapshots after steps 3, 7 and 11


def _snapshots(folder: Path) -> tuple[str, ...]:
    return (f"snapshot_every_steps={EVERY}", f"snapshot_dir={folder}")


def _written(run: FinishedJob, folder: Path, mesh: str) -> list[int]:
    """The run finished and wrote complete snapshots of every shard: their steps."""
    run.check_ok()
    steps = run.complete_snapshots(folder, range(EVERY - 1, STEPS, EVERY))
    for step in steps:
        path = folder / f"step-{step:010d}"
        assert verify_snapshot(path) == [], path
        body = load_manifest(path)
        assert body["mesh"] == [int(v) for v in mesh.split("x")], body.get("mesh")
        file_of = {name: fname for fname, f in body["files"].items() for name in f["entries"]}
        replicas, shards = body["mesh"]
        for shard in range(shards):  # every shard's description and tensors, written by the ranks holding it
            prefix = f"s/{shard:05d}/"
            assert file_of[f"{prefix}meta"] == f"rank-{shard:05d}.h5", file_of
            held = sorted(name for name in file_of if name.startswith(f"{prefix}t/"))
            assert held == [f"{prefix}t/{i:06d}" for i in range(int(body["tensors"]))], held
            writers = {file_of[name] for name in held}
            assert writers == {f"rank-{r * shards + shard:05d}.h5" for r in range(replicas)}, writers
    return steps


def _restore_step(folder: Path) -> int:
    """A complete snapshot's step to restore, at random, one with steps after it where there is one."""
    steps = [info.step for info in list_snapshots(folder) if info.complete]
    return _draw.choice([step for step in steps if step < STEPS - 1] or steps)


def _check_restored(run: FinishedJob, source: FinishedJob, step: int) -> None:
    """Every slot restored the snapshot of ``step``, committed only the steps after it, and ended bitwise equal
    to ``source``'s same slot."""
    run.check_ok()
    restored = run.logged("torchpass.restored")
    assert len(restored) == NPROC and {r["step"] for r in restored} == {step}, restored
    for slot in range(NPROC):
        commits = [s for kind, _gen, s, _pid in _journal(run, slot) if kind == "commit"]
        assert commits == list(range(step + 1, STEPS)), f"slot {slot}: {commits}"
        assert_bitwise_equal(load_final(run.out, slot), load_final(source.out, slot), f"slot {slot}")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-fsdp-snapshot")


@pytest.fixture(scope="module")
def fsdp_full(base: Path) -> FinishedJob:
    """Pure FSDP without a fault, snapshots every EVERY steps (peer copies on: the default)."""
    run = _run(base, "fsdp_full", mesh="1x4", settings=_snapshots(base / "fsdp_snaps"))
    _written(run, base / "fsdp_snaps", "1x4")
    return run


def test_pure_fsdp_restores_every_shard_bitwise(base: Path, fsdp_full: FinishedJob) -> None:
    step = _restore_step(base / "fsdp_snaps")
    folder = base / "fsdp_snaps" / f"step-{step:010d}"
    run = _run(base, "fsdp_restored", mesh="1x4", settings=(f"restore={folder}",))
    _check_restored(run, fsdp_full, step)


def test_hsdp_restores_every_shard_bitwise(base: Path) -> None:
    full = _run(base, "hsdp_full", settings=_snapshots(base / "hsdp_snaps"))
    _written(full, base / "hsdp_snaps", "2x2")
    step = _restore_step(base / "hsdp_snaps")
    run = _run(base, "hsdp_restored", settings=(f"restore={base / 'hsdp_snaps' / f'step-{step:010d}'}",))
    _check_restored(run, full, step)


def test_a_snapshot_of_another_mesh_shape_is_refused(base: Path, fsdp_full: FinishedJob) -> None:
    folder = base / "fsdp_snaps" / f"step-{_restore_step(base / 'fsdp_snaps'):010d}"
    run = _run(base, "wrong_mesh", mesh="2x2", settings=(f"restore={folder}",))
    assert run.returncode != 0
    failed = run.of_kind("torchpass.failed")
    assert failed, run.output[-4000:]
    reason = failed[0]["reason"]
    assert "written by a 1x4 mesh and this job's mesh is 2x2" in reason, reason
    assert not list(run.out.glob("final-slot*.pt")), "a job that refused its snapshot trained anyway"


def test_adjacent_losses_stop_naming_the_snapshot_and_restart_from_it(base: Path, fsdp_full: FinishedJob) -> None:
    step = _draw.randrange(EVERY, STEPS - 2)  # after the first snapshot's step
    kill = f"1:{step}:allgather:0,2:{step}:allgather:0"
    print(f"kill {kill}")
    snaps = base / "adjacent_snaps"
    settings = (*_snapshots(snaps), "snapshot_timeout_s=30")  # a victim's unwritten shard fails its snapshot soon
    run = _run(base, "adjacent", mesh="1x4", kill=kill, spares=2, after_snapshot=True, settings=settings)
    assert run.returncode != 0
    failed = run.of_kind("torchpass.failed")
    assert failed, run.output[-4000:]
    reason = failed[0]["reason"]
    assert "no member holds shard 1 of the 1x4 mesh" in reason and "peer_copies=1: slot 2" in reason, reason
    named = re.search(r"restart from the newest snapshot, (\S+) \(step (\d+)\)", reason)
    assert named, reason
    assert Path(named.group(1)).parent == snaps and verify_snapshot(named.group(1)) == [], reason
    assert int(named.group(2)) < step, reason
    again = _run(base, "adjacent_restarted", mesh="1x4", settings=(*settings, "restore=latest"))
    again.check_ok()
    restored = again.logged("torchpass.restored")
    assert len(restored) == NPROC and len({r["step"] for r in restored}) == 1, restored
    assert restored[0]["step"] >= int(named.group(2)), (restored, reason)
    for slot in range(NPROC):
        assert_bitwise_equal(load_final(again.out, slot), load_final(fsdp_full.out, slot), f"slot {slot}")
