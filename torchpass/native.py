"""TorchPass's compiled part: the failure-tolerant process group DDP's reducer runs over for CPU gradients.

Why compiled: a process group written in Python (:class:`torchpass.ddp._CurrentGroup`, the fallback) costs a
Python call per gradient bucket and a Python callback on gloo's thread when each bucket's sum is in; both take
the GIL, and on a 2-core machine that was about 1 ms of a 40 ms step, the whole of TorchPass's measured cost
per step (``bench/torchpass_overhead.py``). ``csrc/guarded_group.cpp`` does the same in C++ and runs Python
only when a collective fails.

It is compiled with :func:`torch.utils.cpp_extension.load` (a C++ compiler and ninja; about 40 s) against the
torch that imports it: ``make venv`` builds it next to this package, and a process that finds no build there
(or cannot write one) builds it once under ``~/.cache/clockwork``. If it cannot be built, TorchPass logs why
and uses the Python group: the same results, at the cost above. ``native_group = false`` (TorchPassConfig)
skips it.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["SOURCE", "build_dirs", "guarded_group_class"]

log = logging.getLogger("clockwork.torchpass.native")

SOURCE = Path(__file__).with_name("csrc") / "guarded_group.cpp"
_NAME = "torchpass_guarded_group"
# The compiler flags of the project's C code: optimised, hardened.
_CFLAGS = ["-O2", "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2", "-Wall"]
_LDFLAGS = ["-Wl,-z,relro,-z,now", "-Wl,-z,noexecstack"]


def build_dirs() -> list[Path]:
    """Where the compiled group is looked for and built, in order: next to this package (``make venv``),
    then the user's cache. One folder per torch version: an extension only loads into the torch it was
    built against."""
    tag = f"torch-{torch.__version__}".replace("+", "_")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clockwork" / "torchpass-native"
    return [Path(__file__).with_name("_native") / tag, cache / tag]


@functools.cache
def guarded_group_class() -> Any:
    """The compiled ``GuardedGroup`` class, or None (logged once) when it cannot be built or loaded here."""
    from torch.utils import cpp_extension

    errors = []
    for folder in build_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            module = cpp_extension.load(
                _NAME,
                [str(SOURCE)],
                build_directory=str(folder),
                extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS,
                verbose=False,
            )
            return module.GuardedGroup
        except Exception as exc:  # no compiler or ninja, a read-only folder, a failed build
            errors.append(f"{folder}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:] or ''}")
    log.warning(
        "TorchPass's compiled process group could not be built (%s); using the Python one, which costs about "
        "1 ms more per step (set native_group = false to skip this attempt)",
        "; ".join(errors),
    )
    return None


if __name__ == "__main__":  # make venv: build it next to the package
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if guarded_group_class() is None:
        raise SystemExit("torchpass.native: the compiled process group could not be built (see above)")
    print(f"torchpass.native: built under {build_dirs()[0]}")
