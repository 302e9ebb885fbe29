#!/usr/bin/env python3
"""Benchmark: what a node crash costs a TorchPass job on the sandbox's real Slurm (root only).

Each run submits ``sbatch -N5 --no-kill --clockwork-ft --clockwork-spares=standby`` whose batch script runs
``torchpass run bench/support/torchpass_workload.py torchpass ...``: 4 ranks on 4 nodes, 1 standby node, gloo
over the nodes' addresses. At step ``--crash-step`` rank 1 stops in its forward pass and the benchmark crashes
its whole node (``Sandbox.crash_node``: every process killed, its links dark; nothing is told to anybody).

Per run it reports the time from the crash to the first step completed after the resume (the first start of
the step after the crashed one, in any rank's step log), and the coordinator's split of the recovery
(``torchpass.recovered``): detection (the node's agent silent long enough to be counted lost), spare ready
(the spare registered in its slot), state transfer (the replica's state received by the spare) and process
group rebuild; then the medians over ``--runs`` runs. The baseline is the issue's goal (10 s on the sandbox):
the ratio is median / goal. Prints a table for people and, as its last line, one JSON object of the figures.

    sudo .venv/bin/python bench/torchpass_recovery.py [--runs 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from support import sandbox_recovery as recovery

from clockworkd.sandbox.cluster import Sandbox

GOAL_S = 10.0
NODES = 5
SPLIT = ("detect_ms", "spare_ready_ms", "transfer_ms", "rebuild_ms", "total_ms")


def one_run(box: Sandbox, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Submit the job, crash rank 1's node at the chosen step, wait for the end; the run's figures."""
    out.mkdir()
    env = recovery.job_env(box)
    command = recovery.crash_command(out, args)
    options = [f"-N{NODES}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    job_id = recovery.submit(options, command, env)
    t_fault = recovery.crash_and_wait(box, out, job_id)
    return figures_of(out, t_fault, args.crash_step)


def figures_of(out: Path, t_fault: float, crash_step: int) -> dict[str, Any]:
    events = recovery.read_events(out)
    recovered = [e["fields"] for e in events if e["kind"] == "torchpass.recovered"]
    starts = recovery.starts_after(out, crash_step)
    if not t_fault or not recovered or not starts:
        tail = recovery.job_tail(out)
        raise SystemExit(f"run in {out} did not recover (fault at {t_fault}, {len(recovered)} recoveries):\n{tail}")
    fields = recovered[0]
    row = {key: float(fields[key]) for key in SPLIT}
    row["fault_to_step_s"] = min(starts) - t_fault
    return row


def main() -> int:
    args = recovery.parse_args(
        __doc__,
        runs_help="runs (default 5; the medians are reported)",
        quick_help="one run of a shorter job (under a minute)",
    )
    if recovery.lacks_root("bench/torchpass_recovery.py"):
        return 2
    rows = []
    with recovery.running_sandbox(nodes=NODES, accounting=False) as (work, box):
        for k in range(args.runs):
            rows.append(one_run(box, work / f"run{k}", args))
            print(f"run {k}: " + " ".join(f"{key} {value:.3f}" for key, value in rows[-1].items()), flush=True)
    med = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print(f"\nnode crash at step {args.crash_step} of a 4-rank TorchPass job on the sandbox, median of {len(rows)}")
    print(f"  detection        {med['detect_ms']:8.0f} ms   (from its last heartbeat to counted lost)")
    print(f"  spare ready      {med['spare_ready_ms']:8.0f} ms   (after detection)")
    print(f"  state transfer   {med['transfer_ms']:8.0f} ms")
    print(f"  group rebuild    {med['rebuild_ms']:8.0f} ms")
    print(f"  coordinator total{med['total_ms']:8.0f} ms   (fault seen -> every member resumed)")
    print(f"  fault -> first completed step after resume: {med['fault_to_step_s']:.2f} s")
    ratio = med["fault_to_step_s"] / GOAL_S
    print(f"  ratio to the {GOAL_S:.0f} s goal: {ratio:.2f}")
    result = {"runs": len(rows), **{f"median_{k}": round(v, 3) for k, v in med.items()}, "goal_s": GOAL_S}
    result["ratio_to_goal"] = round(ratio, 3)
    result["all_fault_to_step_s"] = [round(row["fault_to_step_s"], 3) for row in rows]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
