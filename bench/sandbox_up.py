#!/usr/bin/env python3
"""Benchmark: sandbox bring-up and tear-down seconds, with and without accounting (root only).

Each trial builds a fresh cluster (``Sandbox.up``: fabric, munged, [MariaDB, slurmdbd], slurmctld,
one slurmd per node, every node idle) and tears it down (``Sandbox.down``). Both configurations run
side by side in this one process; the ratio says what accounting costs. Prints a table for people
and, as its last line, one JSON object with the same figures.

    sudo .venv/bin/python bench/sandbox_up.py [--nodes 4] [--trials 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from clockwork.contracts.config.core import SandboxConfig
from clockwork.sandbox.cluster import Sandbox


def trial(cfg: SandboxConfig) -> tuple[float, float]:
    box = Sandbox(cfg)
    t0 = time.monotonic()
    box.up()
    t_up = time.monotonic() - t0
    t0 = time.monotonic()
    box.down()
    return t_up, time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4, help="sandbox nodes (default 4)")
    parser.add_argument("--trials", type=int, default=5, help="trials per configuration (default 5)")
    parser.add_argument("--quick", action="store_true", help="2 trials per configuration (under a minute)")
    args = parser.parse_args()
    trials = 2 if args.quick else args.trials

    figures: dict[str, float | int] = {"nodes": args.nodes, "trials": trials}
    with tempfile.TemporaryDirectory(prefix="cw-bench-") as tmp:
        base = replace(SandboxConfig(), nodes=args.nodes, state_dir=str(Path(tmp) / "state"))
        results: dict[str, list[tuple[float, float]]] = {"plain": [], "accounting": []}
        for _ in range(trials):  # interleaved, so drift on the machine hits both alike
            results["plain"].append(trial(replace(base, accounting=False)))
            results["accounting"].append(trial(replace(base, accounting=True)))
    print(f"sandbox bring-up / tear-down, {args.nodes} nodes, median of {trials} trials")
    print(f"{'configuration':<14} {'up s':>7} {'down s':>7}   (all trials: up)")
    for name, runs in results.items():
        up = statistics.median(r[0] for r in runs)
        down = statistics.median(r[1] for r in runs)
        figures[f"{name}_up_s"] = round(up, 3)
        figures[f"{name}_down_s"] = round(down, 3)
        print(f"{name:<14} {up:7.2f} {down:7.2f}   ({', '.join(f'{r[0]:.2f}' for r in runs)})")
    figures["accounting_vs_plain_up_ratio"] = round(float(figures["accounting_up_s"]) / float(figures["plain_up_s"]), 2)
    print(f"accounting costs {figures['accounting_vs_plain_up_ratio']:.2f}x the plain bring-up time")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
