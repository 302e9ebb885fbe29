"""The small Llama-shaped model the examples train, its data, and torchtitan's TP plan for it.

Shared by ``train_tp.py`` (the model-aware API: ``ctx.wrap_fsdp(..., tp_plan=tp_plan(depth))``),
``train_tp_plain.py`` (a plain PyTorch script, protected in transparent mode), ``train_moe.py`` (its own MoE block)
and ``train_pp.py`` (the attention and data). Build it identically on every rank (one seed): each TP rank cuts its
own part of the initial weights.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import TensorDataset

__all__ = ["DIM", "HEADS", "SEQ", "VOCAB", "Attention", "Block", "Model", "gathered_sha256", "make_dataset", "tp_plan"]

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
    """Token embeddings, ``depth`` blocks (``block()`` each: :class:`Block` by default), a norm and the head."""

    def __init__(self, depth: int, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(block() for _ in range(depth))
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


def make_dataset(samples: int = NUM_SAMPLES) -> TensorDataset:
    """A fixed next-token task: each sequence counts up modulo VOCAB from a random start."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    start = torch.randint(0, VOCAB, (samples, 1), generator=generator)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def gathered_sha256(model: nn.Module) -> str:
    """Hash of every parameter, gathered from its shards (a collective: every rank calls it); a plain tensor (an
    MoE rank's own experts) as it is."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(name.encode())
        digest.update(full.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
