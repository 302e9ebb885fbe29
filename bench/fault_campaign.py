#!/usr/bin/env python3
"""Time to train N steps under a seeded fault trace: TorchPass, fault-free, checkpoint-restart and TorchFT (root).

One job (``bench/support/torchpass_workload.py``: an MLP, AdamW, one rank per node) trains to ``--steps`` while
the same seeded trace of faults (``bench/support/fault_trace.py``) is replayed against it, timed from its first
training step. The trace holds ``--faults`` faults at random moments of the fault-free run's length (one per
equal window), every kind once before any repeats: node crash, one rank SIGKILLed, NIC down (the node's rail-0
switch port down 2 s), a flapping link (4 x 0.3 s), 2 % loss on the node's port for 5 s, a GPU health warning
(the emulated GPU at 95 C for 3 s: a planned migration), every process of the node SIGSTOPped for 1 s. Node
crashes are capped at the standby nodes less one.

* **fault-free** and **TorchPass** run on the sandbox's real Slurm (``sbatch --clockwork-ft
  --clockwork-spares=standby --no-kill``, ``--spares`` standby nodes); every fault acts on the real node.
* **checkpoint-restart** (plain DDP, ``torch.save`` every K steps, K by Young/Daly for the trace's failure rate and
  the measured save cost; the whole job restarted from the checkpoint when a rank dies, as Slurm's requeue would,
  without its scheduling delay) and **TorchFT 0.2** (one replica group per rank, ``min_replica_size`` 1, a dead
  replica respawned at once) run as local processes on 127.0.0.1, after the sandbox is down, with their own
  fault-free run: this script does not yet run them under Slurm. They get the same trace, its moments scaled by
  the ratio of the two fault-free runs' lengths (the same points of progress), but only the faults a local process
  can feel: node crash and rank kill are a SIGKILL of the rank, node stop a SIGSTOP; NIC, link, loss and GPU
  faults have nothing to act on and are listed as not applied.

Reported per system: time to N steps (first step begun -> last rank finished), ratio to TorchPass, ETTR
(fault-free / faulted, each against its own environment's fault-free run), steps recomputed, each applied fault's
time to full width (until the most stalled slot began a step again) as p50/p99/max, the YOCO rate
(faults resolved with zero recomputed steps / faults applied), and whether TorchPass's final state (a SHA-256 per
rank of parameters and optimizer state) is bitwise equal to the fault-free run's. The last line is one JSON object.

    sudo .venv/bin/python bench/fault_campaign.py [--quick] [--seed 1] [--faults 14] [--keep]

``--quick``: 4 faults, a shorter job (about 3 minutes in all). ``--soak MINUTES``: TorchPass alone, Poisson faults
(``--soak-gap`` seconds apart on average), stopping at the first fault that loses state, hangs or takes over 5 s to
get back to full width; the logs are kept (``bench/support/campaign_soak.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from support import sandbox_recovery as recovery
from support.campaign_runs import (
    Run,
    read_logs,
    read_results,
    run_ddp_local,
    run_torchft_local,
    run_torchpass_slurm,
    time_to_n,
)
from support.campaign_soak import soak
from support.fault_trace import (
    QUICK_KINDS,
    Fault,
    FaultKind,
    checkpoint_every_steps,
    make_trace,
    outcomes,
    recomputed_total,
    summary,
)
from support.torchpass_jobs import torchft_status

from clockwork.contracts.config.core import SandboxConfig
from clockwork.sandbox.cluster import Sandbox

# A sandbox of its own beside any other (tests' and users' use the plain names and the default ports).
SANDBOX_TAG, SANDBOX_MGMT_NET, SANDBOX_PORT_BASE = "camp", "198.19.77.0/24", SandboxConfig().port_base + 770
SYSTEMS = ("torchpass", "fault-free", "restart", "torchft")
HEADS = {"torchpass": "TorchPass", "fault-free": "no fault", "restart": "ckpt-restart", "torchft": "TorchFT"}


T0 = time.monotonic()


def say(text: str = "") -> None:
    """A line of output; progress lines (indented) carry the seconds since the start."""
    print(f"[{time.monotonic() - T0:5.0f} s] {text}" if text.startswith("  ") else text, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 faults, a shorter job (about 3 minutes)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the trace's seed (default 1; --quick 12: a crash, a kill, a stop, a GPU)",
    )
    parser.add_argument("--faults", type=int, default=None, help="faults in the trace (default 14; --quick 4)")
    parser.add_argument("--steps", type=int, default=None, help="N, steps of the job (default 4000; --quick 800)")
    parser.add_argument("--ranks", type=int, default=3, help="training ranks, one per node (default 3)")
    parser.add_argument("--spares", type=int, default=None, help="standby nodes (default 3; --quick 2)")
    parser.add_argument("--hidden", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--layers", type=int, default=3, help="hidden layers (default 3)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one system may take (default 600)")
    parser.add_argument("--skip-torchft", action="store_true", help="leave TorchFT out")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, events)")
    parser.add_argument(
        "--soak", type=float, default=0.0, metavar="MINUTES",
        help="TorchPass only: Poisson faults for MINUTES, stopping at the first that loses state, hangs or waits",
    )  # fmt: skip
    parser.add_argument("--soak-gap", type=float, default=10.0, help="--soak: mean seconds between faults (10)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.seed = args.seed if args.seed is not None else (12 if quick else 1)
    args.faults = args.faults if args.faults is not None else (4 if quick else 14)
    args.steps = args.steps if args.steps is not None else (800 if quick else 4000)
    args.spares = args.spares if args.spares is not None else (2 if quick else 3)
    if args.spares < 2 or args.ranks < 2:
        parser.error("need --ranks >= 2 and --spares >= 2 (a node crash takes one standby node for good)")
    return args


def trace_for(args: argparse.Namespace, horizon_s: float) -> list[Fault]:
    caps = {FaultKind.NODE_CRASH: args.spares - 1, FaultKind.GPU_WARNING: max(1, args.faults // 7)}
    return make_trace(args.seed, args.faults, horizon_s, args.ranks, QUICK_KINDS, caps)


def scaled(trace: list[Fault], factor: float) -> list[Fault]:
    return [replace(f, at_s=round(f.at_s * factor, 3)) for f in trace]


def figures(run: Run, base_s: float | None) -> dict[str, Any]:
    """One system's row: time to N, ETTR against ``base_s``, recomputed steps, the applied faults' outcomes."""
    took = time_to_n(run.out)
    applied = [a for a in run.applied if not a.note.startswith("not applied")]
    record = [{"kind": a.fault.kind.value, "at_s": a.fault.at_s, "at": a.at, "target": a.target, "note": a.note}
              for a in run.applied]  # fmt: skip
    (run.out / "applied.json").write_text(json.dumps(record, indent=1))  # the figures can be redone from the logs
    results = outcomes(read_logs(run.out), [(a.fault, a.at) for a in applied])
    row: dict[str, Any] = {
        "time_to_n_s": round(took, 2) if took is not None else None,
        "ettr": round(base_s / took, 3) if took and base_s else None,
        "recomputed_steps": recomputed_total(read_logs(run.out)),
        "faults_applied": len(applied),
        "faults_not_applied": [a.fault.kind.value for a in run.applied if a.note.startswith("not applied")],
        "restarts": run.restarts,
        "respawns": run.respawns,
        "error": run.error or None,
        **summary(results),
        "per_fault": [
            {
                "kind": r.fault.kind.value,
                "at_s": r.fault.at_s,
                "full_width_s": round(r.full_width_s, 3) if r.full_width_s is not None else None,
                "recomputed": r.recomputed,
            }
            for r in results
        ],
    }
    notes = [f"{a.fault.kind.value}: {a.note}" for a in applied if a.note]
    if notes:
        row["notes"] = notes
    return row


def torchpass_events(out: Path, state: Path, job_id: int) -> dict[str, Any]:
    """What the job's events say: TorchPass's recoveries and migrations (coordinator totals), and how many events
    of each kind the node daemons logged for the job (LinkPass failovers, Fleet Lens verdicts, GPU health)."""
    events = recovery.read_events(out)
    done = [e for e in events if e["kind"] in ("torchpass.recovered", "torchpass.migrated")]
    daemon: dict[str, int] = {}
    for path in state.glob("nodes/*/lib/events/*.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line) if line.strip() else {}
            if event.get("job_id") == job_id and not str(event.get("kind", "")).startswith("torchpass."):
                daemon[event["kind"]] = daemon.get(event["kind"], 0) + 1
    return {
        "recovered_or_migrated": [
            f"{e['kind'].split('.')[1]}: detect {float(e['fields'].get('detect_ms', 0)):.0f} ms, "
            f"total {float(e['fields'].get('total_ms', 0)):.0f} ms"
            for e in done
        ],
        "kinds": sorted({e["kind"] for e in events}),
        "node_daemon_events": dict(sorted(daemon.items())),
    }


def bitwise(a: Path, b: Path) -> bool | None:
    ra, rb = read_results(a), read_results(b)
    if not ra or set(ra) != set(rb):
        return None
    return all(ra[s].get("state_sha256") == rb[s].get("state_sha256") and ra[s].get("state_sha256") for s in ra)


def print_table(rows: dict[str, dict[str, Any]], tp_s: float | None) -> None:
    def cell(system: str, key: str) -> str:
        value = rows.get(system, {}).get(key)
        if value is None:
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    for row in rows.values():
        took = row.get("time_to_n_s")
        row["ratio_to_torchpass"] = round(took / tp_s, 2) if took and tp_s else None
    say("")
    say(f"{'':<34}" + "".join(f"{HEADS[s]:>14}" for s in SYSTEMS))
    for label, key in (
        ("time to N steps (s)", "time_to_n_s"),
        ("ratio to TorchPass", "ratio_to_torchpass"),
        ("ETTR (fault-free / faulted)", "ettr"),
        ("steps recomputed", "recomputed_steps"),
        ("faults applied", "faults_applied"),
        ("time to full width p50 (s)", "full_width_p50_s"),
        ("time to full width p99 (s)", "full_width_p99_s"),
        ("time to full width max (s)", "full_width_max_s"),
        ("never back at full width", "never_full_width"),
        ("YOCO rate", "yoco_rate"),
        ("whole-job restarts", "restarts"),
        ("replica respawns", "respawns"),
    ):
        say(f"{label:<34}" + "".join(f"{cell(s, key):>14}" for s in SYSTEMS))


def sandbox_for(args: argparse.Namespace, work: Path) -> Sandbox:
    config = replace(
        SandboxConfig(), nodes=args.ranks + args.spares, accounting=False, state_dir=str(work / "state"),
        tag=SANDBOX_TAG, mgmt_net=SANDBOX_MGMT_NET, port_base=SANDBOX_PORT_BASE,
    )  # fmt: skip
    return Sandbox(config)


def run_soak(args: argparse.Namespace) -> int:
    """``--soak``: TorchPass alone under Poisson faults; the folder is always kept."""
    work = Path(tempfile.mkdtemp(prefix="cw-soak-"))
    say(f"fault_campaign --soak {args.soak:g}: {args.ranks} ranks + {args.spares} standby nodes; logs in {work}")
    box = sandbox_for(args, work)
    box.up()
    try:
        result = soak(box, work / "torchpass", args, say)
    finally:
        box.down()
    say(f"soak {'stopped: ' + result.stopped if result.stopped else 'ran its time'}; logs kept in {work}")
    print(json.dumps({"bench": "fault_campaign", "soak_minutes": args.soak, "stopped": result.stopped or None,
                      **result.figures, "per_fault": result.per_fault}))  # fmt: skip
    return 1 if result.stopped else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if recovery.lacks_root("bench/fault_campaign.py"):
        return 2
    if args.soak > 0:
        return run_soak(args)
    ft_note = "left out (--skip-torchft)" if args.skip_torchft else torchft_status()
    work = Path(tempfile.mkdtemp(prefix="cw-campaign-"))
    runs: dict[str, Run] = {}
    say(
        f"fault_campaign: {args.ranks} ranks + {args.spares} standby nodes, MLP {args.layers}x{args.hidden}, "
        f"{args.steps} steps, {args.faults} faults, seed {args.seed}; runs in {work}"
    )
    try:
        box = sandbox_for(args, work)
        box.up()
        try:
            say("  fault-free (Slurm) ...")
            runs["fault-free"] = run_torchpass_slurm(box, work / "fault-free", args, [])
            ff_s = time_to_n(runs["fault-free"].out)
            if ff_s is None:
                raise SystemExit(f"the fault-free run did not finish; see {work}/fault-free/job.out")
            trace = trace_for(args, ff_s)
            say(f"  trace over {ff_s:.1f} s: " + ", ".join(f"{f.kind.value}@{f.at_s:.1f}s/slot{f.slot}" for f in trace))
            say("  TorchPass (Slurm) ...")
            runs["torchpass"] = run_torchpass_slurm(box, work / "torchpass", args, trace)
        finally:
            box.down()
        say("  fault-free (local DDP, times a checkpoint) ...")
        local_ff = run_ddp_local(work / "local-fault-free", args, [], args.steps)
        local_s = time_to_n(local_ff.out)
        saves = [r.get("checkpoint_save_s") for r in read_results(local_ff.out).values()]
        save_s = max((float(v) for v in saves if v is not None), default=0.0)  # rank 0 saves
        if local_s is None:
            raise SystemExit(f"the local fault-free run did not finish; see {work}/local-fault-free")
        local_trace = scaled(trace, local_s / ff_s)
        every = checkpoint_every_steps(save_s, local_s / args.faults, local_s / args.steps)
        say(f"  checkpoint-restart (local), a checkpoint every {every} steps (save {save_s * 1000:.1f} ms) ...")
        runs["restart"] = run_ddp_local(work / "restart", args, local_trace, every)
        if not ft_note:
            say("  TorchFT (local) ...")
            runs["torchft"] = run_torchft_local(work / "torchft", args, local_trace)
        rows = {name: figures(run, local_s if name in ("restart", "torchft") else ff_s) for name, run in runs.items()}
        rows["fault-free"]["ettr"] = 1.0
        rows["torchpass"]["bitwise_equal_to_fault_free"] = bitwise(runs["torchpass"].out, runs["fault-free"].out)
        rows["torchpass"]["events"] = torchpass_events(runs["torchpass"].out, work / "state", runs["torchpass"].job_id)
        rows["restart"]["checkpoint_every_steps"] = every
        print_table(rows, rows["torchpass"]["time_to_n_s"])
        say(f"local fault-free DDP: {local_s:.2f} s to N (the base of ckpt-restart's and TorchFT's ETTR)")
        say(f"TorchPass final state bitwise equal to fault-free: {rows['torchpass']['bitwise_equal_to_fault_free']}")
        tp_events = rows["torchpass"]["events"]
        say(f"TorchPass recoveries/migrations (coordinator total): {tp_events['recovered_or_migrated']}")
        say(f"node daemons' events for the TorchPass job: {tp_events['node_daemon_events']}")
        for name in ("torchpass", "restart", "torchft"):
            for fault in rows.get(name, {}).get("per_fault", []):
                say(f"- {HEADS[name]:<13}{fault['kind']:<12} at {fault['at_s']:6.1f} s: full width after "
                    f"{fault['full_width_s']} s, {fault['recomputed']} step(s) recomputed")  # fmt: skip
            for note in rows.get(name, {}).get("notes", []):
                say(f"- {HEADS[name]}: {note}")
        say("ckpt-restart and TorchFT ran as local processes, not under Slurm: NIC/link/loss/GPU faults not applied")
        if ft_note:
            say(f"TorchFT: {ft_note}")
        print(json.dumps({
            "bench": "fault_campaign", "quick": args.quick, "seed": args.seed, "steps": args.steps,
            "ranks": args.ranks, "spares": args.spares, "model": {"hidden": args.hidden, "layers": args.layers},
            "trace": [{"kind": f.kind.value, "at_s": f.at_s, "slot": f.slot} for f in trace],
            "fault_free_local_s": round(local_s, 2), "systems": rows, "torchft": ft_note or "ok (local)",
        }))  # fmt: skip
    finally:
        if args.keep:
            say(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
