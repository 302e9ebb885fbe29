#!/usr/bin/env python3
"""A complete sharded (FSDP2 / HSDP) training script made fault tolerant with TorchPass.

The model is cut into shards over a (replicas x shards) device mesh that TorchPass owns: ``--mesh 2x2`` is
HSDP (two replicas of a model cut in two; a failed rank is rebuilt from the rank holding the same shard in the
other replica), ``--mesh 1x4`` pure FSDP (planned migrations move a rank's shard live; a sudden crash stops the
job with the reason, as no other rank holds that shard). Run it locally with four ranks and one spare, then
kill a rank and watch the job carry on at the same step::

    torchpass run --local --nproc 4 --spares 1 examples/train_fsdp.py --mesh 2x2 --steps 200
    # in another terminal, while it runs:  kill -9 <pid of a rank>   (pids are in the launcher's log)
    # or move a rank, with its shard, to the spare:  clockwork migrate --coordinator FILE --rank 1

Every rank prints the same ``final weights sha256`` (of the gathered, unsharded weights) at the end, and the
value does not change when ranks are killed along the way.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchpass as tp

NUM_SAMPLES = 4096
WIDTH = 64
DATA_SEED = 20240611


class Block(nn.Module):
    """A residual MLP block: the unit that gets its own ``fully_shard`` (its parameters are gathered together)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


def make_model(depth: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (FSDP2 shards each rank's own copy)
    return nn.Sequential(nn.Linear(16, WIDTH), *(Block(WIDTH) for _ in range(depth)), nn.Linear(WIDTH, 1))


def make_dataset() -> TensorDataset:
    """A fixed regression task (the same on every rank and every run)."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(NUM_SAMPLES, 16, generator=generator)
    teacher = torch.randn(16, 1, generator=generator)
    y = torch.tanh(x @ teacher) + 0.05 * torch.randn(NUM_SAMPLES, 1, generator=generator)
    return TensorDataset(x, y)


def gathered_sha256(model: nn.Module) -> str:
    """Hash of every parameter, gathered from its shards (a collective: every rank calls it)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(name.encode())
        digest.update(full.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2x2", help="replicas x shards (default 2x2; 1xN is pure FSDP)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train (default 200)")
    parser.add_argument("--depth", type=int, default=4, help="residual blocks (default 4)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (default 16)")
    args = parser.parse_args(argv)
    replicas, shards = (int(v) for v in args.mesh.split("x"))

    ctx = tp.init()  # a spare waits here until it is given a slot
    model = ctx.wrap_fsdp(make_model(args.depth), mesh_shape=(replicas, shards), shard=Block)
    optimizer = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    scheduler = ctx.register("scheduler", torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps))
    loader = tp.StepLoader(make_dataset(), batch_size=args.batch_size, seed=1)

    for step, (x, y) in ctx.steps(loader, args.steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # over the DTensor gradients
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % 50 == 0 or step == args.steps - 1:
            mean = loss.detach().clone()
            if ctx.all_reduce(mean) and ctx.slot == 0:
                print(f"step {step}: loss {mean.item() / ctx.world_size:.5f}", flush=True)

    print(f"slot {ctx.slot}: final weights sha256 {gathered_sha256(model)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
