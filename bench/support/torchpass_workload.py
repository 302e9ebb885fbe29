#!/usr/bin/env python3
"""The training job the TorchPass benchmarks run, in each of its three forms: one rank (or replica) process.

``bench/torchpass_overhead.py`` and ``bench/torchpass_vs_restart.py`` start this script as their ranks, so
the three systems train exactly the same model on exactly the same batches. It is not a benchmark itself: it
writes its timings to files, and the benchmarks that start it take ``--quick`` and print the JSON line.

* ``ddp``: plain ``torch.nn.parallel.DistributedDataParallel`` over gloo (``RANK``/``WORLD_SIZE``/
  ``MASTER_ADDR``/``MASTER_PORT`` from the launcher). With ``--ckpt`` it is the checkpoint-restart baseline:
  it resumes from the checkpoint when one exists and rank 0 saves one every ``--ckpt-every`` steps
  (``torch.save`` to a temporary file, then an atomic rename);
* ``torchpass``: the same loop under ``torchpass run --local`` (``tp.init``, ``wrap_model``, ``wrap_optimizer``,
  ``ctx.steps``);
* ``interleaved``: plain DDP and TorchPass alternating in the same ranks under ``torchpass run --local``
  (``bench/torchpass_overhead.py``'s low-noise figure; see :func:`train_interleaved`);
* ``replica_check``: TorchPass with its runtime net off and on, alternating in the same job
  (``bench/replica_check.py``; see :func:`train_replica_check`);
* ``torchft``: one TorchFT replica group of one process (``torchft.Manager`` with a ``ProcessGroupGloo``,
  ``torchft.DistributedDataParallel`` and ``OptimizerWrapper``; ``REPLICA_ID``/``NUM_REPLICAS``/
  ``TORCHFT_LIGHTHOUSE`` from the launcher), its own TCPStore.

The model is an MLP (``--layers`` x ``--hidden``, AdamW); the batch of (step, rank) comes from a generator
seeded by both, so every form sees the same data. Every process uses one intra-op thread (the benchmarks
compare coordination overhead, not BLAS scaling, and must not starve the machine).

What a process records, under ``--out``:

* ``steps-<rank>.log``: one line per step *executed* (``step time``), appended as it starts, so a step
  that is redone after a failure shows up twice: that is the "computed twice" count;
* ``result-<rank>.json`` on a clean finish: steps/s over the steps after ``--warmup``;
* with ``--crash-steps S1,S2,...``: at step Sk, rank ``(k + 1) % world`` kills itself with SIGKILL in its
  forward pass (a marker file makes each crash happen once, so a replacement does not crash again);
* with ``--node-crash-step S`` (sandbox, ``bench/torchpass_recovery.py``): at step S, rank 1 writes
  ``crash-request`` (its Slurm node and the time) and waits there for the benchmark to crash its whole node.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def make_model(hidden: int, layers: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    mods: list[nn.Module] = [nn.Linear(64, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    mods.append(nn.Linear(hidden, 8))
    return nn.Sequential(*mods)


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(size, 64, generator=gen), torch.randn(size, 8, generator=gen)


class Recorder:
    """The per-rank step log, the crash schedule and the timing."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, together: tuple[int, ...] = ()) -> None:
        """``together``: the ranks that crash as one at each ``--crash-steps`` step (a node: every rank on it),
        in place of one rank a crash, in turn."""
        self.out = Path(args.out)
        self.rank = rank
        self.world = world
        self.together = together
        self.warmup = args.warmup
        self.crashes = [int(s) for s in args.crash_steps.split(",") if s]
        self.node_crash_step = args.node_crash_step
        self.node_crash_rank = args.node_crash_rank
        self.log = open(self.out / f"steps-{rank}.log", "a")  # open for the process's life
        self.t_warm: float | None = None
        self.timed = 0
        # Who holds this rank now, for a benchmark that kills or stops it from outside (bench/fault_campaign.py):
        # the pid and the Slurm node (empty outside Slurm); a spare that takes the slot rewrites it.
        node = os.environ.get("SLURMD_NODENAME", "")
        (self.out / f"pid-{rank}.tmp").write_text(f"{os.getpid()} {node}\n")
        os.replace(self.out / f"pid-{rank}.tmp", self.out / f"pid-{rank}")

    def executed(self, step: int) -> None:
        """Record that ``step`` is (being) computed by this rank."""
        self.log.write(f"{step} {time.time():.6f}\n")
        self.log.flush()

    def begin(self, step: int, record: bool = True) -> None:
        """A step starts: record it, start the clock after the warm-up, crash when it is this rank's turn."""
        if record:
            self.executed(step)
        if step == self.warmup:
            self.t_warm = time.perf_counter()
        if step >= self.warmup:
            self.timed += 1
        for k, when in enumerate(self.crashes):
            if when == step and self.rank in self.together:
                self.crash_together(when)
            if when == step and not self.together and (k + 1) % self.world == self.rank:
                try:
                    fd = os.open(self.out / f"crashed-{when}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    continue
                os.write(fd, f"{time.time()} rank {self.rank}\n".encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        if step == self.node_crash_step and self.rank == self.node_crash_rank:
            try:
                fd = os.open(self.out / "crash-request", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return
            os.write(fd, f"{os.environ.get('SLURMD_NODENAME', '')} {time.time()}\n".encode())
            os.close(fd)
            while True:  # the benchmark crashes this node now
                time.sleep(1)

    def crash_together(self, when: int) -> None:
        """One crash of every rank in ``together`` (the replacements, at the same step again, do not crash): each
        waits (60 s at most) until all reached the step, the first to get there after that writes the crash
        marker (``crashed-STEP``, the crash's time), and each SIGKILLs itself."""
        try:
            os.close(os.open(self.out / f"victim-{when}-{self.rank}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        deadline = time.monotonic() + 60.0
        while not all((self.out / f"victim-{when}-{r}").exists() for r in self.together):
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        try:
            fd = os.open(self.out / f"crashed-{when}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, f"{time.time()} ranks {','.join(map(str, self.together))}\n".encode())
            os.close(fd)
        except FileExistsError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    def finish(self, mode: str, extra: dict[str, Any] | None = None) -> None:
        seconds = time.perf_counter() - self.t_warm if self.t_warm is not None else 0.0
        result = {
            "mode": mode,
            "rank": self.rank,
            "timed_steps": self.timed,
            "seconds": round(seconds, 4),
            "steps_per_s": round(self.timed / seconds, 3) if seconds > 0 else None,
            "finished_at": time.time(),
            **(extra or {}),
        }
        (self.out / f"result-{self.rank}.json").write_text(json.dumps(result))
        self.log.close()


def state_sha256(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A hash of the final training state (parameters, then the optimizer's per-parameter state in order), which a
    benchmark compares across runs to the bit (``bench/fault_campaign.py``: TorchPass under faults = fault-free)."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    state = opt.state_dict()["state"]
    for key in sorted(state):
        for name in sorted(state[key]):
            value = state[key][name]
            data = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            digest.update(name.encode() + data.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train_ddp(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        rank == 0,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    model = make_model(args.hidden, args.layers)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    ckpt = Path(args.ckpt) if args.ckpt else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["next_step"])
    rec = Recorder(args, rank, world)
    save_s: list[float] = []
    for step in range(start, args.steps):
        rec.begin(step)
        x, y = batch(step, rank, args.batch)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ckpt is not None and rank == 0 and (step + 1) % args.ckpt_every == 0:
            t_save = time.perf_counter()
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "next_step": step + 1}, tmp)
            os.replace(tmp, ckpt)
            save_s.append(time.perf_counter() - t_save)
    extra = {"resumed_at": start, "state_sha256": state_sha256(model, opt)}
    rec.finish("ddp", {**extra, "checkpoint_save_s": statistics.mean(save_s) if save_s else None})
    dist.destroy_process_group()


def train_torchpass(args: argparse.Namespace) -> None:
    import torch._dynamo  # what tp.init pre-imports: done before the spare says it is ready

    import torchpass as tp

    model = make_model(args.hidden, args.layers)  # built before init: a spare is warm when it is needed
    out = Path(args.out)
    if os.environ.get("TORCHPASS_ROLE") == "spare":
        (out / f"spare-ready-{os.environ.get('TORCHPASS_WORKER_ID', os.getpid())}").touch()
    ctx = tp.init()
    deadline = time.monotonic() + 120
    while len(list(out.glob("spare-ready-*"))) < args.wait_spares and time.monotonic() < deadline:
        time.sleep(0.05)  # on a cluster spares wait on nodes of their own: do not train while they start here
    ddp = ctx.wrap_model(model)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = ctx.wrap_optimizer(inner)
    rec = Recorder(args, ctx.slot, ctx.world_size)
    for step, (x, y) in ctx.steps(lambda s: batch(s, ctx.slot, args.batch), args.steps):
        rec.begin(step)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    rec.finish("torchpass", {"state_sha256": state_sha256(model, inner)})
    ctx.close()


def train_interleaved(args: argparse.Namespace) -> None:
    """Plain DDP and TorchPass in the same ranks, alternating every ``--segment`` steps (one ``torchpass run``).

    Two identical models: one wrapped by TorchPass and trained through ``ctx.steps``, one in plain DDP over the
    same gloo group. At every segment boundary, inside TorchPass's step, the ranks meet at a barrier and train
    the DDP model for a segment of the same steps' batches; then TorchPass's next segment is timed; one more
    DDP segment closes the job, so every TorchPass segment lies between two DDP ones. A slow phase of a shared
    machine lasts seconds and so hits both forms alike: the per-segment ratio is far less noisy than two
    separate jobs' steps/s. Rank 0 writes ``interleaved.json``: every segment's wall seconds per form, in order
    (DDP first and last; the first of each form, the warm-up, excluded), and the CPU seconds its process (every
    thread: gloo's and TorchPass's included) spent in each, which time slices lost to other processes do not
    blur."""
    import torchpass as tp

    seg = args.segment
    # Which model's memory is allocated first is varied from job to job (--torchpass-first): where the two
    # models land moves each form's step time by a few per cent for the whole job (cache and page placement).
    first, second = make_model(args.hidden, args.layers), make_model(args.hidden, args.layers)
    tp_model, ddp_model = (first, second) if args.torchpass_first else (second, first)
    ctx = tp.init()
    tp_ddp = ctx.wrap_model(tp_model)
    tp_opt = ctx.wrap_optimizer(torch.optim.AdamW(tp_model.parameters(), lr=1e-3))
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    plain: nn.parallel.DistributedDataParallel | None = None
    spent: dict[str, list[tuple[float, float]]] = {"ddp": [], "torchpass": []}
    started: tuple[float, float] | None = None

    def clocks() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def record(form: str, since: tuple[float, float]) -> None:
        wall, cpu = clocks()
        spent[form].append((wall - since[0], cpu - since[1]))

    # Between steps: DDP fetches the batch; TorchPass's step boundary (ctx.steps) commits the step, reseeds and
    # fetches it. Their difference is TorchPass's own work per step, measured directly (after the first segment).
    between = {"ddp": 0.0, "torchpass": 0.0}
    counted = {"ddp": 0, "torchpass": 0}

    def count(form: str, since: float) -> None:
        between[form] += time.perf_counter() - since
        counted[form] += 1

    def ddp_segment(first: int) -> None:
        nonlocal plain
        plain = plain or nn.parallel.DistributedDataParallel(ddp_model)  # over TorchPass's current group
        dist.barrier()
        t0 = clocks()
        for s in range(first, first + seg):
            t = time.perf_counter()
            xa, ya = batch(s, ctx.slot, args.batch)
            if first >= seg:
                count("ddp", t)
            nn.functional.mse_loss(plain(xa), ya).backward()
            ddp_opt.step()
            ddp_opt.zero_grad()
        record("ddp", t0)
        dist.barrier()

    last = args.steps - args.steps % seg
    steps = iter(ctx.steps(lambda s: batch(s, ctx.slot, args.batch), last))
    while True:
        t = time.perf_counter()
        try:
            step, (x, y) = next(steps)
        except StopIteration:
            break
        if step > seg:  # the first steps' calls include joining the job
            count("torchpass", t)
        if step % seg == 0:
            if started is not None:
                record("torchpass", started)
            ddp_segment(step)
            started = clocks()
        nn.functional.mse_loss(tp_ddp(x), y).backward()
        tp_opt.step()
        tp_opt.zero_grad()
    if started is not None:
        record("torchpass", started)
        ddp_segment(last)
    if ctx.slot == 0:
        result: dict[str, Any] = {"segment": seg, "between_steps_s": {f: between[f] / counted[f] for f in between}}
        for form, pairs in spent.items():
            result[form] = [wall for wall, _ in pairs[1:]]
            result[f"{form}_cpu"] = [cpu for _, cpu in pairs[1:]]
        (Path(args.out) / "interleaved.json").write_text(json.dumps(result))
    ctx.close()


def train_replica_check(args: argparse.Namespace) -> None:
    """TorchPass with its runtime net off and on, alternating every ``--segment`` steps in the same job
    (``bench/replica_check.py``). After two warm-up segments the forms rotate off, K = 1, off, K = the configured
    default, off, ... so every segment with the net on lies between two without it (a last segment, holding the
    wait for every rank to finish, is not counted); the net's period is set on every rank at the same step
    (``ctx.net.every``, the one number :meth:`torchpass.rank.replica_check.ReplicaNet.due` reads), so the ranks always
    agree on which steps are checked. The segments with the net on have odd indices, so with ``--segment`` K or
    K / 2 each default-K segment holds exactly one check (step + 1 divisible by K). Rank 0 writes
    ``replica_check.json``: each segment's form, wall and CPU seconds, and the checks it ran with their own time
    (in all, and computing the checksums) and the bytes each read."""
    import torchpass as tp

    seg = args.segment
    model = make_model(args.hidden, args.layers)
    ctx = tp.init()
    default_every = ctx.config.replica_check_every_steps
    ddp = ctx.wrap_model(model)
    opt = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    cycle = [("off", 0), ("k1", 1), ("off", 0), ("kdefault", default_every)]
    segments: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    net = ctx.net

    def close() -> None:
        if current is not None:
            current["wall_s"] = time.perf_counter() - current.pop("t0")
            current["cpu_s"] = time.process_time() - current.pop("c0")
            current["checks"] = net.checks - current.pop("n0")
            current["check_s"] = net.check_s - current.pop("s0")
            current["checksum_s"] = net.checksum_s - current.pop("k0")
            current["check_bytes"] = net.check_bytes
            segments.append(current)

    last = args.steps - args.steps % seg
    for step, (x, y) in ctx.steps(lambda s: batch(s, ctx.slot, args.batch), last):
        if step % seg == 0:
            close()
            index, total = step // seg, last // seg  # two segments warm up, the last holds the job's end
            form, every = ("warmup", 0) if index < 2 else ("tail", 0) if index == total - 1 else cycle[(index - 2) % 4]
            net.every = every  # from this step's commit on, on every rank alike
            current = {"form": form, "every": every, "t0": time.perf_counter(), "c0": time.process_time()}
            current.update(n0=net.checks, s0=net.check_s, k0=net.checksum_s)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    close()  # the tail: its last commit and the wait for every rank to finish ran inside ctx.steps
    if ctx.slot == 0:
        result = {"segment": seg, "default_every": default_every, "segments": segments}
        (Path(args.out) / "replica_check.json").write_text(json.dumps(result))
    ctx.close()


def train_torchft(args: argparse.Namespace) -> None:
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    replica, world = int(os.environ["REPLICA_ID"]), int(os.environ["NUM_REPLICAS"])
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    model = make_model(args.hidden, args.layers)
    opt_inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt_inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt_inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)),
        min_replica_size=args.min_replicas or world,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench{replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        timeout=datetime.timedelta(seconds=10),
        hostname="127.0.0.1",
    )
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, opt_inner)
    rec = Recorder(args, replica, world)
    reduced = 0
    while manager.current_step() < args.steps:
        step = manager.current_step()
        opt.zero_grad()
        rec.begin(step, record=False)
        x, y = batch(step, replica, args.batch)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        # Recorded after the fact: a respawned replica's first iteration heals it (it receives a peer's state
        # and jumps ahead); that is no computed step. A discarded step (not committed) is one.
        if manager.current_step() in (step, step + 1):
            rec.executed(step)
        if manager.num_participants() < world:
            reduced += 1
    rec.finish("torchft", {"reduced_width_steps": reduced, "state_sha256": state_sha256(model, opt_inner)})
    manager.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("ddp", "torchpass", "torchft", "interleaved", "replica_check"))
    parser.add_argument("--out", required=True, help="folder for the step logs and results")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20, help="steps excluded from the timing")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--crash-steps", default="", help="comma-separated steps at which one rank SIGKILLs itself")
    parser.add_argument("--node-crash-step", type=int, default=-1, help="sandbox: a rank's node crashes at this step")
    parser.add_argument("--node-crash-rank", type=int, default=1, help="sandbox: the rank whose node crashes (1)")
    parser.add_argument("--ckpt", default="", help="ddp: checkpoint file (resume from it; save every --ckpt-every)")
    parser.add_argument("--ckpt-every", type=int, default=50)
    parser.add_argument("--min-replicas", type=int, default=0, help="torchft: min_replica_size (default: all)")
    parser.add_argument(
        "--wait-spares", type=int, default=0, help="torchpass: start training once this many spares are ready"
    )
    parser.add_argument("--segment", type=int, default=20, help="interleaved: steps per segment of each form")
    parser.add_argument(
        "--torchpass-first", action="store_true", help="interleaved: allocate TorchPass's model before DDP's"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    modes = {
        "ddp": train_ddp,
        "torchpass": train_torchpass,
        "torchft": train_torchft,
        "interleaved": train_interleaved,
        "replica_check": train_replica_check,
    }
    modes[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
