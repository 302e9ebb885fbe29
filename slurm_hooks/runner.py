"""What each hook does, and the rule that a hook failure never takes a healthy node out of service.

A non-zero Prolog exit makes slurmd drain the node, and a failing PrologSlurmctld requeues the job.
Clockwork's own trouble (a bad config, a full spool) is therefore logged and swallowed: only a
verdict that the node itself is unhealthy may ever return non-zero (none does yet).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from clockworkd.config import load_config
from clockworkd.logging_setup import configure_logging
from slurm_hooks import events
from slurm_hooks.context import HookContext, from_env, resolve_context

log = logging.getLogger("clockwork.hooks")

EVENT_OF = {
    "prolog_slurmd": "job.prolog",
    "epilog_slurmd": "job.epilog",
    "prolog_slurmctld": "job.start",
    "epilog_slurmctld": "job.end",
}


def handle(ctx: HookContext, spool: Path) -> None:
    """Record the hook's event for the job (the daemon registration builds on this)."""
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
    path = events.append(spool, ctx.job_id, ctx.node, EVENT_OF[ctx.context], **fields)
    log.info("job %d: %s on %s recorded in %s", ctx.job_id, EVENT_OF[ctx.context], ctx.node, path)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Entry point for Slurm (``python -m slurm_hooks CONTEXT``). Returns 0 unless the node is unhealthy."""
    env = os.environ if env is None else env
    args = list(argv or [])
    try:
        loaded = load_config(env=env)
        configure_logging(loaded.config.log, component="hooks")
    except Exception as exc:  # a broken config must not drain nodes
        configure_logging(None, component="hooks")
        log.error("configuration unusable, hook does nothing: %s", exc)
        return 0
    try:
        context = resolve_context(args[0] if args else None, env)
        ctx = from_env(context, env)
        handle(ctx, Path(loaded.config.hooks.spool_dir))
    except Exception:
        log.exception("hook failed (ignored: Clockwork's own failure never drains a node)")
    return 0
