"""The layout of a sharded model's snapshot, without training: who stages which entries (each tensor of each shard
by exactly one rank holding that shard), the manifest's proof that every shard is whole (real shards written by
the real writer), the mesh on the wire, the refusal of another mesh shape, and what a job that lost its state is
told to restart from.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from clockwork.contracts.snapshots.messages import Entry, FinalizeSpec, WriteRequest
from clockwork.contracts.snapshots.store import FORMAT, SnapshotCorrupt, manifest_body, shard_name, write_manifest
from clockwork.contracts.snapshots.writer import write_shard
from torchpass.config import TorchPassConfig
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.snapshot import restart_advice
from torchpass.snapshot.restore import mesh_problem
from torchpass.snapshot.staging import plan_entries, plan_owners

SIZES = [400, 40, 4000, 4, 400, 8, 1200]  # bytes of each tensor (the same structure on every shard)


def test_unsharded_layout_is_the_replicated_one() -> None:
    owner = plan_owners(SIZES, 3)
    for slot in range(3):
        plan = plan_entries(SIZES, slot, 3)
        assert plan.prefix == "" and plan.meta == (slot == 0)
        assert plan.tensors == tuple(i for i, o in enumerate(owner) if o == slot)


@pytest.mark.parametrize("shape", [(1, 4), (2, 2), (3, 2)], ids=["fsdp-1x4", "hsdp-2x2", "hsdp-3x2"])
def test_each_shard_is_staged_once_spread_over_its_replicas(shape: tuple[int, int]) -> None:
    mesh = ShardedReplicas(*shape)
    for shard in range(mesh.shards):
        plans = [plan_entries(SIZES, slot, mesh.world_size, mesh) for slot in mesh.column(shard)]
        assert {p.prefix for p in plans} == {f"s/{shard:05d}/"}
        assert [p.meta for p in plans] == [True] + [False] * (mesh.replicas - 1)  # replica 0 describes the shard
        staged = sorted(i for p in plans for i in p.tensors)
        assert staged == list(range(len(SIZES)))  # every tensor, by exactly one of the shard's holders
        loads = [sum(SIZES[i] for i in p.tensors) for p in plans]
        assert all(load > 0 for load in loads), loads  # spread: every replica writes a part


def _write_snapshot(folder: Path, mesh: ShardedReplicas, drop: str = "", add: str = "") -> None:
    """Every rank's shard file as the writer writes it, with the entries the plan gives each rank (tiny ones)."""
    folder.mkdir(parents=True, exist_ok=True)
    for slot in range(mesh.world_size):
        plan = plan_entries(SIZES, slot, mesh.world_size, mesh)
        names = [f"{plan.prefix}t/{i:06d}" for i in plan.tensors] + ([f"{plan.prefix}meta"] if plan.meta else [])
        names += [f"rank/{slot:05d}/position"] + ([add] if add and slot == 0 else [])
        names = [n for n in names if n != drop]
        entries = [Entry(name, 4096 * k, 16, "torch.uint8", (16,)) for k, name in enumerate(names)]
        fd = os.open("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 4096 * (len(entries) + 1))
            arena = mmap.mmap(fd, 4096 * (len(entries) + 1))
        finally:
            os.close(fd)
        write_shard(arena, folder / shard_name(slot), entries, direct=False)
        arena.close()


def test_the_manifest_proves_every_shard_whole(tmp_path: Path) -> None:
    mesh = ShardedReplicas(2, 2)
    _write_snapshot(tmp_path / "whole", mesh)
    body = manifest_body(tmp_path / "whole", step=3, world_size=4, job="j", tensors=len(SIZES), mesh=(2, 2))
    assert body["mesh"] == [2, 2]
    for drop, error in [("s/00001/t/000002", r"tensors \[2\] of shard 1"), ("s/00000/meta", "description of shard 0")]:
        _write_snapshot(tmp_path / drop.replace("/", "-"), mesh, drop=drop)
        with pytest.raises(SnapshotCorrupt, match=error):
            manifest_body(tmp_path / drop.replace("/", "-"), step=3, world_size=4, job="j", tensors=7, mesh=(2, 2))
    _write_snapshot(tmp_path / "more", mesh, add=f"s/00001/t/{len(SIZES):06d}")  # shard 1 holds a tensor too many
    with pytest.raises(SnapshotCorrupt, match="8 tensors of shard 1, the state has 7"):
        manifest_body(tmp_path / "more", step=3, world_size=4, job="j", tensors=len(SIZES), mesh=(2, 2))
    with pytest.raises(SnapshotCorrupt, match=r"tensors .* are in no file"):  # a sharded snapshot is no replicated one
        manifest_body(tmp_path / "whole", step=3, world_size=4, job="j", tensors=len(SIZES))


def test_the_mesh_travels_to_the_writer() -> None:
    spec = FinalizeSpec(4, 3, "j", 7, 3, "/d", 60.0, mesh=(1, 4))
    request = WriteRequest(1, "/proc/1/fd/3", 1, "/d/step-0000000003", 0, (), spec)
    assert WriteRequest.from_line(request.to_line()).finalize == spec
    assert WriteRequest.from_line(request.to_line().replace('"mesh": [1, 4]', '"mesh": null')).finalize == FinalizeSpec(
        4, 3, "j", 7, 3, "/d", 60.0
    )
    with pytest.raises(ValueError, match="a mesh is"):
        WriteRequest.from_line(request.to_line().replace('"mesh": [1, 4]', '"mesh": [4]'))


def test_another_mesh_shape_is_refused_naming_both() -> None:
    assert mesh_problem({"mesh": [1, 4]}, ShardedReplicas(1, 4)) == ""
    assert mesh_problem({"world_size": 4}, None) == ""
    assert "written by a 1x4 mesh and this job's mesh is 2x2" in mesh_problem({"mesh": [1, 4]}, ShardedReplicas(2, 2))
    assert "sharded 1x4" in mesh_problem({"mesh": [1, 4]}, None)
    assert "unsharded model's state (4 ranks)" in mesh_problem({"world_size": 4}, ShardedReplicas(2, 2))


def test_restart_advice_names_the_newest_complete_snapshot(tmp_path: Path) -> None:
    assert "snapshots are off" in restart_advice(TorchPassConfig(snapshot_dir=str(tmp_path)))
    config = TorchPassConfig(snapshot_dir=str(tmp_path), snapshot_every_steps=4)
    assert "no snapshot was complete yet" in restart_advice(config)
    for step in (3, 7):
        folder = tmp_path / f"step-{step:010d}"
        folder.mkdir()
        write_manifest(folder, {"format": FORMAT, "step": step, "world_size": 4, "files": {}, "tensors": 0})
    (tmp_path / "step-0000000011").mkdir()  # in progress: no manifest
    advice = restart_advice(config)
    assert f"newest snapshot, {tmp_path / 'step-0000000007'} (step 7)" in advice, advice
    assert f"--restore {tmp_path / 'step-0000000007'}" in advice, advice
