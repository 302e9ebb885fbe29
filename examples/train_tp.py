#!/usr/bin/env python3
"""A complete tensor-parallel (TP) + HSDP training script made fault tolerant with TorchPass.

A small Llama-shaped model (attention and SwiGLU MLP blocks, RMSNorm, an output head) is cut by a TP plan, as
torchtitan's ``parallelize_llama`` writes it (ColwiseParallel for wq/wk/wv/w1/w3 and the head, RowwiseParallel for
wo/w2), over the ``tp`` dimension of a (replicate, shard, tp) mesh that TorchPass owns, then sharded with FSDP2
over (replicate, shard). ``--mesh 2x1x2`` is 2 replicas x 1 shard x tp 2 (4 ranks): a failed rank is rebuilt
from the rank at its (shard, tp) coordinate in the other replica. Run it locally with four ranks and one spare,
then kill a rank and watch the job carry on at the same step::

    torchpass run --local --nproc 4 --spares 1 examples/train_tp.py --mesh 2x1x2 --steps 100
    # in another terminal, while it runs:  kill -9 <pid of a rank>   (pids are in the launcher's log)

Every rank prints the same ``final weights sha256`` (of the gathered weights) at the end, and the value does not
change when ranks are killed along the way. With 2 ranks per node, a TP group is one node's two ranks.
"""

from __future__ import annotations

import argparse
import sys

import torch
from llama_model import VOCAB, Block, Model, gathered_sha256, make_dataset, tp_plan
from torch import nn

import torchpass as tp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2x1x2", help="replicas x shards x tp (default 2x1x2)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to train (default 100)")
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per TP group per step (default 8)")
    args = parser.parse_args(argv)
    replicas, shards, tp_size = (int(v) for v in args.mesh.split("x"))

    ctx = tp.init()  # a spare waits here until it is given a slot
    torch.manual_seed(0)  # the same initial weights on every rank: each TP rank cuts its own copy
    model = ctx.wrap_fsdp(
        Model(args.depth), mesh_shape=(replicas, shards), tp=tp_size, tp_plan=tp_plan(args.depth), shard=Block
    )
    optimizer = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    scheduler = ctx.register("scheduler", torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps))
    loader = tp.StepLoader(make_dataset(), batch_size=args.batch_size, seed=1)  # one batch per TP group

    for step, (tokens, targets) in ctx.steps(loader, args.steps):
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        tp.clip_grad_norm_(model.parameters(), max_norm=1.0)  # torch's refuses parameters on different meshes
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
