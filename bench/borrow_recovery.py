#!/usr/bin/env python3
"""Benchmark: a node crash in a --clockwork-spares=borrow job, against the same crash with a standby node (root).

Both kinds of run use the sandbox's real Slurm (5 nodes, accounting) and the TorchPass workload of
``bench/torchpass_recovery.py`` (4 ranks, gloo over the nodes' addresses); at ``--crash-step`` rank 1 stops in
its forward pass and its whole node is crashed (``Sandbox.crash_node``).

* **baseline** (standby): ``sbatch -N5 --no-kill --clockwork-ft --clockwork-spares=standby``: the 5th node
  waits as a spare, so nothing has to be found.
* **borrow**: a preemptible job (``-p low --requeue``) holds node5 and the training job is ``sbatch -N4 -w
  node[1-4] -p high --no-kill --clockwork-ft --clockwork-spares=borrow``: the spare is a node taken from the
  low job through Slurm preemption when the crash happens.

Per borrow run, from the events: detection (the node's agent silent long enough to be counted lost:
``torchpass.recovered`` detect_ms), Slurm preemption (the daemon's holder submitted -> running on node5:
preempt_ms, inside ``torchpass.borrowed``'s ``slurm`` timings; with the queue query, choice and sbatch around it
as borrow_ms), replacement start (from the borrowed node being ours to the guest's spare registered and the new
generation declared), state transfer and process-group rebuild (transfer_ms, rebuild_ms), and crash -> first
step completed after the resume. Medians over ``--runs`` (>= 5 by default) of each kind are printed side by
side; the ratio is borrow / standby for crash -> first step. Last line: one JSON object.

    sudo .venv/bin/python bench/borrow_recovery.py [--runs 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from support import sandbox_recovery as recovery

from clockwork.sandbox.cluster import Sandbox

NODES = 5


def _low_job(box: Sandbox, env: dict[str, str], out: Path) -> int:
    """Preemptible work on node5 (what the borrow run takes its spare from)."""
    proc = subprocess.run(
        ["sbatch", "--parsable", "-p", "low", "--requeue", "--open-mode=append", "-N1", "-w", "node5",
         f"--output={out}", "--wrap", "echo start; exec sleep 3600"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    job_id = int(proc.stdout.strip().split(";")[0])
    deadline = time.monotonic() + 60
    while not (out.exists() and "start" in out.read_text()):
        if time.monotonic() > deadline:
            raise SystemExit(f"low job {job_id} did not start: {box.slurm().job(job_id)}")
        time.sleep(0.1)
    return job_id


def one_run(box: Sandbox, out: Path, args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Submit the job (kind 'standby' or 'borrow'), crash rank 1's node at the chosen step, wait; the figures."""
    out.mkdir()
    env = recovery.job_env(box)
    command = recovery.crash_command(out, args)
    low = _low_job(box, env, out / "low.out") if kind == "borrow" else 0
    if kind == "borrow":
        options = ["-N4", "-w", "node[1-4]", "-p", "high", "--clockwork-spares=borrow"]
    else:
        options = [f"-N{NODES}", "--clockwork-spares=standby"]
    options += ["--no-kill", "--clockwork-ft", f"--output={out}/job.out"]
    job_id = recovery.submit(options, command, env)
    t_fault = recovery.crash_and_wait(box, out, job_id)
    if low:
        box.slurm().cancel(low)
    return figures_of(out, t_fault, args.crash_step, kind)


def figures_of(out: Path, t_fault: float, crash_step: int, kind: str) -> dict[str, float]:
    events = recovery.read_events(out)
    recovered = [e["fields"] for e in events if e["kind"] == "torchpass.recovered"]
    borrowed = [e["fields"] for e in events if e["kind"] == "torchpass.borrowed"]
    starts = recovery.starts_after(out, crash_step)
    if not t_fault or not recovered or not starts or (kind == "borrow" and not borrowed):
        tail = recovery.job_tail(out)
        raise SystemExit(
            f"{kind} run in {out} did not recover (fault at {t_fault}, {len(recovered)} recoveries):\n{tail}"
        )
    rec = recovered[0]
    row = {
        "detect_ms": float(rec["detect_ms"]),
        "transfer_ms": float(rec["transfer_ms"]),
        "rebuild_ms": float(rec["rebuild_ms"]),
        "total_ms": float(rec["total_ms"]),
        "fault_to_step_s": min(starts) - t_fault,
    }
    if borrowed:
        b = borrowed[0]
        slurm = b.get("slurm") or {}
        row["preempt_ms"] = float(slurm.get("preempt_ms", 0.0))
        row["borrow_ms"] = float(b["request_ms"]) + float(b["acquire_ms"])  # daemon: query, choice, sbatch, preempt
        # From the node being ours to the new generation declared: srun into the holder, the guest, its spare.
        row["replacement_ms"] = max(0.0, float(rec["decide_ms"]) - row["borrow_ms"]) + float(rec["spare_ready_ms"])
    else:
        row["replacement_ms"] = float(rec["decide_ms"]) + float(rec["spare_ready_ms"])
    return row


def main() -> int:
    args = recovery.parse_args(
        __doc__,
        runs_help="runs of each kind (default 5; medians are reported)",
        quick_help="one run of each kind, shorter jobs (about a minute)",
    )
    if recovery.lacks_root("bench/borrow_recovery.py"):
        return 2
    rows: dict[str, list[dict[str, float]]] = {"standby": [], "borrow": []}
    with recovery.running_sandbox(nodes=NODES, accounting=True) as (work, box):
        for k in range(args.runs):
            for kind in ("standby", "borrow"):  # interleaved: both see the same machine load
                rows[kind].append(one_run(box, work / f"{kind}{k}", args, kind))
                print(f"{kind} run {k}: " + " ".join(f"{a} {v:.3f}" for a, v in rows[kind][-1].items()), flush=True)
    med = {kind: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for kind, rs in rows.items()}
    s, b = med["standby"], med["borrow"]
    print(f"\nnode crash at step {args.crash_step}, 4 ranks on the sandbox, median of {args.runs} run(s) each")
    print(f"  {'':34}{'standby':>10}{'borrow':>10}")
    print(f"  {'detection (ms)':34}{s['detect_ms']:10.0f}{b['detect_ms']:10.0f}")
    print(f"  {'Slurm preemption (ms)':34}{'-':>10}{b['preempt_ms']:10.0f}")
    print(f"  {'borrow, daemon + Slurm (ms)':34}{'-':>10}{b['borrow_ms']:10.0f}")
    print(f"  {'replacement start (ms)':34}{s['replacement_ms']:10.0f}{b['replacement_ms']:10.0f}")
    print(f"  {'state transfer (ms)':34}{s['transfer_ms']:10.0f}{b['transfer_ms']:10.0f}")
    print(f"  {'process-group rebuild (ms)':34}{s['rebuild_ms']:10.0f}{b['rebuild_ms']:10.0f}")
    print(f"  {'coordinator total (ms)':34}{s['total_ms']:10.0f}{b['total_ms']:10.0f}")
    print(f"  {'crash -> first step after (s)':34}{s['fault_to_step_s']:10.2f}{b['fault_to_step_s']:10.2f}")
    ratio = b["fault_to_step_s"] / s["fault_to_step_s"]
    print(f"  ratio borrow / standby (crash -> first step): {ratio:.2f}")
    result: dict[str, Any] = {"runs": args.runs}
    for kind, values in med.items():
        result.update({f"{kind}_median_{k}": round(v, 3) for k, v in values.items()})
    result["ratio_borrow_to_standby"] = round(ratio, 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
