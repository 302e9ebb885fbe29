#!/usr/bin/env python3
"""Benchmark: how long a NIC fault stalls a 4-node all-reduce loop with LinkPass, and without it (baseline).

On a fresh 4-node sandbox of its own (root; it refuses to start while another sandbox owns the node
namespaces), it starts one node daemon per node with LinkPass enabled and ``examples/allreduce_loop.py`` on
every node (one rank each, plain Popen through ``Sandbox.exec_argv``: no Slurm, so a trial is cheap).
Each rank logs ``STEP MONOTONIC_TIME`` per 1 MiB all-reduce; a stall is the longest gap between two
consecutive steps.

Scenarios, each over ``--trials`` trials on a random node (seeded):
- link down / port down / blackhole on nic0 (the rail carrying the traffic): fault held ``--hold`` s
  (1.5), lifted, then at least ``--failback-wait`` s (2) and until traffic is home again. Reported: the
  longest stall while the fault was on (p50/p99/max), the longest stall that began after the lift
  (fail-back), and how long after the lift traffic was home again (the hold-down included).
- the same faults on nic1 (the idle rail), reported separately;
- flap: link down/up every 2 s for 30 s (``--quick``: 4 s) on nic0 of one node; the longest stall.
Before each trial it waits until every node routes its peers through nic0 again and every daemon's
LinkPass reports all NICs up, all paths alive and every peer routed home, so no trial starts half
failed over. Single-fault trials come every few seconds, far more often than LinkPass's flap window,
so they run with the hold-down fixed at its base value (``--damping`` keeps the doubling); the flap
scenario runs with the configured damping.
Then the baseline: daemons restarted with LinkPass disabled, the loop restarted with a 15 s collective
timeout, nic0 of one node down for 20 s; the outcome is a stall until the fault was lifted, or the
collective error that kills a real job.

Prints a table, the goals (link/port down p50 < 300 ms, p99 < 1 s; blackhole p99 < 1 s; fail-back p99
< 300 ms; zero collective errors), the baseline, the ratio baseline stall / LinkPass p99 stall, and as
its very last line one JSON object with every figure. The sandbox is always torn down.

    sudo .venv/bin/python bench/linkpass_failover.py [--trials 10] [--quick] [--seed 1] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from support.allreduce_ranks import load_loop_module
from support.linkpass_trials import FAULTS, NODES, Bench, Trial, say
from support.owned_processes import Procs
from support.step_stalls import fmt_ms, ms, percentile

from clockwork.contracts.config import load_config
from clockwork.contracts.config.core import SandboxConfig
from clockwork.sandbox.cluster import Sandbox

SCENARIO_NAMES = {"link": "link down", "port": "port down", "blackhole": "blackhole"}
GOALS_MS = {"down_p50": 300.0, "down_p99": 1000.0, "blackhole_p99": 1000.0, "failback_p99": 300.0}


def summarize(trials: list[Trial]) -> dict[str, Any]:
    stalls = [t.stall_s for t in trials]
    backs = [t.failback_stall_s for t in trials]
    steps = [t.step_s for t in trials if t.step_s is not None]
    failovers = [t.failovers for t in trials if t.failovers is not None]
    homes = [t.home_s for t in trials if t.home_s is not None]
    return {
        "trials": len(trials),
        "stall_p50_ms": ms(percentile(stalls, 50)),
        "stall_p99_ms": ms(percentile(stalls, 99)),
        "stall_max_ms": ms(max(stalls) if stalls else None),
        "failback_p50_ms": ms(percentile(backs, 50)),
        "failback_p99_ms": ms(percentile(backs, 99)),
        "home_again_p50_ms": ms(percentile(homes, 50)),
        "home_again_p99_ms": ms(percentile(homes, 99)),
        "step_ms": ms(statistics.median(steps) if steps else None),
        "failovers_counted": sum(failovers) if failovers else None,
        "open_stalls": sum(t.open_stall for t in trials),
        "nodes": [t.node for t in trials],
    }


def run_bench(args: argparse.Namespace, work: Path, procs: Procs) -> dict[str, Any]:
    loop_module = load_loop_module()
    rng = random.Random(args.seed)
    cfg = replace(SandboxConfig(), state_dir=str(work / "state"), nodes=NODES, accounting=False)
    box = Sandbox(cfg)
    say(f"building a {NODES}-node sandbox at {cfg.state_dir} ...")
    up_s = box.up()
    try:
        say(f"  up in {up_s:.1f} s")
        bench = Bench(box, procs, work, rng, args.hold, args.failback_wait, args.settle_timeout)
        # Trials come every few seconds, far more often than LinkPass's 60 s flap window: with its damping
        # on, the trials themselves would look like a flapping fabric and stretch every later fail-back.
        # So single-fault trials run with the hold-down fixed at its base value (unless --damping); the
        # flap scenario runs with the configured damping, as a site would.
        base_holddown = load_config(box.paths.clockwork_toml, env={}).config.linkpass.holddown_s
        single = {} if args.damping else {"holddown_max_s": f"{base_holddown:g}"}
        say(
            "starting one clockworkd per node (LinkPass enabled"
            + ("" if args.damping else f", hold-down fixed at {base_holddown:g} s for single-fault trials")
            + ")"
        )
        bench.daemons.start_all(linkpass=True, settings=single)
        bench.settle(args.settle_timeout)
        say("starting the all-reduce loop (1 MiB, gloo, one rank per node)")
        bench.start_loop("linkpass", args.timeout)

        scenarios: dict[str, list[Trial]] = {}
        for kind in FAULTS:
            for nic, count in (("nic0", args.trials), ("nic1", args.nic1_trials)):
                key = f"{kind}_{nic}"
                scenarios[key] = []
                for i in range(count):
                    node = rng.choice(bench.nodes)
                    t = bench.trial(kind, node, nic)
                    scenarios[key].append(t)
                    say(
                        f"  {SCENARIO_NAMES[kind]:<9} {nic} {node}  trial {i + 1:>2}/{count}: stall "
                        f"{fmt_ms(t.stall_s):>5} ms, fail-back stall {fmt_ms(t.failback_stall_s):>5} ms, "
                        f"failovers {t.failovers if t.failovers is not None else '?'}"
                        + (" (STALL STILL OPEN)" if t.open_stall else "")
                    )
        if single:
            say("restarting the daemons with the configured flap damping for the flap scenario")
            bench.settle(args.settle_timeout)  # routes home first: a starting LinkPass takes them as home
            bench.daemons.start_all(linkpass=True)
            bench.settle(args.settle_timeout)
        flap_node = rng.choice(bench.nodes)
        say(f"  flap: nic0 of {flap_node} down/up every 2 s for {args.flap:g} s ...")
        flap = bench.flap(flap_node, args.flap)
        say(
            f"  flap: longest stall {fmt_ms(flap['stall_s'])} ms, after it {fmt_ms(flap['failback_stall_s'])} ms, "
            f"failovers {flap['failovers'] if flap['failovers'] is not None else '?'}"
        )
        bench.finish_loop(loop_module)

        say(
            f"baseline: LinkPass disabled, nic0 down for {args.baseline_hold:g} s, "
            f"gloo timeout {args.baseline_timeout:g} s"
        )
        base = bench.baseline(args.baseline_hold, args.baseline_timeout)
        return report(args, scenarios, flap, base, bench)
    finally:
        procs.kill_all()
        say("tearing the sandbox down")
        box.down()


def report(
    args: argparse.Namespace,
    scenarios: dict[str, list[Trial]],
    flap: dict[str, Any],
    base: dict[str, Any],
    bench: Bench,
) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "nodes": NODES,
        "trials": args.trials,
        "seed": args.seed,
        "hold_s": args.hold,
        "single_fault_damping": bool(args.damping),
    }
    say()
    say(f"LinkPass failover, {NODES} nodes x 2 NICs, 1 MiB gloo all-reduce per step; stalls in ms")
    say(
        f"{'scenario':<22} {'n':>3} {'p50':>6} {'p99':>6} {'max':>6} {'fb p50':>7} {'fb p99':>7} "
        f"{'home p50':>9} {'step':>5} {'failovers':>9}"
    )
    summaries = {}
    for key, trials in scenarios.items():
        kind, nic = key.split("_")
        s = summarize(trials)
        summaries[key] = s
        label = f"{SCENARIO_NAMES[kind]} {nic}" + (" (idle)" if nic == "nic1" else "")
        say(
            f"{label:<22} {s['trials']:>3} {_f(s['stall_p50_ms']):>6} {_f(s['stall_p99_ms']):>6} "
            f"{_f(s['stall_max_ms']):>6} {_f(s['failback_p50_ms']):>7} {_f(s['failback_p99_ms']):>7} "
            f"{_f(s['home_again_p50_ms']):>9} {_f(s['step_ms']):>5} {_f(s['failovers_counted']):>9}"
        )
        for name, value in s.items():
            figures[f"{key}_{name}"] = value
    say(
        f"{'flap nic0 ' + str(int(args.flap)) + ' s':<22} {flap['downs']:>3} {'':>6} {'':>6} "
        f"{fmt_ms(flap['stall_s']):>6} {'':>7} {fmt_ms(flap['failback_stall_s']):>7} "
        f"{fmt_ms(flap['home_s']):>9} {'':>5} {_f(flap['failovers']):>9}   (n = downs; max = longest stall)"
    )
    figures.update(
        {
            "flap_duration_s": flap["duration_s"],
            "flap_downs": flap["downs"],
            "flap_stall_max_ms": ms(flap["stall_s"]),
            "flap_failback_stall_ms": ms(flap["failback_stall_s"]),
            "flap_failovers": flap["failovers"],
            "flap_home_again_ms": ms(flap["home_s"]),
            "collective_errors": bench.collective_errors,
            "checksums_ok": bench.checksums_ok,
            "unsettled_trials": bench.unsettled,
        }
    )
    say(
        f"collective errors with LinkPass: {bench.collective_errors} (must be 0); results correct: {bench.checksums_ok}"
    )
    if bench.error_lines:
        for line in bench.error_lines:
            say(f"  {line}")

    say(
        f"baseline without LinkPass (nic0 of {base['node']} down {base['hold_s']:g} s, gloo timeout "
        f"{base['collective_timeout_s']:g} s): {base['outcome']}, stall {base['stall_s']:.1f} s"
        + (f", error after {base['error_after_s']:.1f} s" if base["error_after_s"] is not None else "")
    )
    figures.update(
        {
            "baseline_outcome": base["outcome"],
            "baseline_stall_s": round(base["stall_s"], 2),
            "baseline_error_after_s": None if base["error_after_s"] is None else round(base["error_after_s"], 2),
            "baseline_failed_ranks": base["failed_ranks"],
            "baseline_hold_s": base["hold_s"],
            "baseline_timeout_s": base["collective_timeout_s"],
        }
    )
    lp99 = summaries["link_nic0"]["stall_p99_ms"]
    ratio = None if not lp99 else round(base["stall_s"] * 1000.0 / lp99, 1)
    figures["baseline_vs_linkpass_p99_ratio"] = ratio
    say(
        f"baseline stall / LinkPass p99 stall (link down nic0): {ratio}x"
        + (" (the baseline job died: its stall is a lower bound)" if base["error_after_s"] is not None else "")
    )

    goals = {
        "link_down_p50": _le(summaries["link_nic0"]["stall_p50_ms"], GOALS_MS["down_p50"]),
        "link_down_p99": _le(summaries["link_nic0"]["stall_p99_ms"], GOALS_MS["down_p99"]),
        "port_down_p50": _le(summaries["port_nic0"]["stall_p50_ms"], GOALS_MS["down_p50"]),
        "port_down_p99": _le(summaries["port_nic0"]["stall_p99_ms"], GOALS_MS["down_p99"]),
        "blackhole_p99": _le(summaries["blackhole_nic0"]["stall_p99_ms"], GOALS_MS["blackhole_p99"]),
        "failback_p99": all(_le(summaries[f"{k}_nic0"]["failback_p99_ms"], GOALS_MS["failback_p99"]) for k in FAULTS),
        "zero_collective_errors": bench.collective_errors == 0,
        "results_correct": bench.checksums_ok,
    }
    say("goals: " + ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in goals.items()))
    figures["goals"] = goals
    figures["goals_met"] = all(goals.values())
    return figures


def _le(value: float | None, limit: float) -> bool:
    return value is not None and value < limit


def _f(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10, help="trials per nic0 scenario (default 10)")
    parser.add_argument("--nic1-trials", type=int, default=None, help="trials per nic1 scenario (default trials/3)")
    parser.add_argument(
        "--quick", action="store_true", help="under a minute: 1 trial per fault, no nic1, a 4 s flap, an 8 s baseline"
    )
    parser.add_argument("--seed", type=int, default=1, help="random node choice (default 1)")
    parser.add_argument("--hold", type=float, default=1.5, help="seconds each fault is held (1.5)")
    parser.add_argument("--failback-wait", type=float, default=2.0, help="seconds after lifting it (2)")
    parser.add_argument(
        "--settle-timeout", type=float, default=40.0, help="max wait for traffic back home between trials (40)"
    )
    parser.add_argument(
        "--damping", action="store_true", help="keep LinkPass's flap damping on during single-fault trials too"
    )
    parser.add_argument("--flap", type=float, default=30.0, help="flap duration, s (30; --quick: 4)")
    parser.add_argument("--timeout", type=float, default=30.0, help="collective timeout with LinkPass, s (30)")
    parser.add_argument("--baseline-hold", type=float, default=20.0, help="baseline fault duration, s (20)")
    parser.add_argument("--baseline-timeout", type=float, default=15.0, help="baseline collective timeout (15)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs) even on success")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)
    if args.quick:
        args.trials = 1
        args.flap = min(args.flap, 4.0)
        args.baseline_hold = min(args.baseline_hold, 8.0)
        args.baseline_timeout = min(args.baseline_timeout, 5.0)
    if args.nic1_trials is None:
        args.nic1_trials = 0 if args.quick else max(1, args.trials // 3)
    if args.trials < 1 or args.nic1_trials < 0:
        parser.error("--trials must be >= 1 and --nic1-trials >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        say("linkpass_failover.py needs root: it builds a sandbox cluster (network namespaces, Slurm daemons)")
        return 77

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="cwlp-", dir="/tmp"))
    os.chmod(work, 0o755)
    procs = Procs()
    ok = False
    figures: dict[str, Any] = {}
    try:
        figures = run_bench(args, work, procs)
        ok = True
    finally:
        procs.kill_all()
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"logs kept in {work}")
    print(json.dumps(figures), flush=True)
    return 1 if args.strict and not figures["goals_met"] else 0


if __name__ == "__main__":
    sys.exit(main())
