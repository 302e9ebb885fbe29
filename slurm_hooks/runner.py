"""What each hook does, and the rule that a hook failure never takes a healthy node out of service.

A non-zero Prolog exit makes slurmd drain the node, and a failing PrologSlurmctld requeues the job.
Clockwork's own trouble (a bad config, a daemon that will not start, a full spool) is therefore logged
and swallowed. The single exception is the admin's explicit ``[hooks] require_daemon = true``: then a
clockwork job's Prolog fails when the node cannot run the daemon, because the node cannot give the
job the fault tolerance it asked for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from clockwork.contracts.borrow_comments import with_borrowed
from clockwork.contracts.config import LoadedConfig, load_config
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.job_options import SpareMode
from clockwork.contracts.logging_setup import configure_logging
from clockwork.contracts.slurm import expand_hostlist, from_config
from slurm_hooks import events, gpu_jobmap, report
from slurm_hooks.context import HookContext, from_env, resolve_context
from slurm_hooks.supervisor import ensure_daemon

log = logging.getLogger("clockwork.hooks")

EVENT_OF = {
    "prolog_slurmd": "job.prolog",
    "epilog_slurmd": "job.epilog",
    "prolog_slurmctld": "job.start",
    "epilog_slurmctld": "job.end",
}
#: Slurm gives hooks no PATH; the Slurm commands the hooks call live here.
DEFAULT_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def wants_clockwork(ctx: HookContext) -> bool:
    return ctx.job.enabled


def reports_dir(loaded: LoadedConfig) -> Path:
    cfg = loaded.config
    paths = DaemonPaths.from_config(cfg.daemon)
    return Path(cfg.hooks.report_dir.replace("{node}", paths.node)) if cfg.hooks.report_dir else paths.reports_dir


def prolog(ctx: HookContext, loaded: LoadedConfig) -> int:
    """Start or adopt the daemon and register the job. Non-zero only under ``require_daemon``."""
    cfg = loaded.config
    spool = Path(cfg.hooks.spool_dir)
    check = ensure_daemon(cfg.daemon, loaded.path)
    events.append(spool, ctx.job_id, ctx.node, f"daemon.{check.action}", pid=check.pid, detail=check.detail)
    if check.ok:
        try:
            with DaemonClient.from_config(cfg.daemon) as client:
                client.register_job(ctx.job_id, ctx.uid or 0, ctx.user, expand_hostlist(ctx.nodelist), ctx.options)
            log.info("job %d: registered with clockworkd on %s (%s)", ctx.job_id, ctx.node, check.action)
            return 0
        except ClockworkError as exc:
            check_detail = f"registration failed: {exc}"
    else:
        check_detail = check.detail
    events.append(spool, ctx.job_id, ctx.node, "daemon.unavailable", detail=check_detail)
    if cfg.hooks.require_daemon:
        log.error("job %d: no clockworkd on %s and require_daemon is set: %s", ctx.job_id, ctx.node, check_detail)
        return 1
    log.error("job %d: runs without fault tolerance on %s: %s", ctx.job_id, ctx.node, check_detail)
    return 0


def give_back(client: DaemonClient, ctx: HookContext) -> None:
    """The job ended: its borrowed nodes go back to the preempted work (every node's Epilog asks; the first
    one cancels the holder allocations, the others find none). Recorded as ``borrow.released`` events."""
    try:
        released = client.borrow_release(ctx.job_id, why=f"job {ctx.job_id} ended")
    except ClockworkError as exc:  # borrowing off on this node: nothing was borrowed through it
        log.info("job %d: no borrowed node given back on %s: %s", ctx.job_id, ctx.node, exc)
        return
    if released:
        log.info("job %d: gave back borrowed node(s), holder job(s) %s", ctx.job_id, released)


def epilog(ctx: HookContext, loaded: LoadedConfig) -> None:
    """Gather the job's events, unregister it, write the report; the head node sets the AdminComment."""
    cfg = loaded.config
    check = ensure_daemon(cfg.daemon, loaded.path)
    job_events: list[dict[str, object]] = []
    if check.ok:
        with DaemonClient.from_config(cfg.daemon) as client:
            try:
                if ctx.job.spares is SpareMode.BORROW:
                    give_back(client, ctx)
                job_events = client.job_events(ctx.job_id)
                client.unregister_job(ctx.job_id)
            except ClockworkError as exc:
                log.warning("job %d: daemon on %s: %s", ctx.job_id, ctx.node, exc)
    data = report.build(ctx, job_events, daemon=check.action if check.ok else f"unavailable: {check.detail}")
    path = report.write(data, reports_dir(loaded))
    line = report.summary(data, path)
    log.info("job %d: %s", ctx.job_id, line)
    nodes = expand_hostlist(ctx.nodelist)
    if nodes and nodes[0] == ctx.node:  # one AdminComment per job: the first node of the allocation writes it
        backend = from_config(cfg.slurm)
        if ctx.job.spares is SpareMode.BORROW:  # keep what the borrow wrote (which nodes, from which jobs)
            try:
                live = backend.job(ctx.job_id)
                line = with_borrowed(line, live.admin_comment if live is not None else "")
            except ClockworkError as exc:  # the summary is still worth writing
                log.warning("job %d: its borrowed-node note is not kept: %s", ctx.job_id, exc)
        backend.set_admin_comment(ctx.job_id, line)


def map_gpus(ctx: HookContext, loaded: LoadedConfig) -> None:
    """dcgm-exporter's job mapping (every job, Clockwork or not): the Prolog lists the job on its GPUs, the
    Epilog takes it off. Off without ``[hooks] gpu_job_map_dir``; a failure is logged, never fatal."""
    folder = loaded.config.hooks.gpu_job_map_dir
    if not folder:
        return
    try:
        if ctx.context == "prolog_slurmd":
            changed = gpu_jobmap.add_job(Path(folder), ctx.job_id, ctx.gpus)
        else:
            changed = gpu_jobmap.remove_job(Path(folder), ctx.job_id)
    except OSError as exc:
        log.error("job %d: dcgm-exporter job mapping in %s not updated: %s", ctx.job_id, folder, exc)
        return
    if changed:
        log.info("job %d: dcgm-exporter job mapping updated: %s", ctx.job_id, ", ".join(p.name for p in changed))


def handle(ctx: HookContext, loaded: LoadedConfig) -> int:
    """Record the hook's event; for clockwork jobs on a node, run the Prolog/Epilog work."""
    fields: dict[str, object] = {
        "uid": ctx.uid,
        "user": ctx.user,
        "nodelist": ctx.nodelist,
        "partition": ctx.partition,
        "restart_count": ctx.restart_count,
        "options": ctx.options,
    }
    if ctx.exit_code is not None:
        fields["exit_code"] = ctx.exit_code
    if not ctx.on_controller:  # first: an unwritable spool must not leave a job on its GPUs
        map_gpus(ctx, loaded)
    path = events.append(Path(loaded.config.hooks.spool_dir), ctx.job_id, ctx.node, EVENT_OF[ctx.context], **fields)
    log.info("job %d: %s on %s recorded in %s", ctx.job_id, EVENT_OF[ctx.context], ctx.node, path)
    if not wants_clockwork(ctx) or ctx.on_controller:
        return 0
    if ctx.context == "prolog_slurmd":
        return prolog(ctx, loaded)
    epilog(ctx, loaded)
    return 0


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Entry point for Slurm (``python -m slurm_hooks CONTEXT``, or ``clockwork-hook`` with SLURM_SCRIPT_CONTEXT)."""
    env = os.environ if env is None else env
    os.environ.setdefault("PATH", DEFAULT_PATH)
    args = list(argv or [])
    try:
        loaded = load_config(env=env)
        configure_logging(loaded.config.log, component="hooks")
    except Exception as exc:  # a broken config must not drain nodes
        configure_logging(None, component="hooks")
        log.error("configuration unusable, hook does nothing: %s", exc)
        return 0
    try:
        ctx = from_env(resolve_context(args[0] if args else None, env), env)
        return handle(ctx, loaded)
    except Exception:
        log.exception("hook failed (ignored: Clockwork's own failure never drains a node)")
    return 0


def console_main() -> None:
    """``clockwork-hook``: one program for all four hook parameters; Slurm says which in SLURM_SCRIPT_CONTEXT."""
    raise SystemExit(main([]))
