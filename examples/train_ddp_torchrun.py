#!/usr/bin/env python3
"""An ordinary torchrun-style DDP training script (PyTorch's DDP example pattern), with no Clockwork import.

It is what model-transparent mode protects without a code change::

    torchpass run --local --transparent --nproc 3 --spares 1 examples/train_ddp_torchrun.py --epochs 4
    # in another terminal: kill -9 <pid of a rank>, or
    #   clockwork migrate --coordinator /tmp/torchpass-PID.coordinator --rank 1

and, in a Slurm job submitted with ``--clockwork-ft=transparent``, ``torchpass run examples/train_ddp_torchrun.py``
in the batch script. It also runs under ``torchrun --nproc-per-node 2 examples/train_ddp_torchrun.py``
(gloo on CPU), unprotected.

The pattern: ``init_process_group`` from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
``DistributedDataParallel(model)``, an optimizer, an LR scheduler stepped once per epoch, and a DataLoader
over a ``DistributedSampler`` iterated once per epoch after ``sampler.set_epoch(epoch)``. Every rank prints
the same ``final weights sha256``; with TorchPass the value does not change when ranks are killed or moved.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

NUM_SAMPLES = 3072
NUM_FEATURES = 16
DATA_SEED = 20240611


def make_dataset() -> TensorDataset:
    """A fixed regression task (the same on every rank and every run)."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=generator)
    teacher = torch.randn(NUM_FEATURES, 1, generator=generator)
    y = torch.tanh(x @ teacher) + 0.05 * torch.randn(NUM_SAMPLES, 1, generator=generator)
    return TensorDataset(x, y)


def weights_sha256(model: nn.Module) -> str:
    """Hash of every parameter and buffer, in order (bitwise identity check)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4, help="passes over the dataset (default 4)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    args = parser.parse_args(argv)

    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(NUM_FEATURES, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    dataset = make_dataset()
    sampler: DistributedSampler[int] = DistributedSampler(dataset, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item(), 1.0])
        scheduler.step()
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} mean loss {total[0].item() / total[1].item():.5f}", flush=True)

    print(f"rank {rank}/{world_size}: final weights sha256 {weights_sha256(model)}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
