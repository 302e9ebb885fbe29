"""The Hugging Face ``Trainer`` (DDP through accelerate) in transparent mode: its windows are the steps.

Tested with transformers 5.24.0 and accelerate 1.16.0 (the ``frameworks`` extra of pyproject.toml). What the
Trainer does, and what TorchPass makes of it:

* **Process group.** ``TrainingArguments`` builds accelerate's ``PartialState``, which calls
  ``init_process_group``: this adapter is picked there (before any ``Trainer`` exists). Until the first step
  ``torch.distributed.is_initialized()`` says False, as for Lightning.
* **Sampler and loader.** ``accelerator.prepare`` rebuilds the Trainer's loader as a ``DataLoaderShard``: a torch
  ``DataLoader`` over a ``BatchSamplerShard`` (this rank's share of the batches of a ``SeedableRandomSampler``,
  whose order depends on the epoch only). No ``DistributedSampler``: that loader is tracked by its batch
  sampler (:meth:`HFTrainerAdapter.tracks`). ``DataLoaderShard`` reads one batch ahead (to know the last one),
  which would put the step boundary one batch early, so the Trainer's window fetch (``get_batch_samples``: the
  ``gradient_accumulation_steps`` batches of one optimizer step, fetched before the first forward) takes them
  from the tracked pass itself, one ``next()`` each: the window is one step.
* **Model, optimizer, scheduler.** ``accelerator.prepare`` builds ``DistributedDataParallel`` (TorchPass's); the
  torch optimizer under accelerate's ``AcceleratedOptimizer`` and the LR scheduler are registered at
  construction like in any script.
* **Counters and callbacks.** ``trainer.state`` (``global_step``, ``epoch``, the log history, ...), the
  ``TrainerControl`` flags, every stateful callback's attributes and the Trainer's running loss and FLOP count
  are one registered object (:class:`TrainerProgress`): they move to a replacement and roll back with an
  abandoned window.
* **The loop.** ``_run_epoch`` keeps its counters (the update step, the batch index) in Python locals, so a
  window cannot be redone, nor a replacement enter at the replicas' window, by serving batches alone. The
  adapter wraps ``_run_epoch``: when the position moved away from where the Trainer's loop is (a redone window,
  a replacement's received position), the fetch raises :class:`Rewind` out of the loop, and the wrapper enters
  ``_run_epoch`` again through the Trainer's own resume path (``epochs_trained``,
  ``steps_trained_in_current_epoch``), with the position from memory instead of a checkpoint folder. Epochs the
  replicas finished are skipped. The last window of an epoch closes when the epoch's ``_run_epoch`` returns,
  so a window is always redone inside its epoch.

Not protected (refused or warned at start): a ``Trainer`` whose model is not wrapped in DDP (FSDP, DeepSpeed),
an ``IterableDataset`` (no batch sampler to index), ``accelerate`` used without a ``Trainer``.
"""

from __future__ import annotations

import copy
import logging
import os
import types
from typing import Any

import torch
from torch import nn

from torchpass.errors import TorchPassError
from torchpass.frameworks.api import PassView, SessionView

__all__ = ["STATE_NAME", "HFTrainerAdapter", "Rewind", "TrainerProgress"]

log = logging.getLogger("clockwork.torchpass.frameworks.hf_trainer")

STATE_NAME = "hf_trainer.progress"
# Passed as the Trainer's resume_from_checkpoint when _run_epoch is entered again: its resume path then skips
# the batches done; it names no folder that can exist, so no file (RNG state) is read from it.
IN_MEMORY = os.path.join(os.devnull, "torchpass-in-memory-position")
_PER_RANK = ("is_local_process_zero", "is_world_process_zero")
_RUNNING = ("_tr_loss", "_total_loss_scalar", "_globalstep_last_logged", "current_flos")


class Rewind(Exception):
    """Raised out of the Trainer's ``_run_epoch`` to enter it again at batch ``index`` of epoch ``epoch``."""

    def __init__(self, epoch: int, index: int) -> None:
        super().__init__(f"rewind to epoch {epoch}, batch {index}")
        self.epoch, self.index = epoch, index


def _is_trainer(obj: Any) -> bool:
    return any(
        cls.__name__ == "Trainer" and cls.__module__.split(".", 1)[0] == "transformers" for cls in type(obj).__mro__
    )


class TrainerProgress:
    """The Trainer's counters and callbacks' state as one object with ``state_dict``/``load_state_dict``."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def _stateful(self) -> list[Any]:
        return [cb for cb in self.trainer.callback_handler.callbacks if callable(getattr(cb, "state", None))]

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        running = {name: getattr(trainer, name) for name in _RUNNING if hasattr(trainer, name)}
        return copy.deepcopy(
            {
                "state": vars(trainer.state),
                "control": vars(trainer.control),
                "callbacks": [cb.state().get("attributes", {}) for cb in self._stateful()],
                "running": running,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        state = copy.deepcopy(state)
        # Which process logs and saves is this rank's own (the slot's), not the source's.
        own = {name: getattr(trainer.state, name) for name in _PER_RANK if hasattr(trainer.state, name)}
        vars(trainer.state).update(state["state"])
        vars(trainer.state).update(own)
        vars(trainer.control).update(state["control"])
        for callback, attributes in zip(self._stateful(), state["callbacks"], strict=True):
            for name, value in attributes.items():
                setattr(callback, name, value)
        for name, value in state["running"].items():
            setattr(trainer, name, value)


class HFTrainerAdapter:
    """Transparent mode's view of one Hugging Face ``Trainer`` (see the module docstring)."""

    name = "hf_trainer"

    def __init__(self, session: SessionView) -> None:
        self.session = session
        self.trainer: Any = None
        self.shard_loader: Any = None  # the DataLoaderShard the Trainer trains on
        self.epoch = -1  # the epoch whose _run_epoch runs now
        self.next_index = 0  # the batch of that epoch the Trainer's loop takes next
        self.current: PassView | None = None
        self.target: tuple[int, int] | None = None  # a replacement's jump, taken at the epoch it names

    def group_visible(self) -> bool:
        return False

    def tracks(self, loader: Any) -> bool:
        """accelerate's sharded loader: a DataLoader over a BatchSamplerShard (its batches are this rank's)."""
        return type(loader.batch_sampler).__name__ == "BatchSamplerShard" and not isinstance(
            loader.dataset, torch.utils.data.IterableDataset
        )

    def accepts_loader(self) -> bool:
        return True

    def adopt_model(self, module: nn.Module) -> None:
        """``accelerator.prepare`` wrapped the model: find the Trainer on the stack, register its progress and
        take over its epoch loop and window fetch (before the first step, like every other part)."""
        import sys

        frame: Any = sys._getframe(1)
        while frame is not None and not _is_trainer(frame.f_locals.get("self")):
            frame = frame.f_back
        if frame is None:
            raise TorchPassError(
                "transparent mode: accelerate prepared a model outside a transformers Trainer; only the Trainer's "
                "loop is protected (use the model-aware API for a hand-written accelerate loop)"
            )
        trainer = frame.f_locals["self"]
        if self.trainer is not None:
            return
        self.trainer = trainer
        self.session.ctx.register(STATE_NAME, TrainerProgress(trainer))
        real_run_epoch = trainer._run_epoch
        adapter = self

        def run_epoch(trainer: Any, **kwargs: Any) -> Any:
            return adapter.run_epoch(real_run_epoch, kwargs)

        def get_batch_samples(trainer: Any, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            batches = adapter.fetch(num_batches)  # from the tracked pass, not from epoch_iterator
            return batches, trainer._get_num_items_in_batch(batches, device)

        trainer._run_epoch = types.MethodType(run_epoch, trainer)
        trainer.get_batch_samples = types.MethodType(get_batch_samples, trainer)
        self.session.ctx.log.info("Hugging Face Trainer: its counters and callbacks' state move with the state")

    def adopt_sharded(self, module: nn.Module) -> None:
        """Only the Trainer's DDP is protected: its FSDP goes through accelerate's plugin, whose loop and state
        handling transparent mode does not follow."""
        raise TorchPassError(
            "transparent mode: the Hugging Face Trainer's FSDP (accelerate's fsdp plugin) is not protected; only "
            "its DDP training is (an unmodified FSDP2 script with fully_shard is, see docs/user-guide.md)"
        )

    # ----- the epoch loop ------------------------------------------------------------------------------

    def run_epoch(self, real: Any, kwargs: dict[str, Any]) -> Any:
        """One epoch of the Trainer's loop, entered again at the position when it moved (see the docstring)."""
        epoch = int(kwargs["epoch"])
        if self.target is not None and epoch < self.target[0]:
            return None  # the replicas finished this epoch before this process joined
        if self.shard_loader is None:
            self.shard_loader = kwargs["train_dataloader"]
        start = 0
        if self.target is not None:
            start, self.target = self.target[1], None
        while True:
            self.epoch, self.next_index, self.current = epoch, start, None
            call = dict(kwargs)
            if start:
                call.update(
                    resume_from_checkpoint=IN_MEMORY, epochs_trained=epoch, steps_trained_in_current_epoch=start
                )
            try:
                result = real(**call)
            except Rewind as rewind:
                start = self._rewound(rewind, epoch)
                if start < 0:
                    return None
                continue
            # The epoch's last window closes with the epoch: a failure in it is redone inside the epoch.
            if self.session.step_open and self.session.roll_back_open_step():
                start = self.session.position.index
                continue
            return result

    def _rewound(self, rewind: Rewind, epoch: int) -> int:
        """Where to enter this epoch again after ``rewind``; -1: skip to a later epoch."""
        if rewind.epoch == epoch:
            return rewind.index
        if rewind.epoch > epoch:
            self.target = (rewind.epoch, rewind.index)
            return -1
        raise TorchPassError(
            f"transparent mode: the Trainer is in epoch {epoch}, the replicas' state is from epoch {rewind.epoch}"
        )

    def fetch(self, num_batches: int) -> list[Any]:
        """The Trainer's window: ``num_batches`` batches of the tracked pass (fewer at the pass's end)."""
        if self.current is None:
            self.shard_loader.set_epoch(self.epoch)  # the sampler's order of this epoch (a resume may skip it)
            loader = self.session.loader
            if loader is None:
                raise TorchPassError("transparent mode: the Trainer's training loader was not tracked")
            self.current = self.session.start_pass(loader)
        device = getattr(self.shard_loader, "device", None)
        batches = []
        for _ in range(num_batches):
            try:
                batch = next(self.current)
            except StopIteration:
                break
            if device is not None:
                from accelerate.utils import send_to_device

                batch = send_to_device(batch, device)
            batches.append(batch)
        return batches

    # ----- the session's questions ---------------------------------------------------------------------

    def pass_number(self, counted: int) -> int:
        """The Trainer's epoch (its sampler's epoch too)."""
        return self.epoch

    def align(self, it: PassView) -> int:
        """The batch to serve: the next of the Trainer's loop, unless the position (received, or rolled back)
        names another batch, which the loop must be entered at again (:class:`Rewind`)."""
        if self.session.step_open:
            return self.next_index  # inside a window
        position = self.session.position
        epoch, index = position.pass_no, position.index
        if index >= len(it):  # the replicas finished that epoch's windows
            epoch, index = epoch + 1, 0
        if (epoch, index) != (it.pass_no, self.next_index):
            self.session.ctx.log.info(
                "Hugging Face Trainer: entering its loop again at epoch %d, batch %d (it was at epoch %d, batch %d)",
                epoch,
                index,
                it.pass_no,
                self.next_index,
            )
            raise Rewind(epoch, index)
        if index >= len(it):
            raise StopIteration
        return index

    def served(self, index: int) -> None:
        self.next_index = index + 1

    def check_first_step(self, has_model: bool) -> None:
        if not has_model or self.trainer is None:
            raise TorchPassError(
                "transparent mode: the Hugging Face Trainer built no DistributedDataParallel (FSDP or DeepSpeed?); "
                "only its DDP training is protected"
            )
