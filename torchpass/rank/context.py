"""The rank side of TorchPass: ``init``, the wrappers, and the step boundary where recovery happens.

A training script calls :func:`init`, wraps its model and optimizer, and iterates ``ctx.steps(...)``. Nothing
else changes, and nothing is sent anywhere per step: the boundary between two steps compares two integers
(the generation this rank trains in, the newest one the coordinator announced).

What a step is, and when it counts:

* Before step S is handed to the loop body, every RNG is reseeded from (seed, slot, S) and the batch of
  (S, slot) is fetched, so a step can be redone with the same batch and the same dropout masks.
* While the body runs, gradient averaging goes through TorchPass's DDP hook. If a collective fails (a peer
  died; its sockets closed) or a newer generation is announced, the step is *abandoned*: the hook stops
  launching collectives, the wrapped optimizer (and LR scheduler, grad scaler) skip their updates, and no
  exception reaches the user's code. Once every wrapped optimizer has stepped, the update is in the parameters
  and the step can no longer be abandoned (a redo would apply it twice): a ``ctx.all_reduce`` failing after
  that returns False, the step commits, and the rank recovers right after.
* When the body returns, a step that was not abandoned is *committed* (``ctx.committed_step`` = S); an
  abandoned one is rolled back (buffers, registered state, gradients) and the rank recovers.

Recovery (:meth:`Context.recover`): tear down the broken group (which unblocks peers still inside a
collective with us), tell the coordinator if the collective broke, and join the next generation
(:mod:`torchpass.rank.rejoin`: rendezvous, new process group, agreement on who holds the newest committed state,
transfer to everyone behind). A survivor that had already committed step S keeps it and does not redo it; one
that had not receives S's result instead of recomputing it. A planned migration is the same machinery, with
the departing rank handing its live state straight to the spare before it exits cleanly (``SystemExit(0)``
out of ``ctx.steps``).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from clockwork.contracts.coordinator_wire import GenerationInfo
from torchpass.config import TorchPassConfig
from torchpass.errors import TorchPassError
from torchpass.events import EventSink
from torchpass.rank.backends import CommBackend
from torchpass.rank.budget_gate import check_budgets
from torchpass.rank.buffers import StagedBuffers
from torchpass.rank.control import ControlChannel, CoordinatorLost, CoordinatorRefused, JobStopped
from torchpass.rank.data import batch_source
from torchpass.rank.ddp import TorchPassDDP
from torchpass.rank.output import RankLog
from torchpass.rank.rejoin import CoordinatorLink, ProcessGroupTransport, RankPosition, Rejoiner
from torchpass.rank.replica_check import ReplicaNet
from torchpass.rank.state import StateParts
from torchpass.rank.step import StepLifecycle, carried_gradients_reason
from torchpass.rank.torch_compat import forget_forward_order
from torchpass.rank.transfer_plan import Replicated, ShardedReplicas
from torchpass.rank_env import LaunchEnv
from torchpass.sharded.fsdp import ShardedState, ShardPlan, mesh_layout
from torchpass.snapshot import RestoreError, Snapshotter, restart_advice, restore, restore_target

if TYPE_CHECKING:
    from torchpass.coordinator.service import Coordinator
    from torchpass.sharded.pipeline import Pipeline

__all__ = ["Context", "TorchPassError"]

_T = TypeVar("_T")
_FOREVER_S = 10 * 365 * 24 * 3600.0


class Context:
    """One rank's TorchPass state; create it with :func:`torchpass.init`."""

    def __init__(
        self,
        config: TorchPassConfig,
        env: LaunchEnv,
        channel: ControlChannel,
        backend: CommBackend,
        store_server: dist.TCPStore,
        event_sink: EventSink | None,
        coordinator: Coordinator | None = None,
    ) -> None:
        self.config = config
        self.env = env
        self.worker_id = env.worker_id
        self.world_size = env.world_size
        self.position = RankPosition(slot=env.initial_slot if env.initial_slot is not None else -1)
        self.is_replacement = env.initial_slot is None
        self.event_sink = event_sink
        self.log = RankLog(lambda: f"slot {self.slot} g{self.generation} step {self.step} {self.worker_id}")
        self._channel = channel
        self._backend = backend
        self._store_server = store_server  # hosts the rendezvous of generations this rank is chosen for
        self._coordinator = coordinator  # standalone mode only: an in-process coordinator for one rank
        self._parts = StateParts()
        self._model: TorchPassDDP | None = None
        self._commit_hooks: list[Callable[[int], None]] = []  # the script's (ctx.on_commit)
        self._state_hooks: list[Callable[[int], None]] = []  # TorchPass's copies of the committed state
        self._pending: GenerationInfo | None = None  # a spare's first generation, found before ctx.steps
        # The step in progress and what an abandoned one is undone from (torchpass.rank.step).
        self.lifecycle = StepLifecycle(channel, self._parts, lambda: self.generation, self.log, event_sink)
        # Joining generations (torchpass.rank.rejoin): DDP's transport moves the whole state as one part.
        self.link = CoordinatorLink(channel, self.log, self.close)
        # The runtime net for silent divergence (torchpass.rank.replica_check): replicas compare, transfers are checked.
        self.net = ReplicaNet(config.replica_check_every_steps, self._parts, self.log, event_sink)
        chunk, net = int(config.transfer_chunk_mb * (1 << 20)), self.net if self.net.on else None
        self.rejoiner = Rejoiner(
            worker_id=self.worker_id,
            config=config,
            link=self.link,
            transport=ProcessGroupTransport(backend, {0: self._parts}, chunk, net),
            layout=Replicated(),
            position=self.position,
            lifecycle=self.lifecycle,
            own_store_port=store_server.port,
            log=self.log,
            event_sink=event_sink,
        )
        self.mesh: DeviceMesh | None = None  # a sharded model's device mesh (ctx.wrap_fsdp)
        self._sharded: ShardedState | None = None  # its state: what moves, how
        self._data_group = 1  # adjacent slots that take the same batch (a tensor-parallel group)
        self._closed = False
        self._snapshotter = Snapshotter(config, self.log, event_sink)
        self.lifecycle.before_update_hooks.append(self._snapshotter.before_update)
        self._restore_from = restore_target(config) if env.initial_slot is not None else (None, False)
        channel.on_generation = self._on_generation

    # ----- what the user reads --------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This rank's slot (its rank in every generation's process group)."""
        return self.position.slot

    @property
    def slot(self) -> int:
        """This rank's slot (-1 for a spare not given one yet)."""
        return self.position.slot

    @property
    def generation(self) -> int:
        """The generation this rank trains in (-1 before it joined the first)."""
        return self.position.generation

    @property
    def step(self) -> int:
        """The step being executed (-1 outside ``ctx.steps``)."""
        return self.lifecycle.step

    @property
    def committed_step(self) -> int:
        """The last step whose update this rank's state contains (-1 before the first)."""
        return self.position.committed

    @property
    def device(self) -> torch.device:
        """Where the backend's collectives run (cpu for gloo, this rank's GPU for NCCL)."""
        return self._backend.device

    # ----- wrapping -------------------------------------------------------------------------

    def wrap_model(self, model: nn.Module, *, broadcast_buffers: bool = True, **ddp_kwargs: Any) -> TorchPassDDP:
        """Wrap ``model`` in TorchPass's DDP (extra keyword arguments go to DDP, e.g. ``device_ids``).

        Its parameters and buffers are part of the state that moves. One model per job; further modules
        whose state matters can be registered with :meth:`register`.
        """
        if self._model is not None or self._sharded is not None:
            raise TorchPassError("ctx.wrap_model was already called; register further modules with ctx.register")
        return self.adopt_model(TorchPassDDP(model, self, broadcast_buffers=broadcast_buffers, **ddp_kwargs))

    def adopt_model(self, ddp: TorchPassDDP) -> TorchPassDDP:
        """Make ``ddp`` (built over this context) the job's model: its state moves, its buffers roll back.

        Split from :meth:`wrap_model` for transparent mode, whose DDP stand-in constructs itself."""
        self._model = ddp
        self._parts.model = ddp.module
        self.lifecycle.watch_zero_grad(ddp)
        self.lifecycle.watch_zero_grad(ddp.module)
        self.net.buffers = bool(ddp.synced_buffers)  # slot 0's on every rank at a commit: replicas compare them
        self.lifecycle.track_model(
            list(ddp.module.buffers()) if self.config.snapshot_buffers else [],
            StagedBuffers(ddp.synced_buffers) if ddp.synced_buffers and self.world_size > 1 else None,
        )
        return ddp

    def wrap_fsdp(
        self,
        model: nn.Module,
        *,
        mesh_shape: tuple[int, int],
        shard: Any = None,
        tp: int = 1,
        tp_plan: Mapping[str, ParallelStyle] | None = None,
        ep: int = 1,
        **kw: Any,
    ) -> nn.Module:
        """FSDP2 over a ``(replicas, shards)`` mesh TorchPass owns: ``fully_shard(..., **kw)`` on what ``shard``
        names, deepest first, then on ``model`` (returned). See :mod:`torchpass.sharded.fsdp`.

        With ``tp_plan`` the mesh is ``(replicas, shards, tp)`` (``replicas * shards * tp`` ranks, tp innermost):
        ``parallelize_module(model, <tp submesh>, tp_plan)`` first, then ``fully_shard`` over the (replicate,
        shard) submesh, as torchtitan's ``parallelize_llama``; the ranks of one TP group (adjacent slots) take
        the same batch from ``ctx.steps``. ``ep=E``: :mod:`torchpass.sharded.expert_parallel`."""
        shape = mesh_layout(mesh_shape, tp, tp_plan, ep)
        names = ("replicate", "ep", "tp")[: 2 + (tp_plan is not None)] if ep > 1 and mesh_shape[1] == ep else None
        sharded = self.shard_state(shape, names, tensor_parallel=tp_plan is not None)
        ShardPlan(sharded.layout, shard, kw, tp_plan, ep).apply(model, sharded.groups)
        sharded.adopt(model)
        self._data_group = tp
        return model

    def shard_state(
        self, shape: ShardedReplicas, names: tuple[str, ...] | None = None, tensor_parallel: bool = False
    ) -> ShardedState:
        """The job's one mesh (the same ``shape`` again returns it) and, from now on, the rank's shard as what
        moves: what ``wrap_fsdp`` and transparent mode's ``init_device_mesh`` build on."""
        if self._sharded is not None and self._sharded.layout == shape:
            return self._sharded
        if self._sharded is not None or self._model is not None:
            raise TorchPassError("the job's model is already wrapped (one model, one mesh per job)")
        self._sharded = sharded = ShardedState(shape, self, self._parts, names, tensor_parallel)
        chunk, self.net.shape = int(self.config.transfer_chunk_mb * (1 << 20)), shape
        self.rejoiner.transport = sharded.transport(self._backend, chunk, self.net if self.net.on else None)
        self.rejoiner.layout, self.mesh = sharded.part_layout, sharded.groups.mesh
        return sharded

    def wrap_pipeline(
        self,
        stages: Any,
        *,
        mesh_shape: tuple[int, int],
        schedule: Any,
        n_microbatches: int,
        loss_fn: Any,
        dp_shard: int = 1,
        shard: Any = None,
        fsdp_kwargs: dict[str, Any] | None = None,
        tp: int = 1,
        tp_plan: Any = None,
        **kw: Any,
    ) -> Pipeline:
        """Slot ``r * P + k`` runs stage ``k`` (``stages[k]`` or ``stages(k)``) of replica ``r`` of a ``(R, P)``
        pipeline under ``schedule`` (``kw`` goes to it); see :mod:`torchpass.sharded.pipeline`.

        ``dp_shard=S``: each stage FSDP-sharded over S ranks (``fully_shard(..., **fsdp_kwargs)`` on what ``shard``
        names, then on the stage), R * S * P ranks in all; slot ``r * S * P + s * P + k`` runs FSDP shard s of
        stage k, and each pipeline (P adjacent slots) takes its own batch. ``tp=T``: each stage tensor-parallel over
        T ranks (``parallelize_module`` with ``tp_plan``, or ``tp_plan(k)``); slot ``r * P * T + k * T + t`` runs TP
        rank t of stage k, and a replica (P * T adjacent slots) takes one batch."""
        from torchpass.sharded.pipeline import Pipeline, pipeline_layout  # torch's pipelining: only when used

        shape = pipeline_layout(mesh_shape, schedule, self.config.peer_copies_in_hsdp, dp_shard, tp)
        sharded = self.shard_state(shape)
        pipeline = Pipeline(sharded, stages, schedule, n_microbatches, loss_fn, kw, shard, fsdp_kwargs, tp_plan)
        self._data_group = shape.batch_slots
        return pipeline

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``optimizer.step()`` skip abandoned steps; its state becomes part of the state that moves.

        Returns the same object (so LR schedulers and grad scalers built on it keep working).
        """
        if any(optimizer is o for o in self._parts.optimizers):
            return optimizer
        inner = optimizer.step
        ctx, lifecycle = self, self.lifecycle

        def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            lifecycle.settle_staged_buffers()  # the update waits for slot 0's buffers: their loss abandons the step
            if lifecycle.abandoned:
                ctx.log.debug("optimizer step skipped (step abandoned: %s)", lifecycle.reason)
                return None
            lifecycle.before_update()  # snapshot and peer copies still reading the parameters come first
            result = inner(*args, **kwargs)
            lifecycle.optimizer_steps += 1
            return result

        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        lifecycle.watch_zero_grad(optimizer, optimizer)
        self._parts.optimizers.append(optimizer)
        return optimizer

    def register(self, name: str, obj: Any) -> Any:
        """Add ``obj`` (anything with ``state_dict``/``load_state_dict``) to the state that moves.

        A grad scaler is gated like the optimizer (its ``update()`` keeps the old scale in an abandoned step,
        without the GPU sync a copy of its state would cost), and its scale rolls back with an abandoned step
        (copied as tensors at every commit: a step may span updates, e.g. a window whose optimizer step the
        scaler skipped runs on into the next). Any other object, an LR scheduler included, is
        copied at every committed step and restored when a step is abandoned, so keep it small (a scheduler's
        state is a few numbers), or update it only from an :meth:`on_commit` callback. Register before
        ``ctx.steps`` starts.
        """
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"ctx.register({name!r}): object needs state_dict() and load_state_dict()")
        if name in self._parts.extra:
            raise TorchPassError(f"ctx.register: {name!r} is already registered")
        if self.generation >= 0:
            raise TorchPassError("ctx.register must be called before ctx.steps starts")
        if isinstance(obj, torch.amp.GradScaler):
            self._gate_scaler(obj)
            self.lifecycle.track_scaler(obj)
        else:
            self.lifecycle.track_state(name, obj)
        self._parts.extra[name] = obj
        return obj

    def _gate_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """``update()`` must still reset the scaler's per-step bookkeeping; only its scale is kept."""
        inner = scaler.update
        lifecycle = self.lifecycle

        def update(self: torch.amp.GradScaler, new_scale: Any = None) -> None:
            if not lifecycle.abandoned:
                inner(new_scale)
                return
            saved = [t.clone() if t is not None else None for t in (self._scale, self._growth_tracker)]
            inner(new_scale)
            for live, old in zip((self._scale, self._growth_tracker), saved, strict=True):
                if live is not None and old is not None:
                    live.copy_(old)

        scaler.update = types.MethodType(update, scaler)  # type: ignore[method-assign]

    def on_commit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(step)`` each time a step commits (e.g. an EMA update, a step journal)."""
        self._commit_hooks.append(callback)

    def on_committed_state(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(step)`` after each commit once the step's state is final: after the script's
        :meth:`on_commit` callbacks (a sharded model's peer copies capture it here)."""
        self._state_hooks.append(callback)

    # ----- the loop -------------------------------------------------------------------------

    def steps(self, source: Any, total_steps: int) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` for every step from the current one to ``total_steps - 1``.

        ``source`` gives the batch of a step: a :class:`torchpass.StepLoader`, any object with
        ``batch(step, slot, world_size)``, a function ``step -> batch``, a sequence, or None. A step may be
        yielded again (same batch, same RNG) when it was abandoned by a failure; a committed step is never
        yielded twice. Returns when every member has committed the last step.
        """
        group = self._data_group  # a TP group's ranks train on the same batch
        fetch = batch_source(source, lambda: self.slot // group, self.world_size // group)
        self.start()
        while True:
            if not self.follow_generation(stop_when_done=True):
                return
            step = self.position.committed + 1
            if step >= total_steps:
                if self.finish():
                    self.lifecycle.step = -1
                    return
                continue
            self.begin(step)
            batch = fetch(step)
            yield step, batch
            self.end_step()

    def start(self) -> None:
        """Join the first generation (a spare: the one that gave it its slot), judge the job's budgets, restore a
        snapshot if one is due and start its writer; nothing once joined (``steps``; transparent mode's first batch)."""
        if self.generation >= 0:
            return
        self.rejoin(after=-1, first=self._pending)
        check_budgets(self, self._snapshotter, self._sharded)  # before any copy is taken (and starts the writer)
        self._maybe_restore()

    def must_rejoin(self) -> bool:
        """Whether this rank must leave its generation at the next boundary: a newer one was announced, the
        coordinator is lost, or the job was stopped. The one test every step boundary makes."""
        channel = self._channel
        return channel.latest_gen > self.generation or channel.lost or channel.stopped is not None

    def follow_generation(self, *, stop_when_done: bool = False) -> bool:
        """At a step boundary: rejoin until this rank trains in the newest generation. False (only with
        ``stop_when_done``) when the job finished instead; otherwise a finished job ends the process."""
        while self.must_rejoin():
            stopped = self._channel.stopped
            if stop_when_done and stopped is not None and stopped.done:
                return False
            self.recover(f"generation {self._channel.latest_gen} announced", error=False)
        return True

    def begin(self, step: int) -> None:
        """Open ``step`` (the committed step + 1; a redo after an abandoned step gets the same RNG)."""
        cfg = self.config
        self.lifecycle.begin(step, seed=cfg.seed, slot=self.slot, python=cfg.reseed_python, numpy=cfg.reseed_numpy)

    def end_step(self) -> None:
        """Close the step in progress: commit it, or roll it back; then recover when it failed (a rank whose
        collective failed after the update commits first, then recovers)."""
        lifecycle = self.lifecycle
        lifecycle.check_commit()
        if lifecycle.abandoned:
            lifecycle.roll_back()
            self.recover(lifecycle.reason, error=True)
            return
        self.commit(lifecycle.step)
        if lifecycle.failed_after_update:
            self.recover(lifecycle.failed_after_update, error=True)

    def commit(self, step: int) -> None:
        """``step`` is done on this rank: its state is the committed state (callbacks, snapshots)."""
        self.lifecycle.settle_for_commit()  # every rank now holds slot 0's buffers (torchpass.rank.buffers)
        self.position.committed, self.position.has_state = step, True
        self.lifecycle.note_commit(step)
        # The script's callbacks first: what they change in registered state (an EMA updated once per step) is
        # part of the committed step, so the undo copies and the peer copies are taken after them. Taken before,
        # an abandoned next step rolled the EMA back past this step's update, and a shard rebuilt from its peer
        # copy lacked it: every rank ended silently different from the run with no fault.
        for callback in self._commit_hooks:
            callback(step)
        self.lifecycle.remember()
        self.net.after_commit(step, self)  # replicas compare every K steps; a mismatch stops the job here
        for callback in self._state_hooks:
            callback(step)
        planned = step in self._channel.snapshot_steps
        if self._snapshotter.due(step, self._channel.snapshot_steps):
            mesh = self._sharded.layout if self._sharded is not None else None
            if not self._snapshotter.capture(self._parts, step, self.slot, self.world_size, mesh) and planned:
                self._channel.skipped_snapshots.append(step)  # the coordinator may plan it again

    def hold_committed(self) -> None:
        """Between steps, on every member at once: make sure no later recovery rolls back before the committed
        step (peer copies acknowledged everywhere), recovering first when that fails (a member lost before
        its copy was kept: the rolled-back step is redone from here)."""
        reason = self.rejoiner.transport.held_everywhere(self.committed_step)
        if reason:
            self.lifecycle.first_error_at = time.time()
            self.recover(reason, error=True)

    # ----- failure-tolerant collectives ----------------------------------------------------

    @property
    def parts(self) -> StateParts:
        """The state that moves (model, optimizers, registered objects); read it, do not replace it."""
        return self._parts

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    @property
    def user_group(self) -> dist.ProcessGroup | None:
        """This generation's process group for the script's own collectives (never the gradients')."""
        return self._backend.user_group

    def collective_allowed(self) -> bool:
        """Whether a collective may start now (False once the step is abandoned or the generation is stale)."""
        return self.lifecycle.collective_allowed()

    def abandon_step(self, error: BaseException | str) -> None:
        """Mark the current step abandoned (callable from any thread)."""
        self.lifecycle.abandon(error)

    def when_cut_off(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once this rank's groups are aborted for a newer generation (:mod:`step`)."""
        return self.lifecycle.when_cut_off(callback)

    def stage_buffers(self) -> None:
        """After a synchronising forward: start broadcasting slot 0's buffers (a failure abandons the step)."""
        self.lifecycle.stage_buffers()

    def take_staged_buffers(self) -> None:
        """Before a further forward of the same step: take the staged buffers, as DDP's broadcast would."""
        self.lifecycle.take_staged_buffers()

    def local_group(self) -> dist.ProcessGroup:
        """The private one-rank group DDP is constructed over when its gradients are not on the CPU."""
        return self._backend.local_group()

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> bool:
        """``dist.all_reduce`` that abandons the step instead of raising; returns whether it succeeded.

        Use it for collectives of your own inside the loop (e.g. averaging a loss for logging): a raw
        ``dist`` call would raise into your code when a peer dies. After the step's update a failure cannot
        abandon the step: the collective is skipped, the step commits and the rank recovers right after.
        """

        def run() -> bool:
            dist.all_reduce(tensor, op=op, group=self._backend.user_group)
            return True

        return self.guarded_collective("ctx.all_reduce", run, False)

    def guarded_collective(self, name: str, run: Callable[[], _T], failed: _T) -> _T:
        """Run one of the script's collectives inside the step in progress, never raising: before the update
        a failure abandons the step; after it, the step commits and the rank recovers (:meth:`end_step`).
        ``failed`` is returned when it did not run or failed; ``run()``'s result otherwise."""
        lifecycle = self.lifecycle
        if lifecycle.updated:
            if lifecycle.failed_after_update or lifecycle.stale():
                lifecycle.fail_after_update(f"generation {self._channel.urgent_gen} announced")
                return failed
            try:
                return lifecycle.user_collective(name, run)
            except Exception as exc:
                lifecycle.fail_after_update(f"{type(exc).__name__}: {exc}")
                self.log.warning("collective failed after the step's update: %s", str(exc).splitlines()[0][:300])
                return failed
        if not lifecycle.collective_allowed():
            return failed
        try:
            return lifecycle.user_collective(name, run)
        except Exception as exc:
            lifecycle.abandon(exc)
            return failed

    def _on_generation(self, gen: int) -> None:
        """Control thread: a newer generation exists, so any collective of an older one is doomed: abort it,
        then give up the waits that the abort cannot free (:meth:`StepLifecycle.when_cut_off`)."""
        self._backend.abort(superseded_by=gen)
        self.lifecycle.cut_off_waits(gen)

    # ----- membership changes ---------------------------------------------------------------

    def recover(self, reason: str, *, error: bool) -> None:
        """Leave the current generation and join the next (see the module docstring)."""
        left_at = time.time()
        gen = self.generation
        self.log.warning("leaving generation %d: %s", gen, reason.splitlines()[0][:300])
        self.lifecycle.check_carried()
        if self.lifecycle.state_spoiled:
            self.position.has_state = False  # received from a holder (step.StepLifecycle.roll_back)
        if self.lifecycle.carried_lost_at >= 0:
            self.link.fatal(
                carried_gradients_reason(self.lifecycle.carried_lost_at, reason, restart_advice(self.config))
            )
        self._backend.destroy()  # closes our sockets: peers still inside a collective with us fail at once
        if error and self._channel.latest_gen <= gen:
            self.link.report(
                "broken",
                gen=gen,
                slot=self.slot,
                step=self.lifecycle.step,
                committed=self.committed_step,
                error=reason[:500],
                at=self.lifecycle.first_error_at or left_at,
            )
        self.rejoin(after=gen, left_at=left_at)

    def rejoin(self, after: int, first: GenerationInfo | None = None, left_at: float | None = None) -> None:
        """Join ``first`` or the next generation after ``after`` (:class:`torchpass.rank.rejoin.Rejoiner`)."""
        self._snapshotter.before_update()  # joining may overwrite the state a snapshot is still copying
        forget_forward_order(self._parts.model)  # every member's first backward then prefetches the same
        self.rejoiner.join(after, first, left_at)

    def finish(self) -> bool:
        """Wait until every member committed the last step; False when a new generation needs this rank."""
        try:
            reply = self._channel.wait(
                "finished", _FOREVER_S, gen=self.generation, slot=self.slot, committed=self.committed_step
            )
        except JobStopped as stop:
            if stop.done:
                return True
            raise TorchPassError(f"the job failed: {stop.reason}") from None
        except CoordinatorLost as exc:
            raise TorchPassError(str(exc)) from None
        info = GenerationInfo.from_wire(reply["generation"])
        self.log.info("generation %d announced while finishing; rejoining", info.gen)
        self._backend.destroy()
        self.rejoin(after=self.generation, first=info, left_at=time.time())
        return False

    # ----- planned migration ----------------------------------------------------------------

    def request_migration(self, slot: int) -> dict[str, Any]:
        """Ask the coordinator to move ``slot`` to a spare at its next step boundary (as ``clockwork migrate``)."""
        try:
            return self._channel.call("migrate", slot=slot)
        except CoordinatorRefused as exc:
            raise TorchPassError(str(exc)) from None

    # ----- snapshots ------------------------------------------------------------------------

    def snapshot_now(self) -> bool:
        """Take a snapshot after the current step commits (every rank must call it at the same step, or use
        ``clockwork snapshot take``); False when one is still being written."""
        step = self.lifecycle.step if self.lifecycle.step >= 0 else self.committed_step
        self._channel.snapshot_steps.add(step)
        return not self._snapshotter.busy

    def _maybe_restore(self) -> None:
        """Right after the first generation formed: load the snapshot to restore, if any (every rank agrees)."""
        target, required = self._restore_from
        self._restore_from = (None, False)
        if target is None:
            return

        def agree(ok: bool) -> bool:
            flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self._backend.device)
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            except Exception as exc:
                raise TorchPassError(f"ranks could not agree on the snapshot to restore: {exc}") from None
            return bool(flag.item())

        try:
            committed = restore(
                self._parts,
                target,
                required=required,
                slot=self.slot,
                device=self._backend.device,
                agree=agree,
                log=self.log,
                event_sink=self.event_sink,
                mesh=self._sharded.layout if self._sharded is not None else None,
            )
        except RestoreError as exc:
            self.link.fatal(str(exc))
        if committed is None:
            return
        self.position.committed, self.position.has_state = committed, True
        self.lifecycle.restart_at(committed + 1)

    # ----- end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process group and stop talking to the coordinator (also run at exit)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._snapshotter.close(timeout_s=min(self.config.snapshot_timeout_s, 120.0))
        except Exception as exc:  # the job's end must not hang on a snapshot
            self.log.warning("closing the snapshot writer failed: %s", exc)
        try:
            self._backend.destroy()
        finally:
            self._channel.close()
            if self._coordinator is not None:
                self._coordinator.stop()
