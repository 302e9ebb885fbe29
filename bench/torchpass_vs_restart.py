#!/usr/bin/env python3
"""The same job with rank crashes, three ways: TorchPass, checkpoint-restart, and TorchFT, side by side.

The job (``bench/support/torchpass_workload.py``: an MLP, AdamW, ``--nproc`` local ranks on 127.0.0.1 over gloo)
trains ``--steps`` steps (default 600); one rank is SIGKILLed every ``--crash-every`` steps (default 150),
halfway between two checkpoints by default (``--crash-offset``, the average case for checkpoint-restart):
crashes at steps 175, 325 and 475. Each system handles the same crashes its own way:

* **TorchPass**: ``torchpass run --local`` with one spare per crash, all started with the job (on a cluster
  spares wait on nodes of their own; here a spare started mid-run would take CPU from the ranks while it
  imports torch). A spare takes the dead rank's slot and receives the state from a replica;
* **checkpoint-restart**: plain DDP, rank 0 saves a checkpoint every ``--ckpt-every`` steps (default 50); when
  any rank dies, every rank is stopped and the whole job is started again (as torchrun/Slurm requeue would,
  with a 50 ms monitor interval), loads the last checkpoint and recomputes the steps since;
* **TorchFT** (0.2, when installed: ``pip install -e '.[bench]'``): one replica group per rank,
  ``min_replica_size`` 1 (the survivors go on without the dead replica), the dead replica respawned at once
  by this script; it heals from a live peer when it is back.

A fault-free plain-DDP run gives the baseline for "time lost to faults". Reported per system: wall time, time
lost, the global steps computed twice (a step that some rank executed more than once: the step in flight at
a crash, and for checkpoint-restart every step since the last checkpoint), restarts of the whole job, and the
time from a crash until the job begins the step after the crashed one. TorchFT also shows steps trained at
reduced width (fewer replicas averaged: different numerics from the fault-free run) and the time until the
respawned replica trains again.

``--quick`` runs a smaller job (90 steps, crashes at steps 46 and 86, checkpoints every 12) in about a
minute. The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from support.torchpass_jobs import (
    Lighthouse,
    ddp_rank,
    free_port,
    say,
    step_logs,
    torchft_replica,
    torchft_status,
    torchpass_job,
    wait_all,
    whole_job_ran,
)

MONITOR_S = 0.05


def crash_steps(args: argparse.Namespace) -> list[int]:
    return [s for s in range(args.crash_every + args.crash_offset, args.steps, args.crash_every)]


def crash_times(out: Path) -> dict[int, float]:
    """step -> when the rank crashed (the marker file the workload writes just before its SIGKILL)."""
    return {int(p.name.split("-", 1)[1]): float(p.read_text().split()[0]) for p in out.glob("crashed-*")}


def stamped_steps(out: Path) -> dict[int, list[tuple[int, float]]]:
    stamps: dict[int, list[tuple[int, float]]] = {}
    for path in sorted(out.glob("steps-*.log")):
        rank = int(path.stem.split("-", 1)[1])
        stamps[rank] = [(int(a), float(b)) for a, b in (line.split() for line in path.read_text().splitlines())]
    return stamps


def summarize(out: Path, wall: float) -> dict[str, Any]:
    """Steps computed twice and the time back to the step after each crash, from the ranks' step logs.

    ``training_s`` runs from the first step begun to the last one on any rank: unlike the process wall time it
    leaves out each system's one-time start-up (TorchPass's launcher and spare, TorchFT's lighthouse), so
    "time lost to faults" compares training, restarts and recomputation only."""
    logs = step_logs(out)
    twice: set[int] = set()
    for steps in logs.values():
        seen: set[int] = set()
        for step in steps:
            if step in seen:
                twice.add(step)
            seen.add(step)
    stamps = stamped_steps(out)
    back: list[float] = []
    for step, at in sorted(crash_times(out).items()):
        later = [t for entries in stamps.values() for s, t in entries if s == step + 1 and t > at]
        if later:
            back.append(min(later) - at)
    times = [t for entries in stamps.values() for _, t in entries]
    return {
        "wall_s": round(wall, 2),
        "training_s": round(max(times) - min(times), 2) if times else None,
        "crashes": len(crash_times(out)),
        "steps_computed_twice": len(twice),
        "back_to_next_step_s": [round(b, 2) for b in back],
        "back_to_next_step_mean_s": round(statistics.mean(back), 2) if back else None,
    }


def run_fault_free(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    port = free_port()
    started = time.monotonic()
    codes = wait_all([ddp_rank(args, out, rank, port) for rank in range(args.nproc)], args.timeout)
    wall = time.monotonic() - started
    if any(codes):
        raise RuntimeError(f"fault-free ddp exited with {codes}; see {out}")
    return summarize(out, wall)


def run_torchpass(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    # One spare per crash, all started with the job, and training starts once they are ready: on a cluster
    # spares wait on nodes of their own, here they share two cores with the ranks, and a spare importing torch
    # mid-run (the launcher's refill) would slow the training it is compared on.
    spares = len(crash_steps(args))
    extra = ["--crash-steps", ",".join(map(str, crash_steps(args))), "--wait-spares", str(spares)]
    started = time.monotonic()
    code = wait_all([torchpass_job(args, out, spares=spares, extra=extra, respawn=False)], args.timeout)[0]
    wall = time.monotonic() - started
    if code:
        raise RuntimeError(f"torchpass run exited with {code}; see {out}/torchpass.err")
    row = summarize(out, wall)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    recovered = [e["fields"]["total_ms"] for e in events if e["kind"] == "torchpass.recovered"]
    row["restarts"] = 0
    row["recovery_ms"] = recovered
    return row


def run_restart(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    extra = [
        "--crash-steps",
        ",".join(map(str, crash_steps(args))),
        "--ckpt",
        str(out / "ckpt.pt"),
        "--ckpt-every",
        str(args.ckpt_every),
    ]
    started = time.monotonic()
    restarts = 0
    deadline = started + args.timeout
    while True:
        port = free_port()
        procs = [ddp_rank(args, out, rank, port, extra) for rank in range(args.nproc)]
        if whole_job_ran(procs, deadline, MONITOR_S):  # else one rank died (or the deadline passed)
            break
        if time.monotonic() >= deadline:
            raise RuntimeError(f"checkpoint-restart did not finish within {args.timeout:g} s; see {out}")
        restarts += 1
    row = summarize(out, time.monotonic() - started)
    row["restarts"] = restarts
    return row


def run_torchft(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    extra = ["--crash-steps", ",".join(map(str, crash_steps(args))), "--min-replicas", "1"]
    started = time.monotonic()
    respawns: list[tuple[int, float]] = []
    deadline = started + args.timeout
    with Lighthouse(out, min_replicas=1, join_timeout_ms=1000) as lighthouse:
        procs = {r: torchft_replica(args, out, r, lighthouse.address, extra) for r in range(args.nproc)}
        while time.monotonic() < deadline:
            if all(p.poll() == 0 for p in procs.values()):
                break
            for replica, proc in list(procs.items()):
                code = proc.poll()
                if code not in (None, 0):  # TorchFT needs the dead replica back: respawn it at once
                    respawns.append((replica, time.time()))
                    procs[replica] = torchft_replica(args, out, replica, lighthouse.address, extra)
            time.sleep(MONITOR_S)
        else:
            for proc in procs.values():
                proc.kill()
            raise RuntimeError(f"torchft did not finish within {args.timeout:g} s; see {out}")
    row = summarize(out, time.monotonic() - started)
    row["restarts"] = 0
    row["replica_respawns"] = len(respawns)
    results = [json.loads(p.read_text()) for p in out.glob("result-*.json")]
    row["reduced_width_steps"] = max((r.get("reduced_width_steps", 0) for r in results), default=0)
    stamps = stamped_steps(out)
    full: list[float] = []
    for replica, at in respawns:
        later = [t for _, t in stamps.get(replica, []) if t > at]
        if later:
            full.append(min(later) - at)
    row["respawned_training_again_s"] = [round(v, 2) for v in full]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=600, help="steps of the job (default 600)")
    parser.add_argument("--crash-every", type=int, default=150, help="a rank crashes every this many steps")
    parser.add_argument("--crash-offset", type=int, default=25, help="crash this many steps after a multiple")
    parser.add_argument("--ckpt-every", type=int, default=50, help="checkpoint-restart: steps between checkpoints")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    parser.add_argument("--layers", type=int, default=3, help="hidden layers (default 3)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one system may take")
    parser.add_argument("--skip-torchft", action="store_true", help="leave TorchFT out")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders")
    parser.add_argument("--quick", action="store_true", help="90 steps, crashes at 46 and 86, checkpoints every 12")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.crash_every, args.crash_offset, args.ckpt_every = 90, 40, 6, 12
    args.warmup = 0
    crashes = crash_steps(args)
    torchft_note = "left out (--skip-torchft)" if args.skip_torchft else torchft_status()
    systems = ["fault-free", "torchpass", "restart"] + ([] if torchft_note else ["torchft"])
    runners = {
        "fault-free": run_fault_free,
        "torchpass": run_torchpass,
        "restart": run_restart,
        "torchft": run_torchft,
    }
    work = Path(tempfile.mkdtemp(prefix="tp-vs-restart-"))
    say(
        f"torchpass_vs_restart: {args.nproc} ranks on 127.0.0.1 (gloo), MLP {args.layers}x{args.hidden}, "
        f"{args.steps} steps, a rank SIGKILLed at steps {crashes}; checkpoint-restart saves every "
        f"{args.ckpt_every} steps"
    )
    if torchft_note:
        say(f"torchft: {torchft_note}")
    rows: dict[str, dict[str, Any]] = {}
    try:
        for system in systems:
            out = work / system
            out.mkdir()
            say(f"  running {system} ...")
            rows[system] = runners[system](args, out)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"  runs kept in {work}")
    base = rows["fault-free"]["training_s"]
    for row in rows.values():
        row["lost_s"] = round(row["training_s"] - base, 2)

    def cell(system: str, key: str) -> str:
        value = rows.get(system, {}).get(key)
        if value is None:
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    columns = ["fault-free", "torchpass", "restart", "torchft"]
    heads = {"fault-free": "no fault", "torchpass": "TorchPass", "restart": "ckpt-restart", "torchft": "TorchFT"}
    say("")
    say(f"{'':<36}" + "".join(f"{heads[c]:>14}" for c in columns))
    for label, key in (
        ("wall time, processes (s)", "wall_s"),
        ("training, first to last step (s)", "training_s"),
        ("time lost to faults (s)", "lost_s"),
        ("crashes", "crashes"),
        ("global steps computed twice", "steps_computed_twice"),
        ("whole-job restarts", "restarts"),
        ("crash -> next step begun, mean (s)", "back_to_next_step_mean_s"),
        ("steps at reduced width", "reduced_width_steps"),
        ("replica respawns", "replica_respawns"),
    ):
        say(f"{label:<36}" + "".join(f"{cell(c, key):>14}" for c in columns))
    if "torchft" in rows:
        ft = rows["torchft"]
        say(f"TorchFT respawned replica training again after (s): {ft['respawned_training_again_s']}")
        if ft["replica_respawns"] > ft["crashes"]:
            say(
                f"TorchFT: {ft['replica_respawns'] - ft['crashes']} surviving replica(s) crashed too (a kill during "
                "the all-reduce); with every replica gone the job restarts from step 0 (no checkpoint here)"
            )
    else:
        say(f"TorchFT: {torchft_note}")
    if rows["torchpass"].get("recovery_ms"):
        say(f"TorchPass recoveries (fault to all ranks training, ms): {rows['torchpass']['recovery_ms']}")
    print(
        json.dumps(
            {
                "bench": "torchpass_vs_restart",
                "nproc": args.nproc,
                "steps": args.steps,
                "crash_steps": crashes,
                "ckpt_every": args.ckpt_every,
                "model": {"hidden": args.hidden, "layers": args.layers, "batch": args.batch},
                "systems": rows,
                "torchft": torchft_note or "ok",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
