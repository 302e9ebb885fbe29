#!/usr/bin/env python3
"""A timed all-reduce loop across nodes (torch.distributed, gloo): the workload the LinkPass benchmark watches.

Standalone on purpose (no Clockwork imports): it is an ordinary collective program, one rank per node, and
the benchmark judges LinkPass only by what this program sees. Each step all-reduces (sums) a 1 MiB float32
tensor, checks a few elements of the result, and appends ``STEP MONOTONIC_TIME`` to its rank's log; the
longest gap between two consecutive lines is the training stall a fault caused. CLOCK_MONOTONIC is one
clock for every process of a machine (network namespaces share it), so the harness compares these times
with the moments it injected and lifted a fault.

Two ways to launch it, one rank per node:

* by a harness::

      python bench/allreduce_loop.py --rank R --world 4 --master node1 --log /tmp/x/loop.log \
          --stop-file /tmp/x/stop

* under Slurm, inside a job: ``srun python bench/allreduce_loop.py --log ... --steps 500`` (rank from
  SLURM_PROCID, world from SLURM_NTASKS, the rendezvous host is the first host of SLURM_STEP_NODELIST /
  SLURM_JOB_NODELIST unless MASTER_ADDR is set).

The rendezvous (a TCPStore hosted by rank 0) is on ``--master``, a host name that, on a sandbox node,
resolves to the node's stable address; gloo binds to the address of this host's own name, so the traffic
uses the node addresses that LinkPass keeps reachable.

Data is deterministic: rank r contributes ``base_r[i] + (step % 1000)`` with ``base_r[i] = (7 i + 13 r) % 251``;
every sum is an integer below 2**24, exact in float32 whatever the reduction order, so the result after N
steps is known in advance (:func:`expected_checksum`). The last element carries a stop flag: rank 0 sets
it when ``--stop-file`` exists (or any rank after SIGTERM), so every rank stops after the same step
without an extra collective.

Output (stdout): ``done steps=N checksum=HEX`` and exit 0; ``collective error after step N: ...`` and
exit 3 when a collective fails or times out (``--timeout``, default 30 s); exit 4 on a wrong result,
exit 2 when the launch or the rendezvous fails.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import re
import signal
import sys
import time
from array import array
from collections.abc import Sequence
from typing import Any

DEFAULT_PORT = 29521
DEFAULT_BYTES = 1 << 20  # 1 MiB of float32
STEP_MOD = 1000
EXIT_OK, EXIT_LAUNCH, EXIT_COLLECTIVE, EXIT_WRONG = 0, 2, 3, 4


# --------------------------------------------------------------------------------------------------------
# Deterministic data (pure Python here, so a harness can compute the expected checksum without torch)
# --------------------------------------------------------------------------------------------------------


def numel_for(size_bytes: int) -> int:
    """Elements of the all-reduced tensor: the data plus one stop-flag slot."""
    return max(2, size_bytes // 4)


def base_value(index: int, rank: int) -> int:
    return (7 * index + 13 * rank) % 251


def reduced_value(index: int, step: int, world: int) -> float:
    """Element ``index`` of the summed data after step ``step`` (1-based)."""
    return float(sum(base_value(index, r) for r in range(world)) + world * (step % STEP_MOD))


def checksum_of(data: bytes, steps: int, world: int) -> str:
    digest = hashlib.sha256(f"allreduce-loop steps={steps} world={world}\n".encode())
    digest.update(data)
    return digest.hexdigest()


def expected_checksum(steps: int, world: int, size_bytes: int = DEFAULT_BYTES) -> str:
    """The checksum every rank prints after ``steps`` correct steps (native float32 bytes, as torch holds them)."""
    n = numel_for(size_bytes) - 1
    sums = [sum(base_value(i, r) for r in range(world)) for i in range(251)]  # base_value is periodic in i
    offset = world * (steps % STEP_MOD)
    data = array("f", (float(sums[i % 251] + offset) for i in range(n)))
    return checksum_of(data.tobytes(), steps, world)


# --------------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """The command line or the environment does not describe a usable launch."""


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist (``node[1-3,7],login1``) without Slurm binaries."""
    parts, depth, cur = [], 0, ""
    for char in hostlist.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += char
    parts.append(cur)
    hosts: list[str] = []
    for part in filter(None, parts):
        names = [""]
        for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            suffixes = [""]
            if body:
                suffixes = []
                for item in body.split(","):
                    lo, _, hi = item.partition("-")
                    if not lo.isdigit() or (hi and not hi.isdigit()):
                        raise LaunchError(f"bad range {item!r} in hostlist {hostlist!r}")
                    suffixes += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi or lo) + 1)]
            names = [name + literal + suffix for name in names for suffix in suffixes]
        hosts += names
    return hosts


def resolve_launch(args: argparse.Namespace) -> tuple[int, int, str, int]:
    """(rank, world, master host, port) from the command line, else from srun's environment."""
    env = os.environ
    rank = args.rank if args.rank is not None else _env_int("SLURM_PROCID")
    world = args.world if args.world is not None else _env_int("SLURM_NTASKS")
    if rank is None or world is None:
        raise LaunchError("give --rank and --world, or launch with srun (SLURM_PROCID/SLURM_NTASKS)")
    if not 0 <= rank < world:
        raise LaunchError(f"rank {rank} is not in 0..{world - 1}")
    master = args.master or env.get("MASTER_ADDR", "")
    if not master:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        hosts = expand_hostlist(nodelist) if nodelist else []
        if not hosts:
            raise LaunchError("no --master, MASTER_ADDR or Slurm node list to find the rendezvous host")
        master = hosts[0]
    port = args.port or _env_int("MASTER_PORT") or DEFAULT_PORT
    return rank, world, master, port


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------


class StepLog:
    """``STEP MONOTONIC_TIME`` lines, written every ``flush_every`` steps and at exit (one write() each)."""

    def __init__(self, path: str | None, flush_every: int) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None
        self._every = max(1, flush_every)
        self._pending: list[str] = []

    def add(self, step: int, stamp: float) -> None:
        if self._fd is None:
            return
        self._pending.append(f"{step} {stamp:.6f}\n")
        if len(self._pending) >= self._every:
            self.flush()

    def flush(self) -> None:
        if self._fd is not None and self._pending:
            os.write(self._fd, "".join(self._pending).encode())
            self._pending = []

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    try:
        rank, world, master, port = resolve_launch(args)
    except LaunchError as exc:
        say(f"launch error: {exc}")
        return EXIT_LAUNCH

    import torch  # late: expected_checksum and the helpers above need no torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        store = dist.TCPStore(master, port, world, is_master=(rank == 0), timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except Exception as exc:
        say(f"rendezvous error at {master}:{port}: {type(exc).__name__}: {exc}")
        return EXIT_LAUNCH

    numel = numel_for(args.size_bytes)
    idx = torch.arange(numel - 1, dtype=torch.int64)
    base = ((idx * 7 + 13 * rank) % 251).to(torch.float32)
    buf = torch.zeros(numel, dtype=torch.float32)
    data = buf[:-1]
    spots = (0, (numel - 1) // 2, numel - 2)
    spot_sums = {i: sum(base_value(i, r) for r in range(world)) for i in spots}

    stop_requested = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_term)
    log = StepLog(f"{args.log}.rank{rank}" if args.log else None, args.flush_every)
    step = 0
    try:
        while True:
            step += 1
            torch.add(base, float(step % STEP_MOD), out=data)
            if rank == 0 and args.stop_file and not stop_requested:
                stop_requested = os.path.exists(args.stop_file)
            buf[-1] = 1.0 if stop_requested else 0.0
            try:
                dist.all_reduce(buf)
            except Exception as exc:
                log.close()
                say(f"collective error after step {step - 1}: {type(exc).__name__}: {exc}")
                os._exit(EXIT_COLLECTIVE)  # a broken gloo group may hang in its destructors
            log.add(step, time.monotonic())
            offset = world * (step % STEP_MOD)
            for i in spots:
                got = buf[i].item()
                if got != spot_sums[i] + offset:
                    log.close()
                    say(f"wrong result at step {step}: element {i} = {got}, expected {spot_sums[i] + offset}")
                    os._exit(EXIT_WRONG)
            if buf[-1].item() > 0 or (args.steps and step >= args.steps):
                break
        checksum = checksum_of(bytes(data.clone().untyped_storage()), step, world)
        try:
            dist.barrier()  # nobody tears down its sockets while a peer still finishes the last step
        except Exception as exc:
            log.close()
            say(f"collective error after step {step}: {type(exc).__name__}: {exc}")
            os._exit(EXIT_COLLECTIVE)
    finally:
        log.close()
    dist.destroy_process_group()
    say(f"done steps={step} checksum={checksum}")
    return EXIT_OK


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="allreduce_loop.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--rank", type=int, help="this process's rank (default: SLURM_PROCID)")
    parser.add_argument("--world", type=int, help="number of ranks (default: SLURM_NTASKS)")
    parser.add_argument("--master", help="rendezvous host (default: MASTER_ADDR, else the first Slurm host)")
    parser.add_argument("--port", type=int, help=f"rendezvous port (default: MASTER_PORT, else {DEFAULT_PORT})")
    parser.add_argument("--log", help="append 'STEP MONOTONIC_TIME' lines to LOG.rankR")
    parser.add_argument("--stop-file", help="stop (all ranks, after the same step) once this file exists")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (default 0: no limit)")
    parser.add_argument("--timeout", type=float, default=30.0, help="rendezvous and collective timeout, s (30)")
    parser.add_argument("--size-bytes", type=int, default=DEFAULT_BYTES, help="all-reduced bytes (1 MiB)")
    parser.add_argument("--flush-every", type=int, default=1, help="write the log every N steps (default 1)")
    args = parser.parse_args(argv)
    if args.steps < 0 or args.timeout <= 0 or args.size_bytes < 8 or args.flush_every < 1:
        parser.error("--steps >= 0, --timeout > 0, --size-bytes >= 8 and --flush-every >= 1 are required")
    if args.world is not None and args.world < 1:
        parser.error("--world must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
