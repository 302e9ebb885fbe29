#!/usr/bin/env python3
"""The pure-FSDP job ``bench/fsdp_peer_copy.py`` runs: one rank process under ``torchpass run --local``.

The model, batches and step are ``fsdp_workload.py``'s (residual MLP blocks, each its own ``fully_shard``, AdamW,
``clip_grad_norm_``), on a 1 x N mesh (no replica), so each shard lives only in its rank and its peer copies.

* ``interleaved``: segments of ``--segment`` steps cycle through peer copies off and on with each mode of ``--ks``
  (``off, K1, off, K2, ..., off``; a mode is K, or ``1s``: K = 1 with ``peer_copy_sync``), in the same ranks and
  the same job: the rank's peer copies are switched by setting their refresh period (off: a period no step
  reaches) and whether commits wait for them, at a segment's first step boundary. Rank 0 writes
  ``interleaved.json`` (each segment's mode, wall seconds and what its steps waited for copies); every rank writes
  ``peers-SLOT.json`` (rounds, bytes sent, what its steps waited for copies, host memory held).
* ``crash``: slot 1 SIGKILLs itself in the forward pass of ``--crash-step`` (once); the bench reads the
  coordinator's ``torchpass.recovered`` event.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_workload import Block, batch, make_model, train_step

OFF = 1 << 30  # a refresh period no step reaches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("interleaved", "crash"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--segment", type=int, default=10)
    parser.add_argument("--cycles", type=int, default=4, help="interleaved: passes over --ks")
    parser.add_argument("--ks", default="1,5,20,1s", help="interleaved: the modes (K, or 1s: K = 1 synchronous)")
    parser.add_argument("--steps", type=int, default=40, help="crash: steps")
    parser.add_argument("--crash-step", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import torchpass as tp
    from torchpass.rank.transfer_plan import ShardedReplicas

    out = Path(args.out)
    model = make_model(args.hidden, args.layers)
    ctx = tp.init()
    shape = ShardedReplicas(1, ctx.world_size)
    model = ctx.wrap_fsdp(model, mesh_shape=(1, ctx.world_size), shard=Block)
    opt = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    peers = ctx.shard_state(shape).peers
    assert peers is not None, "peer copies are off (peer_copies=0)"
    plan = [mode for _ in range(args.cycles) for k in args.ks.split(",") for mode in ("off", k)] + ["off"]
    steps = args.steps if args.mode == "crash" else args.segment * (len(plan) + 1)  # one warm-up segment
    marker = out / "crashed"
    segments: list[dict[str, float]] = []
    started, waited = 0.0, 0.0
    for step, (x, y) in ctx.steps(lambda s: batch(s, ctx.slot, args.batch), steps):
        if args.mode == "crash":
            if ctx.slot == 1 and step == args.crash_step and not marker.exists():
                marker.write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        elif step % args.segment == 0:
            now = time.perf_counter()
            index = step // args.segment - 1  # the segment that just ended (-1: the warm-up)
            if index >= 0:
                segments.append({"mode": plan[index], "seconds": now - started, "waited_s": peers.waited_s - waited})
            if index + 1 < len(plan):
                mode = plan[index + 1]
                peers.every = OFF if mode == "off" else int(mode.rstrip("s"))
                peers.sync = mode.endswith("s")
            started, waited = now, peers.waited_s
        train_step(model, opt, x, y)
    if args.mode == "interleaved":
        last = {"mode": plan[-1], "seconds": time.perf_counter() - started, "waited_s": peers.waited_s - waited}
        segments.append(last)
        if ctx.slot == 0:
            (out / "interleaved.json").write_text(json.dumps({"segments": segments}))
        stats = {
            "rounds": peers.rounds,
            "failed": peers.failed,
            "skipped": peers.skipped,
            "bytes_sent": peers.bytes_sent,
            "waited_s": peers.waited_s,
            "last_round_ms": peers.last_round_ms,
            "host_bytes": peers.host_bytes(),
            "shard_bytes": max(b.size for b in peers.own),
        }
        (out / f"peers-{ctx.slot}.json").write_text(json.dumps(stats))
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
