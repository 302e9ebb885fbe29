#!/usr/bin/env python3
"""The runtime net's cost with no fault: TorchPass's step time with the replica check off, after every step (K = 1)
and at its default period, interleaved in the same job.

The job is ``bench/torchpass_overhead.py``'s (``bench/support/torchpass_workload.py``: an MLP of 3 x 1024, AdamW,
64 samples per rank, one thread per rank, ``--nproc`` ranks on 127.0.0.1 over gloo) in its ``replica_check`` mode:
one ``torchpass run --local`` in which the net's period changes every ``--segment`` steps on every rank at the same
step, in the order off, K = 1, off, K = default, off, ... (after two warm-up segments). Each segment with the net on is
set against the mean of the two off segments either side of it, so a slow phase of a shared machine hits both
alike; the ratio's 95 % interval comes from the spread of those per-segment ratios. ``--segment`` defaults to the
default K, so each default-K segment holds exactly one check.

Besides the ratios it reports the check's own time (rank 0: computing the checksums of the parameters and the
optimizer state, and the all_gather of three integers that compares them) per check and the bytes each read, and
the default K's expected cost per step, two ways: K = 1's measured overhead over K, and (an upper bound: it
includes the wait in the all_gather for the other rank) the check's own time over K steps. The interleaved ratio at
default K cannot resolve that cost on this machine: its segments differ by more than that from noise alone.

``--quick`` runs in under a minute (one segment of each form, of K / 2 steps: the default-K one still holds one
check; one segment gives no interval). The last line printed is one JSON object of the figures.
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

from support.torchpass_jobs import say, torchpass_job, wait_all
from torchpass_overhead import T95, interval

from torchpass.config import TorchPassConfig


def run_job(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / "job"
    out.mkdir()
    steps = args.segment * (4 * args.pairs + 4)  # 2 warm-up, (off, K=1, off, K=default) x pairs, off, tail
    job_args = argparse.Namespace(**{**vars(args), "steps": steps, "warmup": 0})
    extra = ["--segment", str(args.segment)]
    code = wait_all([torchpass_job(job_args, out, spares=0, extra=extra, mode="replica_check")], args.timeout)[0]
    if code:
        raise RuntimeError(f"the job exited with {code}; see {out}/torchpass.err")
    return json.loads((out / "replica_check.json").read_text())


def _ratios(triples: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]], key: str) -> list[float]:
    """Each on segment's ``key`` over the mean of its two off neighbours'."""
    return [o[key] / ((b[key] + a[key]) / 2) for b, o, a in triples]


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """Step time per form, each on form's ratio to its off neighbours, and the check's own time and bytes."""
    segments = [s for s in result["segments"] if s["form"] not in ("warmup", "tail")]
    seg = result["segment"]
    off_ms = 1000 * statistics.median(s["wall_s"] for s in segments if s["form"] == "off") / seg
    forms: dict[str, Any] = {}
    for form in ("k1", "kdefault"):
        # the segments alternate off / on, so an on segment's neighbours are off ones
        triples = [(segments[i - 1], s, segments[i + 1]) for i, s in enumerate(segments) if s["form"] == form]
        wall, cpu = _ratios(triples, "wall_s"), _ratios(triples, "cpu_s")
        checks = sum(on["checks"] for _, on, _ in triples)
        check_s = sum(on["check_s"] for _, on, _ in triples)
        checksum_s = sum(on["checksum_s"] for _, on, _ in triples)
        forms[form] = {
            "every": triples[0][1]["every"],
            "segments": len(triples),
            "ms_per_step": round(1000 * statistics.median(on["wall_s"] for _, on, _ in triples) / seg, 3),
            "ratio_to_off": round(statistics.fmean(wall), 4),
            "overhead_pct": round(100 * (statistics.fmean(wall) - 1), 2),
            "overhead_ci95_pct": interval(wall, T95) if len(wall) > 1 else None,
            "cpu_overhead_pct": round(100 * (statistics.fmean(cpu) - 1), 2),
            "checks": checks,
            "ms_per_check": round(1000 * check_s / checks, 3) if checks else None,
            "checksum_ms_per_check": round(1000 * checksum_s / checks, 3) if checks else None,
        }
    per_check_ms = forms["k1"]["ms_per_check"]
    every = forms["kdefault"]["every"]
    check_bytes = max(s["check_bytes"] for s in segments)
    # The default K's cost per step, two ways: K = 1's measured overhead spread over K steps, and the check's own
    # time on rank 0 (its wait in the all_gather for the other rank included: an upper bound) over K steps.
    from_k1 = forms["k1"]["overhead_pct"] / every if every else None
    from_own = 100 * per_check_ms / (every * off_ms) if per_check_ms and every else None
    return {
        "off_ms_per_step": round(off_ms, 3),
        "forms": forms,
        "check_bytes": check_bytes,
        "check_mib": round(check_bytes / (1 << 20), 2),
        "default_every": every,
        "expected_default_overhead_pct": round(from_k1, 3) if from_k1 is not None else None,
        "expected_default_overhead_upper_pct": round(from_own, 3) if from_own is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_every = TorchPassConfig().replica_check_every_steps
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    parser.add_argument("--layers", type=int, default=3, help="hidden layers (default 3)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    parser.add_argument(
        "--segment",
        type=int,
        default=default_every,
        help=f"steps per segment (default: the default K, {default_every})",
    )
    parser.add_argument("--pairs", type=int, default=6, help="segments of each form with the net on (default 6)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds the job may take")
    parser.add_argument("--keep", action="store_true", help="keep the job's folder")
    parser.add_argument("--quick", action="store_true", help="1 segment of each form, of K / 2 steps (under a minute)")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.segment = 1, max(1, default_every // 2)
    work = Path(tempfile.mkdtemp(prefix="tp-replica-check-"))
    say(
        f"replica_check: {args.nproc} ranks on 127.0.0.1 (gloo), MLP {args.layers}x{args.hidden}, AdamW, batch "
        f"{args.batch}; segments of {args.segment} steps: 2 warm-up, then (off, K=1, off, K={default_every}) x "
        f"{args.pairs}, off"
    )
    started = time.monotonic()
    try:
        result = run_job(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    fig = figures(result)
    say("")
    say(
        f"{'form':<14} {'ms/step':>8} {'vs off':>7} {'overhead':>9} {'95 % interval':>16} {'checks':>7} {'ms/check':>9}"
    )
    say(f"{'off':<14} {fig['off_ms_per_step']:>8.2f} {1:>7.3f} {'':>9} {'':>16} {0:>7} {'':>9}")
    for form, label in (("k1", "K=1"), ("kdefault", f"K={fig['default_every']}")):
        row = fig["forms"][form]
        ci = row["overhead_ci95_pct"]
        ci_text = f"{ci[0]:.2f}..{ci[1]:.2f} %" if ci else "-"
        per = f"{row['ms_per_check']:.2f}" if row["ms_per_check"] else "-"
        say(
            f"{label:<14} {row['ms_per_step']:>8.2f} {row['ratio_to_off']:>7.3f} {row['overhead_pct']:>8.2f}% "
            f"{ci_text:>16} {row['checks']:>7} {per:>9}"
        )
    k1 = fig["forms"]["k1"]
    say(
        f"a check on rank 0: {k1['ms_per_check']:.2f} ms, of which {k1['checksum_ms_per_check']:.2f} ms computing its "
        "checksums and the rest the all_gather (waiting for the other rank included)"
    )
    say(
        f"each check read {fig['check_mib']:.1f} MiB (parameters and AdamW's moments and steps) on every rank; "
        f"at K={fig['default_every']} that is {fig['forms']['k1']['ms_per_check']:.2f} ms every "
        f"{fig['default_every']} steps of {fig['off_ms_per_step']:.1f} ms: at most "
        f"{fig['expected_default_overhead_upper_pct']:.3f} % per step; K=1's overhead spread over "
        f"{fig['default_every']} steps: {fig['expected_default_overhead_pct']:.3f} % "
        f"({time.monotonic() - started:.0f} s)"
    )
    upper = fig["expected_default_overhead_upper_pct"]
    goals = {"default_well_under_1pct": upper is not None and upper < 0.5}
    say(f"goal (the default period costs well under 1 % of a step: under 0.5 % at most): {goals}")
    print(
        json.dumps(
            {
                "bench": "replica_check",
                "nproc": args.nproc,
                "model": {"hidden": args.hidden, "layers": args.layers, "batch": args.batch},
                "segment_steps": args.segment,
                "pairs": args.pairs,
                **fig,
                "goals_met": goals,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
