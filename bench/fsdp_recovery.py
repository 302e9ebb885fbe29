#!/usr/bin/env python3
"""A rank of a sharded (HSDP) job crashes: how long until the job trains at full width again, and what it costs.

The job (``bench/support/fsdp_workload.py``: residual MLP blocks, each its own ``fully_shard``, AdamW,
``clip_grad_norm_``) runs as ``--nproc`` local ranks on 127.0.0.1 over gloo on a ``(nproc / shards) x shards``
HSDP mesh (2 x 2 by default); rank 1 SIGKILLs itself at step ``--crash-step``. Side by side, in one run,
alternating ``--runs`` times:

* **TorchPass**: ``torchpass run --local`` with one spare, started with the job (on a cluster it waits on a
  node of its own). The spare takes the dead rank's slot and receives its shard from the rank holding the same
  shard in the other replica; every replica resumes at the same step, at full width. Split from the
  coordinator's ``torchpass.recovered`` event: detection, spare ready, rebuild (groups of both mesh
  dimensions), transfer, and the bytes moved;
* **checkpoint-restart**: plain FSDP2, a sharded checkpoint (``torch.distributed.checkpoint``) every
  ``--ckpt-every`` steps; when a rank dies every rank is stopped (a 50 ms monitor, as torchrun's) and the whole
  job is started again from the last checkpoint, recomputing the steps since.

For each: the time from the crash to the end of the first full-width step after it (every rank has begun the
step after it), the global steps computed twice, and the samples skipped (steps some replica trained at reduced
width: none for either). Goal (DESIGN.md): full width in under 3 s on the sandbox, 0 samples skipped.

* **TorchFT** 0.2's HSDP (when installed: ``pip install -e '.[bench]'``): each replica group of ``--shards``
  processes shards the model with FSDP2 over its own mesh, and TorchFT all-reduces the gradients over the replica
  groups (``set_all_reduce_hook`` over a ``ManagedProcessGroup``, ``min_replica_size`` 1). The replica group is
  TorchFT's failure domain: the crashed rank's whole group is restarted at once (as a per-group torchrun would),
  heals from a live group, and meanwhile the others train at reduced width: those steps' samples of the absent
  group are skipped.

``--quick`` runs in about a minute. The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.recovery_report import Arm, report, run_systems
from support.torchpass_jobs import (
    Lighthouse,
    base_env,
    free_port,
    say,
    spawn,
    step_logs,
    torchft_status,
    wait_all,
    whole_job_ran,
)
from torchpass_vs_restart import MONITOR_S, crash_times, stamped_steps

WORKLOAD = Path(__file__).resolve().parent / "support" / "fsdp_workload.py"
HEALED_SLACK_S = 0.5  # TorchFT: a healed group's step ends with the live groups' same step (their last: this later)
Command = Callable[..., list[str]]  # (args, out, mode, *extra) -> a workload's command line after the interpreter


def workload(args: argparse.Namespace, out: Path, mode: str, *extra: str) -> list[str]:
    """The workload script's command line after the interpreter."""
    return [
        str(WORKLOAD), mode, "--out", str(out), "--steps", str(args.steps), "--warmup", "0",
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--batch", str(args.batch),
        "--shards", str(args.shards), "--crash-steps", str(args.crash_step), *extra,
    ]  # fmt: skip


def full_width(out: Path) -> dict[str, Any]:
    """From the step logs: the crash to the end of the first step after it on every rank, and steps done twice."""
    (crash_step, crashed_at), *_ = sorted(crash_times(out).items())
    stamps = stamped_steps(out)
    twice = set()
    for steps in step_logs(out).values():
        twice |= {s for s in steps if steps.count(s) > 1}
    resumed = min(s for entries in stamps.values() for s, t in entries if t > crashed_at)  # the step redone first
    ends = [[t for s, t in entries if s == resumed + 1 and t > crashed_at] for entries in stamps.values()]
    if not all(ends):
        raise RuntimeError(f"not every rank trained step {resumed + 1} after the crash; see {out}")
    return {
        "crash_step": crash_step,
        "resumed_at": resumed,
        "to_full_width_s": round(max(min(e) for e in ends) - crashed_at, 3),
        "steps_computed_twice": len(twice),
        "samples_skipped": 0,  # every step trained by every rank: no replica sat out a step
    }


def run_torchpass(args: argparse.Namespace, out: Path, command: Command = workload, spares: int = 1) -> dict[str, Any]:
    """``spares``: started with the job (as many as the ranks one crash takes: a node's)."""
    cmd = [
        sys.executable, "-m", "torchpass", "run", "--local", "--nproc", str(args.nproc), "--spares", str(spares),
        "--no-respawn-spares", "--events", str(out / "events.jsonl"),
        *command(args, out, "torchpass", "--wait-spares", str(spares)),
    ]  # fmt: skip
    code = wait_all([spawn(cmd, base_env(), out / "torchpass.err")], args.timeout)[0]
    if code:
        raise RuntimeError(f"torchpass run exited with {code}; see {out}/torchpass.err")
    row = full_width(out)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    (recovered,) = [e["fields"] for e in events if e["kind"] == "torchpass.recovered"]
    for key in ("detect_ms", "decide_ms", "spare_ready_ms", "rebuild_ms", "transfer_ms", "transfer_bytes", "total_ms"):
        row[key] = recovered.get(key)
    row["moves"] = recovered.get("moves", [])
    row["bytes_moved"] = sum(move["bytes"] for move in row["moves"])  # every part (transfer_bytes: the largest)
    row["restarts"] = 0
    return row


def run_torchft(args: argparse.Namespace, out: Path, command: Command = workload) -> dict[str, Any]:
    """TorchFT 0.2's HSDP: a replica group (``--shards`` processes) is the failure domain. The crashed rank's
    whole group is stopped and started again at once (as a per-group torchrun would), and heals from a live
    group; meanwhile the other replicas train at reduced width (``min_replica_size`` 1)."""
    replicas = args.nproc // args.shards
    extra = ("--min-replicas", "1")
    deadline = time.monotonic() + args.timeout
    respawns: list[tuple[int, float]] = []
    with Lighthouse(out, min_replicas=1, join_timeout_ms=1000) as lighthouse:

        def start(replica: int) -> list[Any]:
            port, procs = free_port(), []
            for group_rank in range(args.shards):
                env = base_env()
                env.update(
                    REPLICA_ID=str(replica), NUM_REPLICAS=str(replicas), RANK=str(group_rank),
                    WORLD_SIZE=str(args.shards), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    TORCHFT_LIGHTHOUSE=lighthouse.address,
                )  # fmt: skip
                cmd = [sys.executable, *command(args, out, "torchft", *extra)]
                procs.append(spawn(cmd, env, out / f"torchft-{replica}-{group_rank}.err"))
            return procs

        groups = {replica: start(replica) for replica in range(replicas)}
        while not all(p.poll() == 0 for procs in groups.values() for p in procs):
            if time.monotonic() > deadline:
                for p in (p for procs in groups.values() for p in procs):
                    p.kill()
                raise RuntimeError(f"torchft did not finish within {args.timeout:g} s; see {out}")
            for replica, procs in list(groups.items()):
                if any(p.poll() not in (None, 0) for p in procs):  # the group is the failure domain: restart it
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                    wait_all(procs, 10)
                    respawns.append((replica, time.time()))
                    groups[replica] = start(replica)
            time.sleep(MONITOR_S)
    (crash_step, crashed_at), *_ = sorted(crash_times(out).items())
    stamps = stamped_steps(out)
    after = [(replica, at) for replica, at in respawns if at >= crashed_at]  # (a group may also fail at the start)
    restarted_ranks = {replica * args.shards + rank for replica, _ in after[:1] for rank in range(args.shards)}
    # Reduced width is the live groups' count: a restarted group that found no live one (they had finished) trained
    # alone from step 0, and those steps are not the crash's reduced width.
    results = [json.loads(p.read_text()) for p in out.glob("result-*.json")]
    reduced = max(
        (int(r.get("reduced_width_steps", 0)) for r in results if r["rank"] not in restarted_ranks), default=0
    )
    live_end = max(
        (t for rank, entries in stamps.items() if rank not in restarted_ranks for _, t in entries), default=0.0
    )
    back = []  # when the group restarted after the crash trained (finished) a step again, healed, beside a live group
    for replica, restarted in after[:1]:
        for rank in range(args.shards):
            entries = stamps.get(replica * args.shards + rank, [])
            back += [t for s, t in entries if t > restarted and s >= crash_step and t <= live_end + HEALED_SLACK_S]
    twice = set()
    for steps in step_logs(out).values():
        twice |= {s for s in steps if steps.count(s) > 1}
    return {
        "crash_step": crash_step,
        "to_full_width_s": round(min(back) - crashed_at, 3) if back else None,
        "steps_at_reduced_width": reduced,
        "samples_skipped": reduced * args.shards * args.batch,  # the absent group's share of each such step
        "steps_computed_twice": len(twice),
        "group_restarts": len(after),
        "group_restarts_at_start": len(respawns) - len(after),
        "restarts": 0,
    }


def run_restart(args: argparse.Namespace, out: Path, command: Command = workload) -> dict[str, Any]:
    extra = ("--ckpt", str(out / "ckpt"), "--ckpt-every", str(args.ckpt_every))
    (out / "ckpt").mkdir()
    deadline = time.monotonic() + args.timeout
    restarts = 0
    while True:
        port = free_port()
        procs = []
        for rank in range(args.nproc):
            env = base_env()
            env.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            cmd = [sys.executable, *command(args, out, "restart", *extra)]
            procs.append(spawn(cmd, env, out / f"restart-{rank}.err"))
        if whole_job_ran(procs, deadline, MONITOR_S):  # else one rank died: the whole job stopped, as torchrun would
            break
        if time.monotonic() >= deadline:
            raise RuntimeError(f"checkpoint-restart did not finish within {args.timeout:g} s; see {out}")
        restarts += 1
    row = full_width(out)
    row["restarts"] = restarts
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--shards", type=int, default=2, help="shards per replica (default 2: HSDP 2 x 2)")
    parser.add_argument("--steps", type=int, default=120, help="steps of the job (default 120)")
    parser.add_argument("--crash-step", type=int, default=70, help="rank 1 crashes at this step (default 70)")
    parser.add_argument("--ckpt-every", type=int, default=40, help="checkpoint-restart: steps between checkpoints")
    parser.add_argument("--hidden", type=int, default=512, help="block width (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (default 4)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each system, alternated (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders")
    parser.add_argument("--skip-torchft", action="store_true", help="leave TorchFT out")
    parser.add_argument("--quick", action="store_true", help="one run each of 40 steps, crash at 25 (about a minute)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.crash_step, args.ckpt_every, args.runs = 40, 25, 10, 1
    replicas = args.nproc // args.shards
    say(
        f"fsdp_recovery: {args.nproc} ranks on 127.0.0.1 (gloo), HSDP mesh {replicas}x{args.shards}, {args.layers} "
        f"blocks of {args.hidden}, {args.steps} steps, rank 1 SIGKILLed at step {args.crash_step}; checkpoint-restart "
        f"saves every {args.ckpt_every} steps; {args.runs} run(s) each"
    )
    torchft_note = "left out (--skip-torchft)" if args.skip_torchft else torchft_status()
    systems: dict[str, Arm] = {"torchpass": run_torchpass, "restart": run_restart}
    if not torchft_note:
        systems["torchft"] = run_torchft
    began = time.monotonic()
    rows = run_systems(args, systems, "fsdp-recovery-")
    report(
        "fsdp_recovery",
        rows,
        torchft_note,
        torchft_label="TorchFT HSDP",
        issue="DESIGN.md",
        describe={
            "nproc": args.nproc,
            "mesh": [replicas, args.shards],
            "model": {"hidden": args.hidden, "layers": args.layers, "batch": args.batch},
            "steps": args.steps,
            "crash_step": args.crash_step,
            "ckpt_every": args.ckpt_every,
        },
        began=began,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
