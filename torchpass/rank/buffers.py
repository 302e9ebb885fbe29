"""Slot 0's model buffers (BatchNorm statistics), staged so that recovery can copy them like any shared state.

Under DDP each rank updates its buffers with its own batch during the forward pass, and the next forward
starts from slot 0's values (DDP broadcasts them first). Between those two moments the ranks' buffers differ,
so they are per-rank state, and the state a recovery copies from "a replica" would carry the source's
statistics, not the slot's: a spare taking slot 0 would then broadcast a survivor's statistics, and every
rank would drift from the fault-free run by an ulp.

TorchPass therefore moves the broadcast: right after a synchronising forward (grad enabled, not in
``no_sync()``: when DDP would sync before the next forward), slot 0's buffers are broadcast asynchronously
into a staging copy, overlapping the backward pass. The step's update waits for it first (its failure
abandons the step, as a failed gradient bucket does), and the commit copies it into every rank's buffers.
At every committed step all ranks then hold slot 0's buffers, which are exactly what the next forward would
have received, so every forward computes what it computes under DDP, and any replica is a valid source. A
further forward in the same step first takes the staged values, as DDP's broadcast before it would.

What differs from plain DDP: between steps, a rank other than 0 holds slot 0's statistics instead of its own
(DDP would overwrite them at the next forward anyway), so the final state of every slot is slot 0's.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["StagedBuffers"]


class StagedBuffers:
    """The broadcast of slot 0's buffers after a forward pass, and its copy into the live buffers."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
        for buffer in buffers:
            by_dtype[(buffer.dtype, buffer.device)].append(buffer)
        self.groups = list(by_dtype.values())  # one flat broadcast per dtype and device
        self._flats: list[torch.Tensor] = []
        self._works: list[dist.Work] = []

    @property
    def pending(self) -> bool:
        """A broadcast was launched and not yet taken or dropped."""
        return bool(self._flats)

    def launch(self, source_rank: int = 0) -> None:
        """Broadcast slot 0's current buffers into fresh staging tensors (asynchronous; raises when the group
        is already broken). Fresh tensors each time: a dropped broadcast may still write into its own."""
        self._flats, self._works = [], []
        mine = dist.get_rank() == source_rank
        with torch.no_grad():
            for group in self.groups:
                if mine:
                    flat = _flatten_dense_tensors([b.detach() for b in group])
                else:
                    total = sum(b.numel() for b in group)
                    flat = torch.empty(total, dtype=group[0].dtype, device=group[0].device)
                self._flats.append(flat)
                work = dist.broadcast(flat, source_rank, async_op=True)
                assert work is not None
                self._works.append(work)

    def wait(self) -> None:
        """Block until the broadcast is in; raises what the process group raises (a peer died)."""
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def take(self) -> None:
        """Copy the staged values into the live buffers (after :meth:`wait`)."""
        with torch.no_grad():
            for group, flat in zip(self.groups, self._flats, strict=True):
                for live, staged in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                    live.copy_(staged)
        self._flats = []

    def drop(self) -> None:
        """Forget a broadcast of an abandoned step (its group is torn down with the generation)."""
        self._flats, self._works = [], []
