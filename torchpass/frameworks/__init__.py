"""Transparent mode for the training frameworks people use: what each one needs beyond an unmodified DDP script.

Transparent mode (:mod:`torchpass.transparent.bootstrap`) finds a script's step boundaries, data position and training
state through the PyTorch objects it builds. A framework builds the same objects (a ``DistributedDataParallel``,
``torch.optim`` optimizers and schedulers, a ``DataLoader`` over a ``DistributedSampler``), so most of the mode
works unchanged under it, but a framework also keeps state of its own and drives its loop differently:

* its step counters, epoch counter and callbacks' state are Python objects of the framework (Lightning's loop
  progress, ``trainer.global_step``, a ``ModelCheckpoint``'s best score), which must move to a replacement and
  roll back with an abandoned step like the model does;
* its loop is a state machine over those counters (Lightning), or keeps them in locals of its own loop (the
  Hugging Face Trainer), not a ``for`` over the loader: a replacement does not replay earlier epochs, it *jumps*
  there once the counters arrive, and a redone step re-enters the loop where it was;
* it talks to its peers while it sets up (a barrier, the checkpoint directory broadcast from rank 0), before
  TorchPass has formed any process group.

An adapter for each framework (:mod:`torchpass.frameworks.lightning`, :mod:`torchpass.frameworks.hf_trainer`)
is picked when the framework itself calls ``init_process_group`` (:func:`detect`), and the session asks it at
the few points where the framework differs from a plain script (:class:`FrameworkAdapter`). Nothing here
imports a framework: a job that does not use one never loads it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torchpass.frameworks.api import FrameworkAdapter, PassView, SessionView

__all__ = ["FrameworkAdapter", "PassView", "SessionView", "detect", "framework_imported"]

# Top-level packages whose ``init_process_group`` call selects an adapter, and the adapter's module.
_ADAPTERS = {
    "lightning": "lightning",
    "pytorch_lightning": "lightning",
    "accelerate": "hf_trainer",  # accelerate's PartialState, built by the Trainer's TrainingArguments
    "transformers": "hf_trainer",
}


def framework_imported() -> bool:
    """Whether a framework the adapters know was imported (it may still rebuild the script's loaders)."""
    return any(name in sys.modules for name in _ADAPTERS)


def detect(caller_module: str, session: SessionView, frames: Callable[[], Any]) -> FrameworkAdapter | None:
    """The adapter for the framework whose module ``caller_module`` called ``init_process_group``, if any.

    ``frames`` gives the interposer's caller frame: an adapter finds the framework's trainer object there."""
    package = caller_module.split(".", 1)[0]
    kind = _ADAPTERS.get(package)
    if kind == "hf_trainer":
        from torchpass.frameworks.hf_trainer import HFTrainerAdapter

        return HFTrainerAdapter(session)  # it finds the Trainer later, when accelerate prepares its model
    if kind is None:
        return None
    from torchpass.frameworks.lightning import LightningAdapter

    return LightningAdapter.from_frames(session, frames())
