"""Gradient clipping for a model whose parameters live on different meshes (tensor parallelism beside FSDP).

Why: under ``ctx.wrap_fsdp(..., tp=T, tp_plan=...)`` a TP-sharded weight is a ``DTensor`` over (replicate, shard,
tp) and a parameter the plan leaves alone (a norm's weight) one over (replicate, shard) only. torch's
``clip_grad_norm_`` stacks the per-parameter norms into one DTensor and refuses operands on different meshes
(``All operands in aten.stack.default must have the same mesh``). :func:`clip_grad_norm_` takes the norm of each
mesh's gradients separately, reduces each to a plain number (its collectives go through TorchPass's mesh groups,
so a failure abandons the step like any other), combines them, and scales every gradient by the same factor:
the result is torch's over one mesh.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (on any mix of meshes) to a total ``norm_type`` norm of ``max_norm``;
    the total norm before clipping, a plain tensor."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = grad.device_mesh if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    torch._foreach_mul_(grads, coefficient)
    return total
