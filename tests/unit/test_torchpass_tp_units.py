"""The pieces of TorchPass's tensor parallelism that need no job: the (replicate, shard, tp) mesh, the groups each
dimension forms, how a slot's state is named, what ``ctx.wrap_fsdp`` refuses at start, and received optimizer state
rebuilt over each parameter's own mesh. The multi-rank behaviour is the oracle's (test_torchpass_tp.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from torchpass.errors import TorchPassError
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.sharded.fsdp import ShardPlan, mesh_layout
from torchpass.sharded.shard_mesh import MeshGroups


def test_the_tp_mesh_puts_tp_innermost_and_names_a_slot_by_its_shard_and_tp_coordinate() -> None:
    shape = ShardedReplicas(2, 4, tp=2)  # 2 replicas x 2 shards x tp 2: slot = r*4 + s*2 + t
    groups = MeshGroups(shape, 6, "cpu")  # replica 1, shard 1, tp 0
    assert groups.mesh.mesh_dim_names == ("replicate", "shard", "tp") and tuple(groups.mesh.shape) == (2, 2, 2)
    assert groups.mesh.get_coordinate() == (1, 1, 0)
    assert [groups.proxies[d].size() for d in ("replicate", "shard", "tp")] == [2, 2, 2]
    assert groups.groups_of("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # adjacent slots: one node's ranks
    assert groups.groups_of("shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups.groups_of("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.parts_of(6) == (2,) and shape.column(2) == [2, 6]  # its state is held by slot 2 too
    assert str(shape) == "2x2x2" and shape.part_name(3) == "part 3 (shard 1, tp 1) of the 2x2x2 mesh"
    with groups.before_first_generation():  # slicing asks c10d for the rank: the slot, before any group exists
        assert tuple(groups.submesh(("replicate", "shard")).shape) == (2, 2)
        assert groups.submesh("tp").mesh_dim_names == ("tp",)


def test_a_plain_hsdp_mesh_forms_the_groups_it_always_did() -> None:
    groups = MeshGroups(ShardedReplicas(2, 3), 4, "cpu")
    assert groups.groups_of("shard") == [[0, 1, 2], [3, 4, 5]] and "tp" not in groups.proxies
    assert groups.groups_of("replicate") == [[0, 3], [1, 4], [2, 5]]
    assert str(ShardedReplicas(2, 3)) == "2x3" and ShardedReplicas(2, 3).part_name(1) == "shard 1 of the 2x3 mesh"


def test_what_is_refused_at_start() -> None:
    plan = {"w": ColwiseParallel()}
    assert mesh_layout((2, 1), 2, plan) == ShardedReplicas(2, 2, tp=2)
    assert mesh_layout((2, 2)) == ShardedReplicas(2, 2)
    assert mesh_layout((1, 2), 2, plan) == ShardedReplicas(1, 4, tp=2)  # no replica: peer copies hold the state
    with pytest.raises(TorchPassError, match="non-empty tp_plan"):
        mesh_layout((2, 1), 2, None)
    with pytest.raises(ValueError, match="tensor-parallel groups of 3"):
        ShardedReplicas(2, 4, tp=3)
    with pytest.raises(TypeError, match="not a ParallelStyle"):
        ShardPlan(ShardedReplicas(2, 2, tp=2), None, {}, {"w": "colwise"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="needs a tp_plan"):
        ShardPlan(ShardedReplicas(2, 2, tp=2), None, {})
    with pytest.raises(ValueError, match="cannot be flat"):
        MeshGroups(ShardedReplicas(2, 2, tp=2), 0, "cpu", flat=True)


def test_a_flat_tensor_parallel_mesh_names_shard_and_tp() -> None:
    """No replica and a script that names two dimensions ((dp_shard, tp), Lightning's (data_parallel,
    tensor_parallel)): the mesh is (S, T) over the same stable groups, and its slices are what the script's
    fully_shard and parallelize_module take."""
    groups = MeshGroups(ShardedReplicas(1, 4, tp=2), 3, "cpu", flat=True, names=("dp", "tp"))
    assert groups.roles() == ("shard", "tp") and groups.mesh.shape == (2, 2)
    assert groups.mesh.mesh.tolist() == [[0, 1], [2, 3]]
    with groups.before_first_generation():
        assert groups.submesh("tp").mesh.tolist() == [2, 3] and groups.submesh("shard").mesh.tolist() == [1, 3]
    assert groups.groups_of("tp") == [[0, 1], [2, 3]] and groups.groups_of("shard") == [[0, 2], [1, 3]]


def test_received_optimizer_state_is_rebuilt_over_each_parameters_mesh() -> None:
    """A TP-sharded weight and a norm's weight live on different meshes; AdamW's state of each must be on its
    parameter's, or the next update fails (DTensor refuses mixed meshes)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from torchpass.rank.state import StateParts, _fill_optimizer, _strip

    groups = MeshGroups(ShardedReplicas(1, 2, tp=2), 0, "cpu")
    with groups.before_first_generation():
        full, dp = groups.mesh, groups.submesh(("replicate", "shard"))
        weight = nn.Parameter(DTensor.from_local(torch.ones(2, 3), full, [Replicate(), Replicate(), Shard(0)]))
        norm = nn.Parameter(DTensor.from_local(torch.ones(3), dp, [Replicate(), Replicate()]))
        opt = torch.optim.AdamW([weight, norm])
        state = {
            "state": {i: {"step": torch.tensor(1.0), "exp_avg": p.detach() * 2} for i, p in enumerate((weight, norm))},
            "param_groups": [{"params": [0, 1], "lr": 0.1}],
        }
        tensors: list[torch.Tensor] = []
        stripped = _strip(state, tensors)
        filled = _fill_optimizer(opt, stripped, tensors, StateParts(mesh=full).mesh)
        assert filled["state"][0]["exp_avg"].device_mesh == full
        assert filled["state"][1]["exp_avg"].device_mesh == dp  # not the job's whole mesh


def test_clip_grad_norm_matches_torchs_on_one_mesh() -> None:
    """On plain tensors (one "mesh") the helper clips exactly as torch does; the mixed-mesh case runs in the oracle."""
    import torchpass as tp

    torch.manual_seed(0)
    ours, theirs = [nn.Parameter(torch.randn(5, 3)) for _ in range(3)], []
    for p in ours:
        p.grad = torch.randn_like(p) * 4
        q = nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        theirs.append(q)
    total = tp.clip_grad_norm_(ours, max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    assert torch.allclose(total, expected)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.allclose(p.grad, q.grad)  # type: ignore[arg-type]
    assert float(tp.clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0)) == 0.0  # no gradient: nothing to clip


def test_a_snapshot_of_a_tp_mesh_restores_only_into_the_same_tp_mesh() -> None:
    """Its manifest's ``mesh`` is [R, S x T] (the parts), and ``mesh_tp`` says how they split: a plain mesh of the
    same part count is refused, naming the options that would take it."""
    from torchpass.snapshot.restore import mesh_problem

    tp_body = {"mesh": [2, 4], "mesh_tp": 2}
    assert mesh_problem(tp_body, ShardedReplicas(2, 4, tp=2)) == ""
    refused = mesh_problem(tp_body, ShardedReplicas(2, 4))
    assert "written by a 2x2x2 mesh and this job's mesh is 2x4" in refused and "mesh_shape=(2, 2), tp=2" in refused
    assert "written by a 2x4 mesh" in mesh_problem({"mesh": [2, 4]}, ShardedReplicas(2, 4, tp=2))
