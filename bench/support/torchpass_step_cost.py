#!/usr/bin/env python3
"""What TorchPass adds to one training step, in microseconds: one process, one rank, no peer to wait for.

``bench/torchpass_overhead.py`` runs this script alternately as ``ddp`` (plain DistributedDataParallel over a
one-rank gloo group) and ``torchpass`` (``tp.init()`` alone: a one-rank job with its in-process coordinator,
``wrap_model``, ``wrap_optimizer``, ``ctx.steps``), on a model so small that the step is mostly framework
work. The difference of the two per-step times is TorchPass's own cost per step (the comm hook per bucket,
the step boundary's reseed and snapshot, the control thread), free of the scheduling noise that two ranks on
two shared cores add to a steps/s ratio. Prints one JSON object: ``{"mode", "steps", "us_per_step"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("ddp", "torchpass"))
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="1,000 steps (what the --quick overhead run uses)")
    args = parser.parse_args()
    if args.quick:
        args.steps = 1000
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    if args.mode == "ddp":
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            steps = iter(range(args.steps))
            rate = _time(lambda: next(steps, None), ddp, opt, x, y, args.warmup)
            dist.destroy_process_group()
    else:
        import torchpass as tp

        ctx = tp.init()
        ddp = ctx.wrap_model(model)
        opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        loop = iter(ctx.steps(None, args.steps))
        rate = _time(lambda: next(loop, None), ddp, opt, x, y, args.warmup)
        ctx.close()
    print(json.dumps({"mode": args.mode, "steps": args.steps - args.warmup, "us_per_step": round(rate, 2)}))
    return 0


def _time(
    advance: object, ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, warmup: int
) -> float:
    """Run the loop to its end; microseconds per step after ``warmup`` steps."""
    assert callable(advance)
    done, started = 0, 0.0
    while advance() is not None:
        if done == warmup:
            started = time.perf_counter()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        done += 1
    return (time.perf_counter() - started) / (done - warmup) * 1e6


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
