#!/usr/bin/env python3
"""Fleet Lens clock sync on the sandbox: recovered clock offsets against a known truth.

Emulated nodes share one real clock, so each daemon is given a synthetic clock through the clock seam
(``[lens] clock_seam_file``, tests only): a random offset up to +-50 ms and a drift up to +-100 ppm per
node, the reference node included. Lens must recover every node's offset to the reference from its
probes alone. Every second for ``--duration`` seconds, every daemon's solution is compared with the
truth for every pair of nodes at the instant the solution was made.

Compared with: the goal (pairwise error < 20 µs at p99, DESIGN.md) and, side by side in the same run,
the naive estimate an unsynchronised fleet would use: no correction at all (the raw offsets).
Needs root. The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from clockwork.contracts.config.core import SandboxConfig
from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.daemons import NodeDaemons
from clockworkd.lens.clockseam import ClockSeam

GOAL_P99_US = 20.0


def say(text: str = "") -> None:
    print(text, flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))], 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short warm-up and 15 s of samples (< 1 min)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of samples (default 120)")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before sampling (default 20)")
    parser.add_argument("--nodes", type=int, default=4, help="sandbox nodes (default 4)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the sandbox down when killed
    if args.quick:
        args.duration, args.warmup = 15.0, 12.0
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="cw-cs-", dir="/tmp"))
    box = Sandbox(replace(SandboxConfig(), state_dir=str(work / "s"), nodes=args.nodes, accounting=False))
    say(f"clocksync: {args.nodes}-node sandbox at {work / 's'}, seed {seed}")
    box.up()
    errors: list[float] = []
    naive: list[float] = []
    sigmas: list[float] = []
    within_3sigma = 0
    seams: dict[str, ClockSeam] = {}
    try:
        daemons = NodeDaemons(box)
        epoch = time.time_ns()
        seams = {
            n: ClockSeam(round(rng.uniform(-50e6, 50e6)), round(rng.uniform(-100, 100), 3), epoch)
            for n in daemons.nodes
        }
        seam_file = work / "seams.json"
        seam_file.write_text(
            json.dumps(
                {
                    "epoch_ns": epoch,
                    "nodes": {n: {"offset_us": s.offset_ns / 1e3, "drift_ppm": s.drift_ppm} for n, s in seams.items()},
                }
            )
        )
        for n, s in seams.items():
            say(f"  {n}: offset {s.offset_ns / 1e6:+8.3f} ms, drift {s.drift_ppm:+8.3f} ppm")
        daemons.start_all({"lens.clock_seam_file": str(seam_file)})
        say(f"daemons up with the clock seam; warming up {args.warmup:g} s")
        time.sleep(args.warmup)
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            for node in daemons.nodes:
                snap: dict[str, Any] = daemons.request(node, "lens", timeout_s=1.0) or {}
                clock, at = snap.get("clock") or {}, snap.get("clock_at_real_ns") or 0
                for a, b in itertools.combinations(sorted(clock), 2):
                    truth = seams[a].truth_offset(seams[b], at)
                    est = (clock[b]["offset_us"] - clock[a]["offset_us"]) * 1e3
                    err = abs(est - truth) / 1e3
                    sigma = (clock[a]["uncertainty_us"] ** 2 + clock[b]["uncertainty_us"] ** 2) ** 0.5
                    errors.append(err)
                    naive.append(abs(truth) / 1e3)
                    sigmas.append(sigma)
                    within_3sigma += err <= 3 * sigma
            time.sleep(1.0)
    finally:
        box.down()
    p99 = pct(errors, 99)
    naive_p99 = pct(naive, 99)
    say("")
    say(
        f"pairwise offset error over {len(errors)} samples: p50 {pct(errors, 50)} µs, p99 {p99} µs, "
        f"max {pct(errors, 100)} µs"
    )
    say(
        f"reported uncertainty (1 sigma, pair): median {pct(sigmas, 50)} µs; "
        f"error within 3 sigma: {within_3sigma}/{len(errors)}"
    )
    say(
        f"no sync (raw clocks): p99 error {naive_p99} µs -> Lens is "
        f"{naive_p99 / p99 if p99 and naive_p99 else float('inf'):.0f}x better"
    )
    say(
        f"goal: p99 < {GOAL_P99_US:g} µs -> {'met' if p99 is not None and p99 < GOAL_P99_US else 'NOT met'} "
        f"(p99 / goal = {p99 / GOAL_P99_US if p99 is not None else float('nan'):.2f})"
    )
    result = {
        "bench": "clocksync",
        "nodes": args.nodes,
        "seed": seed,
        "samples": len(errors),
        "error_p50_us": pct(errors, 50),
        "error_p99_us": p99,
        "error_max_us": pct(errors, 100),
        "uncertainty_median_us": pct(sigmas, 50),
        "within_3sigma_share": round(within_3sigma / len(errors), 3) if errors else None,
        "no_sync_p99_us": naive_p99,
        "ratio_no_sync_to_lens": round(naive_p99 / p99, 1) if p99 else None,
        "goal_p99_us": GOAL_P99_US,
        "goal_met": p99 is not None and p99 < GOAL_P99_US,
        "seams": {n: {"offset_ms": s.offset_ns / 1e6, "drift_ppm": s.drift_ppm} for n, s in seams.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
