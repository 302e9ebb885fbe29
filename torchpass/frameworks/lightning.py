"""PyTorch Lightning (DDP, and FSDP2 through ModelParallelStrategy) in transparent mode: its loop counters and
callbacks move with the state.

Tested with lightning 2.6.6 (the ``frameworks`` extra of pyproject.toml). What Lightning does, and what
TorchPass makes of it:

* **Process group.** ``DDPStrategy.setup_distributed`` calls ``init_process_group`` with the rank of its cluster
  environment. TorchPass sets ``TORCHELASTIC_RUN_ID`` and the other variables ``torchrun`` sets, so Lightning
  picks its TorchElastic environment (rank = ``RANK`` = the slot) even inside a Slurm job. Until the first step
  ``torch.distributed.is_initialized()`` says False (:meth:`LightningAdapter.group_visible`): Lightning then
  runs its set-up collectives (the ``prepare_data`` barrier, the checkpoint directory broadcast, the sanity
  check's metric reductions, the SIGTERM flag broadcast before the first batch) locally, as it does when it
  trains alone. A replacement, which runs the script from the top while the others train, skips them the same
  way.
* **Sampler and loader.** Lightning rebuilds the script's loader with a ``DistributedSampler`` (rank and world
  size from the strategy) and calls ``set_epoch(epoch)`` before each pass: that loader is the tracked one.
* **Model, optimizers, schedulers.** ``configure_ddp`` builds ``DistributedDataParallel`` (TorchPass's),
  ``configure_optimizers`` the ``torch.optim`` optimizers and schedulers, which transparent mode registers by
  construction order. Automatic optimization runs forward and backward inside ``optimizer.step(closure)``:
  transparent mode runs the closure before it decides whether the step may update (a failed gradient
  all-reduce must keep the update from happening).
* **Counters and callbacks.** ``trainer.global_step``, the epoch, the batch index and the other loop counters
  are Lightning's progress objects; ``ModelCheckpoint``, ``EarlyStopping`` and other callbacks keep their state
  in ``state_dict()``. :class:`LightningProgress` registers both as TorchPass state: they move to a replacement
  and roll back with an abandoned step, exactly like the model.
* **The loop.** Lightning's fit loop is driven by its progress counters, not by a Python ``for``: once a
  replacement has received them, it is *in* the replicas' epoch, so instead of replaying earlier passes it
  jumps there (:meth:`LightningAdapter.align`): the current pass becomes the replicas' pass and serves the
  replicas' next batch. A survivor that rolls back across an epoch boundary jumps back the same way.
* **The end.** Lightning asks for no batch after the last one of an epoch, so the last step of training is
  closed right after it (the epoch loop's ``on_advance_end``); when that step was abandoned, the rolled-back
  counters make Lightning fetch the same batch again. So is an epoch's last step that was abandoned, before
  Lightning runs the epoch's end: the batch is redone and the epoch ends once.
* **Gradient accumulation** (``accumulate_grad_batches``): a step spans the window, so a failure inside a
  window redoes the window (:mod:`torchpass.transparent.bootstrap`).

**FSDP2: ModelParallelStrategy.** ``ModelParallelStrategy(data_parallel_size=D, tensor_parallel_size=T)`` builds
its mesh with ``init_device_mesh(..., (D, T), mesh_dim_names=("data_parallel", "tensor_parallel"))`` right after
``init_process_group``; the script's ``configure_model`` cuts the model with ``parallelize_module(...,
self.device_mesh["tensor_parallel"], plan)`` when T > 1, and shards it with ``fully_shard(...,
mesh=self.device_mesh["data_parallel"])``. Transparent mode (:mod:`torchpass.transparent.fsdp`) answers that
request with TorchPass's tensor-parallel mesh without a replica, (D, T) under Lightning's names (T = 1 too, so
that a ``configure_model`` that slices ``tensor_parallel`` unconditionally works): the slices are over its stable
groups, each rank's (shard, tp) state is what moves, and a crashed rank's comes back from its ring neighbour's
peer copy. Lightning sizes its ``DistributedSampler`` from the data-parallel slice (the ranks of a TP group read
the same batches). Its sanity check of the validation loop is skipped: its forward passes all-gather the shards
before any process group exists, and it changes no training state. ``ModelCheckpoint`` is refused: under this
strategy it saves through ``torch.distributed.checkpoint``, whose own collectives (``gather_object`` over c10d's
``all_gather``) raise when a peer dies, so a crash during a save would take the survivors and then every spare
with it. ``FSDPStrategy`` is refused: it is FSDP1 (``FullyShardedDataParallel``), which has no TorchPass mesh to
follow a recovery. Snapshots of a sharded model are not available yet (:mod:`torchpass.sharded.fsdp`).

Refused at start, with the reason: a strategy other than DDP and ModelParallelStrategy (DeepSpeed, FSDPStrategy,
which names ModelParallelStrategy as the alternative), and ``reload_dataloaders_every_n_epochs`` (each epoch
would have a loader TorchPass did not track).
"""

from __future__ import annotations

import copy
import logging
import types
from typing import Any

from torch import nn

from torchpass.errors import TorchPassError
from torchpass.frameworks.api import PassView, SessionView

__all__ = ["STATE_NAME", "LightningAdapter", "LightningProgress"]

log = logging.getLogger("clockwork.torchpass.frameworks.lightning")

STATE_NAME = "lightning.progress"


def _is_trainer(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "Trainer" and cls.__module__.split(".", 1)[0] in ("lightning", "pytorch_lightning")


class LightningProgress:
    """Lightning's fit-loop progress (epochs, batches, optimizer and scheduler steps) and every callback's
    ``state_dict()``, as one object with ``state_dict``/``load_state_dict`` for ``ctx.register``.

    Loading sets the counters in place without marking the loops as restarting: Lightning's own checkpoint
    restore does that to re-enter its loops from the top, while here the loops are live and go on from the
    restored counters at the next batch."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        callbacks = {}
        for callback in self.trainer.callbacks:
            state = callback.state_dict()
            if state:
                callbacks[callback.state_key] = state
        return {"loops": self.trainer.fit_loop.state_dict(), "callbacks": callbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fit_loop = self.trainer.fit_loop
        for key, value in state["loops"].items():
            *path, leaf = key.split(".")
            owner = fit_loop
            for name in path:
                owner = getattr(owner, name)
            if leaf == "state_dict":
                owner.on_load_checkpoint(copy.deepcopy(value))
            else:
                getattr(owner, leaf).load_state_dict(copy.deepcopy(value))
        saved = state["callbacks"]
        for callback in self.trainer.callbacks:
            if callback.state_key in saved:
                callback.load_state_dict(copy.deepcopy(saved[callback.state_key]))


class LightningAdapter:
    """Transparent mode's view of one Lightning ``Trainer`` (see the module docstring)."""

    name = "lightning"

    def __init__(self, session: SessionView, trainer: Any) -> None:
        self.session = session
        self.trainer = trainer
        strategy = type(trainer.strategy)
        kinds = {cls.__name__ for cls in strategy.__mro__}
        if "FSDPStrategy" in kinds:
            raise TorchPassError(
                f"transparent mode: Lightning's {strategy.__name__} (FSDP1, FullyShardedDataParallel) is not "
                "protected; use ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1) with "
                "fully_shard in configure_model (FSDP2), or strategy='ddp'"
            )
        if not kinds & {"DDPStrategy", "ModelParallelStrategy"}:
            raise TorchPassError(
                f"transparent mode: Lightning's {strategy.__name__} is not protected; use strategy='ddp', or "
                "ModelParallelStrategy(tensor_parallel_size=1) with fully_shard in configure_model for FSDP2"
            )
        self.sharded = "ModelParallelStrategy" in kinds
        self.registered = False
        if self.sharded and trainer.checkpoint_callbacks:
            raise TorchPassError(
                "transparent mode: Lightning's ModelCheckpoint under ModelParallelStrategy writes a distributed "
                "checkpoint (torch.distributed.checkpoint), whose collectives TorchPass cannot carry through a "
                "failure; pass enable_checkpointing=False (TorchPass keeps the state through failures itself)"
            )
        if self.sharded and trainer.num_sanity_val_steps:
            # Its forward passes all-gather the shards, and no process group exists before the first step (the
            # sanity check of a DDP model runs locally). It changes no training state: it is skipped.
            trainer.num_sanity_val_steps = 0
            session.ctx.log.info("Lightning ModelParallelStrategy: the sanity check before training is skipped")
        if getattr(trainer, "reload_dataloaders_every_n_epochs", 0):
            raise TorchPassError(
                "transparent mode: Lightning's reload_dataloaders_every_n_epochs builds a new training loader "
                "each epoch, whose position TorchPass cannot track; leave it at 0"
            )
        session.ctx.log.info(
            "Lightning %s: its loop counters and callbacks' state move with the state", strategy.__name__
        )

    @classmethod
    def from_frames(cls, session: SessionView, frame: Any) -> LightningAdapter | None:
        """The adapter for the ``Trainer`` whose set-up is on the stack above ``frame`` (None: not found)."""
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if candidate is not None and _is_trainer(candidate):
                return cls(session, candidate)
            frame = frame.f_back
        log.warning("Lightning called init_process_group outside a Trainer: treated as a plain script")
        return None

    def group_visible(self) -> bool:
        return False

    def tracks(self, loader: Any) -> bool:
        return False  # Lightning injects a DistributedSampler

    def accepts_loader(self) -> bool:
        """Lightning rebuilds every loader with its DistributedSampler; the training one while it trains (not
        while it runs the sanity check or a validation)."""
        return bool(self.trainer.training)

    def adopt_model(self, module: nn.Module) -> None:
        """DDP was built: register the loop progress and callbacks' state."""
        self._register()

    def adopt_sharded(self, module: nn.Module) -> None:
        """``configure_model`` fully_shard-ed ``module`` (the outermost so far): register the loop progress and
        callbacks' state, once."""
        if not self.sharded:
            raise TorchPassError(
                f"transparent mode: fully_shard under Lightning's {type(self.trainer.strategy).__name__}; shard "
                "with ModelParallelStrategy(tensor_parallel_size=1) instead"
            )
        self._register()

    def _register(self) -> None:
        """The loop progress and callbacks' state become TorchPass state, and the end of training closes the
        last step (before the first step, like every other part)."""
        if self.registered:
            return
        self.registered = True
        self.session.ctx.register(STATE_NAME, LightningProgress(self.trainer))
        epoch_loop = self.trainer.fit_loop.epoch_loop
        original = epoch_loop.on_advance_end
        adapter = self

        def on_advance_end(loop: Any, data_fetcher: Any) -> None:
            original(data_fetcher)
            if adapter.session.step_open and adapter._step_closes_here() and adapter.session.roll_back_open_step():
                # Redo: the counters went back; the fetcher, which counted the batch as its last, must too.
                data_fetcher.done = False
                data_fetcher.fetched = int(loop.batch_progress.current.ready)

        epoch_loop.on_advance_end = types.MethodType(on_advance_end, epoch_loop)

    def _step_closes_here(self) -> bool:
        """Whether the step just done must close before Lightning goes on: the last of training, or the last of
        an epoch when it was abandoned. An abandoned step left open there would let a survivor run the epoch's
        end and then roll back across it at the next step while the replacement reaches the end for the first
        time: their collectives no longer match, and both wait out ``collective_timeout_s``. A committed step at
        an epoch's end stays open, as every other step does until the next batch: the epoch's end (validation,
        ``ModelCheckpoint``'s barrier) is then part of it, which a replacement that jumps into the replicas' epoch
        never runs, so it must not count as collectives between steps."""
        if not self.trainer.fit_loop.epoch_loop.done:
            return False
        return self._training_ends_here() or self.session.ctx.lifecycle.abandoned

    def _training_ends_here(self) -> bool:
        """Whether the batch just done is the last of training (Lightning asks for no further batch)."""
        trainer = self.trainer
        fit_loop = trainer.fit_loop
        if not fit_loop.epoch_loop.done:
            return False
        max_steps = fit_loop.max_steps
        if max_steps is not None and max_steps != -1 and trainer.global_step >= max_steps:
            return True
        max_epochs = fit_loop.max_epochs
        last_epoch = max_epochs is not None and max_epochs != -1
        return bool(last_epoch and fit_loop.epoch_progress.current.processed + 1 >= max_epochs) or bool(
            trainer.should_stop
        )

    def pass_number(self, counted: int) -> int:
        """Lightning's epoch (the sampler's epoch too), not a count of ``iter()`` calls."""
        return int(self.trainer.fit_loop.epoch_progress.current.processed)

    def align(self, it: PassView) -> int:
        """Where Lightning's counters say the next batch is: epoch E, batch I of it. Counters that arrived
        from a replica (a replacement) or were rolled back (a survivor redoing a step) may name another pass
        than the one being iterated: that pass becomes epoch E. I past the end means the replicas finished the
        epoch's batches: the pass ends and Lightning runs the epoch's end."""
        fit_loop = self.trainer.fit_loop
        epoch = int(fit_loop.epoch_progress.current.processed)
        index = int(fit_loop.epoch_loop.batch_progress.current.ready)
        if it.pass_no != epoch:
            self.session.ctx.log.info("Lightning: jumping from pass %d to epoch %d, batch %d", it.pass_no, epoch, index)
            it.retarget(epoch, epoch)
        if index >= len(it):
            raise StopIteration
        return index

    def served(self, index: int) -> None:
        """Lightning's data fetcher counts the batches it handed out, to know the last one: after a jump it
        must count from the batch served, not from the pass's start."""
        fetcher = getattr(self.trainer.fit_loop, "_data_fetcher", None)
        if fetcher is not None:
            fetcher.fetched = index

    def check_first_step(self, has_model: bool) -> None:
        if has_model:
            return
        if self.sharded:
            raise TorchPassError(
                "transparent mode: Lightning's ModelParallelStrategy trained a model that configure_model did not "
                "fully_shard; call fully_shard(module, mesh=self.device_mesh['data_parallel']) there"
            )
        raise TorchPassError(
            f"transparent mode: Lightning's {type(self.trainer.strategy).__name__} built no "
            "DistributedDataParallel; use strategy='ddp'"
        )
