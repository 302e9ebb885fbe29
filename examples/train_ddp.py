#!/usr/bin/env python3
"""A plain data-parallel PyTorch training job: the workload the Clockwork demo keeps alive.

It is deliberately an ordinary user script (no Clockwork imports): the point of the demo is that a job written
like this survives link and node faults without being changed.

Two ways to run it:

* Under Slurm, one process per node, launched by ``srun`` inside an sbatch job::

      srun --ntasks-per-node=1 python examples/train_ddp.py --steps 40

  rank = SLURM_PROCID, world size = SLURM_NTASKS, local rank = SLURM_LOCALID. The rendezvous (a TCPStore
  hosted by rank 0) is on the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), overridable with
  MASTER_ADDR; the port is ``--port``, else MASTER_PORT, else 29511.

* Locally, for development and tests, without Slurm::

      python examples/train_ddp.py --local 3 --steps 10

  spawns 3 processes that rendezvous on 127.0.0.1 on a free port.

The model is a small MLP learning a fixed, synthetic regression task on CPU with the gloo backend. With the
same ``--seed`` and world size the final weights are bitwise identical run after run, which is how the demo
proves that a fault cost no step: compare the ``final weights sha256`` line with a fault-free run.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import os
import re
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DEFAULT_PORT = 29511
# The task is the same for every seed (a "fixed dataset"); --seed changes model init and shuffle order.
DATA_SEED = 20240611
NUM_SAMPLES = 2048
NUM_FEATURES = 16
HIDDEN = 64
BATCH_PER_RANK = 32
LEARNING_RATE = 0.05
MOMENTUM = 0.9
PLOT_ROWS = 10
PLOT_MAX_COLUMNS = 60
PROG = "train_ddp.py"


class LaunchError(RuntimeError):
    """The environment does not describe a usable launch (missing Slurm variables, bad node list)."""


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the job and how it finds the others."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    timeout_s: float
    step_ms: float = 0.0  # --step-ms: each step lasts at least this long (standing for real compute)


# ----------------------------------------------------------------------------------------------------------
# Slurm environment
# ----------------------------------------------------------------------------------------------------------


def _split_top_level(text: str) -> list[str]:
    """Split a hostlist on commas that are not inside brackets (``a[1,3],b`` → ``a[1,3]``, ``b``)."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"unbalanced ']' in hostlist {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise LaunchError(f"unbalanced '[' in hostlist {text!r}")
    parts.append("".join(current))
    return [part for part in parts if part]


def _expand_range_set(body: str, hostlist: str) -> list[str]:
    """Expand the inside of one bracket, ``01-03,7`` → ``01 02 03 7``, keeping Slurm's zero padding."""
    values: list[str] = []
    for item in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if match is None:
            raise LaunchError(f"bad range {item!r} in hostlist {hostlist!r}")
        first, last = match.group(1), match.group(2)
        if last is None:
            values.append(first)
            continue
        if int(last) < int(first):
            raise LaunchError(f"descending range {item!r} in hostlist {hostlist!r}")
        width = len(first)
        values.extend(str(number).zfill(width) for number in range(int(first), int(last) + 1))
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``node[1-3]`` or ``gpu[01-02,07],login1`` into host names.

    A small pure-Python version so the script needs no Slurm binaries (``scontrol show hostnames``) on the
    compute nodes; it covers ranges, lists, zero padding and several bracket groups in one name.
    """
    hosts: list[str] = []
    for part in _split_top_level(hostlist.strip()):
        expansions = [""]
        for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            suffixes = _expand_range_set(bracket, hostlist) if bracket else [""]
            expansions = [prefix + literal + suffix for prefix in expansions for suffix in suffixes]
        hosts.extend(expansions)
    return hosts


def _env_int(names: Sequence[str]) -> int | None:
    """The first of ``names`` that is set, as an int (None when none is set)."""
    for name in names:
        value = os.environ.get(name)
        if value is not None and value != "":
            try:
                return int(value)
            except ValueError as error:
                raise LaunchError(f"{name}={value!r} is not an integer") from error
    return None


def resolve_port(cli_port: int | None) -> int:
    """``--port`` wins, then MASTER_PORT, then the default, so an sbatch script can set either."""
    if cli_port is not None:
        return cli_port
    from_env = _env_int(["MASTER_PORT"])
    return from_env if from_env is not None else DEFAULT_PORT


def launch_from_slurm(cli_port: int | None, timeout_s: float) -> Launch:
    """Read rank, world size and rendezvous host from the variables srun sets for every task."""
    rank = _env_int(["SLURM_PROCID"])
    world_size = _env_int(["SLURM_NTASKS", "SLURM_NPROCS"])
    if rank is None or world_size is None:
        raise LaunchError(
            "SLURM_PROCID/SLURM_NTASKS are not set: launch with srun inside an sbatch/salloc job, "
            "or use --local N to run N processes on this machine"
        )
    # Unused on CPU; a GPU version would pick its device with it (torch.cuda.set_device(local_rank)).
    local_rank = _env_int(["SLURM_LOCALID"]) or 0
    master_addr = os.environ.get("MASTER_ADDR", "")
    if not master_addr:
        nodelist = next(
            (
                os.environ[name]
                for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                if os.environ.get(name)
            ),
            "",
        )
        if not nodelist:
            raise LaunchError("no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST to pick the rendezvous host from")
        hosts = expand_hostlist(nodelist)
        if not hosts:
            raise LaunchError(f"node list {nodelist!r} names no host")
        master_addr = hosts[0]
    return Launch(rank, world_size, local_rank, master_addr, resolve_port(cli_port), timeout_s)


# ----------------------------------------------------------------------------------------------------------
# Model, data, determinism
# ----------------------------------------------------------------------------------------------------------


def make_dataset() -> TensorDataset:
    """A fixed synthetic regression task: targets from a random 'teacher' network plus a little noise.

    Built from its own generator, so every rank (and every run) holds exactly the same samples.
    """
    generator = torch.Generator().manual_seed(DATA_SEED)
    inputs = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=generator)
    teacher_in = torch.randn(NUM_FEATURES, 8, generator=generator) / NUM_FEATURES**0.5
    teacher_out = torch.randn(8, 1, generator=generator) / 8**0.5
    targets = torch.tanh(inputs @ teacher_in) @ teacher_out
    targets = targets + 0.01 * torch.randn(targets.shape, generator=generator)
    return TensorDataset(inputs, targets)


def make_model() -> nn.Module:
    """A small MLP: big enough to show a real loss curve, small enough for a 2-core test machine."""
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    )


def make_deterministic(seed: int) -> None:
    """Pin everything that could make two runs differ, so equal weights prove equal training."""
    torch.manual_seed(seed)
    # One intra-op thread: results then do not depend on the core count, and N ranks on few cores don't fight.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def endless_batches(loader: DataLoader, sampler: DistributedSampler[int]) -> Iterator[tuple[torch.Tensor, ...]]:
    """Cycle over epochs; set_epoch gives each epoch a new (still seeded) shuffle of this rank's shard."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 over the raw bytes of every parameter in order: a bitwise fingerprint of the trained model."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        # clone() gives a fresh storage of exactly this tensor's bytes (a view's storage may hold more).
        digest.update(bytes(parameter.detach().cpu().clone().untyped_storage()))
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Output helpers
# ----------------------------------------------------------------------------------------------------------


def loss_plot(losses: Sequence[float], rows: int = PLOT_ROWS, max_columns: int = PLOT_MAX_COLUMNS) -> str:
    """A small ASCII plot of loss against step, so a newcomer sees the job converge in a text log.

    Plain ASCII on purpose: Slurm output files and terminals without UTF-8 show it unchanged.
    """
    if not losses:
        return "(no steps)"
    columns = min(len(losses), max_columns)
    # Each column shows the mean loss of its share of the steps.
    buckets = [
        losses[column * len(losses) // columns : (column + 1) * len(losses) // columns] for column in range(columns)
    ]
    values = [sum(bucket) / len(bucket) for bucket in buckets]
    top, bottom = max(values), min(values)
    span = top - bottom or 1.0
    heights = [round((value - bottom) / span * (rows - 1)) for value in values]
    label_width = max(len(f"{top:.4f}"), len(f"{bottom:.4f}"))
    lines = [f"loss vs step ({len(losses)} steps, {columns} columns)"]
    for row in range(rows - 1, -1, -1):
        if row == rows - 1:
            label = f"{top:.4f}"
        elif row == 0:
            label = f"{bottom:.4f}"
        else:
            label = ""
        cells = "".join("*" if height == row else " " for height in heights)
        lines.append(f"{label:>{label_width}} |{cells}".rstrip())
    lines.append(f"{'':>{label_width}} +{'-' * columns}")
    first, last = "1", str(len(losses))
    lines.append(f"{'':>{label_width}}  {first}{last:>{max(columns - len(first), len(last))}}")
    return "\n".join(lines)


def _decode_proc_address(hex_address: str) -> str:
    """Turn /proc/net/tcp{,6} ``0100007F`` / 32-hex-digit IPv6 fields into dotted or colon notation."""
    raw = bytes.fromhex(hex_address)
    # The kernel prints each 32-bit word in host byte order (little-endian on the machines we run on).
    if sys.byteorder == "little":
        raw = b"".join(raw[index : index + 4][::-1] for index in range(0, len(raw), 4))
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    if raw[:12] == b"\x00" * 10 + b"\xff\xff":  # IPv4-mapped IPv6 address
        return socket.inet_ntop(socket.AF_INET, raw[12:])
    return socket.inet_ntop(socket.AF_INET6, raw)


def connection_addresses() -> list[str]:
    """Local addresses of this process's established TCP connections (the store and gloo's peer links).

    Read from /proc rather than assumed, because the demo's claim is about *which* address the collective
    traffic really uses: the node's stable address, which LinkPass keeps reachable when a NIC dies. Returns
    an empty list where /proc is not available.
    """
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
        addresses: set[str] = set()
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            try:
                with open(table, encoding="ascii") as handle:
                    next(handle)  # header
                    for line in handle:
                        fields = line.split()
                        local, state, inode = fields[1], fields[3], fields[9]
                        if state == "01" and inode in inodes:  # 01 = ESTABLISHED
                            addresses.add(_decode_proc_address(local.split(":")[0]))
            except FileNotFoundError:
                continue
        return sorted(addresses)
    except OSError:
        return []


def _print(text: str) -> None:
    """Write one whole line and flush at once.

    Under srun/sbatch stdout is a pipe or file and would otherwise be buffered; and with several ranks sharing
    one stdout (--local), a single write per line keeps their lines from running into each other.
    """
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------


def train(launch: Launch, steps: int, seed: int) -> None:
    """Join the process group, train for ``steps`` steps, report, and leave cleanly."""
    rank, world_size = launch.rank, launch.world_size
    make_deterministic(seed)
    timeout = datetime.timedelta(seconds=launch.timeout_s)

    # Rank 0 hosts the rendezvous store; everyone else connects to it. A short timeout (not the 30 min
    # default) makes a job whose peers never arrive fail with a message instead of hanging.
    try:
        store = dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            world_size,
            is_master=(rank == 0),
            timeout=timeout,
        )
    except (RuntimeError, OSError) as error:
        raise LaunchError(
            f"rendezvous at {launch.master_addr}:{launch.master_port} failed within {launch.timeout_s:g} s "
            f"(rank 0 must run on {launch.master_addr} with the port free; set MASTER_ADDR/--port "
            f"otherwise): {error}"
        ) from error
    # gloo's device binds to the address this host's name resolves to (GLOO_SOCKET_IFNAME overrides it).
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        model = DistributedDataParallel(make_model())
        dataset = make_dataset()
        sampler: DistributedSampler[int] = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        loader = DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler, drop_last=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
        loss_fn = nn.MSELoss()

        losses: list[float] = []
        batches = endless_batches(loader, sampler)
        for step in range(1, steps + 1):
            started = time.monotonic()
            inputs, targets = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            optimizer.step()

            # Report the mean loss over all ranks' batches, not only rank 0's shard.
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
            losses.append(mean_loss.item() / world_size)
            if (
                launch.step_ms
            ):  # paced: say how long the step's work took (a stall shows there), then sleep out the rest
                work = time.monotonic() - started
                if rank == 0:
                    _print(f"step {step} loss {losses[-1]:.4f} ({1000 * work:.0f} ms)")
                time.sleep(max(0.0, launch.step_ms / 1000 - work))
            elif rank == 0:
                _print(f"step {step} loss {losses[-1]:.4f}")

        # Every replica must hold the same weights; check it so a silent divergence cannot pass as success.
        digest = weights_sha256(model.module)
        digests: list[str | None] = [None] * world_size
        dist.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise RuntimeError(f"replicas diverged: weight hashes per rank {digests}")
        if rank == 0:
            _print(loss_plot(losses))
            _print(f"final weights sha256 {digest}")

        addresses = connection_addresses()
        dist.barrier()  # the "done" lines follow the summary
        address = ",".join(addresses) if addresses else "unknown"
        _print(f"rank {rank} on {socket.gethostname()} ({address}) done")
    finally:
        # A teardown that hangs must not hold the allocation until its time limit: past 30 s every
        # thread's stack goes to stderr (so the hang can be diagnosed) and the process exits with 1.
        faulthandler.dump_traceback_later(30, exit=True)
        dist.destroy_process_group()


def _fail(rank: int | None, error: BaseException) -> int:
    """One clear line on stderr naming the rank and the cause; the caller turns it into the exit status."""
    where = f"rank {rank}: " if rank is not None else ""
    print(f"{PROG}: {where}error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    return 1


def _local_worker(
    rank: int, world_size: int, port: int, steps: int, seed: int, timeout_s: float, step_ms: float = 0.0
) -> None:
    """Body of one process in --local mode (top level so torch.multiprocessing can pickle it)."""
    launch = Launch(rank, world_size, rank, "127.0.0.1", port, timeout_s, step_ms)
    try:
        train(launch, steps, seed)
    except Exception as error:
        sys.exit(_fail(rank, error))


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1: bind port 0 and let the kernel choose."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def loopback_interface() -> str | None:
    """Name of the loopback interface (``lo`` on Linux), so --local keeps gloo's traffic on 127.0.0.1."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name.startswith("lo")), None)


def run_local(
    processes: int, cli_port: int | None, steps: int, seed: int, timeout_s: float, step_ms: float = 0.0
) -> int:
    """Spawn ``processes`` ranks on this machine and return the exit status for the whole run."""
    port = cli_port if cli_port is not None else free_port()
    # Without this, gloo binds to whatever the hostname resolves to, which may be a LAN address.
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    try:
        mp.spawn(_local_worker, args=(processes, port, steps, seed, timeout_s, step_ms), nprocs=processes, join=True)
    except mp.ProcessExitedException as error:
        print(
            f"{PROG}: error: local run failed: rank {error.error_index} exited with code {error.exit_code}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except Exception as error:
        return _fail(None, error)
    return 0


def run_slurm(cli_port: int | None, steps: int, seed: int, timeout_s: float, step_ms: float = 0.0) -> int:
    """Run this process as the rank srun gave it and return its exit status."""
    rank: int | None = None
    try:
        launch = replace(launch_from_slurm(cli_port, timeout_s), step_ms=step_ms)
        rank = launch.rank
        train(launch, steps, seed)
    except Exception as error:
        return _fail(rank, error)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line; see the module docstring for the two launch modes."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Data-parallel MLP training with torch.distributed (gloo, CPU). Under srun: one rank per "
        "task. With --local N: N processes on 127.0.0.1.",
    )
    parser.add_argument(
        "--local",
        type=int,
        metavar="N",
        default=None,
        help="spawn N ranks on this machine instead of reading the Slurm environment",
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed for model init and data order (default: 0)")
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"rendezvous port (default: MASTER_PORT, else {DEFAULT_PORT}; with --local: a free port)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="rendezvous and collective timeout (default: 60)",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="make every step last at least MS milliseconds (a sleep standing for real compute); each step line "
        "then says how long the step's own work took, the sleep left out (default: 0, no pacing)",
    )
    args = parser.parse_args(argv)
    if args.local is not None and args.local < 1:
        parser.error("--local needs at least 1 process")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.step_ms < 0:
        parser.error("--step-ms must not be negative")
    if args.port is not None and not 0 < args.port < 65536:
        parser.error("--port must be in 1..65535")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: pick the launch mode and return the process exit status."""
    args = parse_args(argv)
    if args.local is not None:
        return run_local(args.local, args.port, args.steps, args.seed, args.timeout, args.step_ms)
    return run_slurm(args.port, args.steps, args.seed, args.timeout, args.step_ms)


if __name__ == "__main__":
    sys.exit(main())
