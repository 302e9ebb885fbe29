#!/usr/bin/env python3
"""A pipeline-parallel (PP) training script made fault tolerant with TorchPass: 2 replicas x 2 stages.

A small Llama-shaped model (attention and SwiGLU MLP blocks, RMSNorm, an output head) is cut into two stages:
the token embeddings and the first half of the blocks, then the other half, the norm and the head. Each rank
builds the whole model from the same seed and ``ctx.wrap_pipeline`` keeps its own stage: slot ``r * 2 + k`` runs
stage ``k`` of replica ``r``, under ``torch.distributed.pipelining``'s ``ScheduleGPipe`` or ``Schedule1F1B``
(``--schedule``) with 4 micro-batches. TorchPass builds the ``PipelineStage`` and the schedule over its own groups,
again after every membership change. A failed rank is rebuilt from the same stage of the other replica, and every
stage resumes the same step with the same micro-batches. Run it locally with four ranks and one spare, then kill a
rank and watch the job carry on at the same step::

    torchpass run --local --nproc 4 --spares 1 examples/train_pp.py --steps 100
    # in another terminal, while it runs:  kill -9 <pid of a rank>   (pids are in the launcher's log)

Each rank prints its stage's ``final weights sha256`` at the end (the two replicas of a stage print the same one),
and the values do not change when ranks are killed along the way.

``--dp-shard 2`` also shards each stage with FSDP2 over two ranks (every block gets its own ``fully_shard``):
2 replicas x 2 FSDP shards x 2 stages, eight ranks, slot ``r * 4 + s * 2 + k`` running shard ``s`` of stage ``k``
(each rank then hashes its own shard)::

    torchpass run --local --nproc 8 --spares 1 examples/train_pp.py --dp-shard 2 --steps 100
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
from llama_model import DIM, VOCAB, Attention, make_dataset
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import torchpass as tp

HIDDEN = 172
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Block(nn.Module):
    """A transformer block (attention, then a SwiGLU MLP, each after an RMSNorm, with a dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = Attention()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        h = self.ffn_norm(x)
        return x + self.dropout(self.w2(nn.functional.silu(self.w1(h)) * self.w3(h)))


class FirstStage(nn.Module):
    """Token embeddings and the first blocks: tokens in, activations out."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The other blocks, the norm and the head: activations in, logits out."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of one micro-batch (computed on the last stage)."""
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def sha256(module: nn.Module) -> str:
    """Hash of every parameter and buffer of this rank's stage (under FSDP, of this rank's shards)."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        digest.update(name.encode())
        digest.update(local.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="pipeline replicas (default 2)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to train (default 100)")
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks per stage (default 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per replica per step (default 8)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b", help="pipeline schedule")
    parser.add_argument(
        "--dp-shard", type=int, default=1, help="FSDP shards per stage (default 1, no FSDP; ranks: replicas x this x 2)"
    )
    args = parser.parse_args(argv)

    ctx = tp.init()  # a spare waits here until it is given a slot
    torch.manual_seed(0)  # the same model on every rank: each keeps its own stage
    stages = [FirstStage(args.depth), LastStage(args.depth)]
    pipe = ctx.wrap_pipeline(
        stages,
        mesh_shape=(args.replicas, 2),
        schedule=SCHEDULES[args.schedule],
        n_microbatches=args.microbatches,
        loss_fn=loss_fn,
        **({"dp_shard": args.dp_shard, "shard": Block} if args.dp_shard > 1 else {}),
    )
    optimizer = ctx.wrap_optimizer(torch.optim.AdamW(pipe.module.parameters(), lr=3e-3, weight_decay=0.01))
    scheduler = ctx.register("scheduler", torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps))
    loader = tp.StepLoader(make_dataset(), batch_size=args.batch_size, seed=1)  # one batch per replica

    for step, (tokens, targets) in ctx.steps(loader, args.steps):
        losses: list[torch.Tensor] = []
        pipe.step(tokens, target=targets, losses=losses)  # a failure abandons the step on every stage
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if pipe.is_last and losses and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step} (slot {ctx.slot}): loss {torch.stack(losses).mean().item():.4f}", flush=True)

    print(f"slot {ctx.slot} (stage {pipe.stage_index}): final weights sha256 {sha256(pipe.module)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
