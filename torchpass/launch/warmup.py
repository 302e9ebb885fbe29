"""A spare imports what its script imports while it waits for a slot, so that a recovery does not wait for it.

In transparent mode a spare runs the script only once it is given a slot: everything the script does before its
first batch is on the recovery's critical path. Its imports are the largest part of that for a framework script
(``import lightning`` or ``import transformers`` costs seconds of CPU), and they do not depend on the slot, so
the spare pays them before it reports ready. The modules are found by reading the script (every ``import`` and
``from ... import`` statement, at any depth, with an absolute name), not by running it; a module that fails to
import is left for the script to import, and fail on, itself.

Importing a framework early binds the names it imports from torch before transparent mode's interposers exist
(Lightning's ``from torch.nn.parallel.distributed import DistributedDataParallel``):
:func:`rebind_in_loaded_modules` points such names at the interposer once it is installed.
"""

from __future__ import annotations

import ast
import importlib
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["FRAMEWORK_PACKAGES", "framework_modules", "imported_by", "preimport", "rebind_in_loaded_modules"]

log = logging.getLogger("clockwork.torchpass.frameworks.warmup")


def imported_by(script: str) -> list[str]:
    """The absolute module names ``script`` imports, in the order they appear (none if it cannot be read)."""
    try:
        tree = ast.parse(Path(script).read_text(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return list(dict.fromkeys(names))


# Frameworks whose import a local job's zygote pays once for every rank, spare and replacement it forks.
FRAMEWORK_PACKAGES = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def framework_modules(script: str) -> tuple[str, ...]:
    """The modules of known frameworks that ``script`` imports (for the zygote's preload)."""
    return tuple(name for name in imported_by(script) if name.split(".", 1)[0] in FRAMEWORK_PACKAGES)


def preimport(script: str) -> tuple[list[str], float]:
    """Import what ``script`` imports (see the module docstring); (modules imported, seconds it took)."""
    started = time.monotonic()
    done: list[str] = []
    for name in imported_by(script):
        if name in sys.modules or name == "__main__":
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # the script's own import will raise it where the user expects it
            log.debug("pre-import of %s failed: %s", name, exc)
            continue
        done.append(name)
    return done, time.monotonic() - started


# torch defines the originals and TorchPass calls them on purpose.
_KEEP = ("torch", "torchpass")


def rebind_in_loaded_modules(original: Any, replacement: Any, patch: Callable[[Any, str, Any], None]) -> int:
    """Point every global of a loaded module (torch's and TorchPass's aside) that is ``original`` at
    ``replacement``, through ``patch``, which records how to undo it; the number of names changed."""
    changed = 0
    for name, module in list(sys.modules.items()):
        # By what the module is, not the name it is filed under: ``python -m torchpass.transparent.bootstrap`` runs as
        # ``__main__``, and multiprocessing files the same module again as ``__mp_main__``.
        spec = getattr(module, "__spec__", None)
        origin = spec.name if spec is not None and spec.name else name
        if module is None or name in ("__main__", "__mp_main__") or origin.split(".", 1)[0] in _KEEP:
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                patch(module, attr, replacement)
                changed += 1
    return changed
