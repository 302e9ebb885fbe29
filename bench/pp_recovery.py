#!/usr/bin/env python3
"""A stage of a pipeline-parallel job crashes: how long until the job trains at full width again, and what it costs.

The job (``bench/support/pp_workload.py``: ``fsdp_workload``'s residual MLP cut into ``--stages`` stages,
``ScheduleGPipe`` with ``--microbatches`` micro-batches, AdamW) runs as ``--nproc`` local ranks on 127.0.0.1 over
gloo, dp_replicate ``nproc / stages`` x pp ``stages`` (2 x 2 by default: slot ``r * P + k`` is stage k of replica r);
rank 1 (stage 1 of replica 0) SIGKILLs itself at the start of step ``--crash-step``. Side by side, in one run,
alternating ``--runs`` times:

* **TorchPass**: ``torchpass run --local`` with one spare, started with the job (on a cluster it waits on a node
  of its own), the job written with ``ctx.wrap_pipeline``. The spare takes the dead stage's slot and receives the
  stage's state from the same stage of the other replica; TorchPass builds the ``PipelineStage`` and the schedule
  again over the new generation's groups, and every stage resumes the same step at full width. Split from the
  coordinator's ``torchpass.recovered`` event: detection, spare ready, transfer, rebuild, and the bytes moved;
* **checkpoint-restart**: plain ``torch.distributed.pipelining`` over the same layout, each stage checkpointed
  every ``--ckpt-every`` steps; when a rank dies every rank is stopped (a 50 ms monitor, as torchrun's) and the
  whole job is started again from the last checkpoint, recomputing the steps since;
* **TorchFT** 0.2 (when installed: ``pip install -e '.[bench]'``), with the replica group as failure domain: each
  pipeline (its ``stages`` processes, its own store and process group) is a TorchFT replica group; each stage's
  ``Manager`` all-reduces the stage's gradients with the same stage of the other groups, and ``OptimizerWrapper``
  commits only when every stage of the group may. The crashed rank's whole group (both its stages) is restarted
  at once, as a per-group torchrun would, and heals from the live group, which meanwhile trains at reduced width
  (``min_replica_size`` 1): those steps' samples of the absent replica are skipped.

For each: the time from the crash to the end of the first full-width step after it, the global steps computed
twice, and the samples skipped. Goal (issue 44): TorchPass at full width in under 3 s here, and at least 2x sooner
than TorchFT. The measuring and the three runners are ``bench/fsdp_recovery.py``'s, given this workload.

``--quick`` runs in under a minute. The last line printed is one JSON object of the figures.
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

WORKLOAD = Path(__file__).resolve().parent / "support" / "pp_workload.py"


def workload(args: argparse.Namespace, out: Path, mode: str, *extra: str) -> list[str]:
    """The pipeline workload's command line after the interpreter (``fsdp_recovery``'s runners start it)."""
    return [
        str(WORKLOAD), mode, "--out", str(out), "--steps", str(args.steps), "--hidden", str(args.hidden),
        "--layers", str(args.layers), "--batch", str(args.batch), "--stages", str(args.stages),
        "--microbatches", str(args.microbatches), "--crash-steps", str(args.crash_step), *extra,
    ]  # fmt: skip


def torchpass_arm(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    return run_torchpass(args, out, workload)


def restart_arm(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    return run_restart(args, out, workload)


def torchft_arm(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    row = run_torchft(args, out, workload)
    # A replica's batch is shared by its stages: a step without the absent replica skips one batch, not one a rank.
    row["samples_skipped"] = row["steps_at_reduced_width"] * args.batch
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2: dp_replicate 2 x pp 2)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--steps", type=int, default=120, help="steps of the job (default 120)")
    parser.add_argument("--crash-step", type=int, default=70, help="rank 1 crashes at this step (default 70)")
    parser.add_argument("--ckpt-every", type=int, default=40, help="checkpoint-restart: steps between checkpoints")
    parser.add_argument("--hidden", type=int, default=512, help="block width (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="blocks, cut among the stages (default 4)")
    parser.add_argument("--batch", type=int, default=32, help="samples per replica per step (default 32)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each system, alternated (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders")
    parser.add_argument("--skip-torchft", action="store_true", help="leave TorchFT out")
    parser.add_argument("--quick", action="store_true", help="one run each of 30 steps, crash at 15 (under a minute)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.crash_step, args.ckpt_every, args.runs = 30, 15, 10, 1
    args.shards = args.stages  # fsdp_recovery's runners call the ranks of one replica group its shards
    replicas = args.nproc // args.stages
    say(
        f"pp_recovery: {args.nproc} ranks on 127.0.0.1 (gloo), dp_replicate {replicas} x pp {args.stages} "
        f"(GPipe, {args.microbatches} micro-batches), {args.layers} blocks of {args.hidden}, {args.steps} steps, "
        f"rank 1 (stage 1 of replica 0) SIGKILLed at step {args.crash_step}; checkpoint-restart saves every "
        f"{args.ckpt_every} steps; {args.runs} run(s) each"
    )
    torchft_note = "left out (--skip-torchft)" if args.skip_torchft else torchft_status()
    systems: dict[str, Arm] = {"torchpass": torchpass_arm, "restart": restart_arm}
    if not torchft_note:
        systems["torchft"] = torchft_arm
    began = time.monotonic()
    rows = run_systems(args, systems, "pp-recovery-")
    report(
        "pp_recovery",
        rows,
        torchft_note,
        torchft_label="TorchFT",
        issue="issue 44",
        describe={
            "nproc": args.nproc,
            "layout": {"dp_replicate": replicas, "pp": args.stages, "microbatches": args.microbatches},
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
