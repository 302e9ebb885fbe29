"""The job's failure report: what Clockwork saw and did for one job on one node, and its one-line summary.

The Epilog writes the report (JSON) under the reports folder and puts the summary into the job's
AdminComment, so ``sacct -o AdminComment`` tells an admin where to look without any other tool.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from clockwork.contracts import atomic_file
from slurm_hooks.context import HookContext

#: Event kinds counted in the summary, and how the summary names them: LinkPass's failovers, TorchPass's live
#: migrations (planned or health-driven) and its restores from a disk snapshot (the only rollback it makes).
COUNTED = {
    "link.failover": "link failovers",
    "torchpass.migrated": "migrations",
    "torchpass.restored": "rollbacks",
}


#: Event fields that hold secrets (TorchPass's job key, for ``clockwork migrate``): never copied into a report.
SECRET_FIELDS = ("key",)


def _redacted(event: dict[str, Any]) -> dict[str, Any]:
    fields = event.get("fields")
    if not isinstance(fields, dict) or not any(name in fields for name in SECRET_FIELDS):
        return event
    return {**event, "fields": {k: "(redacted)" if k in SECRET_FIELDS else v for k, v in fields.items()}}


def build(ctx: HookContext, events: list[dict[str, Any]], daemon: str) -> dict[str, Any]:
    events = [_redacted(e) for e in events]
    # A restore is reported by every rank that loads the snapshot: count each restored step once.
    restores = {(e.get("fields") or {}).get("step") for e in events if e.get("kind") == "torchpass.restored"}
    kinds = Counter(str(e.get("kind", "")) for e in events if e.get("kind") != "torchpass.restored")
    kinds["torchpass.restored"] = len(restores)
    return {
        "job_id": ctx.job_id,
        "node": ctx.node,
        "user": ctx.user,
        "uid": ctx.uid,
        "nodelist": ctx.nodelist,
        "options": ctx.options,
        "exit_code": ctx.exit_code,
        "written": time.time(),
        "daemon": daemon,
        "counts": {label: kinds.get(kind, 0) for kind, label in COUNTED.items()},
        "events": events,
    }


def summary(report: dict[str, Any], path: Path) -> str:
    """``clockwork: 0 link failovers, 0 migrations, 0 rollbacks; report=PATH`` (no quotes, one line)."""
    counts = ", ".join(f"{n} {label}" for label, n in report["counts"].items())
    return f"clockwork: {counts}; report={path}"


def write(report: dict[str, Any], reports_dir: Path) -> Path:
    """Write atomically (:mod:`clockwork.contracts.atomic_file`): a reader never sees half a report, nor a crash an
    empty one."""
    reports_dir.mkdir(parents=True, exist_ok=True)
    path = reports_dir / f"{report['job_id']}.json"
    atomic_file.write_text(path, json.dumps(report, indent=2, sort_keys=True) + "\n")
    return path
