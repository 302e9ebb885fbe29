#!/usr/bin/env python3
"""A complete data-parallel training script made fault tolerant with TorchPass (five added lines).

Run it locally with three ranks and one spare, then kill a rank and watch the job carry on at the same step::

    torchpass run --local --nproc 3 --spares 1 examples/train_torchpass.py --steps 300
    # in another terminal, while it runs:  kill -9 <pid of a rank>   (pids are in the launcher's log)
    # or move a rank to the spare on purpose:  clockwork migrate --coordinator /tmp/torchpass-PID.coordinator --rank 1

Run alone (``python examples/train_torchpass.py``) it trains as a one-rank job.

The model is a small MLP with dropout learning a fixed synthetic regression task on CPU (gloo). Every rank
prints the same ``final weights sha256`` at the end, and the value does not change when ranks are killed
along the way: that is the proof that no step was lost or done twice.
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
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train (default 200)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    args = parser.parse_args(argv)

    ctx = tp.init()  # 1: join the job (a spare waits here until it is given a slot)

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(NUM_FEATURES, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    ddp = ctx.wrap_model(model)  # 2: DDP over the job's current process group
    optimizer = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))  # 3
    scheduler = ctx.register(  # 4: anything else whose state must follow a rank to its replacement
        "scheduler", torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    )
    loader = tp.StepLoader(make_dataset(), batch_size=args.batch_size, seed=1)

    for step, (x, y) in ctx.steps(loader, args.steps):  # 5: the step boundary is where recovery happens
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % 50 == 0 or step == args.steps - 1:
            mean = loss.detach().clone()
            if ctx.all_reduce(mean):  # a collective of our own: it may not raise when a peer dies
                if ctx.slot == 0:
                    print(f"step {step} loss {mean.item() / ctx.world_size:.5f} (generation {ctx.generation})")

    print(f"slot {ctx.slot}: final weights sha256 {weights_sha256(model)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
