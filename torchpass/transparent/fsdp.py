"""Transparent mode for an unmodified FSDP2 script: its ``init_device_mesh`` and ``fully_shard``, on TorchPass's mesh.

An FSDP2 script builds its mesh with ``init_device_mesh(device, (R, S), mesh_dim_names=(...))`` (HSDP), or
``(N,)`` (pure FSDP), and shards its model with ``fully_shard(module, mesh=mesh, ...)``, bottom-up. In
transparent mode (:mod:`torchpass.transparent.bootstrap`):

* ``init_device_mesh`` returns the mesh TorchPass owns for that shape
  (:meth:`torchpass.rank.context.Context.shard_state`, the script's dimension names kept): its groups follow every
  generation, and from then on the rank's shard is what moves to a replacement (from a live holder of the same shard).
  One mesh per job; a shape of three or more dimensions (tensor parallelism) is refused with the reason.
* ``fully_shard`` runs the real one over that mesh (before the first generation exists, DeviceMesh's rank query
  answers with the slot); without ``mesh=`` it uses the job's mesh, or makes a pure-FSDP one as FSDP2 would. The
  outermost module sharded (the model, sharded last) is the job's model: its state moves, its buffers roll back,
  and its first forward pass checks that a loader is tracked, as transparent DDP's does.
* A framework that builds the mesh and calls ``fully_shard`` itself (Lightning's ``ModelParallelStrategy``) is
  asked, through its adapter, which data-parallel mesh its request stands for and, as the model grows, to
  register its own state (:mod:`torchpass.frameworks.lightning`).

Everything else (the optimizer over the DTensor parameters, LR schedulers, the DistributedSampler loader, the
script's own collectives) is transparent mode's as for DDP: the session sees the optimizers and the loader, and
FSDP's and DTensor's collectives abandon the step instead of raising (:mod:`torchpass.sharded.shard_mesh`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
import torch.distributed.distributed_c10d as c10d
import torch.distributed.fsdp as fsdp
import torch.distributed.tensor.parallel as tensor_parallel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchpass.errors import TorchPassError
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.sharded.fsdp import ShardedState, unsynchronised_buffers
from torchpass.sharded.shard_mesh import TP_DIM, MeshGroups
from torchpass.transparent.session import Session

__all__ = ["FsdpInterposers"]

Patch = Callable[[Any, str, Any], None]


class FsdpInterposers:
    """The FSDP2 entry points a session replaces (:meth:`install`, with the interposers' own undoable patch)."""

    def __init__(self, session: Session, internal: Callable[[], bool]) -> None:
        self.session = session
        self.internal = internal
        self.sharded: ShardedState | None = None
        self.tops: list[nn.Module] = []  # the outermost modules fully_shard-ed so far
        self.buffers_checked = False

    def install(self, patch: Patch) -> None:
        """Replace ``init_device_mesh``, ``fully_shard`` and ``parallelize_module`` wherever a script imports them
        from."""
        real_mesh, real_shard = device_mesh.init_device_mesh, fsdp.fully_shard
        mesh_stand_in = functools.wraps(real_mesh)(self._init_device_mesh(real_mesh))
        shard_stand_in = functools.wraps(real_shard)(self._fully_shard(real_shard))
        for owner in (device_mesh, dist, _module("torch.distributed.tensor")):
            if owner is not None and getattr(owner, "init_device_mesh", None) is real_mesh:
                patch(owner, "init_device_mesh", mesh_stand_in)
        patch(device_mesh, "get_rank", self._mesh_rank(device_mesh.get_rank))
        real_parallelize = tensor_parallel.parallelize_module
        parallelize_stand_in = functools.wraps(real_parallelize)(self._parallelize_module(real_parallelize))
        for owner in (tensor_parallel, _module("torch.distributed.tensor.parallel.api")):
            if owner is not None and getattr(owner, "parallelize_module", None) is real_parallelize:
                patch(owner, "parallelize_module", parallelize_stand_in)
        for name in (
            "torch.distributed.fsdp",
            "torch.distributed.fsdp._fully_shard",
            "torch.distributed._composable.fsdp",
        ):
            owner = _module(name)
            if owner is not None and getattr(owner, "fully_shard", None) is real_shard:
                patch(owner, "fully_shard", shard_stand_in)

    def _init_device_mesh(self, real: Callable[..., DeviceMesh]) -> Callable[..., DeviceMesh]:
        def init_device_mesh(
            device_type: str, mesh_shape: tuple[int, ...], *, mesh_dim_names: tuple[str, ...] | None = None, **kw: Any
        ) -> DeviceMesh:
            if self.internal():
                return real(device_type, mesh_shape, mesh_dim_names=mesh_dim_names, **kw)
            shape = tuple(int(n) for n in mesh_shape)
            names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
            tp_dims = [i for i, name in enumerate(names or ()) if _names_tensor_parallel(name)]
            if names is not None and any(_names_context_parallel(name) for name in names):
                raise TorchPassError(
                    f"transparent mode: init_device_mesh(mesh_dim_names={names}) names a context-parallel "
                    "dimension: context parallelism is not protected (leave it out of the mesh when its size is 1)"
                )
            if tp_dims not in ([], [len(shape) - 1]) or len(shape) not in (1, 2, 2 + bool(tp_dims)) or kw:
                raise TorchPassError(
                    f"transparent mode: init_device_mesh({shape}{', ' + ', '.join(kw) if kw else ''}, "
                    f"mesh_dim_names={names}) is not a mesh TorchPass can own: it takes (N,) for FSDP, (replicas, "
                    "shards) for HSDP, and either with a tensor-parallel dimension named tp innermost, without "
                    "backend_override"
                )
            if names is not None and any("ep" in name.lower().split("_") for name in names):
                raise TorchPassError(
                    f"transparent mode: init_device_mesh(mesh_dim_names={names}) names an expert-parallel dimension: "
                    "expert parallelism (MoE) in transparent mode is not built; use ctx.wrap_fsdp(..., ep=E)"
                )
            if names is not None and any("pp" in name.lower().split("_") for name in names):
                raise TorchPassError(
                    f"transparent mode: init_device_mesh(mesh_dim_names={names}) names a pipeline-parallel dimension: "
                    "pipeline parallelism in transparent mode is not built; use ctx.wrap_pipeline"
                )
            ctx = self.session.ctx
            if device_type.split(":")[0] != ctx.device.type:
                raise TorchPassError(
                    f"transparent mode: init_device_mesh({device_type!r}) on a job whose collectives run on "
                    f"{ctx.device.type} (backend {ctx.config.backend})"
                )
            tp = shape[-1] if tp_dims else 1
            replicas, shards = (1, *shape[:1]) if len(shape) - len(tp_dims) == 1 else shape[:2]
            layout = ShardedReplicas(replicas, shards * tp, tp=tp)
            self.sharded = ctx.shard_state(layout, names, tensor_parallel=bool(tp_dims))
            return self.sharded.groups.mesh

        return init_device_mesh

    def _mesh_rank(self, real: Callable[..., int]) -> Callable[..., int]:
        """c10d's rank query as DeviceMesh makes it (``mesh.get_local_rank()``). Before TorchPass forms the first
        generation there is no default group to ask, yet a script or a framework may size its sampler from the
        mesh then (Lightning's ``distributed_sampler_kwargs``): the mesh's own groups know their rank, the
        slot's place in that dimension, which no generation changes. Slicing the mesh (``mesh["dp_shard"]``)
        asks for the rank in the world: the slot, as in every generation."""

        def get_rank(group: Any = None) -> int:
            sharded = self.sharded
            if sharded is not None and not c10d.is_initialized():
                if group is None:
                    return sharded.groups.slot
                if any(group is proxy for proxy in sharded.groups.proxies.values()):
                    return int(group.rank())
            return real(group)

        return get_rank

    def _fully_shard(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def fully_shard(module: Any, *, mesh: DeviceMesh | None = None, **kw: Any) -> Any:
            if self.internal():
                return real(module, mesh=mesh, **kw)
            ctx = self.session.ctx
            if self.sharded is None:  # no init_device_mesh: FSDP2's default, one dimension over every rank
                self.sharded = ctx.shard_state(ShardedReplicas(1, ctx.world_size))
            groups = self.sharded.groups
            data_parallel = tuple(role for role in groups.roles() if role != TP_DIM)
            if mesh is None:
                mesh = groups.submesh(data_parallel) if groups.tensor_parallel else groups.mesh
            elif not _over(mesh, groups, data_parallel):
                where = "the mesh init_device_mesh returned"
                if groups.tensor_parallel:
                    where = f"its data-parallel slice mesh[{', '.join(map(repr, groups.names[:-1]))}]"
                raise TorchPassError(
                    f"transparent mode: fully_shard over a mesh TorchPass did not make (give it {where}; another "
                    "sub-mesh or a mesh of your own groups cannot follow a recovery)"
                )
            with groups.before_first_generation():
                result = real(module, mesh=mesh, **kw)
            modules = module if isinstance(module, list | tuple) else [module]
            for one in modules:
                self._adopt(one)
            return result

        return fully_shard

    def _parallelize_module(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def parallelize_module(
            module: nn.Module, device_mesh: DeviceMesh | None = None, parallelize_plan: Any = None, **kw: Any
        ) -> Any:
            if self.internal():
                return real(module, device_mesh, parallelize_plan, **kw)
            groups = self.sharded.groups if self.sharded is not None else None
            if groups is None or not groups.tensor_parallel:
                raise TorchPassError(
                    "transparent mode: parallelize_module before init_device_mesh made a mesh with a tensor-parallel "
                    "dimension (name it tp, innermost: (dp_shard, tp) or (dp_replicate, dp_shard, tp))"
                )
            if device_mesh is None or not _over(device_mesh, groups, (TP_DIM,)):
                raise TorchPassError(
                    f"transparent mode: parallelize_module over a mesh other than mesh[{groups.names[-1]!r}] of the "
                    "mesh init_device_mesh returned; another mesh cannot follow a recovery"
                )
            # No collective can run before TorchPass forms the first generation: each TP rank cuts its part of the
            # initial weights from its own copy (src_data_rank=None), which every rank builds alike (one seed).
            kw["src_data_rank"] = None
            with groups.before_first_generation():
                return real(module, device_mesh, parallelize_plan, **kw)

        return parallelize_module

    def _adopt(self, module: nn.Module) -> None:
        """Keep the outermost modules sharded so far; once one holds all the others, it is the job's model (FSDP2
        shards bottom-up: the model itself comes last)."""
        if any(module is top or _holds(top, module) for top in self.tops):
            return  # inside a module sharded before it: FSDP2 itself refuses that at the first forward
        self.tops = [top for top in self.tops if not _holds(module, top)] + [module]
        if len(self.tops) == 1:
            assert self.sharded is not None
            self.sharded.adopt(module)
            self.session.model = module
            module.register_forward_pre_hook(self._first_forward_check)
            if self.session.framework is not None:  # its counters and callbacks move with the shard
                self.session.framework.adopt_sharded(module)

    def _first_forward_check(self, module: nn.Module, _args: Any) -> None:
        if len(self.tops) > 1:
            raise TorchPassError(
                "transparent mode protects one model; this script fully_shard-ed modules that no one module holds "
                "(shard the model itself too, or one module holding them all, or use the model-aware API)"
            )
        if not self.buffers_checked:  # as ctx.wrap_fsdp warns (an error with transparent_strict)
            self.buffers_checked = True
            assert self.sharded is not None
            why = unsynchronised_buffers(module, self.sharded.layout.replicas)
            if why:
                self.session.warn(why)
        # A training forward (grad enabled); an evaluation forward, such as Lightning's sanity check of its
        # validation loop before training, may come before the training loader exists.
        if self.session.loader is None and torch.is_grad_enabled():
            raise TorchPassError(
                "transparent mode: the sharded model trains on batches from a loader TorchPass cannot see (no "
                "DataLoader over a DistributedSampler was built before the first forward pass); use a "
                "DistributedSampler or the model-aware API (see 'Sharded training' in docs/user-guide.md)"
            )


def _names_tensor_parallel(name: str) -> bool:
    """A mesh dimension named as torchtitan's (``tp``) or Lightning's (``tensor_parallel``) TP dimension."""
    words = name.lower().split("_")
    return "tp" in words or words[:2] == ["tensor", "parallel"]


def _names_context_parallel(name: str) -> bool:
    words = name.lower().split("_")
    return "cp" in words or words[:2] == ["context", "parallel"]


def _over(mesh: DeviceMesh, groups: MeshGroups, roles: tuple[str, ...]) -> bool:
    """Whether ``mesh`` is the slice of TorchPass's mesh over ``roles``: its dimensions' groups are those roles'
    stable groups, in order (a slice the script took, by its own names, of the mesh init_device_mesh returned)."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != len(roles):
        return False
    try:
        return all(mesh.get_group(i) is groups.proxies[role] for i, role in enumerate(roles))
    except (RuntimeError, ValueError, KeyError):  # a mesh without registered groups is not TorchPass's
        return False


def _holds(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _module(name: str) -> Any:
    """An imported module by name, or None (torch builds without it)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
