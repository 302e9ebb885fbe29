"""The device mesh of a sharded model (FSDP2, HSDP, and tensor parallelism beside them), owned by TorchPass and
re-bound at every generation.

Why a mesh that outlives generations: ``fully_shard`` keeps its mesh's process groups (FSDP's mesh info
caches them at construction), every parameter is a ``DTensor`` that keeps its mesh, and so is every piece of
optimizer state. Rebuilding all of that after a membership change means either re-running ``fully_shard`` on
an unsharded copy of the model (a whole model per rank, and a gather to make it) or rewriting FSDP's private
state. Neither is needed: the :class:`~torch.distributed.device_mesh.DeviceMesh` TorchPass gives
``fully_shard`` is built once, over one stable :class:`GenerationGroup` per mesh dimension, and each of those
forwards its collectives to the *current* generation's real group of that dimension. After every membership
change :meth:`MeshGroups.bind` forms the new generation's groups (one per replica row and one per shard
column, over the generation's default group; with tensor parallelism also one per TP group, T adjacent slots)
and the proxies forward there. The mesh's shape, this rank's
coordinates in it and every parameter's sharding are functions of the slot, which a recovery never changes,
so nothing in FSDP, DTensor or the optimizer notices the rebuild. DTensor's own collectives
(``clip_grad_norm_``, ``full_tensor``) find the proxies by name (they are registered with c10d again after each
rebuild, which clears that registry).

The proxies are also where a failure stops: inside a step a collective never raises into the user's forward,
backward or optimizer step, exactly as DDP's gradient hook (:mod:`torchpass.rank.ddp`). Before the step's update a
failed or refused collective abandons the step; after it the step commits and the rank recovers right after
(:class:`torchpass.rank.step.StepLifecycle`). The outputs of a collective that did not run are left as they are
(an all-gather's zeroed): an abandoned step's results are thrown away. Outside a step (before the loop, or
after it, say to gather the final weights) a collective runs plainly and raises as torch's would.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as _device_mesh
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

from torchpass.rank.torch_compat import (
    mesh_over_groups,
    register_process_group,
    resolve_process_group,
    work_from_future,
)
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.sharded.gloo_wait import HelperWaiter, wait_polling

__all__ = ["DIM_NAMES", "TP_DIM", "GenerationGroup", "MeshGroups", "StepGuard"]

log = logging.getLogger("clockwork.torchpass.shard_mesh")

DIM_NAMES = ("replicate", "shard")  # the mesh's dimension names, as in FSDP2's HSDP examples
TP_DIM = "tp"  # the tensor-parallel dimension, innermost (a TP group is adjacent slots: one node's ranks)
# Expert parallelism carved from a larger shard dimension: the ep groups (E adjacent FSDP shards of a row) and the
# groups of the ranks holding the same experts; neither is a dimension of the mesh FSDP and DTensor see.
EP_GROUP, EP_HOLDERS = "ep", "ep_holders"
_instances = itertools.count()
# c10d's kNoTimeout: what a C++ caller's wait passes (the functional collectives' wait_tensor, DTensor's and TP's)
NO_TIMEOUT = datetime.timedelta(0)


class StepGuard(Protocol):
    """Where the proxies learn whether a collective may run and report that one failed (:mod:`torchpass.sharded.fsdp`
    implements it over the rank's :class:`torchpass.rank.step.StepLifecycle`)."""

    def protecting(self) -> bool:
        """Whether a step is in progress (outside one, collectives run plainly and raise)."""
        ...

    def admit(self) -> bool:
        """Whether a collective may start now (False once the step is abandoned or the generation is stale)."""
        ...

    def failed(self, error: BaseException | str) -> None:
        """A collective of the step failed (callable from a backend thread)."""
        ...

    def cut_off(self) -> bool:
        """Whether the step's groups were aborted for a newer generation (a gloo wait pending in them is given up:
        :mod:`torchpass.sharded.gloo_wait`)."""
        ...


class _GuardedWork(dist.Work):
    """A real collective's work whose failure is the guard's, never its waiter's: ``wait`` waits on the real work
    and reports an exception instead of raising it. Also the way to wait on a backend work that has no future
    (gloo's reduce-scatter).

    How it waits: in the caller's thread (no callback hop through the backend's thread, which costs a GIL
    hand-over per collective), except that under gloo a wait still pending once the step's groups were aborted
    is given up (:mod:`torchpass.sharded.gloo_wait`: ``helper`` for the works whose timed wait blocks)."""

    def __init__(
        self, work: dist.Work, guard: StepGuard, gloo: bool = False, helper: HelperWaiter | None = None
    ) -> None:
        super().__init__()
        self._work = work
        self._guard = guard
        self._gloo = gloo
        self._helper = helper
        self._failed = False

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the real collective; a failure goes to the guard (the step is abandoned, or settled)."""
        if not self._failed:
            try:
                if timeout is not None and timeout != NO_TIMEOUT:
                    self._work.wait(timeout)
                elif self._helper is not None:
                    self._helper.wait([self._work], self._guard.cut_off, "a collective")
                elif self._gloo:
                    wait_polling(self._work, self._guard.cut_off)
                else:
                    self._work.wait()
            except Exception as exc:
                self._failed = True
                self._guard.failed(exc)
        return True

    def is_completed(self) -> bool:
        """Whether the real collective is done (a failed one is)."""
        return self._failed or self._work.is_completed()

    def is_success(self) -> bool:
        """Always: a failure is reported to the guard, not to the caller."""
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """A future that completes when the collective does, never with an error."""
        future: torch.futures.Future[Any] = torch.futures.Future()
        self.wait()
        future.set_result(None)
        return future


def _completed(value: Any) -> dist.Work:
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(value)
    return work_from_future(future)


class GenerationGroup(dist.ProcessGroup):
    """One mesh dimension's process group as FSDP and DTensor see it: a fixed rank and size, and collectives
    that run on the current generation's real group of that dimension (:class:`MeshGroups`), guarded.

    The methods are the ones FSDP2 (all-gather, reduce-scatter, HSDP's all-reduce) and DTensor's functional
    collectives (``clip_grad_norm_``, ``full_tensor``, redistribution) call; each is offered under both of
    c10d's spellings, the Python one and the C++ one."""

    def __init__(self, groups: MeshGroups, dim: str, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (rank, size): a group without a store
        self._groups = groups
        self._dim = dim
        self._name = f"torchpass_{dim}_{next(_instances)}"  # unique: c10d's registry is per process

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The name c10d's registry knows it by (c10d takes a group's name from its backend; this has none)."""
        return self._name

    def getBackendName(self) -> str:
        """The backend of the real groups (DTensor and FSDP ask, e.g. to pick an all-gather algorithm)."""
        return self._groups.backend_name

    def _run(
        self,
        launch: Callable[[dist.ProcessGroup], dist.Work],
        result: Any,
        skipped: Callable[[], object],
        blocking_wait: bool = False,
    ) -> dist.Work:
        """``launch`` on the current real group, guarded (``blocking_wait``: gloo's work of this kind ignores a
        wait's timeout, so a helper thread waits for it)."""
        real = self._groups.current(self._dim)
        guard = self._groups.guard
        if guard is None or not guard.protecting():
            return launch(real)
        if not guard.admit():
            skipped()
            return _completed(result)
        try:
            work = launch(real)
        except Exception as exc:
            guard.failed(exc)
            skipped()
            return _completed(result)
        gloo = self._groups.backend_name == "gloo"
        return _GuardedWork(work, guard, gloo, self._groups.waiter if gloo and blocking_wait else None)

    # ----- what FSDP2 and DTensor call ----------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """HSDP's gradient all-reduce over the replicas; DTensor's reductions (a gradient norm)."""
        if not isinstance(opts, AllreduceOptions):
            options = AllreduceOptions()
            if opts is not None:
                options.reduceOp = opts
            opts = options
        return self._run(lambda g: g.allreduce(tensors, opts), tensors, _nothing)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """FSDP's parameter all-gather; DTensor's Shard -> Replicate."""
        options = opts if opts is not None else AllgatherOptions()
        return self._run(lambda g: g.all_gather_single(output, input, options), [output], output.zero_)

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """FSDP's gradient reduce-scatter; DTensor's Partial -> Shard."""
        options = opts if opts is not None else ReduceScatterOptions()
        return self._run(lambda g: g.reduce_scatter_single(output, input, options), [output], _nothing, True)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """A list all-gather (uneven shards)."""
        options = opts if opts is not None else AllgatherOptions()
        return self._run(lambda g: g.allgather(outputs, inputs, options), outputs, _nothing)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """DTensor's ``distribute_tensor`` from a source rank."""
        options = opts if opts is not None else BroadcastOptions()
        return self._run(lambda g: g.broadcast(tensors, options), tensors, _nothing)

    def alltoall_base(  # type: ignore[override]
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split: list[int],
        input_split: list[int],
        opts: Any = None,
    ) -> dist.Work:
        """DTensor's Shard(i) -> Shard(j)."""
        options = opts if opts is not None else AllToAllOptions()
        return self._run(
            lambda g: g.alltoall_base(output, input, output_split, input_split, options), [output], _nothing
        )

    def allgather_into_tensor_coalesced(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """DTensor's functional all-gather (``full_tensor``, Shard -> Replicate)."""
        options = opts if opts is not None else AllgatherOptions()
        zero = lambda: [t.zero_() for t in outputs]  # noqa: E731
        return self._run(lambda g: g.allgather_into_tensor_coalesced(outputs, inputs, options), outputs, zero)

    def reduce_scatter_tensor_coalesced(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """DTensor's functional reduce-scatter (Partial -> Shard)."""
        options = opts if opts is not None else ReduceScatterOptions()
        launch = lambda g: g.reduce_scatter_tensor_coalesced(outputs, inputs, options)  # noqa: E731
        return self._run(launch, outputs, _nothing, True)

    def barrier(self, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """A barrier over the dimension."""
        options = opts if opts is not None else BarrierOptions()
        return self._run(lambda g: g.barrier(options), None, _nothing)


def _nothing() -> None:
    return None


class MeshGroups:
    """The mesh a sharded model is built over, and the real groups its proxies forward to in this generation.

    :attr:`mesh` is the ``DeviceMesh`` to give ``fully_shard``: dimensions ``("replicate", "shard")``, or only
    ``("shard",)`` for pure FSDP when ``flat`` (``names`` renames them, as a script's ``init_device_mesh`` may).
    With ``tensor_parallel`` (or ``shape.tp > 1``) it is ``("replicate", "shard", "tp")``, tp innermost:
    ``parallelize_module`` takes ``submesh("tp")`` and ``fully_shard`` ``submesh(("replicate", "shard"))``. With
    expert parallelism carved from a larger shard dimension there are two more groups beside the mesh
    (:meth:`expert_groups`). :meth:`bind` runs on every member after each generation's default group formed;
    :meth:`unbind` when it is torn down."""

    def __init__(
        self,
        shape: ShardedReplicas,
        slot: int,
        device_type: str,
        *,
        flat: bool = False,
        names: tuple[str, ...] | None = None,
        tensor_parallel: bool = False,
    ) -> None:
        if not 0 <= slot < shape.world_size:
            raise ValueError(f"slot {slot} is outside a {shape} mesh")
        self.tensor_parallel = tensor_parallel or shape.tp > 1
        if flat and shape.replicas != 1:
            raise ValueError(f"a {shape} mesh has replicas: it cannot be flat")
        self.flat = flat
        roles = self.roles()
        names = roles if names is None else tuple(names)
        if len(names) != len(roles) or len(set(names)) != len(names):
            raise ValueError(f"a {'flat ' if flat else ''}{shape} mesh names {len(roles)} dimension(s), got {names}")
        self.shape = shape
        self.slot = slot
        self.names = names
        self.guard: StepGuard | None = None
        self.waiter = HelperWaiter()  # the collectives' and the pipeline's gloo waits that need a helper thread
        self.backend_name = "gloo"
        self.generation = -1
        tp = shape.tp
        shards = shape.shards // tp  # FSDP shards per replica (each a TP group of tp slots)
        replica, part = shape.coordinate(slot)
        shard, rank_in_tp = divmod(part, tp)
        self._real: dict[str, dist.ProcessGroup] = {}
        self.proxies = {
            "replicate": GenerationGroup(self, "replicate", replica, shape.replicas),
            "shard": GenerationGroup(self, "shard", shard, shards),
        }
        if self.tensor_parallel:
            self.proxies[TP_DIM] = GenerationGroup(self, TP_DIM, rank_in_tp, tp)
        self.carved_ep = shape.ep > 1 and shape.ep != shards
        if self.carved_ep:
            per_row = shards // shape.ep  # ep groups in a replica's row
            self.proxies[EP_GROUP] = GenerationGroup(self, EP_GROUP, shard % shape.ep, shape.ep)
            holder = replica * per_row + shard // shape.ep
            self.proxies[EP_HOLDERS] = GenerationGroup(self, EP_HOLDERS, holder, shape.replicas * per_row)
        layout = torch.arange(shape.world_size, dtype=torch.int)
        layout = layout.view(shape.replicas, shards, tp) if self.tensor_parallel else layout.view(shape.replicas, -1)
        self.mesh = _mesh_over(
            device_type, layout[replica] if flat else layout, names, [self.proxies[r] for r in roles], slot
        )
        self._register()

    def roles(self) -> tuple[str, ...]:
        """What the mesh's dimensions are, outermost first (their names may differ: ``names``)."""
        roles = DIM_NAMES[1:] if self.flat else DIM_NAMES
        return (*roles, TP_DIM) if self.tensor_parallel else roles

    def submesh(self, role: str | tuple[str, ...]) -> DeviceMesh:
        """The mesh's dimension(s) of ``role`` (``"tp"``, or ``("replicate", "shard")``), by the names it was
        given: what ``parallelize_module`` and ``fully_shard`` take beside each other under tensor parallelism."""
        roles = (role,) if isinstance(role, str) else role
        order = self.roles()
        picked = tuple(self.names[order.index(r)] for r in roles)
        return self.mesh[picked[0] if len(picked) == 1 else picked]

    def expert_groups(self) -> tuple[GenerationGroup, GenerationGroup]:
        """An MoE layer's ep group and the group of the ranks holding the same experts: the shard and replicate
        groups when ep is the whole shard dimension, else the narrower groups carved from it."""
        if self.carved_ep:
            return self.proxies[EP_GROUP], self.proxies[EP_HOLDERS]
        return self.proxies["shard"], self.proxies["replicate"]

    def groups_of(self, dim: str) -> list[list[int]]:
        """The slots of each of ``dim``'s groups, in the order every member forms them."""
        shape, tp = self.shape, self.shape.tp
        shards = shape.shards // tp
        if dim == "replicate":
            return [shape.column(part) for part in range(shape.shards)]
        if dim == TP_DIM:
            return [
                [shape.slot(r, s * tp + t) for t in range(tp)] for r in range(shape.replicas) for s in range(shards)
            ]
        ep, rows = shape.ep, range(shape.replicas)
        if dim == EP_GROUP:
            return [[shape.slot(r, m * ep + e) for e in range(ep)] for r in rows for m in range(shards // ep)]
        if dim == EP_HOLDERS:
            return [[shape.slot(r, m * ep + e) for r in rows for m in range(shards // ep)] for e in range(ep)]
        return [[shape.slot(r, s * tp + t) for s in range(shards)] for r in range(shape.replicas) for t in range(tp)]

    @contextlib.contextmanager
    def before_first_generation(self) -> Iterator[None]:
        """While no process group exists yet (the model is sharded, and its optimizer built, before TorchPass forms
        the first generation: a spare builds its model before it joins), c10d's rank query, which a DeviceMesh
        makes when FSDP slices it (``mesh["shard"]``), answers with the slot, which is the rank this process has
        in every generation. Nothing else is faked: no collective runs while sharding."""
        if dist.is_initialized():
            yield
            return
        real = _device_mesh.get_rank
        _device_mesh.get_rank = lambda group=None: self.slot
        try:
            yield
        finally:
            _device_mesh.get_rank = real

    def current(self, dim: str) -> dist.ProcessGroup:
        """This generation's real group of ``dim``; an error before the first generation formed."""
        group = self._real.get(dim)
        if group is None:
            raise RuntimeError(
                f"the sharded model's {dim} group does not exist yet: its collectives run once TorchPass formed "
                "the job's first generation (inside ctx.steps)"
            )
        return group

    def bind(self, generation: int, new_group: Callable[[list[int]], dist.ProcessGroup | None] | None = None) -> None:
        """Form this generation's groups of every dimension over its default group (every member calls this, in
        the same order: :meth:`groups_of`) and point the proxies at the ones this rank belongs to. ``new_group``
        makes one group (the backend's: gloo's tracks its sockets for an abort, NCCL's is non-blocking)."""
        world_size = dist.get_world_size()
        if world_size != self.shape.world_size:
            raise RuntimeError(
                f"a {self.shape} mesh needs {self.shape.world_size} ranks, the generation has {world_size}"
            )
        make = new_group or _new_group
        real: dict[str, dist.ProcessGroup] = {}
        dims = [("shard", ranks) for ranks in self.groups_of("shard")]
        if not self.flat:  # pure FSDP's mesh is flat: no replicate groups
            dims += [("replicate", ranks) for ranks in self.groups_of("replicate")]
        if self.tensor_parallel:
            dims += [(TP_DIM, ranks) for ranks in self.groups_of(TP_DIM)]
        if self.carved_ep:
            dims += [(dim, ranks) for dim in (EP_GROUP, EP_HOLDERS) for ranks in self.groups_of(dim)]
        for dim, ranks in dims:
            group = make(ranks)
            if self.slot in ranks:
                if group is None:
                    raise RuntimeError(f"no {dim} group {ranks} formed for slot {self.slot}")
                real[dim] = group
        self._real = real
        self.backend_name = str(dist.get_backend())
        self.generation = generation
        self._register()

    def unbind(self) -> None:
        """The generation's groups are gone (destroyed with its default group)."""
        self._real = {}
        self.generation = -1

    def _register(self) -> None:
        """c10d's registry of group names (which ``destroy_process_group`` clears) must name the proxies, so that
        DTensor's functional collectives find them."""
        for proxy in self.proxies.values():
            try:
                if resolve_process_group(proxy.group_name) is proxy:
                    continue
            except (RuntimeError, ValueError):  # not registered (yet, or since the last destroy)
                pass
            register_process_group(proxy.group_name, proxy)


def _new_group(ranks: list[int]) -> dist.ProcessGroup | None:
    """A real group of ``ranks`` (None outside it); a one-rank group too: FSDP runs no collective on it."""
    group = dist.new_group(ranks)
    return group if isinstance(group, dist.ProcessGroup) else None


def _mesh_over(
    device_type: str, layout: torch.Tensor, names: tuple[str, ...], groups: list[GenerationGroup], rank: int
) -> DeviceMesh:
    """A ``DeviceMesh`` over ``groups`` that needs no default process group yet.

    ``DeviceMesh.from_group`` builds exactly this, but asks the default group for this process's rank, and the
    model is sharded (and its optimizer built) before TorchPass forms the first generation (a spare builds its
    model before it joins). So the mesh is made as ``from_group`` makes it, with the rank given: the slot."""
    return mesh_over_groups(device_type, layout, names, groups, rank)
