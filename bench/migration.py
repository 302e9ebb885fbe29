#!/usr/bin/env python3
"""Benchmark: a planned migration and a crash recovery, model-aware vs transparent vs Lightning vs the HF Trainer.

Each run starts a local job (``torchpass run --local``: 2 ranks, 1 spare, gloo on 127.0.0.1) of
``bench/support/migration_workload.py``: the same MLP and AdamW, written with the TorchPass API (``aware``) or
as an unmodified DDP script run with ``--transparent``. Once slot 0 has started step ``--mark-step``, the
benchmark asks ``clockwork migrate --coordinator FILE --rank 1`` and waits for the job to end. From the job's
events it reads the coordinator's ``torchpass.migrated`` record (``total_ms``: request to every member resumed, and its
split) and the departing rank's ``torchpass.departed`` (``handoff_ms``: its direct send of the live state to
the spare) with the bytes it moved (``handoff_bytes``). Both modes run in the same invocation, alternately, and
the medians over ``--runs`` runs are printed side by side with the ratio transparent / aware (the baseline
is the model-aware mode). The last line is one JSON object of the figures.

The frameworks: ``lightning`` is the same training as an unmodified PyTorch Lightning script (``--transparent``),
migrated the same way. A crash recovery is measured for the two transparent forms too: slot 1 SIGKILLs itself
at the marker step and the coordinator's ``torchpass.recovered`` record gives ``total_ms`` (first sign of the
failure to every member resumed) and ``spare_ready_ms`` (failure declared to the spare at the rendezvous: its
run of the script up to its first batch, which a framework makes longer), side by side with the ratio
lightning / transparent. Without ``--quick``, the Lightning crash is also timed with a fresh interpreter per
process (``zygote=false``), once with the spare warm-up (the spare imports what the script imports before it is
needed) and once without it (``spare_warmup=false``: the replacement imports Lightning after the failure): the
difference is what the warm-up keeps off the recovery's critical path. ``hf_trainer`` is the same training as an
unmodified Hugging Face Trainer script, migrated and crashed like the others.

    .venv/bin/python bench/migration.py [--runs 3] [--hidden 1024] [--layers 4] [--samples 4096] [--quick]
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "bench" / "support" / "migration_workload.py"
MODES = ("aware", "transparent", "lightning", "hf_trainer")
FIGURES = ("total_ms", "handoff_ms", "rebuild_ms", "handoff_bytes")
CRASH_MODES = ("transparent", "lightning", "hf_trainer")
# Lightning crash runs without the zygote: (label, settings), with and without the spare warm-up.
COLD = (("warm spare", ("zygote=false",)), ("cold spare", ("zygote=false", "spare_warmup=false")))
CRASH_FIGURES = ("total_ms", "spare_ready_ms", "transfer_ms")
RUN_TIMEOUT_S = 300.0


def one_run(
    mode: str, out: Path, args: argparse.Namespace, *, kill: bool = False, settings: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Run one job, migrate slot 1 mid-run (or, with ``kill``, let it crash), and return the figures."""
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    command = [
        sys.executable,
        "-m",
        "torchpass",
        "run",
        "--local",
        *(["--transparent"] if mode != "aware" else []),
        "--nproc",
        "2",
        "--spares",
        "1",
        "--events",
        str(out / "events.jsonl"),
        "--coordinator-file",
        str(out / "coordinator"),
        *(arg for setting in settings for arg in ("--set", setting)),
        str(WORKLOAD),
        mode,
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--samples",
        str(args.samples),
        *(["--kill"] if kill else []),
    ]
    with open(out / "job.log", "wb") as log:
        job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not (out / "at-step").exists():
                if job.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: the job never reached the marker step; see {out / 'job.log'}")
                time.sleep(0.02)
            migrate = [
                sys.executable,
                "-m",
                "clockwork.cli.main",
                "migrate",
                "--coordinator",
                str(out / "coordinator"),
            ]
            if not kill:
                subprocess.run([*migrate, "--slot", "1"], env=env, check=True, capture_output=True, text=True)
            code = job.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    if code != 0:
        raise RuntimeError(f"{mode}: the job exited with {code}; see {out / 'job.log'}")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    if kill:
        recovered = [e["fields"] for e in events if e["kind"] == "torchpass.recovered"]
        if not recovered:
            raise RuntimeError(f"{mode}: no recovery in the events; see {out / 'job.log'}")
        return {key: float(recovered[0].get(key, 0.0)) for key in CRASH_FIGURES}
    migrated = [e["fields"] for e in events if e["kind"] == "torchpass.migrated"]
    departed = [e["fields"] for e in events if e["kind"] == "torchpass.departed"]
    if not migrated or not departed or not migrated[0]["handoff_ok"]:
        raise RuntimeError(f"{mode}: no successful migration in the events ({migrated}, {departed})")
    return {
        "total_ms": float(migrated[0].get("total_ms", 0.0)),
        "handoff_ms": float(departed[0]["handoff_ms"]),
        "rebuild_ms": float(migrated[0]["rebuild_ms"]),
        "handoff_bytes": int(departed[0]["handoff_bytes"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    parser.add_argument("--layers", type=int, default=4, help="MLP layers (default 4)")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024: about 38 MiB of state)")
    parser.add_argument("--steps", type=int, default=64, help="training steps, rounded up to whole epochs")
    parser.add_argument(
        "--samples", type=int, default=4096, help="dataset rows (default 4096: an epoch of 128 steps, 2 ranks)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one run per mode, a small model, 32-step epochs (under a minute)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        # The job trains whole epochs: with the default dataset, ~7 s of each job's ~11 s came after its migration.
        args.runs, args.hidden, args.layers, args.steps, args.samples = 1, 256, 2, 32, 1024
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    crashes: dict[str, list[dict[str, Any]]] = {mode: [] for mode in CRASH_MODES}
    cold: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in COLD}
    with tempfile.TemporaryDirectory(prefix="bench-migration-") as tmp:
        for run in range(args.runs):
            for mode in MODES:  # alternate, so a slow phase of the machine hits every mode alike
                results[mode].append(one_run(mode, Path(tmp) / f"{mode}-{run}", args))
            for mode in CRASH_MODES:
                crashes[mode].append(one_run(mode, Path(tmp) / f"{mode}-kill-{run}", args, kill=True))
            for label, settings in () if args.quick else COLD:
                out = Path(tmp) / f"lightning-{label.replace(' ', '-')}-{run}"
                cold[label].append(one_run("lightning", out, args, kill=True, settings=settings))
    medians = {mode: {k: statistics.median(r[k] for r in results[mode]) for k in FIGURES} for mode in MODES}

    def over(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    ratio = {k: over(medians["transparent"][k], medians["aware"][k]) for k in FIGURES}
    ratio_lightning = {k: over(medians["lightning"][k], medians["aware"][k]) for k in FIGURES}
    ratio_hf = {k: over(medians["hf_trainer"][k], medians["aware"][k]) for k in FIGURES}
    crash = {mode: {k: statistics.median(r[k] for r in crashes[mode]) for k in CRASH_FIGURES} for mode in CRASH_MODES}
    crash_ratio = {k: over(crash["lightning"][k], crash["transparent"][k]) for k in CRASH_FIGURES}
    crash_ratio_hf = {k: over(crash["hf_trainer"][k], crash["transparent"][k]) for k in CRASH_FIGURES}
    print(f"planned migration of slot 1 (2 ranks, 1 spare, local gloo), median of {args.runs} run(s) per mode,")
    print(f"MLP {args.layers} x {args.hidden}, AdamW, {args.samples} samples; ratios against the model-aware mode")
    header = f"{'figure':<16}{'aware':>12}{'transparent':>13}{'ratio':>7}{'lightning':>11}{'ratio':>7}"
    print(f"{header}{'hf_trainer':>12}{'ratio':>7}")
    for key in FIGURES:
        row = [medians[mode][key] for mode in MODES]
        versus = f"{ratio[key] or 0:>7.3f}{row[2]:>11.1f}{ratio_lightning[key] or 0:>7.3f}"
        print(f"{key:<16}{row[0]:>12.1f}{row[1]:>13.1f}{versus}{row[3]:>12.1f}{ratio_hf[key] or 0:>7.3f}")
    print("crash recovery of slot 1 (SIGKILL), ratios lightning and hf_trainer / plain transparent script")
    print(f"{'figure':<16}{'transparent':>13}{'lightning':>11}{'ratio':>7}{'hf_trainer':>12}{'ratio':>7}")
    for key in CRASH_FIGURES:
        t, lt, hf = crash["transparent"][key], crash["lightning"][key], crash["hf_trainer"][key]
        print(f"{key:<16}{t:>13.1f}{lt:>11.1f}{crash_ratio[key] or 0:>7.3f}{hf:>12.1f}{crash_ratio_hf[key] or 0:>7.3f}")
    spare = {
        label: {k: statistics.median(r[k] for r in runs) for k in CRASH_FIGURES} for label, runs in cold.items() if runs
    }
    if spare:
        print("Lightning crash recovery, a fresh interpreter per process (zygote=false), ratio cold / warm spare")
        print(f"{'figure':<16}{'warm spare':>12}{'cold spare':>12}{'ratio':>7}")
        for key in CRASH_FIGURES:
            warm, cool = spare["warm spare"][key], spare["cold spare"][key]
            print(f"{key:<16}{warm:>12.1f}{cool:>12.1f}{over(cool, warm) or 0:>7.3f}")
    print(
        json.dumps(
            {
                "runs": args.runs,
                "layers": args.layers,
                "hidden": args.hidden,
                "steps": args.steps,
                "samples": args.samples,
                "median": medians,
                "ratio_transparent_vs_aware": ratio,
                "ratio_lightning_vs_aware": ratio_lightning,
                "crash_recovery_median": crash,
                "ratio_crash_lightning_vs_transparent": crash_ratio,
                "lightning_crash_without_zygote": spare,
                "ratio_hf_trainer_vs_aware": ratio_hf,
                "ratio_crash_hf_trainer_vs_transparent": crash_ratio_hf,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
