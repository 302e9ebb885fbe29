"""``clockwork node``: a node daemon's health, its jobs and their events, read over its control socket.

Local only: the command talks to the daemon whose control socket lies under ``[daemon] run_dir`` with
``{node}`` expanded. On a real cluster each node has its own run folder, so ``--node`` other than
this host only works where the nodes share one (the sandbox); elsewhere run it on the node (srun, ssh).
What a caller sees is what the daemon lets its uid see (root and SlurmUser: everything).
"""

from __future__ import annotations

import json
import time
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clockwork.cli.context import CliContext, pass_ctx
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import local_node_name
from clockwork.contracts.errors import ClockworkError


def _client(state: CliContext, node: str | None) -> DaemonClient:
    cfg = state.load().config.daemon
    here = local_node_name(cfg)
    if node and node != here and "{node}" not in cfg.run_dir:
        raise ClockworkError(
            f"the daemon of {node} cannot be reached from {here}: [daemon] run_dir ({cfg.run_dir}) has no "
            f"{{node}}, so only this host's daemon is reachable here; run the command on {node}"
        )
    return DaemonClient.from_config(cfg, node or here)


def _when(stamp: Any) -> str:
    if not isinstance(stamp, int | float):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) + f".{int(stamp * 1000) % 1000:03d}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


def _console() -> Console:
    return Console(width=max(120, Console().width), soft_wrap=False)


def _events_table(title: str, events: list[dict[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("time", "job", "seq", "node", "kind", "fields"):
        table.add_column(col, overflow="fold")
    for event in events:
        table.add_row(
            _when(event.get("time")),
            str(event.get("job_id", "")),
            str(event.get("seq", "")),
            str(event.get("node", "")),
            str(event.get("kind", "")),
            json.dumps(event.get("fields", {}), sort_keys=True),
        )
    return table


@click.group()
def node() -> None:
    """A node daemon (clockworkd): health, registered jobs, events."""


def _lens_line(lens: dict[str, Any]) -> str:
    """One line: Fleet Lens on or off (and why), paths watched, bad paths, suspects."""
    if not lens:
        return "not reported"
    if not lens.get("enabled"):
        return f"off ({lens.get('state', 'unknown')})"
    suspects = lens.get("suspects") or []
    return (
        f"on: {lens.get('paths', 0)} paths watched, {lens.get('bad_paths', 0)} bad, "
        + (f"suspects: {', '.join(suspects)}" if suspects else "no suspects")
        + f"; metrics {lens.get('metrics', 'off')}"
    )


def _linkpass_line(lp: dict[str, Any]) -> str:
    """One line: LinkPass state, each NIC, where traffic goes, failover counts, sysctls it depends on."""
    if not lp.get("enabled"):
        return f"off ({lp.get('state', 'not reported')})"
    nics = ", ".join(f"{n} {'up' if v['up'] else 'DOWN'}" for n, v in lp["nics"].items())
    moved = sorted(f"{peer} via {'+'.join(rails)}" for peer, rails in lp["routes"].items())
    sysctl = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in lp.get("sysctls", {}).items())
    note = f"; {lp['note']}" if lp.get("note") else ""
    hcas = lp.get("avoid_hcas") or {}  # new communicators exclude these (NCCL_IB_HCA); none on a daemon predating it
    rdma = f"; NCCL_IB_HCA excludes {', '.join(sorted(hcas))}" if hcas else ""
    refused = (lp.get("heartbeats") or {}).get("refused", 0)
    forged = f"; {refused} heartbeats refused (not signed by their sender for itself)" if refused else ""
    return (
        f"on; NICs {nics}; routes {', '.join(moved)}; {lp['failovers']} failovers, {lp['failbacks']} failbacks; "
        f"avoid [{', '.join(lp['avoid_nics'])}]{rdma}; sysctls {sysctl}{note}{forged}"
    )


def _health_line(health: dict[str, Any]) -> str:
    """One line: the GPU health watch on or off (and why), its source, each GPU's health."""
    if not health:
        return "not reported"
    if not health.get("enabled"):
        return f"off ({health.get('state', 'unknown')})"
    gpus = ", ".join(f"{name} {state}" for name, state in sorted(health.get("health", {}).items()))
    return f"on: {health.get('source', '?')}; " + (gpus or "no GPUs")


def _nodewatch_line(w: dict[str, Any]) -> str:
    """One line: the node watch on or off (and why), the nodes judged dead now, the peers under suspicion."""
    if not w.get("enabled"):
        return f"off ({w.get('state', 'not reported')})"
    dead = ", ".join(v["node"] for v in w.get("in_force", [])) or "none"
    watched = ", ".join(f"{peer} ({s['state']})" for peer, s in w.get("suspects", {}).items()) or "none"
    fault = f"; cannot judge: {w['local_fault']}" if w.get("local_fault") else ""
    return (
        f"on; silent after {w['silent_after_ms']} ms; judged dead now: {dead}; silent now: {watched}; "
        f"second observer {w['second_observer']}{fault}"
    )


def _borrow_line(b: dict[str, Any]) -> str:
    """One line: whether this daemon borrows nodes, and how many it holds now."""
    if not b.get("enabled"):
        return f"off ({b.get('state', 'not reported')})"
    return (
        f"on; {b['held']} node(s) held now, {b['requests']} request(s) ({b['failed']} failed); "
        f"give back at {b['give_back']}"
    )


@node.command()
@click.option("--node", "node_name", metavar="NODE", help="Whose daemon (default: this host's).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (the daemon's status reply).")
@pass_ctx
def status(state: CliContext, node_name: str | None, as_json: bool) -> None:
    """Show the daemon's health: pid, uptime, peer plane, registered jobs and recent events."""
    with _client(state, node_name) as client:
        info = client.status()
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    console = _console()
    console.print(
        f"clockworkd on {info['node']}: up {_duration(info['uptime_s'])} (pid {info['pid']}, version {info['version']})"
    )
    console.print(f"  control socket: {info['control']}")
    console.print(f"  peer plane:     {info['peer_plane']}")
    console.print(f"  linkpass:       {_linkpass_line(info.get('linkpass', {}))}")
    console.print(f"  lens:           {_lens_line(info.get('lens', {}))}")
    console.print(f"  node watch:     {escape(_nodewatch_line(info.get('nodewatch', {})))}")
    console.print(f"  gpu health:     {escape(_health_line(info.get('health', {})))}")
    console.print(f"  borrow:         {_borrow_line(info.get('borrow', {}))}")
    console.print(f"  jobs:           {info['jobs_running']} running, {info['jobs_total']} known")
    counters = info.get("counters", {})
    console.print("  requests:       " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    stuck = info.get("watchdog", {}).get("stuck", [])
    console.print("  stuck parts:    " + escape(", ".join(_stuck_part(s) for s in stuck) or "none"))
    if not info["caller"]["privileged"]:
        console.print(f"  (showing only the jobs of uid {info['caller']['uid']})")
    table = Table(title="jobs", title_justify="left")
    for col in ("job", "user (uid)", "state", "nodes", "options", "registered"):
        table.add_column(col, overflow="fold")
    for job in info["jobs"]:
        table.add_row(
            str(job["job_id"]),
            f"{job['user']} ({job['uid']})",
            job["state"],
            ",".join(job["nodes"]),
            " ".join(f"{k}={v}" for k, v in sorted(job["options"].items())) or "-",
            _when(job["registered_at"]),
        )
    console.print(table if info["jobs"] else "no jobs registered")
    events = info["recent_events"]
    console.print(_events_table("recent events", events) if events else "no recent events")


def _stuck_part(stuck: dict[str, Any]) -> str:
    """``health.read for 12.0 s (busy in one call, thread gpu-health-read_0)``: one part the watchdog reports."""
    thread = f", thread {stuck['thread']}" if stuck.get("thread") else ""
    return f"{stuck['part']} for {stuck['for_s']} s ({stuck['how']}{thread})"


@node.command()
@click.argument("job_id", type=click.IntRange(min=1))
@click.option("--node", "node_name", metavar="NODE", help="Whose daemon (default: this host's).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: a JSON list of events.")
@pass_ctx
def events(state: CliContext, job_id: int, node_name: str | None, as_json: bool) -> None:
    """List the events one daemon recorded for JOB_ID, oldest first (also after the job ended)."""
    with _client(state, node_name) as client:
        found = client.job_events(job_id)
    if as_json:
        click.echo(json.dumps(found, indent=2, sort_keys=True))
        return
    if not found:
        click.echo(f"job {job_id}: no events")
        return
    _console().print(_events_table(f"job {job_id}: {len(found)} events", found))


def _signal_text(signal: dict[str, Any]) -> str:
    threshold = signal.get("threshold")
    numeric = isinstance(threshold, int | float) and not isinstance(threshold, bool)
    limit = f" (threshold {threshold:g})" if numeric else ""
    return f"{signal['signal']}={signal.get('value')}{limit} -> {signal.get('action')}"


def _reading_text(reading: dict[str, Any]) -> str:
    """The reading's main values in one cell (missing ones are left out)."""
    if reading.get("lost"):
        return "LOST (fallen off the bus)"
    parts = []
    if reading.get("temperature_c") is not None:
        limits = "/".join(f"{reading[k]:g}" for k in ("slowdown_c", "shutdown_c") if reading.get(k) is not None)
        parts.append(f"{reading['temperature_c']:g} C" + (f" (limits {limits})" if limits else ""))
    if reading.get("throttle"):
        parts.append("throttle " + "+".join(reading["throttle"]))
    ecc = [f"{k.split('_', 1)[1]} {reading[k]}" for k in ("ecc_corrected", "ecc_uncorrected") if reading.get(k)]
    if ecc:
        parts.append("ECC " + ", ".join(ecc))
    if reading.get("rows_pending"):
        parts.append("row remap pending")
    if reading.get("rows_remap_failed"):
        parts.append("row remap FAILED")
    if reading.get("recovery_action") not in (None, "none"):
        parts.append(f"driver: {reading['recovery_action']}")
    if reading.get("error"):
        parts.append(f"error: {reading['error']}")
    return "; ".join(parts) or "-"


@node.command()
@click.option("--node", "node_name", metavar="NODE", help="Whose daemon (default: this host's).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (the daemon's gpus reply).")
@pass_ctx
def gpus(state: CliContext, node_name: str | None, as_json: bool) -> None:
    """Show each GPU's health, its reading, raised signals, the ranks on it and the last signal changes."""
    with _client(state, node_name) as client:
        info = client.gpus()
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    console = _console()
    if not info.get("enabled"):
        click.echo(f"GPU health on {info.get('node')}: off ({info.get('state', 'unknown')})")
        return
    click.echo(f"GPU health on {info['node']}: {info['source_state']}, every {info['interval_s']:g} s")
    if not info["gpus"]:
        click.echo("no GPUs")
        return
    table = Table(title="GPUs", title_justify="left")
    for col in ("gpu", "health", "reading", "signals", "ranks", "drain"):
        table.add_column(col, overflow="fold")
    for gpu in info["gpus"]:
        ranks = ", ".join(f"job {r['job_id']} slot {r['slot']}" for r in gpu["ranks"]) or "-"
        drain = gpu["drain_reason"] + (" (ready)" if gpu["drain_ready"] else " (once the job left)")
        table.add_row(
            f"{gpu['index']} {gpu.get('name', '')}".strip(),
            gpu["health"],
            escape(_reading_text(gpu["reading"])),
            escape("; ".join(_signal_text(s) for s in gpu["signals"]) or "-"),
            ranks,
            escape(drain) if gpu["drain_reason"] else "-",
        )
    console.print(table)
    changes = sorted((c for gpu in info["gpus"] for c in gpu["history"]), key=lambda c: c["time"])
    if changes:
        last = Table(title="last signals", title_justify="left")
        for col in ("time", "gpu", "signal", "state", "value", "threshold", "action"):
            last.add_column(col, overflow="fold")
        for c in changes[-20:]:
            last.add_row(
                _when(c["time"]),
                str(c["gpu"]),
                c["signal"],
                c["state"],
                str(c["value"]),
                "-" if c["threshold"] is None else str(c["threshold"]),
                c["action"],
            )
        console.print(last)
    for m in info.get("migrations", []):
        if m.get("scope") == "node":  # a whole-node move: every rank of the job on this node, together
            what = f"slots {', '.join(map(str, m['slots']))} off the node"
        else:
            what = f"slot {m['slot']} off gpu{m['gpu']}"
        click.echo(
            f"migration: job {m['job_id']} {what} ({m['signal']} {m['value']}): "
            f"{m['state']} {m.get('detail', '')}".rstrip()
        )
