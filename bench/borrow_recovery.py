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
NODES = 5


def _events(out: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in out.glob("events-*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return events


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
    env = dict(box.slurm_env(), OMP_NUM_THREADS="1", CLOCKWORK_CONFIG=str(box.paths.clockwork_toml))
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    workload = f"{WORKLOAD} torchpass --out {out} --steps {args.steps} --warmup 0 --hidden {args.hidden}"
    command = (
        f"{sys.executable} -m torchpass run --events {out}/events-{{agent}}.jsonl {workload} "
        f"--node-crash-step {args.crash_step}"
    )
    low = _low_job(box, env, out / "low.out") if kind == "borrow" else 0
    if kind == "borrow":
        options = ["-N4", "-w", "node[1-4]", "-p", "high", "--clockwork-spares=borrow"]
    else:
        options = [f"-N{NODES}", "--clockwork-spares=standby"]
    options += ["--no-kill", "--clockwork-ft", f"--output={out}/job.out"]
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
    if low:
        slurm.cancel(low)
    return figures_of(out, t_fault, args.crash_step, kind)


def figures_of(out: Path, t_fault: float, crash_step: int, kind: str) -> dict[str, float]:
    events = _events(out)
    recovered = [e["fields"] for e in events if e["kind"] == "torchpass.recovered"]
    borrowed = [e["fields"] for e in events if e["kind"] == "torchpass.borrowed"]
    starts = []
    for path in out.glob("steps-*.log"):
        starts += [float(t) for s, t in (line.split() for line in path.read_text().splitlines()) if int(s) > crash_step]
    if not t_fault or not recovered or not starts or (kind == "borrow" and not borrowed):
        tail = (out / "job.out").read_text()[-3000:] if (out / "job.out").exists() else "(no job output)"
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each kind (default 5; medians are reported)")
    parser.add_argument("--steps", type=int, default=80, help="steps per job (default 80)")
    parser.add_argument("--crash-step", type=int, default=40, help="the step at which the node crashes (default 40)")
    parser.add_argument("--hidden", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--quick", action="store_true", help="one run of each kind, shorter jobs (about a minute)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.steps, args.crash_step = 1, 40, 20
    if os.geteuid() != 0:
        print("bench/borrow_recovery.py needs root (it builds the sandbox cluster)", file=sys.stderr)
        return 2
    rows: dict[str, list[dict[str, float]]] = {"standby": [], "borrow": []}
    with tempfile.TemporaryDirectory(prefix="cw-bench-") as tmp:
        box = Sandbox(replace(SandboxConfig(), nodes=NODES, accounting=True, state_dir=str(Path(tmp) / "state")))
        box.up()
        try:
            for k in range(args.runs):
                for kind in ("standby", "borrow"):  # interleaved: both see the same machine load
                    rows[kind].append(one_run(box, Path(tmp) / f"{kind}{k}", args, kind))
                    print(f"{kind} run {k}: " + " ".join(f"{a} {v:.3f}" for a, v in rows[kind][-1].items()), flush=True)
        finally:
            box.down()
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
