"""Staging a snapshot through a bounded arena: the rank's share goes to its writer a window at a time.

Why: the whole-share arena is a /dev/shm file the size of the part of the state the rank writes, kept for the
job: 100-200 GB per GPU, 0.8-1.6 TB on an 8-GPU node, more than /dev/shm (half the memory by default) and on
top of everything else the node holds. With ``snapshot_arena_max`` smaller than the share, the arena is that
size instead, and the shard is written in pieces: the snapshot thread copies piece i of the shard's bytes
into the arena, the writer writes it and answers, and piece i + 1 overwrites it
(:mod:`clockwork.contracts.snapshots.messages`). The shard file is the same, byte for byte, as the whole-arena
writer's (same offsets, same CRC-32s), so restore, the manifest and retention do not change.

What it costs, and why it stays exact: the parameters and optimizer state are read from the live tensors, and
the optimizer step after the snapshot may change them only once every piece has been copied, so that step
waits (:meth:`torchpass.snapshot.snapshotter.Snapshotter.before_update`) until all but the last window have
reached the writer: about (share - arena) / write bandwidth, instead of nothing. Everything else (buffers,
which the next forward pass may change, the state's description and the rank's own RNG states) is copied at
the step boundary into private memory (a clone, on the tensor's device) and staged from there. This module
imports torch and nothing of the writer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clockwork.contracts.snapshots.messages import pieces
from torchpass.snapshot.arena import SharedArena
from torchpass.snapshot.staging import Layout

__all__ = ["WindowedStaging"]


@dataclass
class WindowedStaging:
    """The sources of one windowed snapshot, and how to put piece i of it into the arena."""

    sources: list[tuple[int, torch.Tensor]]  # (offset in the shard, flat uint8 bytes)
    cuts: list[tuple[int, int]]  # the pieces, in shard offsets
    ready: object = None  # CUDA event: the committed step's update is complete (GPU state only)

    @classmethod
    def of(cls, layout: Layout, window: int) -> WindowedStaging:
        """At the step boundary: the live parameters and optimizer state as they are (the next optimizer step
        waits for :meth:`copy` of the last piece), private copies of everything else."""
        with torch.no_grad():
            sources = [(e.offset, e.tensor if e.side_stream else e.tensor.clone()) for e in layout.entries]
        ready = None
        if layout.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        cuts = pieces([e.wire() for e in layout.entries], window)
        return cls(sources, cuts, ready)

    def copy(self, arena: SharedArena, index: int) -> None:
        """Put piece ``index`` at the start of ``arena`` (blocking: the arena is the writer's once this returns)."""
        if index == 0 and self.ready is not None:
            self.ready.synchronize()  # type: ignore[attr-defined]
        lo, hi = self.cuts[index]
        with torch.no_grad():
            for offset, source in self.sources:
                first, last = max(lo, offset), min(hi, offset + int(source.numel()))
                if first < last:
                    arena.view(first - lo, last - first).copy_(source[first - offset : last - offset])

    def release(self) -> None:
        """Drop the references to the live tensors and the private copies (the snapshot is staged)."""
        self.sources = []
