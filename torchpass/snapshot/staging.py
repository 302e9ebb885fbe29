"""What one rank puts into a snapshot, where in the arena, and the copies that put it there.

The layout (:func:`plan_entries`): the replicated state (:func:`torchpass.rank.state.describe`: model, optimizers,
registered objects; the same on every data-parallel replica) is spread over the replicas, each tensor staged and
written by one of them (greedy by size, the same plan on every rank) as entry ``t/NNNNNN``, rank 0 also stages
the state's description (``meta``), and each rank adds its own state (RNG generators, slot, data position).

A sharded model (FSDP2 over an R x S mesh, :class:`torchpass.rank.transfer_plan.ShardedReplicas`) has S different
states, one per shard, each with its own description (its tensors are the local shards): shard ``s``'s go under
``s/SSSSS/`` (``s/SSSSS/t/NNNNNN`` and ``s/SSSSS/meta``), spread by the same greedy plan over the R replicas
holding it; under pure FSDP (R = 1) each rank writes its own shard. Every entry starts on an :data:`ALIGN`
boundary so that the writer can send it to the disk with O_DIRECT.

The copies: parameters and optimizer state change only inside the optimizer step, so they are copied while
the next forward and backward pass run (GPU: non-blocking on a side stream; CPU: by the snapshot thread,
:meth:`Staged.copy_deferred`), and the next optimizer step waits for them. Everything else (buffers, which a
forward pass may change, and the rank's own small state) is copied at the step boundary.
"""

from __future__ import annotations

import json
import pickle
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from clockwork.contracts.snapshots.messages import Entry
from clockwork.contracts.snapshots.store import shard_prefix
from torchpass.rank.state import StateParts, as_bytes, describe, update_only_tensors
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.snapshot.arena import ALIGN, SharedArena

__all__ = [
    "EntryPlan",
    "Layout",
    "Staged",
    "StagedEntry",
    "lay_out",
    "plan_entries",
    "plan_owners",
    "rank_state",
    "stage",
]


@dataclass(frozen=True)
class StagedEntry:
    """One entry of this rank's snapshot: the live bytes, and where they go in the arena."""

    name: str
    tensor: torch.Tensor  # a flat uint8 view of the live tensor (or of a CPU copy of small state)
    offset: int
    dtype: str  # the framework's dtype of the original tensor, as text
    shape: tuple[int, ...]
    side_stream: bool  # parameters and optimizer state: changed only by the optimizer step

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    def wire(self) -> Entry:
        """The entry as the writer process sees it."""
        return Entry(self.name, self.offset, self.nbytes, self.dtype, self.shape)


@dataclass(frozen=True)
class Layout:
    """This rank's entries and the arena size they need."""

    entries: list[StagedEntry]
    size: int
    tensors: int  # tensors in the state (of each shard, if sharded; the manifest checks each is in some file)

    @property
    def cuda(self) -> bool:
        return any(e.tensor.is_cuda for e in self.entries)


def plan_owners(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each tensor: largest first to the least-loaded rank (the same on every rank)."""
    loads = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += sizes[i]
    return owner


@dataclass(frozen=True)
class EntryPlan:
    """Which part of the training state one rank stages: the tensors it writes and under which prefix."""

    prefix: str  # "" for the replicated state, ``s/SSSSS/`` for shard S of a sharded model
    tensors: tuple[int, ...]  # indices (in payload order) of the tensors this rank writes
    meta: bool  # whether this rank also writes the state's description


def plan_entries(sizes: list[int], slot: int, world_size: int, mesh: ShardedReplicas | None = None) -> EntryPlan:
    """What ``slot`` stages of a state whose tensors have ``sizes`` bytes: unsharded, one greedy plan over every
    rank; sharded, one per shard over the replicas holding it (replica 0 also writes the shard's description)."""
    if mesh is None:
        owner = plan_owners(sizes, world_size)
        return EntryPlan("", tuple(i for i, o in enumerate(owner) if o == slot), slot == 0)
    replica, shard = mesh.coordinate(slot)
    owner = plan_owners(sizes, mesh.replicas)
    return EntryPlan(shard_prefix(shard), tuple(i for i, o in enumerate(owner) if o == replica), replica == 0)


def bytes_tensor(data: bytes) -> torch.Tensor:
    """``data`` as a CPU uint8 tensor (of its own copy)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def rank_state(slot: int, committed: int, seed: int) -> dict[str, torch.Tensor]:
    """This rank's own state: RNG generators and data position (entries ``rank/SSSSS/...``)."""
    prefix = f"rank/{slot:05d}"
    out = {
        f"{prefix}/position": bytes_tensor(
            json.dumps({"slot": slot, "committed": committed, "next_step": committed + 1, "seed": seed}).encode()
        ),
        f"{prefix}/torch_cpu_rng": torch.get_rng_state(),
        f"{prefix}/python_rng": bytes_tensor(pickle.dumps(random.getstate())),
        f"{prefix}/numpy_rng": bytes_tensor(pickle.dumps(np.random.get_state())),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"{prefix}/cuda_rng/{index}"] = state
    return out


def lay_out(
    parts: StateParts, committed: int, slot: int, world_size: int, seed: int, mesh: ShardedReplicas | None = None
) -> Layout:
    """This rank's entries of the snapshot of step ``committed`` (nothing is copied yet); ``mesh``: the shape
    a sharded model's state is cut into (``parts`` then holds this rank's shard)."""
    meta, tensors = describe(parts, committed)
    plan = plan_entries([t.numel() * t.element_size() for t in tensors], slot, world_size, mesh)
    mine = set(plan.tensors)
    side = update_only_tensors(parts)
    entries: list[StagedEntry] = []
    offset = 0

    def add(name: str, tensor: torch.Tensor, dtype: str, shape: tuple[int, ...], on_side: bool) -> None:
        nonlocal offset
        entry = StagedEntry(name, as_bytes(tensor.contiguous()), offset, dtype, shape, on_side)
        entries.append(entry)
        offset += (entry.nbytes + ALIGN - 1) // ALIGN * ALIGN

    for i, live in enumerate(tensors):
        if i in mine:
            shape = tuple(int(v) for v in live.shape)
            add(f"{plan.prefix}t/{i:06d}", live, str(live.dtype), shape, live.data_ptr() in side)
    if plan.meta:
        blob = bytes_tensor(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
        add(f"{plan.prefix}meta", blob, "torch.uint8", (blob.numel(),), False)
    for name, tensor in rank_state(slot, committed, seed).items():
        nbytes = tensor.numel() * tensor.element_size()
        add(name, tensor, "torch.uint8", (nbytes,), False)
    return Layout(entries, max(offset, ALIGN), len(tensors))


@dataclass
class Staged:
    """Copies started by :func:`stage`: what the writer waits for, and what the snapshot thread still copies."""

    writer_waits: list[Any] = field(default_factory=list)  # CUDA events: the arena holds every GPU byte after
    update_waits: Any = None  # CUDA event the next optimizer step waits for (the side stream's copies)
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (arena view, live CPU)

    def copy_deferred(self) -> None:
        """Copy the CPU parameters and optimizer state into the arena (the snapshot thread, during the next
        forward and backward pass: ``Tensor.copy_`` releases the GIL)."""
        with torch.no_grad():
            for into, tensor in self.deferred:
                into.copy_(tensor)
        self.deferred = []

    def wait_for_gpu(self) -> None:
        """Block until every GPU copy into the arena is done (releases the GIL meanwhile)."""
        for event in self.writer_waits:
            event.synchronize()


def stage(arena: SharedArena, layout: Layout) -> Staged:
    """Copy, or start copying, every entry into the arena."""
    staged = Staged()
    entries = layout.entries
    side_entries = [e for e in entries if e.tensor.is_cuda and e.side_stream]
    main_entries = [e for e in entries if not e.side_stream]
    cpu_side = [e for e in entries if not e.tensor.is_cuda and e.side_stream]
    staged.deferred = [(arena.view(e.offset, e.nbytes), e.tensor) for e in cpu_side]
    with torch.no_grad():
        if side_entries:
            compute = torch.cuda.current_stream()
            stream = torch.cuda.Stream()
            stream.wait_stream(compute)  # the committed step's update must be complete before we read
            with torch.cuda.stream(stream):
                for e in side_entries:
                    arena.view(e.offset, e.nbytes).copy_(e.tensor, non_blocking=True)
                    e.tensor.record_stream(stream)
                done = torch.cuda.Event()
                done.record(stream)
            staged.writer_waits.append(done)
            staged.update_waits = done
        for e in main_entries:
            arena.view(e.offset, e.nbytes).copy_(e.tensor, non_blocking=e.tensor.is_cuda)
        if layout.cuda and main_entries:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream())
            staged.writer_waits.append(done)
    return staged
