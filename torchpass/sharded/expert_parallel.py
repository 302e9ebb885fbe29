"""Expert parallelism (an MoE layer's experts sharded over the mesh's ``ep`` dimension) beside HSDP, under TorchPass.

Why here, and why so narrow: a rank's state must be a function of its coordinate for a spare to be rebuilt from
the same coordinate of another replica. Under ``ctx.wrap_fsdp(model, mesh_shape=(R, E), ep=E)`` the mesh is
``("replicate", "ep")``: the ep dimension is FSDP's shard dimension (torchtitan's ep carved out of dp_shard, with
dp_shard == ep), so slot ``r * E + e`` holds FSDP shard ``e`` of every non-expert parameter *and* experts
``e * n .. (e + 1) * n - 1`` (``n = num_experts / E``) of every :class:`MoE` layer. Both are part ``e`` of the
existing :class:`~torchpass.rank.transfer_plan.ShardedReplicas` layout, held by slot ``(r', e)`` of every other
replica: transfers, plans, the replica check and snapshots need nothing new.

What this module adds:

* :class:`MoE`: a top-1 MoE feed-forward layer (router, ``num_experts`` SwiGLU-free MLP experts as two stacked
  weights) that runs unchanged without expert parallelism (every expert local) and, once :func:`shard_experts`
  cut it, dispatches tokens to the experts' ranks with ``all_to_all`` and combines them back with another.
  Dispatch is capacity-based with no dropping (each rank sends ``num_experts x tokens`` slots, zero-padded), so
  every all-to-all has equal splits known in advance: no count exchange, and a skipped all-to-all (an abandoned
  step) leaves well-formed zeros.
* :class:`AllToAll`: the autograd function; forward and backward run one ``alltoall_base`` each on the mesh's
  ep proxy (:class:`torchpass.sharded.shard_mesh.GenerationGroup`), so a dead peer abandons the step exactly as
  an FSDP or TP collective does (the proxy reports to the step's guard and never raises in a step).
* :func:`shard_experts`: replaces each layer's expert weights by this rank's slice (plain parameters, which
  ``fully_shard`` is told to ignore), and reduces their gradients over the replicate dimension only (a sum over
  the replicas of the same ep coordinate, divided by ``R * E``: the mean over the global batch, as FSDP's
  gradients of the non-expert parameters). That all-reduce also runs on a guarded proxy.

With tensor parallelism beside it (``ep=E, tp=T, tp_plan=...``: the mesh is ``("replicate", "ep", "tp")``, tp
innermost), the plan cuts the dense layers (attention) over tp and the experts are not cut by it: every TP rank of
a group keeps its ep coordinate's experts whole (torchtitan's expert-TP degree 1). The group's ranks hold the
same tokens at the MoE input (a RowwiseParallel output is all-reduced over tp), so each routes them over its own
ep group (the ranks at its tp coordinate: the mesh's shard groups) and computes the same expert outputs; the
expert gradients are then equal over tp and summed over the replicas only, divided by the data-parallel ranks
(R * E). A rank's part, (e, t), holds experts e and its TP slice of FSDP shard e.

Carved from a larger dp_shard (``mesh_shape=(R, S)`` with S a multiple of E, torchtitan's dp_shard_mod_ep x
dp_shard_in_ep): FSDP still shards the dense parameters over all S; FSDP shard s holds the experts of ep
coordinate ``e = s % E`` whole (not sharded further over dp_shard_mod_ep), its ep group is the E adjacent FSDP
shards ``(s // E) * E ..`` of its row (the mesh's ``ep`` groups), and an expert weight's gradient is summed over
every rank holding the same experts (``ep_holders``: the R * S / E ranks at ep coordinate e) and divided by
R * S. A rank's part is still its FSDP shard s (with experts e), held by (r', s) of every other replica.

Refused at start (:func:`check_expert_layout`): shards that are not a multiple of ep, ep carved from a larger
dp_shard together with tensor parallelism, and a model with no :class:`MoE` layer. Without a replica (R = 1) a
rank's part is kept by pure FSDP's peer copies (:mod:`torchpass.sharded.peer_copy`), experts included. Other MoE
implementations are not recognised: their experts would be FSDP parameters like any other.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllreduceOptions, AllToAllOptions

from torchpass.errors import TorchPassError

__all__ = ["EP_DIM", "AllToAll", "MoE", "check_expert_layout", "expert_names", "shard_experts"]

log = logging.getLogger("clockwork.torchpass.expert_parallel")

EP_DIM = "ep"  # the name of the mesh's expert-parallel dimension (FSDP's shard dimension under ep)


class AllToAll(torch.autograd.Function):
    """An equal-split ``all_to_all`` of dim 0 over ``group`` whose backward is the reverse ``all_to_all``; with
    no group (one ep rank) the identity."""

    @staticmethod
    def forward(ctx: Any, chunks: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(chunks, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _all_to_all(chunks: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return chunks.clone()
    output = torch.zeros_like(chunks)  # what an abandoned step computes on: zeros, never garbage
    group.alltoall_base(output, chunks.contiguous(), [], [], AllToAllOptions()).wait()
    return output


class MoE(nn.Module):
    """A top-1 mixture of ``num_experts`` experts (``w2(silu(x @ w1))`` each) with a linear router.

    ``w1`` is ``(experts, dim, hidden)`` and ``w2`` ``(experts, hidden, dim)``: after :func:`shard_experts` they
    hold this rank's experts only. Every rank of an ep group must call it with the same number of tokens (the
    all-to-all's splits are equal)."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, dim) / hidden**0.5)
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route each token to its top expert, run the experts where they live, and combine (weighted by the
        router's probability)."""
        dim = x.shape[-1]
        tokens = x.reshape(-1, dim)
        count, experts, ep = tokens.shape[0], self.num_experts, self.ep_size
        local = experts // ep
        gate, expert = torch.softmax(self.router(tokens), dim=-1).max(dim=-1)
        position = (nn.functional.one_hot(expert, experts).cumsum(0) - 1).gather(1, expert[:, None]).squeeze(1)
        slots = tokens.new_zeros(experts, count, dim).index_put((expert, position), tokens)
        # chunk k (experts k*local ..) goes to ep rank k; chunk j received holds rank j's tokens for my experts
        received = AllToAll.apply(slots.reshape(ep, local * count * dim), self.ep_group)
        inputs = received.reshape(ep, local, count, dim).transpose(0, 1).reshape(local, ep * count, dim)
        outputs = torch.bmm(nn.functional.silu(torch.bmm(inputs, self.w1)), self.w2)
        back = outputs.reshape(local, ep, count, dim).transpose(0, 1).reshape(ep, local * count * dim)
        returned = AllToAll.apply(back, self.ep_group).reshape(experts, count, dim)
        return (returned[expert, position] * gate[:, None]).reshape(x.shape)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """The model's :class:`MoE` layers, by qualified name."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def expert_names(model: nn.Module) -> list[str]:
    """The qualified names of the expert weights (what is sharded over ep, not by FSDP)."""
    return [f"{name}.{w}" if name else w for name, _ in moe_layers(model) for w in ("w1", "w2")]


def check_expert_layout(mesh_shape: tuple[int, int], ep: int, tp: int = 1) -> None:
    """Refuse, naming it, an expert-parallel layout TorchPass does not protect (see the module's docstring)."""
    shards = mesh_shape[1]
    if ep < 1:
        raise TorchPassError(f"ep must be >= 1, got {ep}")
    if ep == 1:
        return
    if shards % ep:
        raise TorchPassError(
            f"expert parallelism needs mesh_shape's shards to be a multiple of ep (got {shards} shards, ep={ep})"
        )
    if shards != ep and tp != 1:
        raise TorchPassError(
            f"ep={ep} carved from a larger dp_shard ({shards}) together with tensor parallelism is not built yet "
            "(shards == ep beside tp is)"
        )


def shard_experts(
    model: nn.Module,
    ep_group: dist.ProcessGroup,
    ep_rank: int,
    ep: int,
    replicate_group: dist.ProcessGroup,
    data_ranks: int,
) -> set[nn.Parameter]:
    """Cut every :class:`MoE` layer of ``model`` to this rank's experts (each rank cuts its own copy: the model
    was built identically everywhere, as every TorchPass job's replicas are) and route its tokens over
    ``ep_group``; each backward's contribution to an expert weight's gradient is summed over ``replicate_group``
    and divided by ``data_ranks`` (the ranks that take a batch of their own) before it is accumulated. Returns the
    expert parameters (for ``fully_shard``'s ``ignored_params``). Call before the optimizer is built: the parameters
    are new objects."""
    layers = moe_layers(model)
    if not layers:
        raise TorchPassError(
            f"ep={ep} but the model has no torchpass.sharded.expert_parallel.MoE layer: other MoE implementations "
            "are not recognised (their experts would be sharded by FSDP like any other parameter)"
        )
    ignored: set[nn.Parameter] = set()
    for name, layer in layers:
        if layer.num_experts % ep:
            raise TorchPassError(f"{name or 'the model'}: {layer.num_experts} experts do not split over ep={ep}")
        local = layer.num_experts // ep
        cut = slice(ep_rank * local, (ep_rank + 1) * local)
        for attr in ("w1", "w2"):
            weight = nn.Parameter(getattr(layer, attr).detach()[cut].clone())
            weight.register_hook(_replicate_mean(replicate_group, data_ranks))
            setattr(layer, attr, weight)
            ignored.add(weight)
        layer.ep_group, layer.ep_size = ep_group, ep
    log.info("experts of %d MoE layer(s) sharded over ep=%d (ep rank %d)", len(layers), ep, ep_rank)
    return ignored


def _replicate_mean(group: dist.ProcessGroup, world_size: int) -> Any:
    """A gradient hook that reduces each backward's contribution before it is accumulated into ``.grad``, so that
    gradient accumulation over several backward passes sums reduced contributions (reducing the accumulated
    gradient again would count the earlier ones once per replica)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        reduced = grad.clone()
        group.allreduce([reduced], AllreduceOptions()).wait()  # a sum; guarded like any mesh collective
        return reduced.div_(world_size)

    return hook
