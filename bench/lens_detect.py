#!/usr/bin/env python3
"""Fleet Lens on the sandbox: how fast a gray failure is detected, and whether the right link is named.

Brings up its own sandbox (4+ nodes, one clockworkd per node with Lens and LinkPass at their
defaults), lets the paths learn their baselines, then:

1. watches a healthy fabric for ``--healthy-s`` seconds (default 600: the goal is no suspect at all);
2. runs ``--trials`` randomized trials of each fault kind, each on a random NIC of a random node:
   a rate limit (5-20 Mbit/s), random loss (1-5 %), a silent blackhole (switch port stops forwarding,
   carrier stays up) and a switch port down. A trial is *correct* when, at detection and one second
   later, Lens's suspects are exactly that NIC's link; *time to detect* runs from the injection to the
   moment the daemon raised the suspect. The fault is then cleared and the suspect must clear too.

Goals (DESIGN.md): detect < 3 s, correct >= 95 %, no suspects on a healthy fabric.
Needs root (network namespaces). The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from clockwork.contracts.config.core import SandboxConfig
from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.daemons import NodeDaemons

KINDS = ("rate", "loss", "blackhole", "port")


def say(text: str = "") -> None:
    print(text, flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))], 3)


def suspects(daemons: NodeDaemons) -> dict[str, dict[str, Any]]:
    """Every raised suspect any daemon reports, by link (earliest ``since`` kept)."""
    out: dict[str, dict[str, Any]] = {}
    for node in daemons.nodes:
        snap = daemons.request(node, "lens", timeout_s=1.0) or {}
        for s in snap.get("suspects") or []:
            if s["link"] not in out or s.get("since", 1e18) < out[s["link"]].get("since", 1e18):
                out[s["link"]] = s
    return out


@dataclass
class Trial:
    kind: str
    node: str
    nic: str
    value: str
    detected_s: float | None = None
    correct: bool = False
    named: tuple[str, ...] = ()
    cleared_s: float | None = None


def fault_on(kind: str, rng: random.Random) -> tuple[str, str]:
    """(value that injects, value that lifts) for a kind."""
    if kind == "rate":
        return f"{rng.choice((5, 8, 10, 15, 20))}mbit", "off"
    if kind == "loss":
        return f"{rng.choice((1, 2, 3, 4, 5))}", "0"
    if kind == "blackhole":
        return "on", "off"
    return "down", "up"


def run_trial(box: Sandbox, daemons: NodeDaemons, trial: Trial, off: str, timeout_s: float) -> None:
    target = f"{trial.node}/{trial.nic}"
    t0 = time.time()
    box.fault(trial.kind, trial.node, trial.nic, trial.value)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = suspects(daemons)
            mine = [s for s in found.values() if s.get("nic") == target]
            if mine:
                trial.detected_s = round(max(0.0, min(s.get("since", time.time()) for s in mine) - t0), 3)
                time.sleep(1.0)
                later = suspects(daemons)
                trial.named = tuple(sorted(set(found) | set(later)))
                trial.correct = all(s.get("nic") == target for s in [*found.values(), *later.values()])
                break
            time.sleep(0.1)
        else:
            trial.named = tuple(sorted(suspects(daemons)))
    finally:
        box.fault(trial.kind, trial.node, trial.nic, off)
    t1 = time.time()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not suspects(daemons):
            trial.cleared_s = round(time.time() - t1, 3)
            break
        time.sleep(0.2)


def healthy_watch(daemons: NodeDaemons, seconds: float) -> list[str]:
    """Every suspect raised while nothing is wrong, as 'link (kinds)'."""
    seen: set[str] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen |= {f"{link} ({','.join(s.get('kinds', []))})" for link, s in suspects(daemons).items()}
        time.sleep(0.5)
    return sorted(seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 trial per kind and a short healthy watch (< 1 min)")
    parser.add_argument("--trials", type=int, default=20, help="trials per fault kind (default 20)")
    parser.add_argument("--healthy-s", type=float, default=600.0, help="healthy-fabric watch, seconds (default 600)")
    parser.add_argument("--nodes", type=int, default=4, help="sandbox nodes (default 4)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the sandbox down when killed
    if args.quick:
        args.trials, args.healthy_s = 1, 8.0
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="cw-ld-", dir="/tmp"))
    box = Sandbox(replace(SandboxConfig(), state_dir=str(work / "s"), nodes=args.nodes, accounting=False))
    say(f"lens_detect: {args.nodes}-node sandbox at {work / 's'}, seed {seed}")
    box.up()
    trials: list[Trial] = []
    try:
        daemons = NodeDaemons(box)
        daemons.start_all()
        say("daemons up; letting every path learn its baseline (6 s)")
        time.sleep(6.0)
        say(f"healthy fabric watch: {args.healthy_s:g} s")
        false_suspects = healthy_watch(daemons, args.healthy_s)
        say(f"  suspects seen on the healthy fabric: {false_suspects or 'none'}")
        nics = [nic.name for nic in box.layout().nodes[0].nics]
        plan = [k for k in KINDS for _ in range(args.trials)]
        rng.shuffle(plan)
        for i, kind in enumerate(plan, 1):
            value, off = fault_on(kind, rng)
            trial = Trial(kind, rng.choice(daemons.nodes), rng.choice(nics), value)
            run_trial(box, daemons, trial, off, timeout_s=10.0)
            trials.append(trial)
            det = f"{trial.detected_s:.2f} s" if trial.detected_s is not None else "NOT DETECTED"
            clr = f"{trial.cleared_s:.1f} s" if trial.cleared_s is not None else "never"
            say(
                f"  {i:>3}/{len(plan)} {kind:<9} {trial.value:<6} {trial.node}/{trial.nic}: detected {det}, "
                f"{'right link' if trial.correct else 'WRONG: ' + ', '.join(trial.named)}, cleared {clr}"
            )
            time.sleep(1.0)
    finally:
        box.down()
    rows = []
    say("")
    head = ("fault", "trials", "detected", "correct", "p50 s", "p95 s", "max s", "clear p50")
    say(f"{head[0]:<10} " + " ".join(f"{h:>{max(7, len(h))}}" for h in head[1:]))
    for kind in KINDS:
        ts = [t for t in trials if t.kind == kind]
        det = [t.detected_s for t in ts if t.detected_s is not None]
        clr = [t.cleared_s for t in ts if t.cleared_s is not None]
        row = {
            "fault": kind,
            "trials": len(ts),
            "detected": len(det),
            "correct_share": round(sum(t.correct for t in ts) / len(ts), 3) if ts else None,
            "detect_p50_s": pct(det, 50),
            "detect_p95_s": pct(det, 95),
            "detect_max_s": max(det) if det else None,
            "clear_p50_s": pct(clr, 50),
        }
        rows.append(row)

        def f(v: float | None) -> str:
            return f"{v:.2f}" if v is not None else "-"

        say(
            f"{kind:<10} {len(ts):>6} {len(det):>8} {row['correct_share'] or 0:>8.0%} {f(row['detect_p50_s']):>7} "
            f"{f(row['detect_p95_s']):>7} {f(row['detect_max_s']):>7} {f(row['clear_p50_s']):>9}"
        )
    all_det = [t.detected_s for t in trials if t.detected_s is not None]
    correct = sum(t.correct for t in trials) / len(trials) if trials else 0.0
    goals = {
        "detect_under_3s": bool(all_det) and len(all_det) == len(trials) and max(all_det) < 3.0,
        "correct_95pct": correct >= 0.95,
        "healthy_no_suspects": not false_suspects,
    }
    say(
        f"overall: {correct:.0%} correct over {len(trials)} trials, detection p50 {pct(all_det, 50)} s, "
        f"max {max(all_det) if all_det else None} s; healthy {args.healthy_s:g} s: {len(false_suspects)} suspects"
    )
    say(f"goals (detect < 3 s, >= 95 % correct, none on a healthy fabric): {goals}")
    result = {
        "bench": "lens_detect",
        "nodes": args.nodes,
        "seed": seed,
        "healthy_s": args.healthy_s,
        "healthy_suspects": false_suspects,
        "correct_share": round(correct, 3),
        "detect_p50_s": pct(all_det, 50),
        "detect_max_s": max(all_det) if all_det else None,
        "by_fault": rows,
        "goals_met": goals,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
