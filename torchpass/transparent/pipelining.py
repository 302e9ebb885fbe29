"""Transparent mode refuses pipeline parallelism: a script that builds a ``torch.distributed.pipelining`` stage
fails when it builds it, naming the feature and the model-aware API that protects it (``ctx.wrap_pipeline``).

Why refuse rather than run: a stage's sends and receives would go over groups that no recovery rebuilds, and the
loss, the schedule step and the stage's place in a replica are what the model-aware API needs to know. Why the
refusal waits for the import: ``torch.distributed.pipelining`` costs a few tenths of a second to import, and the
interposers are installed on a recovery's critical path (a spare installs them once it has its slot), so a
script that never imports it must not pay for it. If the module is already loaded the stage class is patched at
once; otherwise an import hook patches it as it loads.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from torchpass.errors import TorchPassError

__all__ = ["refuse_pipelining"]

STAGE_MODULE = "torch.distributed.pipelining.stage"

Patch = Callable[[Any, str, Any], None]


def _refused(*_args: Any, **_kwargs: Any) -> None:
    raise TorchPassError(
        "transparent mode: pipeline parallelism (torch.distributed.pipelining's PipelineStage) is not protected; "
        "use the model-aware API, ctx.wrap_pipeline (docs/user-guide.md, Pipeline parallelism)"
    )


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the stage module as the path finder would, and patches it once its code ran."""

    def __init__(self, patch: Callable[[ModuleType], None]) -> None:
        self._patch = patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != STAGE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        if loader is None:
            return spec
        real_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            self._patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader instance
        return spec


def refuse_pipelining(patch: Patch, undo: list[Callable[[], None]]) -> None:
    """Make building a pipeline stage raise (``patch(owner, name, value)`` records its own undo; the import hook,
    if one is needed, is removed through ``undo``)."""

    def patch_stage(module: ModuleType) -> None:
        patch(module._PipelineStageBase, "__init__", _refused)

    loaded = sys.modules.get(STAGE_MODULE)
    if loaded is not None:
        patch_stage(loaded)
        return
    finder = _PatchOnImport(patch_stage)
    sys.meta_path.insert(0, finder)
    undo.append(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)
