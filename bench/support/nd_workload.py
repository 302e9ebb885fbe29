#!/usr/bin/env python3
"""The tensor-parallel training job ``bench/nd_recovery.py`` runs (dp_replicate R x tp T), in each form: one rank.

The benchmark starts this script as its ranks, so every form trains the same model on the same batches. It is not
a benchmark itself: it writes its step logs and results to files (``torchpass_workload.Recorder``). With
``--crash-steps`` the T ranks of the last replica's TP group (a node: ranks 2 and 3 of 2 x 2) SIGKILL themselves
together at those steps (``Recorder``'s ``together``: each waits until all reached the step, then all die).

* ``torchpass``: under ``torchpass run --local``, ``ctx.wrap_fsdp(mesh_shape=(R, 1), tp=T, tp_plan=...)``
  (dp_replicate R x dp_shard 1 x tp T: TorchPass's TP API is the one beside FSDP2; with one shard FSDP2 only
  all-reduces the gradients over the replicas), so a lost TP rank is rebuilt from its TP coordinate in the other
  replica;
* ``restart``: plain DTensor TP (``parallelize_module`` over the ``tp`` dimension of a (replicate, tp) mesh,
  ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets them), the gradients' local parts
  all-reduced over the ``replicate`` dimension by hand, a ``torch.distributed.checkpoint`` every ``--ckpt-every``
  steps, resumed from at start when one exists: the checkpoint-restart baseline;
* ``torchft``: TorchFT 0.2 with the replica group (the T ranks of one TP group, its own store and process group,
  the TP mesh over it) as failure domain: each rank's ``Manager`` all-reduces its gradients' local parts with the
  same TP rank of the other groups, and ``OptimizerWrapper`` commits a step only when every rank of the group may,
  so the surviving group goes on at reduced width while the dead one restarts and heals from it.

The model is ``fsdp_workload``'s residual MLP (input layer, ``--layers`` blocks of ``--hidden``, head), each
block's ``up`` ColwiseParallel and ``down`` RowwiseParallel (one all-reduce over the TP group in forward, one in
backward), the input layer and head replicated; AdamW, MSE loss, no gradient clipping (TorchPass's would be
``tp.clip_grad_norm_``, the others' a hand-written one: left out so that all three compute the same step). A
replica's batch of a step is ``fsdp_workload.batch(step, replica)``: the T ranks of a TP group take the same one.
One intra-op thread a process.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_workload import (
    Block,
    batch,
    checkpoint,
    load_local_state,
    local_state,
    make_model,
    resume,
    tp_plan,
    wait_for_spares,
)
from pp_workload import flat_grads, unflatten
from torchpass_workload import Recorder


def victims(tp: int, world: int) -> tuple[int, ...]:
    """The ranks that crash together: the last replica's TP group (a node; slot 0 is left alone)."""
    return tuple(range(world - tp, world))


def step_and_reduce(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, all_reduce: Any
) -> None:
    """Forward and backward under TP, then ``all_reduce`` averages the gradients' local parts over the replicas."""
    nn.functional.mse_loss(model(x), y).backward()
    grads, flat = flat_grads(model)
    all_reduce(flat)
    unflatten(grads, flat)
    opt.step()


def train_torchpass(args: argparse.Namespace) -> None:
    import torchpass as tp

    model = make_model(args.hidden, args.layers)  # built before init: a spare is warm when it is needed
    out = Path(args.out)
    if os.environ.get("TORCHPASS_ROLE") == "spare":
        (out / f"spare-ready-{os.environ.get('TORCHPASS_WORKER_ID', os.getpid())}").touch()
    ctx = tp.init()
    wait_for_spares(out, args.wait_spares)
    replicas = ctx.world_size // args.tp
    model = ctx.wrap_fsdp(model, mesh_shape=(replicas, 1), tp=args.tp, tp_plan=tp_plan(args.layers), shard=Block)
    opt = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    rec = Recorder(args, ctx.slot, ctx.world_size, together=victims(args.tp, ctx.world_size))
    for step, (x, y) in ctx.steps(lambda s: batch(s, ctx.slot // args.tp, args.batch), args.steps):
        rec.begin(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    rec.finish("torchpass")
    ctx.close()


def train_restart(args: argparse.Namespace) -> None:
    """Plain DTensor TP over (replicas x tp) ranks, DCP checkpoints; resumes from the newest one."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timeout=datetime.timedelta(60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    replicas = world // args.tp
    mesh = init_device_mesh("cpu", (replicas, args.tp), mesh_dim_names=("replicate", "tp"))
    model = parallelize_module(make_model(args.hidden, args.layers), mesh["tp"], tp_plan(args.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    column = mesh["replicate"].get_group()  # the ranks of this TP coordinate in every replica

    def all_reduce(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=column)
        flat.div_(replicas)

    ckpt = Path(args.ckpt) if args.ckpt else None
    start = resume(model, opt, ckpt)
    rec = Recorder(args, rank, world, together=victims(args.tp, world))
    for step in range(start, args.steps):
        rec.begin(step)
        x, y = batch(step, rank // args.tp, args.batch)
        step_and_reduce(model, opt, x, y, all_reduce)
        opt.zero_grad()
        if ckpt is not None and (step + 1) % args.ckpt_every == 0:
            checkpoint(model, opt, ckpt, step + 1, rank)
    rec.finish("restart", {"resumed_at": start})
    dist.destroy_process_group()


def train_torchft(args: argparse.Namespace) -> None:
    """TorchFT 0.2: this process is TP rank ``RANK`` of replica group ``REPLICA_ID`` (``WORLD_SIZE`` = tp)."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    replica, replicas = int(os.environ["REPLICA_ID"]), int(os.environ["NUM_REPLICAS"])
    group_rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), tp, group_rank == 0, timeout=datetime.timedelta(60)
    )
    dist.init_process_group("gloo", store=dist.PrefixStore("nd", store), rank=group_rank, world_size=tp)
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))  # the group's own TP mesh
    model = parallelize_module(make_model(args.hidden, args.layers), mesh, tp_plan(args.layers))
    opt_inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)),
        min_replica_size=args.min_replicas or replicas,
        load_state_dict=lambda state: load_local_state(model, opt_inner, state),  # a live group's same TP rank's
        state_dict=lambda: local_state(model, opt_inner),
        replica_id=f"bench{replica}",
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        rank=group_rank,
        world_size=tp,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        timeout=datetime.timedelta(seconds=10),
        hostname="127.0.0.1",
    )
    opt = OptimizerWrapper(manager, opt_inner)
    rec = Recorder(args, replica * tp + group_rank, replicas * tp, together=victims(tp, replicas * tp))
    reduced = 0
    while manager.current_step() < args.steps:
        step = manager.current_step()
        opt.zero_grad()  # starts the quorum of this step
        rec.begin(step, record=False)
        x, y = batch(step, replica, args.batch)
        # averaged over the groups in the quorum; an error makes should_commit False and opt.step a no-op
        step_and_reduce(model, opt, x, y, lambda flat: manager.allreduce(flat).wait())
        if manager.current_step() in (step, step + 1):
            rec.executed(step)
        if manager.num_participants() < replicas:
            reduced += 1
    rec.finish("torchft", {"reduced_width_steps": reduced})
    manager.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("torchpass", "restart", "torchft"))
    parser.add_argument("--out", required=True, help="folder for the step logs and results")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=0, help="steps excluded from the timing")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="samples per replica per step")
    parser.add_argument("--tp", type=int, default=2, help="TP degree (the ranks are replicas x tp)")
    parser.add_argument("--crash-steps", default="", help="comma-separated steps at which the last TP group dies")
    parser.add_argument("--node-crash-step", type=int, default=-1, help="unused here (Recorder's sandbox hook)")
    parser.add_argument("--node-crash-rank", type=int, default=-1, help="unused here (Recorder's sandbox hook)")
    parser.add_argument("--ckpt", default="", help="restart: checkpoint folder (resumed from)")
    parser.add_argument("--ckpt-every", type=int, default=40)
    parser.add_argument("--min-replicas", type=int, default=0, help="torchft: min_replica_size (default: all)")
    parser.add_argument("--wait-spares", type=int, default=0, help="torchpass: train once this many spares are ready")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    {"torchpass": train_torchpass, "restart": train_restart, "torchft": train_torchft}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
