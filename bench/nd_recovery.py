#!/usr/bin/env python3
"""A node of a tensor-parallel job crashes: how long until the job trains at full width again, and what it costs.

The job (``bench/support/nd_workload.py``: ``fsdp_workload``'s residual MLP, each block's ``up`` ColwiseParallel and
``down`` RowwiseParallel, AdamW) runs as ``--nproc`` local ranks on 127.0.0.1 over gloo, dp_replicate
``nproc / tp`` x tp ``tp`` (2 x 2 by default: slot ``r * T + t`` is TP rank t of replica r). At the start of step
``--crash-step`` a node is lost: both ranks of the last replica's TP group (slots 2 and 3) SIGKILL themselves as
one crash (each waits until the other reached the step). Side by side, in one run, alternating ``--runs`` times:

* **TorchPass**: ``torchpass run --local`` with two spares (as many as the node's ranks), started with the job (on
  a cluster they wait on a node of their own), the job written with ``ctx.wrap_fsdp(mesh_shape=(R, 1), tp=T,
  tp_plan=...)`` (dp_replicate R x dp_shard 1 x tp T). The spares take both dead slots in one recovery, each fed
  by the rank at its TP coordinate in the other replica; TorchPass rebuilds the mesh's groups and every rank
  resumes the same step at full width. Split from the coordinator's ``torchpass.recovered`` event: detection,
  spare ready, transfer, rebuild, and the bytes moved;
* **checkpoint-restart**: plain DTensor TP (``parallelize_module``) with the gradients all-reduced over the
  replicate dimension, a ``torch.distributed.checkpoint`` every ``--ckpt-every`` steps; when a rank dies every
  rank is stopped (a 50 ms monitor, as torchrun's) and the whole job is started again from the last checkpoint,
  recomputing the steps since;
* **TorchFT** 0.2 (when installed: ``pip install -e '.[bench]'``), with the same TP layout inside its replica
  groups: each TP group (its own store, process group and TP mesh) is a TorchFT replica group, each TP rank's
  ``Manager`` all-reduces its gradients' local parts with the same TP rank of the other groups. The crashed
  group restarts (as a per-group torchrun would) and heals from the live group, which meanwhile trains at
  reduced width (``min_replica_size`` 1): those steps' samples of the absent replica are skipped.

For each: the time from the crash to the end of the first full-width step after it, the global steps computed
twice, and the samples skipped. Goal (issue 42): TorchPass at full width in under 3 s here, at least 2x sooner than
TorchFT, no sample skipped. The measuring and the three runners are ``bench/fsdp_recovery.py``'s, given this
workload.

``--quick``: one run of each, 60 steps, the crash at step 15. It does not fit in a minute here (2 to 3.5
minutes on 2 shared cores): TorchFT's restarted group takes 10 s or more to come back, and the live group must still
be training then for it to heal (else it has no full-width figure), so the job cannot be shorter than that after
the crash. The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from fsdp_recovery import run_restart, run_torchft, run_torchpass
from support.recovery_report import Arm, report, run_systems
from support.torchpass_jobs import say, torchft_status

WORKLOAD = Path(__file__).resolve().parent / "support" / "nd_workload.py"


def workload(args: argparse.Namespace, out: Path, mode: str, *extra: str) -> list[str]:
    """The TP workload's command line after the interpreter (``fsdp_recovery``'s runners start it)."""
    return [
        str(WORKLOAD), mode, "--out", str(out), "--steps", str(args.steps), "--hidden", str(args.hidden),
        "--layers", str(args.layers), "--batch", str(args.batch), "--tp", str(args.tp),
        "--crash-steps", str(args.crash_step), *extra,
    ]  # fmt: skip


def torchpass_arm(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    return run_torchpass(args, out, workload, spares=args.tp)  # a spare for each rank of the lost node


def restart_arm(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    return run_restart(args, out, workload)


def torchft_arm(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    row = run_torchft(args, out, workload)
    # A replica's batch is shared by its TP ranks: a step without the absent replica skips one batch, not one a rank.
    row["samples_skipped"] = row["steps_at_reduced_width"] * args.batch
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--tp", type=int, default=2, help="TP degree (default 2: dp_replicate 2 x tp 2)")
    parser.add_argument("--steps", type=int, default=120, help="steps of the job (default 120)")
    parser.add_argument(
        "--crash-step", type=int, default=70, help="the last TP group crashes at this step (default 70)"
    )
    parser.add_argument("--ckpt-every", type=int, default=40, help="checkpoint-restart: steps between checkpoints")
    parser.add_argument("--hidden", type=int, default=512, help="block width (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="blocks, each cut over the TP group (default 4)")
    parser.add_argument("--batch", type=int, default=32, help="samples per replica per step (default 32)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each system, alternated (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders")
    parser.add_argument("--skip-torchft", action="store_true", help="leave TorchFT out")
    parser.add_argument("--quick", action="store_true", help="one run each of 60 steps, crash at 15")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.crash_step, args.ckpt_every, args.runs = 60, 15, 10, 1
    args.shards = args.tp  # fsdp_recovery's runners call the ranks of one replica group its shards
    replicas = args.nproc // args.tp
    lost = ", ".join(str(r) for r in range(args.nproc - args.tp, args.nproc))
    say(
        f"nd_recovery: {args.nproc} ranks on 127.0.0.1 (gloo), dp_replicate {replicas} x tp {args.tp}, "
        f"{args.layers} blocks of {args.hidden}, {args.steps} steps, a node lost at step {args.crash_step}: ranks "
        f"{lost} (the TP group of replica {replicas - 1}) SIGKILLed together; checkpoint-restart saves every "
        f"{args.ckpt_every} steps; {args.runs} run(s) each"
    )
    torchft_note = "left out (--skip-torchft)" if args.skip_torchft else torchft_status()
    systems: dict[str, Arm] = {"torchpass": torchpass_arm, "restart": restart_arm}
    if not torchft_note:
        systems["torchft"] = torchft_arm
    began = time.monotonic()
    rows = run_systems(args, systems, "nd-recovery-")
    report(
        "nd_recovery",
        rows,
        torchft_note,
        torchft_label="TorchFT",
        issue="issue 42",
        describe={
            "nproc": args.nproc,
            "layout": {"dp_replicate": replicas, "dp_shard": 1, "tp": args.tp},
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
