"""Snapshots of the training state that cost the training loop a memory copy, and restores that never load a
bad one.

Taking one (:class:`Snapshotter`, at a step boundary right after a commit, on every rank at the same step):

1. the state TorchPass already moves between ranks (:func:`torchpass.rank.state.describe`: model parameters and
   buffers, optimizers, registered objects, the committed step, which is also the data position) is laid out
   in a shared-memory arena (:mod:`~torchpass.snapshot.arena`, a file under /dev/shm mapped by the rank and
   by its writer process), each replicated tensor staged by one data-parallel replica only, plus each rank's
   own state (:mod:`~torchpass.snapshot.staging`). A sharded model (``ctx.wrap_fsdp``) is S states, one per
   shard: each shard's tensors are staged by one of the replicas holding it (under pure FSDP, by its only
   holder), with that shard's own description;
2. parameters and optimizer state, which only an optimizer step changes, are copied while the next forward
   and backward pass run, and the next optimizer step waits for that copy (:meth:`Snapshotter.before_update`);
   the rest is copied at the boundary. Parameters and optimizer state must therefore change only inside the
   wrapped ``optimizer.step()``;
3. the snapshot thread hands the arena to the writer process (:mod:`~torchpass.snapshot.writer_client`,
   :mod:`clockwork.contracts.snapshots.writer`), which checksums, writes and fsyncs the shard while training goes on;
   rank 0's writer waits for every shard, writes the manifest (the snapshot now exists) and applies retention
   (:mod:`~torchpass.snapshot.snapshotter`).

Restoring (:func:`restore`, :mod:`~torchpass.snapshot.restore`): the newest snapshot whose manifest and every
checksum verify on every rank, bitwise; a sharded model's rank loads its own shard, and only a job of the same
mesh shape can. Where the snapshots are and whether a start restores one:
:mod:`torchpass.snapshot_location`.
"""

from __future__ import annotations

from torchpass.snapshot.restore import RestoreError, restart_advice, restore
from torchpass.snapshot.snapshotter import Snapshotter
from torchpass.snapshot_location import restore_target, snapshot_directory

__all__ = ["RestoreError", "Snapshotter", "restart_advice", "restore", "restore_target", "snapshot_directory"]
