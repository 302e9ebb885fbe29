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
import hashlib
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import TensorDataset

import torchpass as tp

DIM, HEADS, HIDDEN, SEQ, VOCAB = 64, 8, 172, 16, 32
NUM_SAMPLES = 2048
DATA_SEED = 20240611


class Attention(nn.Module):
    """Causal self-attention; under TP each rank holds HEADS / tp heads (wq/wk/wv column-cut, wo row-cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        head_dim = DIM // HEADS
        q, k, v = (w(x).view(b, n, -1, head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # the local heads only
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP (w1/w3 column-cut, w2 row-cut: one all-reduce in forward, one in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A transformer block: the unit that gets its own ``fully_shard``."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Model(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))


def tp_plan(depth: int) -> dict[str, Any]:
    """torchtitan's plan for Llama's linear layers (without sequence parallelism): the head's logits gathered."""
    plan: dict[str, Any] = {"output": ColwiseParallel(output_layouts=Replicate())}
    for i in range(depth):
        plan |= {f"layers.{i}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan |= {f"layers.{i}.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")}
        plan |= {f"layers.{i}.attention.wo": RowwiseParallel(), f"layers.{i}.feed_forward.w2": RowwiseParallel()}
    return plan


def make_dataset() -> TensorDataset:
    """A fixed next-token task: each sequence counts up modulo VOCAB from a random start."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    start = torch.randint(0, VOCAB, (NUM_SAMPLES, 1), generator=generator)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


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
