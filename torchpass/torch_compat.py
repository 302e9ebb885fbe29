"""The private parts of torch that TorchPass relies on, each behind a function that says why it is needed.

Why a module of its own: a private attribute changes between torch releases without notice, and a silent change
in one of them is the kind of defect that ends a run bitwise different from its fault-free twin. Kept in one place,
each use is checked against the torch release that is tested, and a layout it does not recognise is refused with
the reason instead of being guessed at.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchpass.errors import TorchPassError

__all__ = ["check_fsdp_internals", "drop_held_back_gradients", "restart_group_names"]


def _param_groups(module: FSDPModule) -> list[Any]:
    """FSDP2's parameter groups of one ``fully_shard``-ed module (torch 2.13: ``FSDPState._fsdp_param_groups``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        single = getattr(state, "_fsdp_param_group", None)
        groups = [] if single is None else [single]
    return list(groups)


def check_fsdp_internals(model: nn.Module) -> None:
    """Refuse at start an FSDP2 whose held-back gradients :func:`drop_held_back_gradients` could not find: an
    abandoned accumulation window would then leave its gradients in the redone one (a silent difference)."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in _param_groups(module):
            for param in getattr(group, "fsdp_params", None) or [None]:
                if param is None or not hasattr(param, "unsharded_accumulated_grad"):
                    raise TorchPassError(
                        "this torch release's FSDP2 keeps the gradients of an accumulation window where TorchPass "
                        "cannot find them (FSDPParam.unsharded_accumulated_grad), so a failed window could not be "
                        "redone exactly; TorchPass is tested with torch 2.13"
                    )


def drop_held_back_gradients(model: nn.Module) -> int:
    """Drop the gradients FSDP2 holds outside the parameters: a micro-batch's unsharded gradient kept for the
    window's reduce-scatter while ``set_requires_gradient_sync(False)`` holds, in its own dtype
    (``unsharded_accumulated_grad``, mixed precision) or on the unsharded parameter, and HSDP's partial reduce
    output kept while ``set_requires_all_reduce(False)`` holds. ``zero_grad`` reaches only the sharded
    parameters' gradients, so without this an abandoned window's gradients are summed into the redone one.
    Returns how many tensors were dropped."""
    dropped = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in _param_groups(module):
            if getattr(group, "_partial_reduce_output", None) is not None:
                group._partial_reduce_output = None
                dropped += 1
            for param in group.fsdp_params:
                if param.unsharded_accumulated_grad is not None:
                    param.unsharded_accumulated_grad = None
                    dropped += 1
                unsharded = getattr(param, "_unsharded_param", None)  # exists once it was all-gathered
                if unsharded is not None and unsharded.grad is not None:
                    unsharded.grad = None
                    dropped += 1
    return dropped


def restart_group_names() -> None:
    """Name the next process groups from the start again (torch 2.13: ``_world.group_count``), as
    ``destroy_process_group`` does, when no default group exists.

    Why: torch names a group without ranks of its own (the default group, a ``new_group``) by a per-process count,
    and its rendezvous keys carry the name. ``init_process_group`` counts the name before it meets its peers, and
    only destroying a formed default group starts the count again. A rank whose formation of a generation failed
    (a member killed while the group formed) therefore named every later generation's groups one further than a
    rank that never failed, or a newcomer: they waited for each other's keys under different names until the job
    failed after ``max_resets`` rebuilds."""
    if not c10d.is_initialized():
        c10d._world.group_count = 0
