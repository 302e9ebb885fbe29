"""A node crash in a TorchPass job on the sandbox's real Slurm, for the recovery benchmarks (root only).

Shared by ``bench/torchpass_recovery.py`` and ``bench/borrow_recovery.py`` so that both run the same job the same
way and read the same figures: ``torchpass run bench/support/torchpass_workload.py torchpass ... --node-crash-step
S`` as a batch job (4 ranks on 4 nodes, gloo over the nodes' addresses), whose rank 1 stops in its forward pass at
step S and names its node; the benchmark crashes that whole node (``Sandbox.crash_node``) and notes when, then
waits for the job's end. One benchmark's standby figures are then measured exactly as the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from clockwork.contracts.config.core import SandboxConfig
from clockwork.sandbox.cluster import Sandbox

WORKLOAD = Path(__file__).resolve().with_name("torchpass_workload.py")


def parse_args(
    description: str, runs_help: str, quick_help: str, *, ranks_per_node: bool = False
) -> argparse.Namespace:
    """The benchmarks' common options (``--quick``: short runs, one of each kind unless ``--runs`` N); with
    ``ranks_per_node``, ``--ranks-per-node G`` too (0 when the benchmark does not take it)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=None, help=runs_help)
    if ranks_per_node:
        parser.add_argument(
            "--ranks-per-node",
            type=int,
            default=1,
            metavar="G",
            help="also run the job with G ranks per node (torchpass run --nproc-per-node G), beside 1 (default 1)",
        )
    parser.add_argument("--steps", type=int, default=80, help="steps per job (default 80)")
    parser.add_argument("--crash-step", type=int, default=40, help="the step at which the node crashes (default 40)")
    parser.add_argument("--hidden", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    args = parser.parse_args()
    args.ranks_per_node = getattr(args, "ranks_per_node", 0)
    if args.quick:  # a shorter job, and one run of each kind unless --runs says how many
        args.steps, args.crash_step = 40, 20
    if args.runs is None:
        args.runs = 1 if args.quick else 5
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: at least 1")
    return args


def lacks_root(script: str) -> bool:
    """True, after saying so on stderr, when this process is not root: building the sandbox cluster needs root."""
    if os.geteuid() != 0:
        print(f"{script} needs root (it builds the sandbox cluster)", file=sys.stderr)
        return True
    return False


@contextmanager
def running_sandbox(*, nodes: int, accounting: bool) -> Iterator[tuple[Path, Sandbox]]:
    """A temporary folder for the runs and the sandbox, its state in that folder, up for the benchmark's runs and
    taken down after them (then the folder is removed)."""
    with tempfile.TemporaryDirectory(prefix="cw-bench-") as tmp:
        box = Sandbox(replace(SandboxConfig(), nodes=nodes, accounting=accounting, state_dir=str(Path(tmp) / "state")))
        box.up()
        try:
            yield Path(tmp), box
        finally:
            box.down()


def job_env(box: Sandbox) -> dict[str, str]:
    """The job's environment: the sandbox's Slurm and Clockwork configuration, this Python's programs first on
    PATH (``torchpass`` on the nodes is this one), one intra-op thread per rank."""
    env = dict(box.slurm_env(), OMP_NUM_THREADS="1", CLOCKWORK_CONFIG=str(box.paths.clockwork_toml))
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def crash_command(out: Path, args: argparse.Namespace, settings: tuple[str, ...] = (), per_node: int = 1) -> str:
    """The batch script: ``torchpass run`` of the workload, events and step logs under ``out``, the first rank of
    agent 1's node (rank 1, or rank G with ``per_node`` G ranks per node) asking for its node's crash at
    ``--crash-step``; ``settings`` are TorchPass ``--set KEY=VALUE`` options."""
    workload = f"{WORKLOAD} torchpass --out {out} --steps {args.steps} --warmup 0 --hidden {args.hidden}"
    sets = "".join(f"--set {setting} " for setting in settings)
    layout = f"--nproc-per-node {per_node} " if per_node > 1 else ""
    return (
        f"{sys.executable} -m torchpass run --events {out}/events-{{agent}}.jsonl {layout}{sets}{workload} "
        f"--node-crash-step {args.crash_step} --node-crash-rank {per_node}"
    )


def submit(options: list[str], command: str, env: dict[str, str]) -> int:
    """``sbatch --parsable OPTIONS --wrap=COMMAND``; the job's id (a failed submission raises)."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", *options, f"--wrap={command}"], env=env, capture_output=True, text=True, check=True
    )
    return int(submitted.stdout.strip().split(";")[0])


def crash_and_wait(box: Sandbox, out: Path, job_id: int) -> float:
    """Crash the node a rank names in ``crash-request`` once it does, bring it back once the job is over (a
    crashed node keeps its job COMPLETING until then), wait for the job's end (300 s in all); when the crash
    happened (``time.time()``; 0.0 when no rank asked for one)."""
    slurm = box.slurm()
    crashed, t_fault = "", 0.0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        request = out / "crash-request"
        if not crashed and request.exists() and request.read_text().strip():
            crashed = request.read_text().split()[0]
            t_fault = time.time()
            box.crash_node(crashed)
        info = slurm.job(job_id)
        if info is None or info.finished or (crashed and "COMPLETING" in info.state):
            break
        time.sleep(0.02)
    if crashed:
        box.restore_node(crashed)
    while (info := slurm.job(job_id)) is not None and not info.finished and time.monotonic() < deadline:
        time.sleep(0.3)
    return t_fault


def read_events(out: Path) -> list[dict[str, Any]]:
    """Every node agent's events (``events-*.jsonl`` under ``out``)."""
    events: list[dict[str, Any]] = []
    for path in out.glob("events-*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return events


def starts_after(out: Path, crash_step: int) -> list[float]:
    """When any rank started a step after ``crash_step`` (the step logs): the resume's first step is the earliest."""
    starts = []
    for path in out.glob("steps-*.log"):
        starts += [float(t) for s, t in (line.split() for line in path.read_text().splitlines()) if int(s) > crash_step]
    return starts


def job_tail(out: Path) -> str:
    """The end of the job's output, for the message when a run did not recover."""
    return (out / "job.out").read_text()[-3000:] if (out / "job.out").exists() else "(no job output)"
