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
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from clockworkd.config.schema import SandboxConfig
from clockworkd.sandbox.cluster import Sandbox

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "bench" / "support" / "torchpass_workload.py"
GOAL_S = 10.0
NODES = 5
SPLIT = ("detect_ms", "spare_ready_ms", "transfer_ms", "rebuild_ms", "total_ms")


def one_run(box: Sandbox, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Submit the job, crash rank 1's node at the chosen step, wait for the end; the run's figures."""
    out.mkdir()
    env = dict(box.slurm_env(), OMP_NUM_THREADS="1", CLOCKWORK_CONFIG=str(box.paths.clockwork_toml))
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    workload = f"{WORKLOAD} torchpass --out {out} --steps {args.steps} --warmup 0 --hidden {args.hidden}"
    command = (
        f"{sys.executable} -m torchpass run --events {out}/events-{{agent}}.jsonl {workload} "
        f"--node-crash-step {args.crash_step}"
    )
    options = [f"-N{NODES}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    submitted = subprocess.run(
        ["sbatch", "--parsable", *options, f"--wrap={command}"], env=env, capture_output=True, text=True, check=True
    )
    job_id = int(submitted.stdout.strip().split(";")[0])
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
    return figures_of(out, t_fault, args.crash_step)


def figures_of(out: Path, t_fault: float, crash_step: int) -> dict[str, Any]:
    events = []
    for path in out.glob("events-*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recovered = [e["fields"] for e in events if e["kind"] == "torchpass.recovered"]
    starts = []
    for path in out.glob("steps-*.log"):
        starts += [float(t) for s, t in (line.split() for line in path.read_text().splitlines()) if int(s) > crash_step]
    if not t_fault or not recovered or not starts:
        tail = (out / "job.out").read_text()[-3000:] if (out / "job.out").exists() else "(no job output)"
        raise SystemExit(f"run in {out} did not recover (fault at {t_fault}, {len(recovered)} recoveries):\n{tail}")
    fields = recovered[0]
    row = {key: float(fields[key]) for key in SPLIT}
    row["fault_to_step_s"] = min(starts) - t_fault
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs (default 5; the medians are reported)")
    parser.add_argument("--steps", type=int, default=80, help="steps per job (default 80)")
    parser.add_argument("--crash-step", type=int, default=40, help="the step at which the node crashes (default 40)")
    parser.add_argument("--hidden", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--quick", action="store_true", help="one run of a shorter job (under a minute)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.steps, args.crash_step = 1, 40, 20
    if os.geteuid() != 0:
        print("bench/torchpass_recovery.py needs root (it builds the sandbox cluster)", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="cw-bench-") as tmp:
        box = Sandbox(replace(SandboxConfig(), nodes=NODES, accounting=False, state_dir=str(Path(tmp) / "state")))
        box.up()
        try:
            for k in range(args.runs):
                rows.append(one_run(box, Path(tmp) / f"run{k}", args))
                print(f"run {k}: " + " ".join(f"{key} {value:.3f}" for key, value in rows[-1].items()), flush=True)
        finally:
            box.down()
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
