#!/usr/bin/env python3
"""Benchmark: how long the node Prolog takes for a clockwork job, cold (daemon started) and warm (adopted).

Each trial runs the real Prolog program (``python -m slurm_hooks prolog``, a fresh interpreter as
slurmd runs it) against a real clockworkd in a temporary run folder. Baseline, run side by side: the
same Prolog for a job without clockwork options (it only records the job event). Slurm itself is
not involved, so this measures what Clockwork adds to a job's start. The issue's goal: well under 2 s.

    .venv/bin/python bench/prolog_latency.py [--trials 10] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_prolog(config: Path, job_id: int, ft: str) -> float:
    env = {
        "CLOCKWORK_CONFIG": str(config),
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_UID": "0",
        "SLURM_JOB_USER": "root",
        "SLURMD_NODENAME": "bench1",
        "SLURM_JOB_NODELIST": "bench1",
        "SPANK_CLOCKWORK_FT": ft,
    }
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "slurm_hooks", "prolog"], env=env, check=True)
    return time.monotonic() - t0


def stop_daemon(run_dir: Path) -> None:
    pid_file = run_dir / "clockworkd.pid"
    if pid_file.is_file():
        pid = int(pid_file.read_text().split()[0])
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 trials (well under a minute)")
    args = parser.parse_args()
    trials = 3 if args.quick else args.trials
    times: dict[str, list[float]] = {"baseline_no_clockwork": [], "cold_start_daemon": [], "warm_adopt_daemon": []}
    with tempfile.TemporaryDirectory(prefix="cwb-", dir="/tmp") as tmp:
        root = Path(tmp)
        config = root / "clockwork.toml"
        config.write_text(
            f'[log]\nfile = "{root / "log"}"\nlevel = "warning"\n[hooks]\nspool_dir = "{root / "spool"}"\n'
            f'[daemon]\nnode_name = "bench1"\nrun_dir = "{root / "run"}"\nstate_dir = "{root / "lib"}"\n'
            f'curve_secret_key = "{root / "k/daemon.key_secret"}"\ncurve_public_key = "{root / "k/daemon.key"}"\n'
        )
        job = 1
        try:
            for _ in range(trials):  # interleaved so machine drift hits all three alike
                times["baseline_no_clockwork"].append(run_prolog(config, job, "off"))
                stop_daemon(root / "run")
                times["cold_start_daemon"].append(run_prolog(config, job + 1, "aware"))
                times["warm_adopt_daemon"].append(run_prolog(config, job + 2, "aware"))
                job += 3
        finally:
            stop_daemon(root / "run")
    figures: dict[str, float | int] = {"trials": trials}
    print(f"node Prolog wall time, median of {trials} (a fresh Python each time, as slurmd runs it)")
    for name, values in times.items():
        figures[f"{name}_s"] = round(statistics.median(values), 3)
        print(f"  {name:<24} {statistics.median(values):6.3f} s   max {max(values):6.3f} s")
    for name in ("cold_start_daemon", "warm_adopt_daemon"):
        ratio = figures[f"{name}_s"] / figures["baseline_no_clockwork_s"]
        figures[f"{name}_vs_baseline"] = round(ratio, 2)
        print(f"  {name} costs {ratio:.2f}x the plain Prolog")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
