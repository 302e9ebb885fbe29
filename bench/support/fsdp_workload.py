#!/usr/bin/env python3
"""The sharded (FSDP2 / HSDP) training job the FSDP benchmarks run, in each of its forms: one rank process.

``bench/fsdp_overhead.py`` and ``bench/fsdp_recovery.py`` start this script as their ranks, so every form trains
the same model on the same batches. It is not a benchmark itself: it writes its timings to files.

* ``interleaved``: plain FSDP2 and TorchPass's FSDP alternating in the same ranks under ``torchpass run --local``
  (two identical models: one sharded by ``ctx.wrap_fsdp``, one by ``fully_shard`` over a mesh of TorchPass's
  current process group), ``--segment`` steps each; rank 0 writes ``interleaved.json`` (see
  :func:`train_interleaved`);
* ``torchpass``: the job under ``torchpass run --local`` (``ctx.wrap_fsdp``), for the recovery benchmark: with
  ``--crash-steps`` a rank SIGKILLs itself at those steps (``torchpass_workload.Recorder``);
* ``restart``: plain FSDP2 (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, as torchrun sets them),
  the checkpoint-restart baseline: every ``--ckpt-every`` steps a sharded checkpoint
  (``torch.distributed.checkpoint``, each rank its own shard), resumed from at start when one exists;
* ``torchft``: TorchFT 0.2's HSDP: each replica group (``--shards`` processes, its own store) shards the model
  with FSDP2 over its own mesh; the all-reduce over the replicas is TorchFT's (``set_all_reduce_hook`` over a
  ``ManagedProcessGroup``), which lets the quorum go on without a dead replica group.

The model is a stack of residual MLP blocks (``--layers`` x ``--hidden``, each block its own ``fully_shard``),
AdamW; the batch of (step, rank) comes from a generator seeded by both. One intra-op thread per process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchpass_workload import Recorder


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def make_model(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), *(Block(hidden) for _ in range(layers)), nn.Linear(hidden, 8))


def tp_plan(layers: int) -> dict[str, ParallelStyle]:
    """Megatron's MLP cut for each block (``make_model``'s Sequential: the blocks are modules 1..layers)."""
    plan: dict[str, ParallelStyle] = {}
    for index in range(1, layers + 1):
        plan |= {f"{index}.up": ColwiseParallel(), f"{index}.down": RowwiseParallel()}
    return plan


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(size, 64, generator=gen), torch.randn(size, 8, generator=gen)


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    for module in model:
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, clip: Any = None
) -> None:
    """One step; ``clip``: the gradient clipping function (torch's by default; under TP the gradients live on two
    meshes, which only ``torchpass.clip_grad_norm_`` takes)."""
    nn.functional.mse_loss(model(x), y).backward()
    (clip or torch.nn.utils.clip_grad_norm_)(model.parameters(), max_norm=1.0)
    opt.step()
    opt.zero_grad()


def mesh_shape(args: argparse.Namespace, world: int) -> tuple[int, int]:
    """(replicas, shards): every rank is in one, times ``--tp`` ranks of a TP group."""
    return (world // (args.shards * args.tp), args.shards)


def wait_for_spares(out: Path, spares: int) -> None:
    """Wait (120 s at most) until ``spares`` spares wrote their ``spare-ready-*`` file: on a cluster spares wait on
    nodes of their own, so the job must not train while they start (import torch) on the same cores here."""
    deadline = time.monotonic() + 120
    while len(list(out.glob("spare-ready-*"))) < spares and time.monotonic() < deadline:
        time.sleep(0.05)


def local(value: Any) -> Any:
    """``value`` with every DTensor in it replaced by its local part."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [local(v) for v in value]
    return value


# TorchFT heals a restarted group rank by rank from a live group's same rank: each sends its local shards (TorchFT's
# transport carries plain tensors), and the receiver puts them into its own DTensors (plain parameters as they are).
def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": local(dict(model.state_dict())), "optim": local(opt.state_dict())}


def load_local_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            local(tensor).copy_(state["model"][name])
    params = [p for group in opt.param_groups for p in group["params"]]
    optim = state["optim"]
    for index, values in optim["state"].items():
        param = params[int(index)]
        if not isinstance(param, DTensor):
            continue
        for key, value in list(values.items()):
            if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape and key != "step":
                values[key] = DTensor.from_local(
                    value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )
    opt.load_state_dict(optim)


def train_torchpass(args: argparse.Namespace) -> None:
    import torchpass as tp

    model = make_model(args.hidden, args.layers)  # built before init: a spare is warm when it is needed
    out = Path(args.out)
    if os.environ.get("TORCHPASS_ROLE") == "spare":
        (out / f"spare-ready-{os.environ.get('TORCHPASS_WORKER_ID', os.getpid())}").touch()
    ctx = tp.init()
    wait_for_spares(out, args.wait_spares)
    model = ctx.wrap_fsdp(model, mesh_shape=mesh_shape(args, ctx.world_size), shard=Block)
    opt = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    rec = Recorder(args, ctx.slot, ctx.world_size)
    for step, (x, y) in ctx.steps(lambda s: batch(s, ctx.slot, args.batch), args.steps):
        rec.begin(step)
        train_step(model, opt, x, y)
    rec.finish("torchpass")
    ctx.close()


def resume(model: nn.Module, opt: torch.optim.Optimizer, ckpt: Path | None) -> int:
    """Load the newest checkpoint in ``ckpt`` (``torch.distributed.checkpoint``: each rank its DTensors' parts)
    when there is one; the step to resume at (0 without one). Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if ckpt is None or not (ckpt / "next_step").exists():
        return 0
    model_state, optim_state = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(ckpt / "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int((ckpt / "next_step").read_text())


def checkpoint(model: nn.Module, opt: torch.optim.Optimizer, ckpt: Path, next_step: int, rank: int) -> None:
    """Save the model and optimizer (a collective: every rank calls it), then name ``next_step`` as the step to
    resume at. Parts held by several ranks (the replicas') are written once (``dcp``'s de-duplication)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(ckpt / "dcp"))
    if rank == 0:  # every part is written once dcp.save returns (it ends with a barrier)
        tmp = ckpt / "next_step.tmp"
        tmp.write_text(str(next_step))
        os.replace(tmp, ckpt / "next_step")


def train_restart(args: argparse.Namespace) -> None:
    """Plain FSDP2 with sharded checkpoints; resumes from the newest one (the checkpoint-restart baseline)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timeout=datetime.timedelta(60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    replicas, shards = mesh_shape(args, world)
    names = ("replicate", "shard") if replicas > 1 else ("shard",)
    mesh = init_device_mesh("cpu", (replicas, shards) if replicas > 1 else (shards,), mesh_dim_names=names)
    model = shard(make_model(args.hidden, args.layers), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Path(args.ckpt) if args.ckpt else None
    start = resume(model, opt, ckpt)
    rec = Recorder(args, rank, world)
    for step in range(start, args.steps):
        rec.begin(step)
        x, y = batch(step, rank, args.batch)
        train_step(model, opt, x, y)
        if ckpt is not None and (step + 1) % args.ckpt_every == 0:
            checkpoint(model, opt, ckpt, step + 1, rank)
    rec.finish("restart", {"resumed_at": start})
    dist.destroy_process_group()


def train_interleaved(args: argparse.Namespace) -> None:
    """Plain FSDP2 and TorchPass's FSDP in the same ranks, alternating every ``--segment`` steps.

    As ``torchpass_workload.train_interleaved`` does for DDP: inside TorchPass's step, at every segment boundary,
    the ranks meet at a barrier and train the plain FSDP2 model for a segment of the same steps' batches (its mesh
    is built over TorchPass's current group, once); then TorchPass's next segment is timed; one more plain segment
    closes the job. Rank 0 writes ``interleaved.json``: every segment's wall and CPU seconds per form, in order
    (the first of each form, the warm-up, left out)."""
    import torchpass as tp

    seg = args.segment
    first, second = make_model(args.hidden, args.layers), make_model(args.hidden, args.layers)
    tp_model, plain_model = (first, second) if args.torchpass_first else (second, first)
    ctx = tp.init()
    shape = mesh_shape(args, ctx.world_size)
    plan = tp_plan(args.layers) if args.tp > 1 else None
    clip = tp.clip_grad_norm_ if plan else None  # the same clipping for both forms
    tp_model = ctx.wrap_fsdp(tp_model, mesh_shape=shape, shard=Block, tp=args.tp, tp_plan=plan)
    tp_opt = ctx.wrap_optimizer(torch.optim.AdamW(tp_model.parameters(), lr=1e-3))
    data_rank = ctx.slot // args.tp  # the ranks of a TP group take the same batch
    plain: dict[str, Any] = {}
    spent: dict[str, list[tuple[float, float]]] = {"fsdp": [], "torchpass": []}
    started: tuple[float, float] | None = None

    def clocks() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def record(form: str, since: tuple[float, float]) -> None:
        wall, cpu = clocks()
        spent[form].append((wall - since[0], cpu - since[1]))

    def plain_segment(first: int) -> None:
        if not plain:
            if plan:  # plain DTensor TP, then FSDP2 over the data-parallel slice (torchtitan's order)
                mesh = init_device_mesh("cpu", (*shape, args.tp), mesh_dim_names=("replicate", "shard", "tp"))
                parallelize_module(plain_model, mesh["tp"], plan)
                mesh = mesh["replicate", "shard"]
            else:
                names = ("replicate", "shard") if shape[0] > 1 else ("shard",)
                mesh = init_device_mesh("cpu", shape if shape[0] > 1 else (shape[1],), mesh_dim_names=names)
            plain["model"] = shard(plain_model, mesh)
            plain["opt"] = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
        dist.barrier()
        t0 = clocks()
        for s in range(first, first + seg):
            xa, ya = batch(s, data_rank, args.batch)
            train_step(plain["model"], plain["opt"], xa, ya, clip)
        record("fsdp", t0)
        dist.barrier()

    last = args.steps - args.steps % seg
    for step, (x, y) in ctx.steps(lambda s: batch(s, data_rank, args.batch), last):
        if step % seg == 0:
            if started is not None:
                record("torchpass", started)
            plain_segment(step)
            started = clocks()
        train_step(tp_model, tp_opt, x, y, clip)
    if started is not None:
        record("torchpass", started)
        plain_segment(last)
    if ctx.slot == 0:
        result: dict[str, Any] = {"segment": seg}
        for form, pairs in spent.items():
            result[form] = [wall for wall, _ in pairs[1:]]
            result[f"{form}_cpu"] = [cpu for _, cpu in pairs[1:]]
        (Path(args.out) / "interleaved.json").write_text(json.dumps(result))
    ctx.close()


def train_torchft(args: argparse.Namespace) -> None:
    """TorchFT 0.2's HSDP: this process is rank ``GROUP_RANK`` of replica group ``REPLICA_ID``."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ManagedProcessGroup

    replica, replicas = int(os.environ["REPLICA_ID"]), int(os.environ["NUM_REPLICAS"])
    group_rank, group_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        group_size,
        group_rank == 0,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=group_rank, world_size=group_size)
    mesh = init_device_mesh("cpu", (group_size,), mesh_dim_names=("shard",))
    model = shard(make_model(args.hidden, args.layers), mesh)
    opt_inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)),
        min_replica_size=args.min_replicas or replicas,
        load_state_dict=lambda state: load_local_state(model, opt_inner, state),
        state_dict=lambda: local_state(model, opt_inner),
        replica_id=f"bench{replica}",
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        rank=group_rank,
        world_size=group_size,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        timeout=datetime.timedelta(seconds=10),
        hostname="127.0.0.1",
    )
    replicated = ManagedProcessGroup(manager)

    def all_reduce_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicated, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if hasattr(module, "set_all_reduce_hook"):
            module.set_all_reduce_hook(all_reduce_hook)
    opt = OptimizerWrapper(manager, opt_inner)
    rec = Recorder(args, replica * group_size + group_rank, replicas * group_size)
    reduced = 0
    while manager.current_step() < args.steps:
        step = manager.current_step()
        opt.zero_grad()
        rec.begin(step, record=False)
        x, y = batch(step, replica * group_size + group_rank, args.batch)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if manager.current_step() in (step, step + 1):
            rec.executed(step)
        if manager.num_participants() < replicas:
            reduced += 1
    rec.finish("torchft", {"reduced_width_steps": reduced})
    manager.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("torchpass", "restart", "interleaved", "torchft"))
    parser.add_argument("--out", required=True, help="folder for the step logs and results")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20, help="steps excluded from the timing")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--shards", type=int, default=2, help="shards per replica (the mesh is world/shards x shards)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per shard (interleaved, torchpass)")
    parser.add_argument("--crash-steps", default="", help="comma-separated steps at which one rank SIGKILLs itself")
    parser.add_argument("--node-crash-step", type=int, default=-1, help="unused here (Recorder's sandbox hook)")
    parser.add_argument("--node-crash-rank", type=int, default=-1, help="unused here (Recorder's sandbox hook)")
    parser.add_argument("--ckpt", default="", help="restart: checkpoint folder (resumed from)")
    parser.add_argument("--ckpt-every", type=int, default=50)
    parser.add_argument("--min-replicas", type=int, default=0, help="torchft: min_replica_size (default: all)")
    parser.add_argument("--wait-spares", type=int, default=0, help="torchpass: train once this many spares are ready")
    parser.add_argument("--segment", type=int, default=10, help="interleaved: steps per segment of each form")
    parser.add_argument("--torchpass-first", action="store_true", help="interleaved: allocate TorchPass's model first")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    modes = {
        "torchpass": train_torchpass,
        "restart": train_restart,
        "interleaved": train_interleaved,
        "torchft": train_torchft,
    }
    modes[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
