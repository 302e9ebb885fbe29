#!/usr/bin/env python3
"""A plain PyTorch script shaped like torchtitan's Llama training: tensor parallelism inside a node, FSDP2 over the
rest. It imports nothing from TorchPass, runs as it is under torchrun, and TorchPass protects it unchanged in
transparent mode.

The script names its mesh's dimensions as torchtitan's ``ParallelDims`` does: ``init_device_mesh`` over
``("dp_replicate", "dp_shard", "tp")`` (``("dp_shard", "tp")`` without replicas), ``parallelize_module`` of the
model over ``mesh["tp"]`` with torchtitan's plan, then ``fully_shard`` of every block and of the model over the
data-parallel slice, and a ``DistributedSampler`` over the data-parallel ranks (the ranks of one TP group read the
same batches)::

    torchrun --nproc-per-node 4 examples/train_tp_plain.py --mesh 2x1x2
    torchpass run --local --transparent --nproc 4 --spares 1 examples/train_tp_plain.py --mesh 2x1x2
    # in another terminal, while it runs:  kill -9 <pid of a rank>   (pids are in the launcher's log)

``--mesh 1x2x2`` has no replica: a lost rank comes back from its peer copy on a ring neighbour (on another node
when two ranks run per node). Every rank prints the same ``final weights sha256`` at the end, killed ranks or not.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from llama_model import VOCAB, Model, gathered_sha256, make_dataset, tp_plan
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DataLoader, DistributedSampler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2x1x2", help="dp_replicate x dp_shard x tp (default 2x1x2)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--samples", type=int, default=512, help="sequences in the data set (default 512)")
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per TP group per step (default 8)")
    args = parser.parse_args(argv)
    replicas, shards, tp = (int(v) for v in args.mesh.split("x"))

    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if replicas > 1:
        mesh = init_device_mesh(device, (replicas, shards, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        dp_rank = mesh["dp_replicate"].get_local_rank() * shards + mesh["dp_shard"].get_local_rank()
    else:
        mesh = init_device_mesh(device, (shards, tp), mesh_dim_names=("dp_shard", "tp"))
        dp_mesh, dp_rank = mesh["dp_shard"], mesh["dp_shard"].get_local_rank()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = Model(args.depth)
    parallelize_module(model, mesh["tp"], tp_plan(args.depth))
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    dataset = make_dataset(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=replicas * shards, rank=dp_rank, seed=1, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for tokens, targets in loader:
            loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
        print(f"rank {dist.get_rank()}: epoch {epoch} loss {loss.item():.4f}", flush=True)

    print(f"rank {dist.get_rank()}: final weights sha256 {gathered_sha256(model)}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
