"""``clockwork report JOBID``: what happened to a job, joined with its Slurm accounting record; ``--since``: the
fleet's faults over a window.

The events come from the node daemons (this host's, and those of the job's nodes when their run folders are
reachable from here, as in the sandbox) and, for a node whose daemon no longer knows the job, from the report
the Epilog wrote there. The accounting record comes from ``sacct`` (state, nodes, start/end, exit code,
requeues, AdminComment); without slurmdbd the live ``squeue`` view is used and the report says so. The story
itself (incidents, resolutions, durations, savings) is :mod:`clockwork.cli.job_story`.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import click

from clockwork.cli.context import CliContext, pass_ctx
from clockwork.cli.job_events import events_from, job_nodes
from clockwork.cli.job_story import FleetSummary, JobStory, build_story, fleet_summary
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import DaemonPaths, local_node_name
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.hostlist import expand_hostlist


def _gather(loaded: Any, job_id: int, nodes: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every node's events of the job (deduplicated), and where they came from."""
    cfg = loaded.daemon
    here = local_node_name(cfg)
    candidates = [here] + ([n for n in nodes if n != here] if "{node}" in cfg.run_dir else [])
    seen: set[tuple[str, int, str]] = set()
    events: list[dict[str, Any]] = []
    sources: list[str] = []
    for node in candidates:
        found = events_from(cfg, node, job_id)
        origin = f"{node} (daemon)"
        if found is None:
            report = DaemonPaths.from_config(cfg, node).reports_dir / f"{job_id}.json"
            found = _report_events(report)
            origin = f"{node} (Epilog report)"
        if found is None:
            continue
        sources.append(origin)
        for event in found:
            key = (str(event.get("node", node)), int(event.get("seq", 0)), str(event.get("kind", "")))
            if key not in seen:
                seen.add(key)
                events.append(event)
    return events, sources


def _report_events(path: Path) -> list[dict[str, Any]] | None:
    try:
        return list(json.loads(path.read_text()).get("events", []))
    except (OSError, ValueError):
        return None


def _accounting(loaded: Any, job_id: int) -> dict[str, Any]:
    """The job's accounting summary: sacct's record, else slurmctld's live view, else why neither."""
    from clockwork.contracts.slurm import from_config

    slurm = from_config(loaded.slurm)
    try:
        records = slurm.accounting(job_id, all_steps=True)
    except ClockworkError as exc:
        records, note = [], f"no accounting ({exc})"
    else:
        note = ""
    job = next((r for r in records if not r.is_step), None)
    if job is not None:
        return {
            "source": "sacct",
            "state": job.state,
            "nodes": job.nodes,
            "start": job.start,
            "end": job.end,
            "exit_code": job.exit_code,
            "admin_comment": job.admin_comment,
            "steps": [
                {"step": r.job_id, "state": r.state, "nodes": r.nodes, "exit_code": r.exit_code}
                for r in records
                if r.is_step
            ],
        }
    try:
        info = slurm.job(job_id)
    except ClockworkError as exc:
        return {"source": "none", "note": f"{note or 'no accounting record'}; slurmctld: {exc}"}
    if info is None:
        return {"source": "none", "note": note or "Slurm knows no such job"}
    return {
        "source": "slurmctld",
        "state": info.state,
        "nodes": info.nodes,
        "exit_code": info.exit_code,
        "requeues": info.restart_count,
        "admin_comment": info.admin_comment,
        "note": note,
    }


def _render(story: JobStory, sources: list[str]) -> None:
    acct = story.accounting
    if acct.get("source") in ("sacct", "slurmctld"):
        span = f", {acct['start']} -> {acct['end'] or 'running'}" if acct.get("start") else ""
        click.echo(
            f"Job {story.job_id}: {acct['state']}, exit {acct.get('exit_code') or '?'}, nodes "
            f"{','.join(acct.get('nodes') or []) or '?'}{span} (from {acct['source']})"
        )
        if acct.get("admin_comment"):
            click.echo(f"  AdminComment: {acct['admin_comment']}")
        for step in acct.get("steps", []):
            click.echo(f"  step {step['step']}: {step['state']} exit {step['exit_code']} on {','.join(step['nodes'])}")
    else:
        click.echo(f"Job {story.job_id}: {acct.get('note', 'no Slurm record')}")
    click.echo(f"\nTimeline: {len(story.incidents)} incident(s) from {story.events} event(s) ({', '.join(sources)})")
    start = min((i.time for i in story.incidents), default=0.0)
    for incident in story.incidents:
        stamp = time.strftime("%H:%M:%S", time.localtime(incident.time))
        click.echo(
            f"  {stamp} +{incident.time - start:7.1f}s  {incident.node:<8} {incident.what:<14} {incident.detail}"
        )
        click.echo(f"  {'':>19}{'':<9}{'':<15}-> {incident.resolution}")
    click.echo(
        f"\nSaved against checkpoint-restart (a checkpoint every {story.checkpoint_interval_s / 60:g} min, a "
        f"restart costing {story.restart_cost_s:g} s, {story.nodes} node(s)): {story.saved_node_h:.2f} node-hours "
        f"over {story.faults} fault(s) resolved without a rollback."
    )


def _duration_s(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``90s`` -> seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match is None:
        raise click.BadParameter(f"{text!r} is not a duration such as 7d, 12h, 30m or 90s", param_hint="--since")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def _fleet(loaded: Any, since: float, interval_s: float, restart_s: float) -> tuple[list[JobStory], list[str]]:
    """A story for every job any reachable daemon ran since ``since``, and the nodes that answered."""
    from clockwork.contracts.slurm import from_config

    cfg = loaded.daemon
    here = local_node_name(cfg)
    nodes = [here]
    if "{node}" in cfg.run_dir:
        try:
            nodes += [n.name for n in from_config(loaded.slurm).nodes() if n.name != here]
        except ClockworkError:
            pass
    jobs: dict[int, dict[str, Any]] = {}
    answered = []
    for node in nodes:
        try:
            with DaemonClient.from_config(cfg, node) as client:
                listed = client.jobs()
            answered.append(node)
        except ClockworkError:  # no daemon there now: the reports its Epilog wrote still tell
            listed = _reported_jobs(DaemonPaths.from_config(cfg, node).reports_dir)
            if listed:
                answered.append(f"{node} (Epilog reports)")
        for job in listed:
            if (job.get("ended_at") or time.time()) >= since:
                jobs.setdefault(int(job["job_id"]), job)
    stories = []
    for job_id, job in sorted(jobs.items()):
        events, _ = _gather(loaded, job_id, list(job.get("nodes") or []))
        size = max(1, len(job.get("nodes") or []))
        stories.append(
            build_story(job_id, events, {}, nodes=size, checkpoint_interval_s=interval_s, restart_cost_s=restart_s)
        )
    return stories, answered


def _reported_jobs(reports_dir: Path) -> list[dict[str, Any]]:
    """The jobs whose Epilog reports lie in ``reports_dir``, shaped like the daemon's ``jobs`` answer."""
    out = []
    for path in sorted(reports_dir.glob("*.json")) if reports_dir.is_dir() else []:
        if not path.stem.isdigit():  # JOB.N.json: an earlier run of a requeued job, not another job
            continue
        try:
            report = json.loads(path.read_text())
            nodes = expand_hostlist(str(report.get("nodelist") or ""))
            out.append({"job_id": int(report["job_id"]), "nodes": nodes, "ended_at": float(report["written"])})
        except (OSError, ValueError, KeyError, TypeError, ClockworkError):
            continue
    return out


def _render_fleet(summary: FleetSummary, answered: list[str]) -> None:
    days = (summary.until - summary.since) / 86400
    click.echo(f"Fleet: {summary.jobs} job(s) over the last {days:g} day(s) (daemons of {', '.join(answered)})")
    click.echo(f"  faults resolved without a rollback: {summary.faults}; rollbacks: {summary.rollbacks}")
    if summary.compute_once_ratio is not None and summary.mtbf_h is not None:
        click.echo(f"  you-only-compute-once ratio: {summary.compute_once_ratio:.0%}; MTBF {summary.mtbf_h:.2f} h")
    click.echo(f"  by kind: {', '.join(f'{k} {v}' for k, v in summary.by_kind.items()) or 'none'}")
    click.echo(f"  by node: {', '.join(f'{k} {v}' for k, v in summary.by_node.items()) or 'none'}")
    click.echo(f"  worst links: {', '.join(f'{k} ({v})' for k, v in summary.worst_links) or 'none'}")
    click.echo(f"  saved against checkpoint-restart: {summary.saved_node_h:.2f} node-hours")


@click.command()
@click.argument("job_id", type=click.IntRange(min=1), required=False)
@click.option("--since", metavar="DURATION", help="Fleet view: every job of the last DURATION (7d, 12h, 30m).")
@click.option(
    "--checkpoint-interval-min",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="The checkpoint interval the savings are counted against.",
)
@click.option(
    "--restart-cost-s",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="What one checkpoint restart costs (requeue, start, reload).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for tools.")
@pass_ctx
def report(
    state: CliContext,
    job_id: int | None,
    since: str | None,
    checkpoint_interval_min: float,
    restart_cost_s: float,
    as_json: bool,
) -> None:
    """Show what happened to job JOB_ID: each fault, how it was resolved, how long that took, what it saved.

    With --since instead of a job: the fleet's faults by kind and by node, the mean time between faults, the
    share resolved without a rollback, the worst links, and the node-hours saved."""
    loaded = state.load().config
    if (job_id is None) == (since is None):
        raise click.UsageError("give either JOB_ID or --since DURATION")
    if since is not None:
        now = time.time()
        start = now - _duration_s(since)
        stories, answered = _fleet(loaded, start, checkpoint_interval_min * 60, restart_cost_s)
        summary = fleet_summary(stories, start, now)
        if as_json:
            click.echo(json.dumps({**summary.to_dict(), "daemons": answered}, indent=2))
        else:
            _render_fleet(summary, answered)
        return
    assert job_id is not None  # the usage check above
    accounting = _accounting(loaded, job_id)
    nodes = list(accounting.get("nodes") or []) or job_nodes(loaded, job_id)
    events, sources = _gather(loaded, job_id, nodes)
    if not events and accounting.get("source") == "none":
        raise ClockworkError(f"job {job_id}: no Clockwork events and no Slurm record ({accounting.get('note')})")
    story = build_story(
        job_id,
        events,
        accounting,
        nodes=max(1, len(nodes)),
        checkpoint_interval_s=checkpoint_interval_min * 60,
        restart_cost_s=restart_cost_s,
    )
    if as_json:
        click.echo(json.dumps({**story.to_dict(), "sources": sources}, indent=2, default=str))
        return
    _render(story, sources)
