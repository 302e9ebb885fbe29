#!/usr/bin/env python3
"""The training script of bench/gpu_torchpass_nccl.py: a model-aware TorchPass job whose model and batches live
on the backend's device (the GPU under NCCL), which writes its final weights' hash where it is told. With
``--fsdp`` the model is sharded by ``ctx.wrap_fsdp`` over a (1 x world) mesh instead of wrapped in DDP: FSDP2's
collectives then run on the NCCL subgroups of TorchPass's mesh, and the hash is of the gathered weights."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchpass as tp


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds per step (time to ask for a migration)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fsdp", action="store_true", help="shard with ctx.wrap_fsdp (pure FSDP) instead of DDP")
    args = parser.parse_args()

    ctx = tp.init()
    device = ctx.device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 1)).to(device)
    ddp = ctx.wrap_fsdp(model, mesh_shape=(1, ctx.world_size), shard=nn.Linear) if args.fsdp else ctx.wrap_model(model)
    optimizer = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(4096, 64, generator=g), torch.randn(4096, 1, generator=g))
    loader = tp.StepLoader(data, batch_size=64, seed=1)
    for step, (x, y) in ctx.steps(loader, args.steps):
        loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        (args.out / "progress").write_text(f"{step} {ctx.generation}\n")
        time.sleep(args.sleep)
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a shard: gather it
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    (args.out / f"final-{ctx.slot}").write_text(f"{digest.hexdigest()} {device}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
