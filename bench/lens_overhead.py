#!/usr/bin/env python3
"""Fleet Lens's CPU cost per node daemon at a 10 ms probe interval, against the peers each NIC probes.

Brings up a sandbox of ``--nodes`` nodes (17 by default, so a NIC can probe 16 peers), starts one
clockworkd per node for each setting of ``[lens] peers_per_nic`` and measures every daemon's CPU time
(user + system, /proc) over ``--seconds``. The baseline, measured side by side in the same run, is the
same daemon with Lens off (LinkPass is off in both, to isolate Lens). The figure that matters is the
difference: Lens's own share of one core. The probe rate each daemon achieved is printed too (it must
be the configured cadence, or a low CPU figure would mean nothing).

A second baseline, the *probe floor* (``bench/support/probe_floor.c``, compiled here), runs one small C
program per node that sends and reads exactly the probe packets Lens sends for each setting (same count,
size, batching and read cadence) and does nothing else: what the packets alone cost on this machine. It
runs on the sandbox's rails and again over the kernel's loopback device, whose difference is the emulated
NICs and switch (veth, bridge, veth, all charged to the sending process here; a NIC and a switch do that
work in hardware on a cluster). Lens above the floor is Lens's own work.

Goal (DESIGN.md): < 3 % of one core per node at 10 ms with 16 peers per NIC.
Needs root. The last line printed is one JSON object of the figures.
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
from dataclasses import replace
from pathlib import Path

from clockwork.contracts.config.core import SandboxConfig
from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.daemons import NodeDaemons
from clockwork.sandbox.shell import in_netns
from clockworkd.lens.prober import DRAIN_EVERY_S
from clockworkd.lens.wire import PROBE_BYTES

GOAL_PCT = 3.0
TICK = os.sysconf("SC_CLK_TCK")
FLOOR_SOURCE = Path(__file__).resolve().parent / "support" / "probe_floor.c"
FLOOR_PORT = 16990  # not Lens's port: the floor runs while no daemon does, but keep them apart anyway


def say(text: str = "") -> None:
    print(text, flush=True)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def measure(daemons: NodeDaemons, settings: dict[str, str], seconds: float, warmup: float) -> dict[str, float]:
    pids = daemons.start_all(settings)
    time.sleep(warmup)
    c0 = {n: cpu_seconds(p) for n, p in pids.items()}
    r0 = {n: daemons.request(n, "lens") or {} for n in pids}
    t0 = time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    c1 = {n: cpu_seconds(p) for n, p in pids.items()}
    r1 = {n: daemons.request(n, "lens") or {} for n in pids}
    s0 = {n: r.get("counters", {}).get("probes_sent", 0) for n, r in r0.items()}
    s1 = {n: r.get("counters", {}).get("probes_sent", 0) for n, r in r1.items()}
    # Lens's own account of its CPU time per phase (user + kernel of its event loop thread), median node.
    phases = sorted({k for r in r1.values() for k in r.get("cpu_ms", {})})
    per_phase = {
        k: round(
            statistics.median(
                (r1[n].get("cpu_ms", {}).get(k, 0.0) - r0[n].get("cpu_ms", {}).get(k, 0.0)) / 10 / dt for n in pids
            ),
            3,
        )
        for k in phases
    }
    user = [100 * (c1[n][0] - c0[n][0]) / dt for n in pids]
    system = [100 * (c1[n][1] - c0[n][1]) / dt for n in pids]
    cpu = [u + k for u, k in zip(user, system, strict=True)]
    rate = [(s1[n] - s0[n]) / dt for n in pids]
    return {
        "cpu_median_pct": round(statistics.median(cpu), 2),
        "cpu_max_pct": round(max(cpu), 2),
        "user_median_pct": round(statistics.median(user), 2),
        "system_median_pct": round(statistics.median(system), 2),
        "probes_per_s_median": round(statistics.median(rate), 1),
        "lens_phases_pct": per_phase,
    }


def build_floor(work: Path) -> Path:
    """Compile the probe floor (``bench/support/probe_floor.c``): the probe packets alone, no Lens."""
    exe = work / "probe_floor"
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(FLOOR_SOURCE)], check=True)
    return exe


def measure_floor(exe: Path, box: Sandbox, peers: int, interval_ms: float, seconds: float, loopback: bool) -> float:
    """Median CPU (% of a core) of one probe floor per node sending what Lens sends with ``peers`` per NIC.

    On the sandbox's rails (each node's NICs, in its namespace), or with ``loopback`` over the kernel's
    loopback device instead (127.0.R.N addresses in this namespace): the same UDP stacks without the emulated
    NICs and switch, whose cost a real NIC and switch do not charge to the node."""
    nodes = box.layout().nodes
    drain_ticks = max(1, round(DRAIN_EVERY_S * 1000 / interval_ms))
    procs = []

    def addr(q: int, r: int) -> str:  # node q's NIC r
        return f"127.0.{r + 1}.{q + 1}" if loopback else nodes[q].nics[r].ip

    try:
        for i, node in enumerate(nodes):
            ring = [(i + j) % len(nodes) for j in range(1, peers + 1)]
            specs = [f"{addr(i, r)}:" + ",".join(addr(q, r) for q in ring) for r in range(len(node.nics))]
            argv = [
                str(exe),
                str(FLOOR_PORT),
                str(round(interval_ms * 1000)),
                str(drain_ticks),
                str(PROBE_BYTES),
                *specs,
            ]
            procs.append(subprocess.Popen(argv if loopback else [*in_netns(node.netns), *argv]))
        time.sleep(1.0)
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a probe floor process exited at once (see its message above)")
        c0 = [sum(cpu_seconds(p.pid)) for p in procs]
        t0 = time.monotonic()
        time.sleep(seconds)
        dt = time.monotonic() - t0
        c1 = [sum(cpu_seconds(p.pid)) for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
    return round(statistics.median(100 * (b - a) / dt for a, b in zip(c0, c1, strict=True)), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="9 nodes, peers 2 and 8, 5 s each, floors 3 s (< 1 min)")
    parser.add_argument("--nodes", type=int, default=17, help="sandbox nodes (default 17)")
    parser.add_argument("--peers", default="1,2,4,8,16", help="peers per NIC to measure (default 1,2,4,8,16)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement per setting (default 20)")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="probe interval (default 10)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the sandbox down when killed
    if args.quick:
        args.nodes, args.peers, args.seconds = 9, "2,8", 5.0
    peers = [int(p) for p in args.peers.split(",")]
    if max(peers) > args.nodes - 1:
        parser.error(f"{max(peers)} peers per NIC need at least {max(peers) + 1} nodes")
    warmup = 3.0
    work = Path(tempfile.mkdtemp(prefix="cw-lo-", dir="/tmp"))
    box = Sandbox(replace(SandboxConfig(), state_dir=str(work / "s"), nodes=args.nodes, accounting=False))
    say(f"lens_overhead: {args.nodes}-node sandbox at {work / 's'}, interval {args.interval_ms:g} ms")
    box.up()
    rows = []
    try:
        daemons = NodeDaemons(box)
        base = measure(daemons, {"lens.enabled": "false", "linkpass.enabled": "false"}, args.seconds, warmup)
        say(f"  baseline (Lens off): daemon CPU median {base['cpu_median_pct']} %, max {base['cpu_max_pct']} %")
        for k in peers:
            settings = {
                "lens.peers_per_nic": str(k),
                "lens.interval_ms": str(args.interval_ms),
                "linkpass.enabled": "false",
            }
            m = measure(daemons, settings, args.seconds, warmup)
            m["peers_per_nic"] = k
            m["lens_pct"] = round(m["cpu_median_pct"] - base["cpu_median_pct"], 2)
            rows.append(m)
            say(
                f"  {k:>2} peers/NIC: daemon CPU median {m['cpu_median_pct']:5.2f} % (max {m['cpu_max_pct']:5.2f} %; "
                f"user {m['user_median_pct']:5.2f} %, kernel {m['system_median_pct']:5.2f} %), "
                f"Lens's share {m['lens_pct']:5.2f} % of a core, {m['probes_per_s_median']:.0f} probes/s sent"
            )
            if m["lens_phases_pct"]:
                say(
                    "      by phase (Lens's own account, % of a core, median node): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in m["lens_phases_pct"].items())
                )
        daemons.stop_all()
        exe = build_floor(work)
        floor_s = min(args.seconds, 3.0) if args.quick else args.seconds
        nics = len(box.layout().nodes[0].nics)
        for m in rows:
            # The peers Lens really probed (the plan may add some to cover every link twice): from its rate,
            # one probe per peer and one more for the coded pair per NIC and tick.
            k = max(1, round(m["probes_per_s_median"] * args.interval_ms / 1000 / nics) - 1)
            m["floor_peers"] = k
            m["floor_pct"] = measure_floor(exe, box, k, args.interval_ms, floor_s, loopback=False)
            m["floor_loopback_pct"] = measure_floor(exe, box, k, args.interval_ms, floor_s, loopback=True)
            m["above_floor_pct"] = round(m["lens_pct"] - m["floor_pct"], 2)
            m["with_loopback_floor_pct"] = round(m["above_floor_pct"] + m["floor_loopback_pct"], 2)
            say(
                f"  {m['peers_per_nic']:>2} peers/NIC ({k} probed): the probe packets alone (probe floor) "
                f"{m['floor_pct']:5.2f} % on the rails, {m['floor_loopback_pct']:5.2f} % over loopback; "
                f"Lens above them "
                f"{m['above_floor_pct']:5.2f} %; Lens had its packets cost what loopback's do "
                f"{m['with_loopback_floor_pct']:5.2f} % (an estimate)"
            )
    finally:
        box.down()
    at16 = next((r for r in rows if r["peers_per_nic"] == 16), None)
    verdict = (
        "not measured (needs 16 peers)"
        if at16 is None
        else (
            f"{at16['lens_pct']} % at 16 peers/NIC: goal < {GOAL_PCT:g} % "
            + ("met" if at16["lens_pct"] < GOAL_PCT else "NOT met")
        )
    )
    say(f"goal: {verdict}")
    result = {
        "bench": "lens_overhead",
        "nodes": args.nodes,
        "interval_ms": args.interval_ms,
        "seconds": args.seconds,
        "baseline_lens_off": base,
        "results": rows,
        "goal_pct": GOAL_PCT,
        "goal_met": None if at16 is None else at16["lens_pct"] < GOAL_PCT,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
