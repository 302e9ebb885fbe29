"""The private parts of torch that TorchPass relies on, each behind a function that says why it is needed.

Why a module of its own: a private attribute changes between torch releases without notice, and a silent change
in one of them is the kind of defect that ends a run bitwise different from its fault-free twin. Kept in one place,
each use is checked against the torch release that is tested, and a layout it does not recognise is refused with
the reason instead of being guessed at.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.placement_types import Placement

from torchpass.errors import TorchPassError

__all__ = [
    "check_fsdp_internals",
    "drop_held_back_gradients",
    "holds_back_gradients",
    "is_strided_shard",
    "strided_shard",
]


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


def holds_back_gradients(model: nn.Module) -> bool:
    """Whether FSDP2 holds gradients outside the parameters now (see :func:`drop_held_back_gradients`): after a
    micro-batch under ``set_requires_gradient_sync(False)``, until the reduce-scatter of the window's last one."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in _param_groups(module):
            if getattr(group, "_partial_reduce_output", None) is not None:
                return True
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                if param.unsharded_accumulated_grad is not None or (
                    unsharded is not None and unsharded.grad is not None
                ):
                    return True
    return False


def _strided_shard_type() -> type[Placement] | None:
    """DTensor's strided shard placement (torch 2.13: ``placement_types._StridedShard``), which FSDP2 gives a
    parameter that tensor parallelism already sharded on the same dimension; None where this torch has none."""
    from torch.distributed.tensor import placement_types

    found = getattr(placement_types, "_StridedShard", None)
    return found if isinstance(found, type) else None


def is_strided_shard(placement: Placement) -> bool:
    """Whether ``placement`` is a strided shard (its ``dim`` and ``split_factor`` describe it)."""
    kind = _strided_shard_type()
    return kind is not None and isinstance(placement, kind)


def strided_shard(dim: int, split_factor: int) -> Placement:
    """A strided shard placement, as a peer's state description names it (the peer-copy wire's decoder)."""
    kind = _strided_shard_type()
    if kind is None:
        raise TorchPassError("a peer sent a strided shard placement, which this torch release does not know")
    return kind(dim, split_factor=split_factor)  # type: ignore[call-arg]
