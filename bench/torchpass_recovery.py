#!/usr/bin/env python3
"""Benchmark: what a node crash costs a TorchPass job on the sandbox's real Slurm, found by the fabric or by the
agents' heartbeats, side by side (root only).

Each run submits ``sbatch -N5 --no-kill --clockwork-ft --clockwork-spares=standby`` whose batch script runs
``torchpass run bench/support/torchpass_workload.py torchpass ...``: 4 ranks on 4 nodes, 1 standby node, gloo
over the nodes' addresses. At step ``--crash-step`` rank 1 stops in its forward pass and the benchmark crashes
its whole node (``Sandbox.crash_node``: every process killed, its links dark; nothing is told to anybody).

Two kinds of run alternate, ``--runs`` of each, on the same sandbox:

* ``fabric``: TorchPass as shipped: the node daemons' node watch judges the silent node dead (silent on every
  LinkPass rail for 100 ms, its kernel silent to ICMP echo, a second daemon agreeing) and the agents act on it;
* ``heartbeat``: the same with ``--set fabric_verdicts=false``: only the agents' own heartbeats count
  (``agent_timeout_s``, 2 s), as before the node watch.

With ``--ranks-per-node G`` (G > 1) a third kind joins them, ``fabric-G-per-node``: the fabric run with G ranks
on every node (``torchpass run --nproc-per-node G``: 4G ranks, a standby node of G spare slots), whose crash
takes all G ranks of agent 1's node (rank G asks for it, the node of rank 1 in the others): the G slots must be
rebuilt on the standby node at once, each from its own replica.

Per run it reports the time from the crash to the first step completed after the resume (the first start of
the step after the crashed one, in any rank's step log), the time from the crash to the node's agent counted
lost (the ``torchpass.agent_lost`` event, from the agents' event files), and the coordinator's split of the
recovery (``torchpass.recovered``): detection (from the node's last sign of life to counted lost), spare ready,
state transfer and process group rebuild; then the medians of each kind. The ratio is fabric / heartbeat on
the median fault-to-step time; the goals are the issue's: fault to step under 0.5 s, detection under 200 ms.
Prints a table for people and, as its last line, one JSON object of the figures.

    sudo .venv/bin/python bench/torchpass_recovery.py [--runs 5] [--quick] [--ranks-per-node 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from support import sandbox_recovery as recovery

from clockwork.sandbox.cluster import Sandbox

GOAL_STEP_S = 0.5
GOAL_DETECT_MS = 200.0
NODES = 5
SPLIT = ("detect_ms", "spare_ready_ms", "transfer_ms", "rebuild_ms", "total_ms")
KINDS: dict[str, tuple[tuple[str, ...], int]] = {"fabric": ((), 1), "heartbeat": (("fabric_verdicts=false",), 1)}


def kinds(ranks_per_node: int) -> dict[str, tuple[tuple[str, ...], int]]:
    """The kinds of run: name -> (TorchPass settings, ranks per node)."""
    if ranks_per_node <= 1:
        return dict(KINDS)
    return {**KINDS, f"fabric-{ranks_per_node}-per-node": ((), ranks_per_node)}


def one_run(box: Sandbox, out: Path, args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Submit the job, crash the node of agent 1 at the chosen step, wait for the end; the run's figures."""
    out.mkdir()
    env = recovery.job_env(box)
    settings, per_node = kinds(args.ranks_per_node)[kind]
    command = recovery.crash_command(out, args, settings, per_node)
    options = [f"-N{NODES}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    job_id = recovery.submit(options, command, env)
    t_fault = recovery.crash_and_wait(box, out, job_id)
    return figures_of(out, t_fault, args.crash_step, per_node)


def figures_of(out: Path, t_fault: float, crash_step: int, per_node: int = 1) -> dict[str, Any]:
    events = recovery.read_events(out)
    recovered = [e["fields"] for e in events if e["kind"] == "torchpass.recovered"]
    lost = [e for e in events if e["kind"] == "torchpass.agent_lost"]
    starts = recovery.starts_after(out, crash_step)
    if not t_fault or not recovered or not starts or not lost:
        tail = recovery.job_tail(out)
        raise SystemExit(f"run in {out} did not recover (fault at {t_fault}, {len(recovered)} recoveries):\n{tail}")
    fields = recovered[0]
    if len(fields["slots"]) != per_node:  # a node's ranks are rebuilt together, in one recovery
        raise SystemExit(f"run in {out}: the first recovery rebuilt slots {fields['slots']}, not {per_node}")
    row: dict[str, Any] = {key: float(fields[key]) for key in SPLIT}
    first = min(lost, key=lambda e: e["time"])
    row["fault_to_lost_ms"] = 1000 * (first["time"] - t_fault)
    row["fault_to_step_s"] = min(starts) - t_fault
    row["by_verdict"] = bool(first["fields"].get("verdict"))
    return row


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k in rows[0] if k != "by_verdict"]
    return {key: statistics.median(float(row[key]) for row in rows) for key in keys}


def main() -> int:
    args = recovery.parse_args(
        __doc__,
        runs_help="runs of each kind (default 5; the medians are reported)",
        quick_help="shorter jobs, one run of each kind unless --runs N",
        ranks_per_node=True,
    )
    if recovery.lacks_root("bench/torchpass_recovery.py"):
        return 2
    plan = kinds(args.ranks_per_node)
    rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in plan}
    with recovery.running_sandbox(nodes=NODES, accounting=False) as (work, box):
        for k in range(args.runs):
            for kind in plan:
                row = one_run(box, work / f"{kind}{k}", args, kind)
                rows[kind].append(row)
                print(f"{kind} run {k}: " + " ".join(f"{key} {value:.3f}" for key, value in row.items()), flush=True)
    med = {kind: medians(kind_rows) for kind, kind_rows in rows.items()}
    print(f"\nnode crash at step {args.crash_step} of a TorchPass job on 4 sandbox nodes, median of {args.runs}")
    print(f"  {'':40s} " + " ".join(f"{kind:>18s}" for kind in plan))
    lines = [
        ("fault -> agent counted lost (ms)", "fault_to_lost_ms", 1.0),
        ("detection, last sign of life -> lost (ms)", "detect_ms", 1.0),
        ("spare ready after detection (ms)", "spare_ready_ms", 1.0),
        ("state transfer (ms)", "transfer_ms", 1.0),
        ("group rebuild (ms)", "rebuild_ms", 1.0),
        ("coordinator total (ms)", "total_ms", 1.0),
        ("fault -> first step after resume (ms)", "fault_to_step_s", 1000.0),
    ]
    for label, key, scale in lines:
        print(f"  {label:40s} " + " ".join(f"{scale * med[kind][key]:18.0f}" for kind in plan))
    spread = {kind: [1000 * row["fault_to_step_s"] for row in rows[kind]] for kind in plan}
    print(
        f"  {'  its range over the runs (ms)':40s} "
        + " ".join(f"{f'{min(v):.0f}-{max(v):.0f}':>18s}" for v in spread.values())
    )
    verdicts = sum(row["by_verdict"] for row in rows["fabric"])
    print(f"  fabric runs whose node was lost by the daemons' verdict: {verdicts} of {len(rows['fabric'])}")
    ratio = med["fabric"]["fault_to_step_s"] / med["heartbeat"]["fault_to_step_s"]
    print(f"  ratio fabric / heartbeat (fault -> step): {ratio:.3f}")
    step_ok = all(med[kind]["fault_to_step_s"] < GOAL_STEP_S for kind in plan if kind != "heartbeat")
    detect_ok = med["fabric"]["fault_to_lost_ms"] < GOAL_DETECT_MS
    print(
        f"  goals: fault -> step < {GOAL_STEP_S:g} s (every fabric kind): {'met' if step_ok else 'NOT met'}; "
        f"detection < {GOAL_DETECT_MS:.0f} ms: {'met' if detect_ok else 'NOT met'}"
    )
    result: dict[str, Any] = {"runs_per_kind": args.runs, "ranks_per_node": {kind: plan[kind][1] for kind in plan}}
    for kind in plan:
        result[kind] = {f"median_{k}": round(v, 3) for k, v in med[kind].items()}
        result[kind]["all_fault_to_step_s"] = [round(row["fault_to_step_s"], 3) for row in rows[kind]]
        result[kind]["all_fault_to_lost_ms"] = [round(row["fault_to_lost_ms"], 1) for row in rows[kind]]
    result["fabric"]["lost_by_verdict"] = verdicts
    result["ratio_fabric_to_heartbeat"] = round(ratio, 3)
    result["goal_step_s"], result["goal_detect_ms"] = GOAL_STEP_S, GOAL_DETECT_MS
    result["goals_met"] = step_ok and detect_ok
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
