"""TorchPass: a failed rank costs seconds, not a rollback.

The training-side library of Clockwork (the only package that imports torch, and only in its ``rank``,
``sharded``, ``transparent``, ``frameworks``, ``snapshot`` and ``rollout`` subpackages). In a training script::

    import torchpass as tp

    ctx = tp.init()
    model = ctx.wrap_model(model)
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step, batch in ctx.steps(tp.StepLoader(dataset, batch_size=32), total_steps=1000):
        loss = model(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()

and launched with ``torchpass run --local --nproc 4 --spares 1 train.py``. See docs/user-guide.md.

The names below load lazily (PEP 562), so the launcher and the ``torchpass`` command line, which need no
torch, start fast; ``import torchpass`` alone imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchpass.config import ConfigError, TorchPassConfig
    from torchpass.errors import TorchPassError
    from torchpass.events import DaemonEventSink, EventSink, JsonlEventSink
    from torchpass.rank.context import Context
    from torchpass.rank.data import StepLoader
    from torchpass.rank.start import init
    from torchpass.sharded.tensor_parallel import clip_grad_norm_

__all__ = [
    "ConfigError",
    "Context",
    "DaemonEventSink",
    "EventSink",
    "JsonlEventSink",
    "StepLoader",
    "TorchPassConfig",
    "TorchPassError",
    "clip_grad_norm_",
    "init",
]

_WHERE = {
    "ConfigError": "torchpass.config",
    "TorchPassConfig": "torchpass.config",
    "Context": "torchpass.rank.context",
    "TorchPassError": "torchpass.errors",
    "init": "torchpass.rank.start",
    "StepLoader": "torchpass.rank.data",
    "DaemonEventSink": "torchpass.events",
    "EventSink": "torchpass.events",
    "JsonlEventSink": "torchpass.events",
    "clip_grad_norm_": "torchpass.sharded.tensor_parallel",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'torchpass' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
