#!/usr/bin/env python3
"""The pipeline-parallel training job ``bench/pp_recovery.py`` runs (dp_replicate R x pp P), in each form: one rank.

The benchmark starts this script as its ranks, so every form trains the same stages on the same batches. It is not
a benchmark itself: it writes its step logs and results to files (``torchpass_workload.Recorder``), and with
``--crash-steps`` a rank SIGKILLs itself at those steps (rank 1: stage 1 of replica 0 at the first).

* ``torchpass``: under ``torchpass run --local``, ``ctx.wrap_pipeline`` (``ScheduleGPipe``), so TorchPass builds the
  ``PipelineStage`` and the schedule over its own groups and rebuilds a lost stage from the other replica;
* ``restart``: plain ``torch.distributed.pipelining`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, as
  torchrun sets them): a pipeline group per replica, a gradient all-reduce per stage over the replicas, and a
  checkpoint every ``--ckpt-every`` steps (each stage written by replica 0, into a folder of its step, then
  ``next_step`` names it), resumed from at start when one exists: the checkpoint-restart baseline;
* ``torchft``: TorchFT 0.2 with the replica group (the P stages of one pipeline, its own store and process group)
  as failure domain: each stage's ``Manager`` all-reduces its gradients with the same stage of the other groups,
  and ``OptimizerWrapper`` commits a step only when every stage of the group may (``should_commit``), so the
  surviving group goes on at reduced width while a dead one restarts and heals from it.

The model is ``fsdp_workload``'s residual MLP (input layer, ``--layers`` blocks of ``--hidden``, head), cut into P
stages of consecutive blocks; AdamW, MSE loss, ``--microbatches`` micro-batches. A replica's batch of a step is
``fsdp_workload.batch(step, replica)``: the P ranks of a pipeline take the same one. One intra-op thread a process.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_workload import batch, local, make_model, wait_for_spares
from torchpass_workload import Recorder

CPU = torch.device("cpu")


def make_stages(args: argparse.Namespace) -> list[nn.Module]:
    """The model cut into ``--stages`` stages of consecutive blocks (the input layer in the first, the head in the
    last); every rank builds all of them from the same seed and keeps its own."""
    layers = list(make_model(args.hidden, args.layers))
    blocks = layers[1:-1]
    per = math.ceil(len(blocks) / args.stages)
    chunks = [blocks[k * per : (k + 1) * per] for k in range(args.stages)]
    chunks[0].insert(0, layers[0])
    chunks[-1].append(layers[-1])
    return [nn.Sequential(*chunk) for chunk in chunks]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def schedule_step(schedule: Any, stage: int, stages: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """One plain schedule step: the inputs to the first stage, the target to the last."""
    schedule.step(*((x,) if stage == 0 else ()), target=y if stage == stages - 1 else None)


def flat_grads(module: nn.Module) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The module's gradients (a DTensor's: its local part, which shares its storage) and one flat copy of them."""
    grads = [local(p.grad) for p in module.parameters() if p.grad is not None]
    return grads, torch.cat([g.reshape(-1) for g in grads])


def unflatten(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def train_torchpass(args: argparse.Namespace) -> None:
    import torchpass as tp

    stages = make_stages(args)  # built before init: a spare is warm when it is needed
    out = Path(args.out)
    if os.environ.get("TORCHPASS_ROLE") == "spare":
        (out / f"spare-ready-{os.environ.get('TORCHPASS_WORKER_ID', os.getpid())}").touch()
    ctx = tp.init()
    wait_for_spares(out, args.wait_spares)
    pipe = ctx.wrap_pipeline(
        stages,
        mesh_shape=(ctx.world_size // args.stages, args.stages),
        schedule=ScheduleGPipe,
        n_microbatches=args.microbatches,
        loss_fn=loss_fn,
    )
    opt = ctx.wrap_optimizer(torch.optim.AdamW(pipe.module.parameters(), lr=1e-3))
    rec = Recorder(args, ctx.slot, ctx.world_size)
    for step, (x, y) in ctx.steps(lambda s: batch(s, ctx.slot // args.stages, args.batch), args.steps):
        rec.begin(step)
        pipe.step(x, target=y)  # a failure abandons the step on every stage (None): ctx.steps yields it again
        opt.step()
        opt.zero_grad()
    rec.finish("torchpass")
    ctx.close()


def train_restart(args: argparse.Namespace) -> None:
    """Plain pipelining over (replicas x stages) ranks, with per-stage checkpoints; resumes from the newest one."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timeout=datetime.timedelta(60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    stages, replicas = args.stages, world // args.stages
    replica, stage = divmod(rank, stages)
    # Every rank makes every group, in the same order (new_group's contract); each keeps its row and its column.
    rows = [dist.new_group(list(range(r * stages, (r + 1) * stages))) for r in range(replicas)]
    columns = [dist.new_group(list(range(k, world, stages))) for k in range(stages)]
    module = make_stages(args)[stage]
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ckpt = Path(args.ckpt) if args.ckpt else None
    start = 0
    if ckpt is not None and (ckpt / "next_step").exists():
        start = int((ckpt / "next_step").read_text())
        state = torch.load(ckpt / str(start) / f"stage-{stage}.pt")
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    pipe = PipelineStage(module, stage, stages, CPU, group=rows[replica])
    schedule = ScheduleGPipe(pipe, args.microbatches, loss_fn=loss_fn)
    rec = Recorder(args, rank, world)
    for step in range(start, args.steps):
        rec.begin(step)
        x, y = batch(step, replica, args.batch)
        schedule_step(schedule, stage, stages, x, y)
        grads, flat = flat_grads(module)
        dist.all_reduce(flat, group=columns[stage])
        unflatten(grads, flat.div_(replicas))
        opt.step()
        opt.zero_grad()
        if ckpt is not None and (step + 1) % args.ckpt_every == 0:
            folder = ckpt / str(step + 1)
            if replica == 0:  # the replicas hold the same stages: one copy of each is written
                folder.mkdir(parents=True, exist_ok=True)
                torch.save({"model": module.state_dict(), "optim": opt.state_dict()}, folder / f"stage-{stage}.pt")
            dist.barrier()  # every stage is written: the checkpoint of this step is whole
            if rank == 0:
                tmp = ckpt / "next_step.tmp"
                tmp.write_text(str(step + 1))
                os.replace(tmp, ckpt / "next_step")
    rec.finish("restart", {"resumed_at": start})
    dist.destroy_process_group()


def train_torchft(args: argparse.Namespace) -> None:
    """TorchFT 0.2: this process is stage ``RANK`` of replica group ``REPLICA_ID`` (``WORLD_SIZE`` = the stages)."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    replica, replicas = int(os.environ["REPLICA_ID"]), int(os.environ["NUM_REPLICAS"])
    stage, stages = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), stages, stage == 0, timeout=datetime.timedelta(60)
    )
    dist.init_process_group("gloo", store=dist.PrefixStore("pp", store), rank=stage, world_size=stages)
    module = make_stages(args)[stage]
    opt_inner = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def state_dict() -> dict[str, Any]:  # what a live group's same stage sends to a healing one
        return {"model": module.state_dict(), "optim": opt_inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])
        opt_inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)),
        min_replica_size=args.min_replicas or replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench{replica}",
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        rank=stage,
        world_size=stages,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        timeout=datetime.timedelta(seconds=10),
        hostname="127.0.0.1",
    )
    opt = OptimizerWrapper(manager, opt_inner)
    pipe = PipelineStage(module, stage, stages, CPU)  # the group's own pipeline (its default process group)
    schedule = ScheduleGPipe(pipe, args.microbatches, loss_fn=loss_fn)
    rec = Recorder(args, replica * stages + stage, replicas * stages)
    reduced = 0
    while manager.current_step() < args.steps:
        step = manager.current_step()
        opt.zero_grad()  # starts the quorum of this step
        rec.begin(step, record=False)
        x, y = batch(step, replica, args.batch)
        schedule_step(schedule, stage, stages, x, y)
        grads, flat = flat_grads(module)
        manager.allreduce(flat).wait()  # averaged over the groups in the quorum; an error makes should_commit False
        unflatten(grads, flat)
        opt.step()  # only when every stage of every group in the quorum may commit
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
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (the ranks are replicas x stages)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--crash-steps", default="", help="comma-separated steps at which one rank SIGKILLs itself")
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
