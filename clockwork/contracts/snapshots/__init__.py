"""Training snapshots on disk: the format, the checks and the writer process, without torch.

TorchPass (the ranks) and the ``clockwork snapshot`` command both use this package, so it imports only h5py
and numpy: the CLI must not import torch, and TorchPass imports of Clockwork only ``clockwork.contracts``.
:mod:`clockwork.contracts.snapshots.store` defines what a snapshot is on disk (and when it exists at all);
:mod:`clockwork.contracts.snapshots.writer` is the background process that writes a rank's shard, and
:mod:`clockwork.contracts.snapshots.messages` the requests and answers between a rank and that process.
"""
