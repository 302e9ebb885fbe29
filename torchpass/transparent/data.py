"""Transparent mode's view of the script's data: the data position that moves, and the passes over the tracked loader.

:mod:`torchpass.transparent.bootstrap` explains the mode. The session (:mod:`torchpass.transparent.session`) tracks the
first ``DataLoader`` over a ``DistributedSampler``; each ``iter()`` on it is a :class:`TrackedPass`, whose
``next()`` is the session's step boundary and which serves any batch of the pass by index (a redone step, a
replacement resuming inside a pass). :class:`DataPosition` is the registered state saying where the replicas are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, DistributedSampler

from torchpass.rank.rng import step_seed

__all__ = ["DATA_STATE", "DataPosition", "Enumerated", "StepBoundary", "TrackedPass"]

DATA_STATE = "torchpass.data_position"


class DataPosition:
    """Where the replicas are in the script: ``index`` batches of pass ``pass_no`` over the tracked loader are
    done, and ``collectives`` of the script's collectives between steps have completed.

    Registered with the context like any user state, so it travels with the model and rolls back with an
    abandoned step. ``epoch`` is the sampler's epoch of that pass (a consistency check for newcomers; -1 when
    unknown). A pass whose end the replicas have passed is recorded as the next pass at index 0: from there on
    they ran the script's code after that pass (its epilogue), which a newcomer must then skip, while a pass
    ended but not yet left (``index`` = its length) means the epilogue is still to run, newcomer included.
    ``collectives`` tells a newcomer which of the epilogue's collectives the replicas already ran."""

    def __init__(self) -> None:
        self.pass_no = 0
        self.index = 0
        self.epoch = -1
        self.collectives = 0

    def state_dict(self) -> dict[str, int]:
        return {"pass": self.pass_no, "index": self.index, "epoch": self.epoch, "collectives": self.collectives}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pass_no, self.index, self.epoch = int(state["pass"]), int(state["index"]), int(state["epoch"])
        self.collectives = int(state.get("collectives", 0))  # snapshots written before the field existed


class StepBoundary(Protocol):
    """What a pass asks of the session: the step boundary at each ``next()``."""

    passes: int
    step_index: int

    def next_batch(self, it: TrackedPass) -> Any: ...


class TrackedPass:
    """One ``iter(loader)`` of the tracked loader: its batches (index lists) and a streaming inner loader."""

    def __init__(self, session: StepBoundary, loader: DataLoader[Any], pass_no: int) -> None:
        self.session = session
        self.loader = loader
        self.pass_no = pass_no
        sampler = loader.sampler
        if not isinstance(sampler, DistributedSampler):  # a batch sampler over the DistributedSampler
            sampler = getattr(loader.batch_sampler, "sampler", sampler)
        self.sampler = sampler
        self.epoch = int(getattr(sampler, "epoch", 0))
        self.batches: list[Any] = list(iter(loader.batch_sampler))  # type: ignore[arg-type]
        self.inner: Iterator[Any] | None = None
        self.inner_next = -1

    def retarget(self, pass_no: int, epoch: int) -> None:
        """Become pass ``pass_no``, in the sampler's order of ``epoch`` (a framework adapter's jump)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self.pass_no, self.epoch = pass_no, epoch
        self.batches = list(iter(self.loader.batch_sampler))  # type: ignore[arg-type]
        self.inner, self.inner_next = None, -1
        self.session.passes = pass_no + 1

    def __iter__(self) -> TrackedPass:
        return self

    def __len__(self) -> int:
        return len(self.batches)

    def __next__(self) -> Any:
        return self.session.next_batch(self)

    def fetch(self, index: int, step: int, seed: int, slot: int) -> Any:
        """Batch ``index`` of this pass: streamed, or from a fresh inner loader after a jump (redo, resume).

        The inner loader's private generator keeps its construction from drawing on the global RNG, which
        was just reseeded for the step (in-process ``__getitem__`` randomness then depends on the step only)."""
        if self.inner is None or index != self.inner_next:
            src = self.loader
            workers = src.num_workers
            inner_loader: DataLoader[Any] = DataLoader(
                src.dataset,
                batch_sampler=self.batches[index:],  # type: ignore[arg-type]
                num_workers=workers,
                collate_fn=src.collate_fn,
                pin_memory=src.pin_memory,
                timeout=src.timeout,
                worker_init_fn=src.worker_init_fn,
                multiprocessing_context=src.multiprocessing_context if workers else None,
                generator=torch.Generator().manual_seed(step_seed(seed, slot, step)),
                prefetch_factor=src.prefetch_factor if workers else None,
                pin_memory_device=src.pin_memory_device,
            )
            self.inner = iter(inner_loader)
        batch = next(self.inner)
        self.inner_next = index + 1
        return batch


class Enumerated:
    """``enumerate`` over the tracked loader: the index is the batch's place in its pass (see
    :meth:`torchpass.transparent.session.Session.enumerate`)."""

    def __init__(self, it: TrackedPass, start: int) -> None:
        self.it = it
        self.start = start

    def __iter__(self) -> Enumerated:
        return self

    def __next__(self) -> tuple[int, Any]:
        batch = next(self.it)
        return self.start + self.it.session.step_index, batch
