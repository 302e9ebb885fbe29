#!/usr/bin/env python3
"""A complete mixture-of-experts (MoE) training script with expert parallelism (EP) beside HSDP, made fault tolerant
with TorchPass.

A small Llama-shaped model whose feed-forward layers are top-1 MoE layers
(:class:`torchpass.sharded.expert_parallel.MoE`): each rank keeps the experts of its coordinate on the mesh's
``ep`` dimension and sends every token to its expert's rank and back with all-to-all; everything else is HSDP over
the same ``("replicate", "ep")`` mesh. ``--mesh 2x2`` is 2 replicas x ep 2 (4 ranks): a failed rank is rebuilt
from the rank at its ep coordinate in the other replica (its experts, its FSDP shard of the rest, the optimizer
and scheduler state). Run it locally with four ranks and one spare, then kill a rank and watch the job carry on
at the same step::

    torchpass run --local --nproc 4 --spares 1 examples/train_moe.py --mesh 2x2 --steps 100
    # in another terminal, while it runs:  kill -9 <pid of a rank>   (pids are in the launcher's log)

The two replicas of each ep coordinate print the same ``final weights sha256`` (of the gathered non-expert
weights and that coordinate's experts) at the end, and the values do not change when ranks are killed.
"""

from __future__ import annotations

import argparse
import sys

import torch
from llama_model import DIM, VOCAB, Attention, Model, gathered_sha256, make_dataset
from torch import nn

import torchpass as tp
from torchpass.sharded.expert_parallel import MoE

HIDDEN, EXPERTS = 128, 4


class MoEBlock(nn.Module):
    """A transformer block with an MoE feed-forward: the unit that gets its own ``fully_shard``."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.moe = Attention(), MoE(DIM, HIDDEN, EXPERTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.ffn_norm(x))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2x2", help="replicas x ep (default 2x2)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to train (default 100)")
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, all ranks (default 16)")
    args = parser.parse_args(argv)
    replicas, ep = (int(v) for v in args.mesh.split("x"))

    ctx = tp.init()  # a spare waits here until it is given a slot
    torch.manual_seed(0)  # the same initial weights on every rank: each rank cuts its own experts
    model = ctx.wrap_fsdp(Model(args.depth, MoEBlock), mesh_shape=(replicas, ep), ep=ep, shard=MoEBlock)
    optimizer = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    scheduler = ctx.register("scheduler", torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps))
    loader = tp.StepLoader(make_dataset(), batch_size=args.batch_size, seed=1)  # one equal share per rank

    for step, (tokens, targets) in ctx.steps(loader, args.steps):
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % 20 == 0 or step == args.steps - 1:
            mean = loss.detach().clone()
            if ctx.all_reduce(mean) and ctx.slot == 0:
                print(f"step {step}: loss {mean.item() / ctx.world_size:.4f}", flush=True)

    print(f"slot {ctx.slot}: final weights sha256 {gathered_sha256(model)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
