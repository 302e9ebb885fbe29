"""Pipeline parallelism under TorchPass: (dp_replicate R x pp P), a dead stage rebuilt from its replica.

``ctx.wrap_pipeline(stages, mesh_shape=(R, P), schedule=ScheduleGPipe, n_microbatches=M, loss_fn=...)`` makes
slot ``r * P + k`` stage ``k`` of replica ``r``: its module is ``stages[k]`` (or ``stages(k)``), its state (the
stage's parameters, optimizer state, schedulers and registered objects) is *part* ``k`` of a
:class:`~torchpass.rank.transfer_plan.ShardedReplicas` layout, held by stage ``k`` of every other replica. So the
transport, the plan and the recovery are HSDP's (:mod:`torchpass.sharded.fsdp`): a spare that takes slot (r, k)
receives stage ``k``'s state from (r', k) and every stage resumes the same step, whose micro-batches
``ctx.steps`` gives again (one batch per replica: the P ranks of a pipeline take the same one).

Why TorchPass builds the ``PipelineStage`` and the schedule itself, and again in every generation: a stage keeps
its process group (and its peers' global ranks) for life, and a schedule keeps its stage and the state of a
half-finished step (outstanding sends, received activations, shape metadata). The groups are the mesh's
(:class:`~torchpass.sharded.shard_mesh.MeshGroups`: its "shard" rows are the pipelines, its "replicate" columns
the same stage across replicas), formed anew after every membership change, so the stage and schedule are built
over the current generation's row before its first step, and after any step that failed.

Why a failure never hangs or raises into the loop: :meth:`Pipeline.step` runs one ``schedule.step()``, averages
the stage's gradients over its replicate column, then votes over its pipeline row (one integer: a replica updates
all of its stages or none, :meth:`Pipeline._vote`), each guarded like every mesh collective. A peer that dies
breaks its neighbours' gloo sockets, so a ``recv`` for its activations or a ``send`` of gradients to it fails at
once; a rank blocked on a live peer that is itself stuck (the other replica's all-reduce, a neighbour waiting in
recovery) is freed when the coordinator announces the next generation, which aborts every group of the old one
(:mod:`torchpass.rank.backends` shuts their sockets down), and a gloo send that the abort does not free (one
queued on a connection just closed) is given up at that announcement (:mod:`torchpass.sharded.gloo_wait`).
Either way the error is caught here and the step is abandoned on this rank (the optimizer step skipped,
registered state rolled back): ``schedule.step()`` is the unit done exactly once or not at all, since the
gradients only reach the optimizer when every stage of every replica finished it.

Refused at start, naming what is not protected: schedules other than ``ScheduleGPipe`` and ``Schedule1F1B``
(interleaved and zero-bubble schedules hold several stages per rank), a single replica (no one holds a lost
stage), a pipeline beside a second model (one model, one mesh per job), and FSDP and TP together in the stages.

A third dimension inside the stages (:class:`PipelineReplicas`): with FSDP (``dp_shard=S``) each stage is HSDP
over the (replicate, shard) dimensions and the pipeline the mesh's innermost one; FSDP reduces the gradients in
the schedule's last backward, and an abandoned step's half-done FSDP backward is ended on the spot
(:meth:`Pipeline.step`). With tensor parallelism (``tp=T``) each stage is ``parallelize_module``-d over the
innermost dimension; TP's collectives in forward and backward are the mesh's, guarded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from torchpass.errors import TorchPassError
from torchpass.rank.state import local_tensor
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.sharded.fsdp import ShardedState, ShardSpec, sharded_modules
from torchpass.sharded.shard_mesh import DIM_NAMES, TP_DIM

__all__ = ["PROTECTED_SCHEDULES", "Pipeline", "PipelineReplicas", "pipeline_layout"]

log = logging.getLogger("clockwork.torchpass.pipeline")

PROTECTED_SCHEDULES: tuple[type, ...] = (ScheduleGPipe, Schedule1F1B)  # one stage per rank, tested here

StageSpec = Sequence[nn.Module] | Callable[[int], nn.Module]
TPPlan = Mapping[str, ParallelStyle] | Callable[[int], Mapping[str, ParallelStyle]]  # one for all, or per stage


@dataclass(frozen=True)
class PipelineReplicas(ShardedReplicas):
    """HSDP's layout with stages for shards (slot ``r * P + k`` holds stage k): only the names differ, so events
    and messages say which stage moved.

    A third dimension takes the innermost place of the mesh (the one its groups call ``tp``):

    * FSDP inside each stage (``fsdp``, dp_shard S > 1): the stages are innermost (``tp`` = P), slot
      ``r * S * P + s * P + k`` holds FSDP shard s of stage k, a pipeline is P adjacent slots (one batch), and
      each stage is sharded over the (replicate, shard) dimensions;
    * tensor parallelism inside each stage (``tp`` = T, not ``fsdp``): slot ``r * P * T + k * T + t`` holds TP
      rank t of stage k, the stages are the shard dimension, and a replica (P * T adjacent slots) takes one batch.
    """

    fsdp: bool = field(default=False, kw_only=True)

    @property
    def stages(self) -> int:
        """P: the pipeline's stages."""
        if self.tp == 1:
            return self.shards
        return self.tp if self.fsdp else self.shards // self.tp

    @property
    def batch_slots(self) -> int:
        """How many adjacent slots take the same batch: a pipeline, or a replica under tensor parallelism."""
        return self.stages if self.fsdp or self.tp == 1 else self.shards

    def stage_of(self, part: int) -> tuple[int, int]:
        """(stage, FSDP shard or TP rank) of ``part``."""
        if self.tp > 1 and not self.fsdp:
            return divmod(part, self.tp)
        inner, stage = divmod(part, self.stages)
        return stage, inner

    def part_name(self, part: int) -> str:
        """``stage K of the RxP pipeline``; with FSDP in the stages ``stage K (FSDP shard S) of the RxSxP
        pipeline``; with tensor parallelism ``stage K (tp T) of the RxPxT pipeline``."""
        if self.tp == 1:
            return f"stage {part} of the {self.replicas}x{self.shards} pipeline"
        stage, inner = self.stage_of(part)
        return f"stage {stage} ({'FSDP shard' if self.fsdp else 'tp'} {inner}) of the {self} pipeline"


def pipeline_layout(
    mesh_shape: tuple[int, int], schedule: Any, peer_copies: bool = False, dp_shard: int = 1, tp: int = 1
) -> PipelineReplicas:
    """The layout of ``ctx.wrap_pipeline(mesh_shape=(R, P), schedule=..., dp_shard=S, tp=T)``: R replicas of P
    stages, each stage FSDP-sharded over S ranks when S > 1 or tensor-parallel over T ranks when T > 1, refusing
    at start what TorchPass cannot protect (``peer_copies``: the job asks for ``peer_copies_in_hsdp``)."""
    if peer_copies:
        raise TorchPassError(
            "peer_copies_in_hsdp is not built for pipeline parallelism yet: a lost stage is rebuilt from the same "
            "stage of another replica only (set peer_copies_in_hsdp = false)"
        )
    if not isinstance(schedule, type) or schedule not in PROTECTED_SCHEDULES:
        name = getattr(schedule, "__name__", repr(schedule))
        raise TorchPassError(
            f"schedule {name} is not protected by TorchPass: only ScheduleGPipe and Schedule1F1B (one stage per "
            "rank) are; interleaved, looped and zero-bubble schedules (several stages per rank) are not built yet"
        )
    replicas, stages = mesh_shape
    if stages < 2:
        raise TorchPassError(f"a pipeline needs at least 2 stages (mesh_shape=(replicas, stages), got {stages})")
    if replicas < 2:
        raise TorchPassError(
            "pipeline parallelism is protected only beside a replica (mesh_shape's replicas >= 2): a lost stage is "
            "rebuilt from the same stage of another replica, and peer copies of a stage are not implemented yet"
        )
    if dp_shard < 1 or tp < 1:
        raise TorchPassError(f"dp_shard and tp must be >= 1 (FSDP shards, TP ranks per stage), got {dp_shard}, {tp}")
    if dp_shard > 1 and tp > 1:
        raise TorchPassError("FSDP and tensor parallelism together inside pipeline stages are not built yet")
    if dp_shard > 1:
        return PipelineReplicas(replicas, dp_shard * stages, tp=stages, fsdp=True)
    return PipelineReplicas(replicas, stages * tp, tp=tp)


class Pipeline:
    """One rank's stage of a replicated pipeline: its module, and ``step`` (one schedule step, then the stage's
    gradients averaged over the replicas), which never raises a peer's failure into the loop."""

    def __init__(
        self,
        sharded: ShardedState,
        stages: StageSpec,
        schedule: type,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None,
        schedule_kwargs: dict[str, Any],
        shard: ShardSpec | None = None,
        fsdp_kwargs: dict[str, Any] | None = None,
        tp_plan: TPPlan | None = None,
    ) -> None:
        if sharded.parts.model is not None:
            raise TorchPassError("the job's model is already wrapped (one model, one mesh per job)")
        shape = sharded.layout
        if not isinstance(shape, PipelineReplicas):
            raise TorchPassError(f"a pipeline needs a pipeline layout, got a {shape} mesh")
        self.replica, part = shape.coordinate(sharded.host.slot)
        self.stage_index = shape.stage_of(part)[0]
        self.num_stages = shape.stages
        self.fsdp = shape.fsdp  # FSDP inside each stage: the pipeline is the mesh's innermost dimension
        self.tensor_parallel = shape.tp > 1 and not shape.fsdp
        self._pp_dim = TP_DIM if self.fsdp else "shard"
        # the stage's other dimension inside its replica, which the vote also covers
        self._inner_dim = "shard" if self.fsdp else TP_DIM if self.tensor_parallel else None
        if callable(stages) and not isinstance(stages, nn.Module | Sequence):
            module = stages(self.stage_index)
        else:
            listed = list(stages)  # type: ignore[arg-type]
            if len(listed) != self.num_stages:
                raise TorchPassError(f"{len(listed)} stage module(s) for a pipeline of {self.num_stages} stages")
            module = listed[self.stage_index]
        if not isinstance(module, nn.Module):
            raise TorchPassError(f"stage {self.stage_index} is a {type(module).__name__}, not an nn.Module")
        if n_microbatches < 1:
            raise TorchPassError(f"n_microbatches must be >= 1, got {n_microbatches}")
        self.module = module
        self._sharded = sharded
        self._schedule_cls = schedule
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._schedule_kwargs = schedule_kwargs
        self._schedule: Any = None
        self._stage: PipelineStage | None = None
        self._built_generation = -1
        self.rebuilds = 0  # how many times the stage and schedule were built (one per generation it trained in)
        # Called after each schedule step that succeeded, before the gradients are averaged (a time or a metric of
        # the schedule alone; the oracle test's fault point between the two).
        self.schedule_hooks: list[Callable[[], None]] = []
        host, parts = sharded.host, sharded.parts
        if self.fsdp:
            self._fully_shard(shard, fsdp_kwargs or {})
            sharded.adopt(module)  # DTensors, each rebuilt over its own parameter's mesh when received
        else:
            if shard is not None or fsdp_kwargs:
                raise TorchPassError("shard= and fsdp_kwargs= shard each stage over dp_shard ranks: give dp_shard > 1")
            if self.tensor_parallel:
                self._parallelize(tp_plan)
            elif tp_plan is not None:
                raise TorchPassError("tp_plan= shards each stage over tp ranks: give tp > 1")
            parts.model = module
            if not self.tensor_parallel:
                parts.mesh = None  # plain tensors: nothing is rebuilt as a DTensor (label: the stage)
            host.lifecycle.watch_zero_grad(module)
            host.lifecycle.track_model(list(module.buffers()) if host.config.snapshot_buffers else [], None)
        log.info("slot %d: %s", host.slot, parts.label)

    def _parallelize(self, tp_plan: TPPlan | None) -> None:
        """``parallelize_module`` the stage over the mesh's tp dimension with its plan (``tp_plan``, or
        ``tp_plan(k)`` for stage k), as torchtitan does before it builds the stages; each TP rank cuts its own copy
        of the initial weights (no collective runs before the first generation forms). The stage's output must
        be a plain tensor (a last style with ``use_local_output=True``, the default): that is what it sends."""
        plan = tp_plan(self.stage_index) if callable(tp_plan) else tp_plan
        if not plan:
            raise TorchPassError(f"tp > 1 needs a tp_plan for stage {self.stage_index} ({{name: ParallelStyle}})")
        for name, style in plan.items():
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"tp_plan[{name!r}] is a {type(style).__name__}, not a ParallelStyle")
        groups = self._sharded.groups
        with groups.before_first_generation():
            parallelize_module(self.module, groups.submesh(TP_DIM), dict(plan), src_data_rank=None)

    def _fully_shard(self, shard: ShardSpec | None, options: dict[str, Any]) -> None:
        """``fully_shard`` the submodules ``shard`` names (deepest first), then the stage, over the (replicate,
        shard) dimensions: HSDP inside the stage, whose gradient reduction runs in the schedule's last backward
        (``PipelineStage.perform_reduce_grad``), over TorchPass's guarded groups like every mesh collective."""
        if "mesh" in options:
            raise TypeError("ctx.wrap_pipeline builds the mesh itself (mesh_shape=, dp_shard=); do not pass mesh=")
        groups = self._sharded.groups
        with groups.before_first_generation():
            mesh = groups.submesh(DIM_NAMES)
            for _, submodule in sharded_modules(self.module, shard):
                fully_shard(submodule, mesh=mesh, **options)
            fully_shard(self.module, mesh=mesh, **options)

    @property
    def is_first(self) -> bool:
        """Whether this rank is the first stage (the one ``step`` gives the inputs to)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank is the last stage (the one that computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def _build(self) -> Any:
        """The stage and schedule over this generation's pipeline row (built again after a membership change or a
        failed step: neither survives one)."""
        groups = self._sharded.groups
        if self._schedule is None or self._built_generation != groups.generation:
            device, row = self._sharded.host.device, groups.current(self._pp_dim)
            self._stage = PipelineStage(self.module, self.stage_index, self.num_stages, device, group=row)
            self._schedule = self._schedule_cls(
                self._stage, self._n_microbatches, loss_fn=self._loss_fn, **self._schedule_kwargs
            )
            self._built_generation = groups.generation
            self.rebuilds += 1
        return self._schedule

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any) -> Any:
        """One ``schedule.step()`` on every stage of this replica, then the stage's gradients averaged over the
        replicas. Every rank calls it with the same arguments (the replica's batch): the inputs go to the first
        stage, ``target`` and ``losses`` to the last. Inside ``ctx.steps`` a failure abandons the step and
        returns None; the last stage's merged outputs otherwise (None on other stages)."""
        guard = self._sharded.groups.guard
        protecting = guard is not None and guard.protecting()
        if protecting and guard is not None and not guard.admit():
            return None
        try:
            schedule = self._build()
            inputs = args if self.is_first else ()
            with self._waits_guarded(protecting):
                output = schedule.step(
                    *inputs,
                    target=target if self.is_last else None,
                    losses=losses if self.is_last else None,
                    **(kwargs if self.is_first else {}),
                )
        except Exception as exc:
            if not protecting or guard is None:
                raise
            stage, self._stage, self._schedule = self._stage, None, None  # half a step's state is thrown away
            log.warning("pipeline step abandoned on stage %d: %s", self.stage_index, str(exc).splitlines()[0][:300])
            guard.failed(exc)
            if self.fsdp and stage is not None:
                self._finish_fsdp_backward(stage)
            return None
        for hook in self.schedule_hooks:
            hook()
        if not self.fsdp:  # FSDP reduced them over (replicate, shard) in the schedule's last backward
            self._average_gradients()
        self._vote()
        return output

    def _finish_fsdp_backward(self, stage: PipelineStage) -> None:
        """End the FSDP backward that the abandoned schedule step left half done on this rank, as a finished step
        ends it (``perform_reduce_grad``: post-backward and FSDP's final callback; their collectives are skipped,
        the step being abandoned), and reshard. Without it the stage's parameters stay unsharded and FSDP's state
        mid-backward, while a replacement's FSDP starts clean: in the redo the two ran different collectives and
        waited for each other until the group's timeout."""
        try:
            stage.perform_reduce_grad(1)
            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        except Exception as exc:
            raise TorchPassError(
                f"stage {self.stage_index}: FSDP could not be reset after an abandoned step ({exc}); stopping, "
                "since the redo would start from a state no other member has"
            ) from exc

    def _waits_guarded(self, protecting: bool) -> AbstractContextManager[None]:
        """Where the schedule waits on its gloo sends and receives: on a helper thread, given up once this rank's
        control thread aborted the generation's groups (:mod:`torchpass.sharded.gloo_wait`: gloo can leave a send
        to a closed peer pending until its timeout). NCCL's waits do not block the CPU, and outside ``ctx.steps``
        nothing is abandoned."""
        groups = self._sharded.groups
        if not protecting or groups.guard is None or groups.backend_name != "gloo":
            return nullcontext()
        return groups.waiter.guarding(groups.guard.cut_off)

    def _vote(self) -> None:
        """One integer all-reduced over this rank's pipeline (guarded): it completes only once every stage of the
        replica averaged its gradients, so a replica updates all of its stages or none. Without it a stage whose
        column averaged while another stage's column failed (its rank died between the schedule step and the
        all-reduce) committed the step that the other stage abandoned, and no member held that stage at the
        step the first one reached: the job stopped, state lost (test_torchpass_pp.py, ``scheduled``)."""
        flag = torch.ones(1, dtype=torch.int32, device=self._sharded.host.device)
        proxies = self._sharded.groups.proxies
        proxies[self._pp_dim].allreduce([flag]).wait()
        if self._inner_dim is not None:  # then over the stage's FSDP shards or TP ranks: done on one rank, every
            proxies[self._inner_dim].allreduce([flag]).wait()  # pipeline of the replica voted

    def _average_gradients(self) -> None:
        """The stage's gradients summed over its replicate column (one flat all-reduce, guarded: a failure
        abandons the step) and divided by the replicas."""
        grads = [local_tensor(p.grad) for p in self.module.parameters() if p.grad is not None]  # TP: local shards
        replicas = self._sharded.layout.replicas
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._sharded.groups.proxies["replicate"].allreduce([flat]).wait()
        flat.div_(replicas)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
