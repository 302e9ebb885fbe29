"""Data position as a function of the step: batches any rank (or its replacement) can produce for any step.

TorchPass never moves a data loader's internal state. The rule is instead that the batch of rank slot R at
step S is a pure function of (dataset, seed, S, R, world size), so a replacement rank, or a survivor redoing
an abandoned step, produces exactly the same batch. :class:`StepLoader` implements that for map-style
datasets: a per-epoch permutation seeded by (seed, epoch), cut into global batches of
``batch_size * world_size`` samples, each rank taking its contiguous share. Any callable ``f(step) -> batch``
that follows the same rule works too (see :func:`batch_source`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from torchpass.rank.rng import step_seed

__all__ = ["StepIndexed", "StepLoader", "batch_source"]


@runtime_checkable
class StepIndexed(Protocol):
    """Anything that can produce rank ``slot``'s batch of ``step`` directly."""

    def batch(self, step: int, slot: int, world_size: int) -> Any:
        """The batch of ``slot`` at ``step`` (a pure function of its arguments)."""
        ...


class _StepBatches:
    """The index lists of steps ``start``, ``start + 1``, ... for one rank (a DataLoader batch_sampler)."""

    def __init__(self, loader: StepLoader, start: int, slot: int, world_size: int) -> None:
        self.loader, self.start, self.slot, self.world_size = loader, start, slot, world_size

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start
        while True:
            yield self.loader.indices(step, self.slot, self.world_size)
            step += 1


class StepLoader:
    """Deterministic, step-indexed, sharded batches from a map-style dataset.

    ``num_workers > 0`` prefetches with a torch DataLoader whose batch sampler starts at the requested step;
    it is rebuilt whenever the requested step is not the next one (after a recovery). Randomness inside the
    dataset's ``__getitem__`` must then derive from the index (worker processes do not see TorchPass's
    per-step reseeding); with ``num_workers == 0`` it runs in the rank and is reseeded per step.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn or default_collate
        self.num_workers = num_workers
        self._length = len(dataset)  # type: ignore[arg-type]
        self._perm_epoch = -1
        self._perm: list[int] = []
        self._prefetch: Iterator[Any] | None = None
        self._prefetch_key: tuple[int, int, int] | None = None  # (next step, slot, world size)

    def steps_per_epoch(self, world_size: int) -> int:
        """Whole global batches per pass over the dataset (the remainder of each epoch is skipped)."""
        steps = self._length // (self.batch_size * world_size)
        if steps < 1:
            raise ValueError(
                f"dataset of {self._length} samples is smaller than one global batch "
                f"({self.batch_size} x {world_size} ranks)"
            )
        return steps

    def epoch_of(self, step: int, world_size: int) -> int:
        """The epoch ``step`` falls in."""
        return step // self.steps_per_epoch(world_size)

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(step_seed(self.seed, -1, epoch))
                self._perm = torch.randperm(self._length, generator=generator).tolist()
            else:
                self._perm = list(range(self._length))
            self._perm_epoch = epoch
        return self._perm

    def indices(self, step: int, slot: int, world_size: int) -> list[int]:
        """Dataset indices of ``slot``'s share of the global batch of ``step``."""
        per_epoch = self.steps_per_epoch(world_size)
        epoch, within = divmod(step, per_epoch)
        global_size = self.batch_size * world_size
        start = within * global_size + slot * self.batch_size
        return self._permutation(epoch)[start : start + self.batch_size]

    def batch(self, step: int, slot: int, world_size: int) -> Any:
        """The collated batch of ``slot`` at ``step``."""
        if self.num_workers == 0:
            return self.collate_fn([self.dataset[i] for i in self.indices(step, slot, world_size)])
        if self._prefetch is None or self._prefetch_key != (step, slot, world_size):
            loader = DataLoader(
                self.dataset,
                batch_sampler=_StepBatches(self, step, slot, world_size),  # type: ignore[arg-type]
                num_workers=self.num_workers,
                collate_fn=self.collate_fn,
                generator=torch.Generator().manual_seed(step_seed(self.seed, slot, step)),
            )
            self._prefetch = iter(loader)
        batch = next(self._prefetch)
        self._prefetch_key = (step + 1, slot, world_size)
        return batch


def batch_source(source: Any, slot: Callable[[], int], world_size: int) -> Callable[[int], Any]:
    """Turn what the user passed to ``ctx.steps`` into ``f(step) -> batch``.

    Accepted: an object with ``batch(step, slot, world_size)`` (e.g. :class:`StepLoader`), a callable
    ``f(step)``, a sequence indexed by step, or None (the loop body fetches its own data: batch is None).
    """
    if source is None:
        return lambda step: None
    if isinstance(source, StepIndexed):
        return lambda step: source.batch(step, slot(), world_size)
    if isinstance(source, DataLoader):
        raise TypeError(
            "a torch DataLoader cannot be resumed at an arbitrary step; pass torchpass.StepLoader(dataset, "
            "batch_size) or a function step -> batch"
        )
    if callable(source):
        return source  # type: ignore[no-any-return]
    if isinstance(source, Sequence):
        return lambda step: source[step]
    raise TypeError(f"ctx.steps cannot take batches from {type(source).__name__}")
