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
(:mod:`torchpass.rank.backends` shuts their sockets down). Either way the error is caught here and the step is
abandoned on this rank (the optimizer step skipped, registered state rolled back): ``schedule.step()`` is the
unit done exactly once or not at all, since the gradients only reach the optimizer when every stage of every
replica finished it.

Refused at start, naming what is not protected: schedules other than ``ScheduleGPipe`` and ``Schedule1F1B``
(interleaved and zero-bubble schedules hold several stages per rank), a single replica (no one holds a lost
stage), and a pipeline beside FSDP or tensor parallelism (one model, one mesh per job).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from torchpass.errors import TorchPassError
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.sharded.fsdp import ShardedState

__all__ = ["PROTECTED_SCHEDULES", "Pipeline", "PipelineReplicas", "pipeline_layout"]

log = logging.getLogger("clockwork.torchpass.pipeline")

PROTECTED_SCHEDULES: tuple[type, ...] = (ScheduleGPipe, Schedule1F1B)  # one stage per rank, tested here

StageSpec = Sequence[nn.Module] | Callable[[int], nn.Module]


@dataclass(frozen=True)
class PipelineReplicas(ShardedReplicas):
    """HSDP's layout with stages for shards (slot ``r * P + k`` holds stage k): only the names differ, so events
    and messages say which stage moved."""

    def part_name(self, part: int) -> str:
        """``stage K of the RxP pipeline``."""
        return f"stage {part} of the {self.replicas}x{self.shards} pipeline"


def pipeline_layout(mesh_shape: tuple[int, int], schedule: Any, peer_copies: bool = False) -> ShardedReplicas:
    """The layout of ``ctx.wrap_pipeline(mesh_shape=(R, P), schedule=...)``: R replicas of P stages, refusing at
    start what TorchPass cannot protect (``peer_copies``: the job asks for ``peer_copies_in_hsdp``)."""
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
    return PipelineReplicas(replicas, stages)


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
    ) -> None:
        if sharded.parts.model is not None:
            raise TorchPassError("the job's model is already wrapped (one model, one mesh per job)")
        shape = sharded.layout
        self.replica, self.stage_index = shape.coordinate(sharded.host.slot)
        self.num_stages = shape.shards
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
        self._built_generation = -1
        self.rebuilds = 0  # how many times the stage and schedule were built (one per generation it trained in)
        # Called after each schedule step that succeeded, before the gradients are averaged (a time or a metric of
        # the schedule alone; the oracle test's fault point between the two).
        self.schedule_hooks: list[Callable[[], None]] = []
        host, parts = sharded.host, sharded.parts
        parts.model, parts.mesh = module, None  # plain tensors: nothing is rebuilt as a DTensor (label: the stage)
        host.lifecycle.watch_zero_grad(module)
        host.lifecycle.track_model(list(module.buffers()) if host.config.snapshot_buffers else [], None)
        log.info("slot %d: %s", host.slot, parts.label)

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
            stage = PipelineStage(
                self.module, self.stage_index, self.num_stages, self._sharded.host.device, group=groups.current("shard")
            )
            self._schedule = self._schedule_cls(
                stage, self._n_microbatches, loss_fn=self._loss_fn, **self._schedule_kwargs
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
            output = schedule.step(
                *inputs,
                target=target if self.is_last else None,
                losses=losses if self.is_last else None,
                **(kwargs if self.is_first else {}),
            )
        except Exception as exc:
            if not protecting or guard is None:
                raise
            self._schedule = None  # half a step's state (outstanding sends, received chunks) is thrown away
            log.warning("pipeline step abandoned on stage %d: %s", self.stage_index, str(exc).splitlines()[0][:300])
            guard.failed(exc)
            return None
        for hook in self.schedule_hooks:
            hook()
        self._average_gradients()
        self._vote()
        return output

    def _vote(self) -> None:
        """One integer all-reduced over this rank's pipeline (guarded): it completes only once every stage of the
        replica averaged its gradients, so a replica updates all of its stages or none. Without it a stage whose
        column averaged while another stage's column failed (its rank died between the schedule step and the
        all-reduce) committed the step that the other stage abandoned, and no member held that stage at the
        step the first one reached: the job stopped, state lost (test_torchpass_pp.py, ``scheduled``)."""
        flag = torch.ones(1, dtype=torch.int32, device=self._sharded.host.device)
        self._sharded.groups.proxies["shard"].allreduce([flag]).wait()

    def _average_gradients(self) -> None:
        """The stage's gradients summed over its replicate column (one flat all-reduce, guarded: a failure
        abandons the step) and divided by the replicas."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
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
