#!/usr/bin/env python3
"""The control plane's cost per node: LinkPass's heartbeats and the node watch, measured on the sandbox at growing
node counts and modelled for 64, 256 and 1,024 nodes x 8 NICs, bounded peers against every peer.

1. **Sandbox.** For each size (4, 8, 16, 32 nodes; 4 only with ``--quick``, which then says nothing about
   flatness) a private sandbox (its own tag, management net and Slurm ports) runs one clockworkd per node with
   LinkPass and the node watch on and Lens off,
   and one job registered on its first ``--job-nodes`` nodes (the node watch heartbeats the job's other nodes).
   Two settings side by side in the same run: the bounded peers (the shipped defaults) and every peer on every
   rail (``ring_neighbours`` = nodes, which selects the pre-#47 all-to-all pattern; the packets are the new
   fixed-size ones). Per daemon over ``--seconds``: CPU (user + system, /proc, every thread), heartbeat packets
   sent and received a second (LinkPass's counters), bytes a second (packets x the packet's size on the wire).
2. **Model** (``bench/support/heartbeat_costs.py``): this machine's cost of one heartbeat sent and received and
   of the loop's tick, measured with LinkPass's own code over loopback, times the packets a node sends and
   receives at 64, 256 and 1,024 nodes x 8 NICs.

Goal (issue 47): per-node CPU flat in the node count, under 3 % of a core at 1,024 nodes by the model.
Needs root. The last line printed is one JSON object of the figures.

    sudo .venv/bin/python bench/control_plane_scale.py [--quick] [--sizes 4,8,16,32] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from support.heartbeat_costs import IP_UDP, measure, model

from clockwork.contracts.config.core import SandboxConfig
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.daemons import NodeDaemons
from clockwork.sandbox.processes import wait_until
from linkpass.heartbeat import packet_size
from linkpass.settings import LinkPassConfig

GOAL_PCT = 3.0
TICK = os.sysconf("SC_CLK_TCK")
JOB_ID = 4747


def say(text: str = "") -> None:
    print(text, flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def register_job(daemons: NodeDaemons, nodes: list[str]) -> None:
    """The job the node watch heartbeats for: registered on each of its nodes, as the Prolog does."""
    for node in nodes:
        with DaemonClient(daemons.paths(node), timeout_s=5) as client:
            client.register_job(JOB_ID, 0, "root", nodes, {})


def measure_sandbox(
    daemons: NodeDaemons, settings: dict[str, str], job: list[str], seconds: float, nics: int
) -> dict[str, Any]:
    pids = daemons.start_all(settings)
    register_job(daemons, job)

    def heard() -> bool:  # every daemon hears its peers (its path peers and job peers are heard)
        return all(daemons.component(n, "linkpass").get("heartbeats", {}).get("received", 0) > 0 for n in pids)

    wait_until("every daemon to hear heartbeats", heard, timeout_s=30, interval_s=0.1)
    time.sleep(1.0)  # past the start-up: the job's watch peers are heartbeated from the node watch's next tick
    c0 = {n: cpu_seconds(p) for n, p in pids.items()}
    h0 = {n: daemons.component(n, "linkpass").get("heartbeats", {}) for n in pids}
    t0 = time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    c1 = {n: cpu_seconds(p) for n, p in pids.items()}
    status = {n: daemons.component(n, "linkpass") for n in pids}
    cpu = [100 * (c1[n] - c0[n]) / dt for n in pids]
    sent = [(status[n]["heartbeats"]["sent"] - h0[n].get("sent", 0)) / dt for n in pids]
    got = [(status[n]["heartbeats"]["received"] - h0[n].get("received", 0)) / dt for n in pids]
    rejected = sum(status[n]["heartbeats"]["rejected"] for n in pids)
    path_peers = [len(status[n].get("heartbeat_peers", {}).get("path", [])) for n in pids]
    size = packet_size(statistics.median_high(path_peers))
    daemons.stop_all()
    return {
        "cpu_median_pct": round(statistics.median(cpu), 2),
        "cpu_max_pct": round(max(cpu), 2),
        "sent_per_s_median": round(statistics.median(sent), 1),
        "received_per_s_median": round(statistics.median(got), 1),
        "bytes_out_per_s_median": round(statistics.median(sent) * (size + IP_UDP)),
        "packet_bytes": size,
        "path_peers_max": max(path_peers),
        "rejected": rejected,
    }


def sandbox_rows(sizes: list[int], seconds: float, job_nodes: int) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        work = Path(tempfile.mkdtemp(prefix="cw-cps-", dir="/tmp"))
        cfg = replace(
            SandboxConfig(),
            state_dir=str(work / "s"),
            nodes=n,
            accounting=False,
            tag="cps",
            mgmt_net="198.19.47.0/24",
            port_base=SandboxConfig().port_base + 470,
        )
        box = Sandbox(cfg)
        t0 = time.monotonic()
        try:
            box.up()
        except Exception as exc:  # a size the machine cannot hold: say so and stop growing
            say(f"  {n} nodes: the sandbox did not come up ({exc}); stopping here")
            box.down()
            break
        say(f"  {n}-node sandbox up in {time.monotonic() - t0:.1f} s")
        try:
            daemons = NodeDaemons(box)
            job = daemons.nodes[: min(job_nodes, n)]
            base = {"lens.enabled": "false", "linkpass.enabled": "true", "nodewatch.enabled": "true"}
            bounded = measure_sandbox(daemons, base, job, seconds, cfg.nics)
            every = measure_sandbox(daemons, {**base, "linkpass.ring_neighbours": str(n)}, job, seconds, cfg.nics)
        finally:
            box.down()
        row = {"nodes": n, "nics": cfg.nics, "job_nodes": len(job), "bounded": bounded, "all_peers": every}
        row["cpu_ratio_all_over_bounded"] = round(every["cpu_median_pct"] / max(bounded["cpu_median_pct"], 1e-3), 2)
        rows.append(row)
        say(
            f"  {n:>2} nodes x {cfg.nics} NICs: bounded {bounded['cpu_median_pct']:5.2f} % CPU (max "
            f"{bounded['cpu_max_pct']:5.2f}), {bounded['sent_per_s_median']:7.0f} pkts/s out, "
            f"{bounded['received_per_s_median']:7.0f} in, {bounded['bytes_out_per_s_median'] / 1e3:7.1f} kB/s out, "
            f"{bounded['path_peers_max']} path peers | all peers {every['cpu_median_pct']:5.2f} % CPU, "
            f"{every['sent_per_s_median']:7.0f} pkts/s out | all/bounded CPU x{row['cpu_ratio_all_over_bounded']}"
        )
    return rows


def model_rows(rounds: int, job_nodes: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cfg = LinkPassConfig()
    costs_rows, rows = [], []
    for n in (64, 256, 1024):
        costs = measure(n, 8, rounds, cfg)
        costs_rows.append(asdict(costs))
        say(
            f"  measured at {n} x 8 ({costs.packet_bytes}-byte packets): send {costs.send_us:.1f} us, receive "
            f"{costs.recv_us:.1f} us per packet; tick {costs.tick_us_per_peer:.2f} us per path peer, judge "
            f"{costs.judge_us_per_peer:.2f} us per heard peer"
        )
        for job in sorted({job_nodes, 64}):
            bounded, every = model(costs, cfg, job), model(costs, cfg, job, all_peers=True)
            rows.append({"bounded": asdict(bounded), "all_peers": asdict(every)})
            say(
                f"    model {n:>4} nodes x 8, a {job}-node job here: bounded {bounded.path_peers} path + "
                f"{bounded.watch_peers} watch peers, {bounded.packets_per_s:8.0f} pkts/s each way, "
                f"{bounded.bytes_per_s / 1e6:6.2f} MB/s, {bounded.cpu_pct:5.2f} % CPU | all peers "
                f"{every.packets_per_s:8.0f} pkts/s, {every.bytes_per_s / 1e6:9.1f} MB/s ({every.packet_bytes}-byte "
                f"packets{', over the old 8 KB limit: all dropped' if every.packet_bytes > 8192 else ''}), "
                f"{every.cpu_pct:7.1f} % CPU | x{every.cpu_pct / bounded.cpu_pct:.0f}"
            )
    return costs_rows, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sandbox at 4 nodes, 2 s each (< 1 min)")
    parser.add_argument("--sizes", default="4,8,16,32", help="sandbox node counts (default 4,8,16,32)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measurement per setting (default 10)")
    parser.add_argument("--job-nodes", type=int, default=8, help="nodes of the job registered (default 8)")
    parser.add_argument("--no-sandbox", action="store_true", help="the model only")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the sandbox down when killed
    if args.quick:
        args.sizes, args.seconds = "4", 2.0
    sizes = [int(s) for s in args.sizes.split(",")]
    say("control_plane_scale: cost model (this machine's per-packet costs, LinkPass's own code, loopback)")
    costs, models = model_rows(100 if args.quick else 400, args.job_nodes)
    rows: list[dict[str, Any]] = []
    if not args.no_sandbox:
        say(f"control_plane_scale: sandbox, LinkPass + node watch on, Lens off, {args.seconds:g} s per setting")
        rows = sandbox_rows(sizes, args.seconds, args.job_nodes)
    at1024 = next(m["bounded"] for m in models if m["bounded"]["nodes"] == 1024 and m["bounded"]["job_nodes"] == 8)
    flat = None
    if len(rows) >= 2:
        cpus = [r["bounded"]["cpu_median_pct"] for r in rows]
        flat = max(cpus) <= 1.5 * min(cpus) + 0.5
        say(f"sandbox: bounded CPU per node {cpus} % across {[r['nodes'] for r in rows]} nodes: flat = {flat}")
    met = at1024["cpu_pct"] < GOAL_PCT
    say(
        f"goal: {at1024['cpu_pct']:.2f} % of a core at 1,024 nodes x 8 (model, an 8-node job): < {GOAL_PCT:g} % "
        + ("met" if met else "NOT met")
    )
    result = {
        "bench": "control_plane_scale",
        "sizes": sizes,
        "seconds": args.seconds,
        "job_nodes": args.job_nodes,
        "sandbox": rows,
        "costs": costs,
        "model": models,
        "goal_pct": GOAL_PCT,
        "goal_met": met,
        "flat": flat,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
