"""Starting the benchmark job's processes in its three forms (plain DDP, TorchPass, TorchFT), for the bench scripts.

Shared by ``bench/torchpass_overhead.py`` and ``bench/torchpass_vs_restart.py`` so both run the job the same
way: every rank is ``bench/support/torchpass_workload.py`` on 127.0.0.1 over gloo (``GLOO_SOCKET_IFNAME=lo``), one
thread each, stderr to a file in the run's folder. TorchFT's lighthouse runs as its own process (the
``torchft_lighthouse`` program the package installs), so its log does not mix with the table. No torch here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKLOAD = Path(__file__).resolve().with_name("torchpass_workload.py")
LIGHTHOUSE = Path(sys.executable).with_name("torchft_lighthouse")


def say(text: str = "") -> None:
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchft_status() -> str:
    """'' when TorchFT can be used here, else why not (to print instead of numbers)."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install -e '.[bench]')"
    lighthouse = LIGHTHOUSE if LIGHTHOUSE.exists() else shutil.which("torchft_lighthouse")
    if not lighthouse:
        return "torchft is installed but its torchft_lighthouse program is missing"
    return ""


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "SLURM_", "TORCHFT_"))}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def workload_args(args: argparse.Namespace, out: Path, extra: list[str] | None = None) -> list[str]:
    return [
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        *(extra or []),
    ]


def spawn(cmd: list[str], env: dict[str, str], err: Path) -> subprocess.Popen[bytes]:
    """A process whose stderr goes to ``err`` (appended: a restarted rank keeps its history)."""
    with open(err, "ab") as handle:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=handle)


def wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [p.returncode for p in procs]


def whole_job_ran(procs: list[subprocess.Popen[bytes]], deadline: float, poll_s: float = 0.05) -> bool:
    """Watch a job's ranks as torchrun (or Slurm without TorchPass) does: True once every rank exited 0; at the
    first rank that fails, or at ``deadline`` (monotonic), stop the others and return False (the job is to be
    started again from its checkpoint)."""
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(poll_s)
    if all(p.poll() == 0 for p in procs):
        return True
    for p in procs:
        if p.poll() is None:
            p.kill()
    wait_all(procs, 10)
    return False


def ddp_rank(
    args: argparse.Namespace, out: Path, rank: int, port: int, extra: list[str] | None = None
) -> subprocess.Popen[bytes]:
    """One plain-DDP rank (torchrun's environment contract)."""
    env = base_env()
    env.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return spawn([sys.executable, str(WORKLOAD), "ddp", *workload_args(args, out, extra)], env, out / f"ddp-{rank}.err")


def torchpass_job(
    args: argparse.Namespace,
    out: Path,
    spares: int,
    extra: list[str] | None = None,
    respawn: bool = True,
    mode: str = "torchpass",
) -> subprocess.Popen[bytes]:
    """``torchpass run --local`` of the workload in ``mode`` (``respawn`` False: no new spare when one takes a
    slot)."""
    cmd = [
        sys.executable,
        "-m",
        "torchpass",
        "run",
        "--local",
        "--nproc",
        str(args.nproc),
        "--spares",
        str(spares),
        *([] if respawn else ["--no-respawn-spares"]),
        "--events",
        str(out / "events.jsonl"),
        str(WORKLOAD),
        mode,
        *workload_args(args, out, extra),
    ]
    return spawn(cmd, base_env(), out / "torchpass.err")


def torchft_replica(
    args: argparse.Namespace, out: Path, replica: int, lighthouse: str, extra: list[str] | None = None
) -> subprocess.Popen[bytes]:
    """One TorchFT replica group (one process)."""
    env = base_env()
    env.update(REPLICA_ID=str(replica), NUM_REPLICAS=str(args.nproc), TORCHFT_LIGHTHOUSE=lighthouse)
    cmd = [sys.executable, str(WORKLOAD), "torchft", *workload_args(args, out, extra)]
    return spawn(cmd, env, out / f"torchft-{replica}.err")


class Lighthouse:
    """TorchFT's lighthouse on 127.0.0.1, as a process of its own (a context manager)."""

    def __init__(self, out: Path, min_replicas: int, join_timeout_ms: int = 10000) -> None:
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        program = str(LIGHTHOUSE) if LIGHTHOUSE.exists() else (shutil.which("torchft_lighthouse") or "")
        cmd = [
            program,
            "--min_replicas",
            str(min_replicas),
            "--bind",
            f"127.0.0.1:{self.port}",
            "--quorum_tick_ms",
            "100",
            "--join_timeout_ms",
            str(join_timeout_ms),
        ]
        self.proc = spawn(cmd, base_env(), out / "lighthouse.log")

    def __enter__(self) -> Lighthouse:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError("torchft_lighthouse did not start")

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def step_logs(out: Path) -> dict[int, list[int]]:
    """rank -> every step it executed, in order (a step executed twice appears twice)."""
    logs: dict[int, list[int]] = {}
    for path in sorted(out.glob("steps-*.log")):
        rank = int(path.stem.split("-", 1)[1])
        logs[rank] = [int(line.split()[0]) for line in path.read_text().splitlines() if line.strip()]
    return logs
