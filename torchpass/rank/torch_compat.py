"""The private parts of torch that TorchPass relies on, each behind a name that says why it is needed.

Why a module of its own: a private attribute changes between torch releases without notice, and a silent change
in one of them is the kind of defect that ends a run bitwise different from its fault-free twin. Kept in one place,
each use is checked against the torch release that is tested (:data:`TESTED_TORCH`), and a layout it does not
recognise is refused with the reason instead of being guessed at. Importing this module on another torch release
fails with that reason, unless ``TORCHPASS_UNTESTED_TORCH=1`` asks to run anyway (a warning then).

What is here: c10d's work-from-future, group registry, abort and default group (the process-group rebuild); a
``DeviceMesh`` made over TorchPass's proxy groups before any default group exists (sharded models); DDP's reducer
wrapped so that it never rebuilds its buckets; FSDP2's held-back gradients of an accumulation window; DTensor's
strided shard placement (the peer-copy wire names it); the pipeline schedules' wait on their sends and receives.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.placement_types import Placement

from torchpass.errors import TorchPassError

__all__ = [
    "TESTED_TORCH",
    "FixedBuckets",
    "abort_all_groups",
    "check_fsdp_internals",
    "default_group",
    "drop_held_back_gradients",
    "forget_default_group",
    "holds_back_gradients",
    "is_strided_shard",
    "mesh_over_groups",
    "register_process_group",
    "resolve_process_group",
    "restart_group_names",
    "route_pipeline_waits",
    "strided_shard",
    "work_from_future",
]

TESTED_TORCH = "2.13"  # the release (major.minor) every private use below was checked against
ENV_UNTESTED = "TORCHPASS_UNTESTED_TORCH"


def _check_release(version: str) -> None:
    if version.split("+")[0].split(".")[:2] == TESTED_TORCH.split("."):
        return
    message = (
        f"TorchPass is tested with torch {TESTED_TORCH}.x and relies on parts of it that change without notice; "
        f"this is torch {version}"
    )
    if os.environ.get(ENV_UNTESTED) != "1":
        raise TorchPassError(f"{message} (set {ENV_UNTESTED}=1 to run anyway, at your own risk)")
    warnings.warn(f"{message}: running anyway ({ENV_UNTESTED}=1)", RuntimeWarning, stacklevel=2)


_check_release(torch.__version__)

# c10d's Work around a future: what a proxy or comm hook returns for a collective it completes itself.
work_from_future: Callable[[torch.futures.Future[Any]], dist.Work] = torch._C._distributed_c10d._create_work_from_future  # type: ignore[attr-defined]
# c10d's registry of group names, which ``destroy_process_group`` clears and DTensor's collectives look up.
register_process_group: Any = torch._C._distributed_c10d._register_process_group  # type: ignore[attr-defined]
resolve_process_group: Any = torch._C._distributed_c10d._resolve_process_group  # type: ignore[attr-defined]


def default_group() -> dist.ProcessGroup:
    """The current default group, without ``dist``'s per-call checks (DDP's gradient hook calls it per bucket)."""
    return dist.distributed_c10d._get_default_group()


def abort_all_groups() -> None:
    """Abort every NCCL communicator of this process (c10d's abort of the default group reaches all groups)."""
    dist.distributed_c10d._abort_process_group()


def restart_group_names() -> None:
    """Name the next process groups from the start again (torch 2.13: ``_world.group_count``), as
    ``destroy_process_group`` does, when no default group exists.

    Why: torch names a group without ranks of its own (the default group, a ``new_group``) by a per-process count,
    and its rendezvous keys carry the name. ``init_process_group`` counts the name before it meets its peers, and
    only destroying a formed default group starts the count again. A rank whose formation of a generation failed
    (a member killed while the group formed) therefore named every later generation's groups one further than a
    rank that never failed, or a newcomer: they waited for each other's keys under different names until the job
    failed after ``max_resets`` rebuilds."""
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


def forget_default_group() -> None:
    """Drop a default group that refuses ``destroy_process_group`` (an NCCL group whose eager init failed) from
    c10d's books, so that the next generation's ``init_process_group`` does not find it."""
    dist.distributed_c10d._world.default_pg = None


def mesh_over_groups(
    device_type: str, layout: torch.Tensor, names: tuple[str, ...], groups: Sequence[dist.ProcessGroup], rank: int
) -> DeviceMesh:
    """A ``DeviceMesh`` over ``groups`` (one per dimension) that needs no default process group: what
    ``DeviceMesh.from_group`` builds, with this process's rank given instead of asked of the default group."""
    mesh = DeviceMesh(device_type, layout, mesh_dim_names=names, _init_backend=False, _rank=rank)
    mesh._dim_group_names = [group.group_name for group in groups]  # type: ignore[misc]
    for group in groups:
        mesh._pg_registry[group.group_name] = group
    return mesh


_PipelineWait = Callable[[list[dist.Work]], None]


def route_pipeline_waits(wait: _PipelineWait) -> _PipelineWait:
    """Have torch's pipeline schedules wait on their sends and receives through ``wait``, and return the wait it
    replaces (torch's own, on the first call: what ``wait`` falls back to outside a protected step).

    torch 2.13: every schedule waits on a batch of P2P works through the module function
    ``torch.distributed.pipelining.schedules._wait_batch_p2p``, looked up at each call
    (:mod:`torchpass.sharded.gloo_wait` says why TorchPass needs its own)."""
    from torch.distributed.pipelining import schedules

    current = getattr(schedules, "_wait_batch_p2p", None)
    if not callable(current):
        raise TorchPassError(f"this torch's pipeline schedules have no _wait_batch_p2p (tested: {TESTED_TORCH})")
    schedules._wait_batch_p2p = wait  # type: ignore[assignment]
    return current


class FixedBuckets:
    """DDP's reducer, except that it declines to rebuild its buckets (everything else goes to the reducer).

    DDP calls ``reducer._rebuild_buckets()`` from Python before each forward; the C++ side never does. The
    comm hook is registered on the real reducer before this wrapper is installed."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


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
            if not hasattr(group, "comm_ctx") or not hasattr(group, "_post_forward_indices"):
                raise TorchPassError(
                    "this torch release's FSDP2 keeps its forward order where TorchPass cannot find it "
                    "(FSDPParamGroup.comm_ctx.post_forward_order), so a rank that rejoins could prefetch other "
                    "all-gathers than its peers; TorchPass is tested with torch 2.13"
                )
            for param in getattr(group, "fsdp_params", None) or [None]:
                if param is None or not hasattr(param, "unsharded_accumulated_grad"):
                    raise TorchPassError(
                        "this torch release's FSDP2 keeps the gradients of an accumulation window where TorchPass "
                        "cannot find them (FSDPParam.unsharded_accumulated_grad), so a failed window could not be "
                        "redone exactly; TorchPass is tested with torch 2.13"
                    )


def forget_forward_order(model: nn.Module | None) -> None:
    """Forget the order in which FSDP2 saw its modules' forwards since its last backward (the comm context's
    ``post_forward_order`` and each group's indices into it), from which its backward prefetches all-gathers.
    A backward clears it; a forward under ``no_grad`` (validation) adds to it until the next backward does. A
    survivor that ran a validation in an abandoned step, and redoes the step beside a replacement that never ran
    one, would prefetch one all-gather more than the replacement in its first backward, and both would wait out
    the collective timeout in mismatched collectives (Lightning, a failure on an epoch's last batch). Cleared on
    every member at every join, every rank's first backward of a generation prefetches the same all-gathers; the
    numbers do not change (a prefetch only gathers earlier)."""
    for module in model.modules() if model is not None else ():
        if not isinstance(module, FSDPModule):
            continue
        for group in _param_groups(module):
            order = getattr(group.comm_ctx, "post_forward_order", None)  # made at FSDP2's lazy init
            if order is not None:
                order.clear()
            group._post_forward_indices.clear()


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
