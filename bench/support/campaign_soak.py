"""The fault campaign's soak (``bench/fault_campaign.py --soak MINUTES``): TorchPass only, Poisson faults, until
the time is up or the first fault that goes wrong.

One TorchPass job on the sandbox's real Slurm trains far more steps than it can finish while faults of
:func:`fault_trace.poisson_trace` are replayed against it (node crashes capped at the standby nodes less one: a
crashed node does not come back into the job). Every ``POLL_S`` the step logs and events are read and the running
distribution of time to full width printed. The soak stops at the first fault that:

* **loses state**: the job failed or ended (``torchpass.failed``), or the runtime net found the replicas apart
  (``torchpass.replica_mismatch``);
* **hangs**: a slot began no step for ``HANG_S``;
* **waits**: it took longer than ``WAIT_S`` to get back to full width (a collective or heartbeat timeout, or
  waiting for a spare, would show as such a wait).

The job is then cancelled and its folder kept. No torch here.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clockwork.sandbox.cluster import Sandbox
from support import sandbox_recovery as recovery
from support.campaign_inject import Replay, SandboxFaults
from support.campaign_runs import WORKLOAD, read_logs
from support.fault_trace import FaultKind, outcomes, poisson_trace, summary

POLL_S = 5.0
HANG_S = 30.0
WAIT_S = 5.0  # TorchPass's own recoveries take well under a second; a timeout (>= 15 s) or a spare's start is more
SOAK_STEPS = 10**8
FATAL_EVENTS = ("torchpass.failed", "torchpass.replica_mismatch")


@dataclass
class SoakResult:
    """How the soak ended (``stopped``: why, empty when its time ran out) and the faults' figures so far."""

    minutes: float
    stopped: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    per_fault: list[dict[str, Any]] = field(default_factory=list)


def soak(box: Sandbox, out: Path, args: argparse.Namespace, say: Any) -> SoakResult:
    """Run the soak against a fresh job in ``out``; ``say`` prints a progress line."""
    out.mkdir()
    duration = args.soak * 60.0
    caps = {FaultKind.NODE_CRASH: args.spares - 1}
    trace = poisson_trace(args.seed, duration, args.soak_gap, args.ranks, caps=caps)
    say(f"  soak: {len(trace)} faults over {args.soak:g} min, a mean gap of {args.soak_gap:g} s (seed {args.seed})")
    env = recovery.job_env(box)
    workload = (
        f"{WORKLOAD} torchpass --out {out} --steps {SOAK_STEPS} --warmup 0 --hidden {args.hidden} "
        f"--layers {args.layers} --batch {args.batch} --wait-spares {args.spares}"
    )
    command = (
        # A soak injects far more failures than a job's budget allows (max_failures, 32 by default: a 47-minute
        # soak ended there, by policy, after 186 faults): the soak judges recoveries, not the budget.
        f"{sys.executable} -m torchpass run --nproc {args.ranks} --spares {args.spares} --set max_failures=1000000 "
        f"--events {out}/events-{{agent}}.jsonl {workload}"
    )
    options = [f"-N{args.ranks + args.spares}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby"]
    job_id = recovery.submit([*options, f"--output={out}/job.out"], command, env)
    slurm = box.slurm()
    injector = SandboxFaults(box, out, args.ranks, protected="node1")
    result = SoakResult(args.soak)
    started = time.monotonic()
    with Replay(trace, out, injector) as replay:
        while not result.stopped:
            time.sleep(POLL_S)
            if time.monotonic() - started > duration + 60:
                break
            result.stopped = _verdict(out, replay.applied, slurm.job(job_id))
            results = outcomes(read_logs(out), [(a.fault, a.at) for a in replay.applied])
            result.figures = summary(results)
            result.per_fault = [
                {
                    "kind": r.fault.kind.value,
                    "at_s": r.fault.at_s,
                    "full_width_s": r.full_width_s,
                    "redone": r.recomputed,
                }
                for r in results
            ]
            say(f"  {len(results)} faults: {result.figures}")
    slurm.cancel(job_id)
    box.clear_faults()
    return result


def _verdict(out: Path, applied: list[Any], info: Any) -> str:
    """Why the soak must stop now ('' to go on)."""
    events = recovery.read_events(out)
    fatal = [e for e in events if e["kind"] in FATAL_EVENTS]
    if fatal:
        return f"{fatal[0]['kind']}: {fatal[0].get('fields')}"
    if info is None or info.finished:
        return f"the job ended ({info.state if info else 'gone'})"
    logs = read_logs(out)
    now = time.time()
    if logs and applied:
        silent = {slot: now - log[-1][1] for slot, log in logs.items() if log}
        slot, quiet = max(silent.items(), key=lambda kv: kv[1])
        if quiet > HANG_S:
            return f"hang: slot {slot} began no step for {quiet:.0f} s"
    for outcome in outcomes(logs, [(a.fault, a.at) for a in applied]):
        if outcome.full_width_s is not None and outcome.full_width_s > WAIT_S + outcome.fault.hold_s:
            return f"wait: {outcome.fault.kind.value} at {outcome.fault.at_s} s took {outcome.full_width_s:.1f} s"
    return ""
