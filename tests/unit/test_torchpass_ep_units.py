"""The pieces of TorchPass's expert parallelism that need no job: the MoE layer's routing (the same result with
every expert local as a per-token loop), cutting experts to an ep coordinate, how a slot's state is named, and
what ``ctx.wrap_fsdp(..., ep=E)`` refuses at start. The multi-rank behaviour is the oracle's (test_torchpass_ep.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from torchpass.errors import TorchPassError
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.sharded.expert_parallel import MoE, expert_names, shard_experts
from torchpass.sharded.fsdp import mesh_layout
from torchpass.sharded.shard_mesh import MeshGroups


def test_the_moe_layer_sends_each_token_to_its_top_expert() -> None:
    torch.manual_seed(0)
    layer = MoE(8, 16, 4)
    x = torch.randn(3, 5, 8)
    got = layer(x)
    tokens = x.reshape(-1, 8)
    probs = torch.softmax(layer.router(tokens), dim=-1)
    expected = []
    for token, p in zip(tokens, probs, strict=True):
        e = int(p.argmax())
        expected.append(nn.functional.silu(token @ layer.w1[e]) @ layer.w2[e] * p[e])
    assert got.shape == x.shape
    assert torch.allclose(got.reshape(-1, 8), torch.stack(expected), atol=1e-6)
    got.sum().backward()  # gradients reach the experts and the router
    assert layer.w1.grad is not None and layer.router.weight.grad is not None


def test_an_ep_mesh_names_a_slot_by_its_ep_coordinate() -> None:
    shape = mesh_layout((2, 2), ep=2)
    assert shape == ShardedReplicas(2, 2, ep=2) and shape.parts_of(3) == (1,) and shape.column(1) == [1, 3]
    assert shape.part_name(1) == "ep 1 (experts and FSDP shard 1) of the 2x2 (replicate x ep) mesh"
    groups = MeshGroups(shape, 3, "cpu", names=("replicate", "ep"))
    assert groups.mesh.mesh_dim_names == ("replicate", "ep") and groups.mesh.get_coordinate() == (1, 1)
    assert groups.groups_of("shard") == [[0, 1], [2, 3]]  # the ep groups: one replica's row
    assert groups.groups_of("replicate") == [[0, 2], [1, 3]]  # where expert gradients are summed


def test_experts_are_cut_to_the_ep_coordinate() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), MoE(8, 16, 4))
    layer = model[1]
    assert isinstance(layer, MoE)
    full = layer.w1.detach().clone()
    groups = MeshGroups(ShardedReplicas(2, 2, ep=2), 1, "cpu")
    experts = shard_experts(model, groups.proxies["shard"], 1, 2, groups.proxies["replicate"], 4)
    assert layer.ep_size == 2 and layer.ep_group is groups.proxies["shard"]
    assert torch.equal(layer.w1, full[2:]) and {id(p) for p in experts} == {id(layer.w1), id(layer.w2)}
    assert expert_names(model) == ["1.w1", "1.w2"]


def test_ep_carved_from_a_larger_dp_shard_has_its_own_groups() -> None:
    """(2 x dp_shard 4, ep 2): FSDP shards over all 4; the ep groups are 2 adjacent shards of a row, and the
    ranks holding the same experts are every (replica, shard) at that ep coordinate."""
    shape = ShardedReplicas(2, 4, ep=2)
    groups = MeshGroups(shape, 6, "cpu")  # replica 1, FSDP shard 2: ep coordinate 0 of the row's second ep group
    assert groups.groups_of("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups.groups_of("ep_holders") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    ep_group, holders = groups.expert_groups()
    assert (ep_group.rank(), ep_group.size(), holders.rank(), holders.size()) == (0, 2, 3, 4)
    assert shape.part_name(6 % 4) == "shard 2 (with the experts of ep 0) of the 2x4 (replicate x shard, ep 2) mesh"
    plain = MeshGroups(ShardedReplicas(2, 2, ep=2), 3, "cpu")  # ep is the whole shard dimension
    assert plain.expert_groups() == (plain.proxies["shard"], plain.proxies["replicate"])
    with pytest.raises(ValueError, match="do not split into ep groups of 2"):
        ShardedReplicas(2, 3, ep=2)


def test_what_is_refused_at_start() -> None:
    beside_tp = mesh_layout((2, 2), 2, {"w": ColwiseParallel()}, ep=2)  # (replicate, ep, tp): TP beside EP
    assert beside_tp == ShardedReplicas(2, 4, tp=2, ep=2)
    assert beside_tp.part_name(3) == "part 3 (ep 1: its experts and FSDP shard, tp 1) of the 2x2x2 mesh"
    assert mesh_layout((2, 4), ep=2) == ShardedReplicas(2, 4, ep=2)  # ep carved from a larger dp_shard
    with pytest.raises(TorchPassError, match="a multiple of ep"):
        mesh_layout((2, 3), ep=2)
    with pytest.raises(TorchPassError, match="together with tensor parallelism is not built"):
        mesh_layout((2, 4), 2, {"w": ColwiseParallel()}, ep=2)
    assert mesh_layout((1, 2), ep=2) == ShardedReplicas(1, 2, ep=2)  # no replica: peer copies keep each part
    with pytest.raises(TorchPassError, match="ep must be >= 1"):
        mesh_layout((2, 2), ep=0)
    groups = MeshGroups(ShardedReplicas(2, 2, ep=2), 0, "cpu")
    with pytest.raises(TorchPassError, match=r"no torchpass\.sharded\.expert_parallel\.MoE layer"):
        shard_experts(nn.Linear(4, 4), groups.proxies["shard"], 0, 2, groups.proxies["replicate"], 4)
    with pytest.raises(TorchPassError, match="3 experts do not split over ep=2"):
        shard_experts(MoE(4, 4, 3), groups.proxies["shard"], 0, 2, groups.proxies["replicate"], 4)


def test_a_snapshot_of_an_ep_mesh_restores_only_into_the_same_ep_mesh() -> None:
    """Its manifest records ``mesh_ep`` (its parts hold experts): a plain HSDP mesh of the same shape is refused,
    and so is an ep snapshot restored into it, naming the options that would take it."""
    from torchpass.snapshot.restore import mesh_problem

    ep_body = {"mesh": [2, 2], "mesh_ep": 2}
    assert mesh_problem(ep_body, ShardedReplicas(2, 2, ep=2)) == ""
    refused = mesh_problem(ep_body, ShardedReplicas(2, 2))
    assert "written by a 2x2 (ep 2) mesh and this job's mesh is 2x2" in refused and "mesh_shape=(2, 2), ep=2" in refused
    assert "written by a 2x2 mesh and this job's mesh is 2x2 (ep 2)" in mesh_problem(
        {"mesh": [2, 2]}, ShardedReplicas(2, 2, ep=2)
    )
