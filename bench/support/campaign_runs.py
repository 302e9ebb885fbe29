"""The fault campaign's systems, each running the same workload to N steps under the same trace
(``bench/fault_campaign.py``).

* TorchPass, and the fault-free run, on the sandbox's real Slurm: ``sbatch -N R+S --no-kill --clockwork-ft
  --clockwork-spares=standby`` of ``torchpass run --nproc R --spares S`` (one rank per node, S standby nodes);
* checkpoint-restart and TorchFT 0.2 as local processes on 127.0.0.1 (``support.torchpass_jobs``, the same ranks
  as ``bench/torchpass_vs_restart.py``), with only the trace's process kills and stops: see the module
  docstring of ``bench/fault_campaign.py`` for why.

Every run leaves its step logs, ``pid-<slot>`` files and ``result-<slot>.json`` (with the final state's hash) in
its folder; :func:`read_run` turns them into the figures. No torch here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clockwork.sandbox.cluster import Sandbox
from support import sandbox_recovery as recovery
from support.campaign_inject import Applied, LocalFaults, Replay, SandboxFaults
from support.fault_trace import Fault, StepLog
from support.torchpass_jobs import Lighthouse, ddp_rank, free_port, torchft_replica, whole_job_ran

WORKLOAD = recovery.WORKLOAD
MONITOR_S = 0.05


@dataclass
class Run:
    """One system's run: its folder, the faults as applied, whole-job restarts and replica respawns, and how it
    ended (``error``: why it did not reach N steps)."""

    out: Path
    applied: list[Applied] = field(default_factory=list)
    restarts: int = 0
    respawns: int = 0
    error: str = ""
    job_id: int = 0


def read_logs(out: Path) -> dict[int, StepLog]:
    """slot -> (step, time begun) as executed, from ``steps-<slot>.log``."""
    logs: dict[int, StepLog] = {}
    for path in sorted(out.glob("steps-*.log")):
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        logs[int(path.stem.split("-", 1)[1])] = [(int(s), float(t)) for s, t in rows]
    return logs


def read_results(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem.split("-", 1)[1]): json.loads(p.read_text()) for p in out.glob("result-*.json")}


def time_to_n(out: Path) -> float | None:
    """From the first step begun to the last rank's clean finish (None when a rank did not finish)."""
    logs, results = read_logs(out), read_results(out)
    if not logs or set(results) != set(logs):
        return None
    start = min(log[0][1] for log in logs.values() if log)
    return max(float(r["finished_at"]) for r in results.values()) - start


def run_torchpass_slurm(box: Sandbox, out: Path, args: argparse.Namespace, trace: list[Fault]) -> Run:
    """The job under Slurm with ``args.spares`` standby nodes, ``trace`` replayed against it (empty: fault-free).
    A crashed node is restored once the job is over (Slurm keeps the job COMPLETING until its node is back)."""
    out.mkdir()
    env = recovery.job_env(box)
    workload = (
        f"{WORKLOAD} torchpass --out {out} --steps {args.steps} --warmup 0 --hidden {args.hidden} "
        f"--layers {args.layers} --batch {args.batch} --wait-spares {args.spares}"
    )
    command = (
        f"{sys.executable} -m torchpass run --nproc {args.ranks} --spares {args.spares} "
        f"--events {out}/events-{{agent}}.jsonl {workload}"
    )
    nodes = args.ranks + args.spares
    options = [f"-N{nodes}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    run = Run(out)
    run.job_id = recovery.submit(options, command, env)
    slurm = box.slurm()
    injector = SandboxFaults(box, out, args.ranks, protected="node1")
    deadline = time.monotonic() + args.timeout
    with Replay(trace, out, injector) as replay:
        while time.monotonic() < deadline:
            info = slurm.job(run.job_id)
            if info is None or info.finished or (injector.crashed and "COMPLETING" in info.state):
                break
            time.sleep(0.1)
        else:
            run.error = f"job {run.job_id} did not end within {args.timeout:g} s"
            slurm.cancel(run.job_id)
    run.applied = replay.applied
    time.sleep(max(f.hold_s for f in trace) if trace else 0.0)  # let lasting faults lift before the next run
    box.clear_faults()  # restores crashed nodes too; the job, done training, may stay COMPLETING a while: no wait
    return run


def _local_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(
        nproc=args.ranks, steps=args.steps, warmup=0, hidden=args.hidden, layers=args.layers, batch=args.batch
    )


def _pid(procs: dict[int, subprocess.Popen[bytes]], slot: int) -> int | None:
    proc = procs.get(slot)
    return proc.pid if proc is not None and proc.poll() is None else None


def run_ddp_local(out: Path, args: argparse.Namespace, trace: list[Fault], ckpt_every: int) -> Run:
    """Plain DDP with a checkpoint every ``ckpt_every`` steps (rank 0, torch.save, atomic rename); when a rank
    dies every rank is stopped and the whole job started again from the checkpoint (as Slurm's requeue would,
    without its scheduling delay), the trace going on in wall time."""
    out.mkdir()
    local = _local_args(args)
    extra = ["--ckpt", str(out / "ckpt.pt"), "--ckpt-every", str(ckpt_every)]
    run = Run(out)
    deadline = time.monotonic() + args.timeout
    current: dict[int, subprocess.Popen[bytes]] = {}
    with Replay(trace, out, LocalFaults(lambda slot: _pid(current, slot))) as replay:
        while time.monotonic() < deadline:
            port = free_port()
            procs = [ddp_rank(local, out, rank, port, extra) for rank in range(args.ranks)]
            current.update(enumerate(procs))
            if whole_job_ran(procs, deadline, MONITOR_S):
                break
            run.restarts += 1
        else:
            run.error = f"checkpoint-restart did not finish within {args.timeout:g} s"
    run.applied = replay.applied
    return run


def run_torchft_local(out: Path, args: argparse.Namespace, trace: list[Fault]) -> Run:
    """TorchFT 0.2: one replica group per rank (per node), ``min_replica_size`` 1, a dead replica respawned at once
    by this script (as Slurm would restart a replaced node's task); it heals from a live peer."""
    out.mkdir()
    local = _local_args(args)
    extra = ["--min-replicas", "1"]
    run = Run(out)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    deadline = time.monotonic() + args.timeout
    with (
        Lighthouse(out, min_replicas=1, join_timeout_ms=1000) as lighthouse,
        Replay(trace, out, LocalFaults(lambda slot: _pid(procs, slot))) as replay,
    ):
        procs.update({r: torchft_replica(local, out, r, lighthouse.address, extra) for r in range(args.ranks)})
        while time.monotonic() < deadline:
            if all(p.poll() == 0 for p in procs.values()):
                break
            for replica, proc in list(procs.items()):
                if proc.poll() not in (None, 0):
                    run.respawns += 1
                    procs[replica] = torchft_replica(local, out, replica, lighthouse.address, extra)
            time.sleep(MONITOR_S)
        else:
            run.error = f"torchft did not finish within {args.timeout:g} s"
            for proc in procs.values():
                proc.kill()
    run.applied = replay.applied
    return run
