"""Per-rank random streams that need no transfer: reseeded at every step from (seed, slot, step).

Dropout masks and data augmentation differ per rank, so a replica cannot supply a dead rank's RNG state.
Instead of capturing and shipping generator states, TorchPass makes each step's randomness a pure function
of (seed, rank slot, step): at each step boundary it reseeds torch's default generators (CPU and, when CUDA is
initialised, every GPU), and optionally Python's ``random`` and NumPy's global generator. A replacement rank
in slot R at step S therefore draws exactly what the original rank would have drawn, and a step redone after
an abandoned attempt draws the same masks again. The fault-free run reseeds the same way, which is what makes
final weights bitwise comparable. Cost: a few microseconds per step on warm caches, tens of microseconds
between two training steps (mostly NumPy's and Python's generators, whose states are 2.5 KB each).

Randomness that lives outside these generators (a private ``torch.Generator``, DataLoader worker processes)
must be derived from the step or the sample index too; :class:`torchpass.rank.data.StepLoader` does so.
"""

from __future__ import annotations

import importlib
import random
from types import ModuleType

import torch

__all__ = ["reseed", "step_seed"]

_numpy: ModuleType | None = None
_numpy_checked = False

_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64 finaliser: spreads nearby inputs over the whole 64-bit range."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def step_seed(seed: int, slot: int, step: int) -> int:
    """A 63-bit seed that depends on all three inputs (stable across processes and Python versions)."""
    return _mix(_mix(_mix(seed & _MASK64) ^ (slot & _MASK64)) ^ (step & _MASK64)) >> 1


def reseed(seed: int, slot: int, step: int, *, python: bool = True, numpy: bool = True) -> int:
    """Reseed the global generators for ``step`` of ``slot``; returns the seed used."""
    global _numpy, _numpy_checked
    value = step_seed(seed, slot, step)
    # torch.manual_seed would also walk every accelerator backend (~100 us); seed only what is live (~1 us).
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(value)
    if python:
        random.seed(value)
    if numpy:
        if not _numpy_checked:
            _numpy_checked = True
            try:
                _numpy = importlib.import_module("numpy")
            except ImportError:
                _numpy = None
        if _numpy is not None:
            _numpy.random.seed(value % (1 << 32))
    return value
