"""The job's failure report: what Clockwork saw and did for one job on one node, and its one-line summary.

The Epilog writes the report (JSON) under the reports folder and puts the summary into the job's
AdminComment, so ``sacct -o AdminComment`` tells an admin where to look without any other tool.

With TorchPass, the summary also names the slots whose rank was replaced or moved, where each started and where
it ended (``slots moved: 2 node3/0->node5/0, 3 node3/1->node5/1``: node and local index, its GPU), and the part of
the state its new rank received where the layout names one (``1 node2/0->node5/0 (stage 1 of the 2x2 pipeline)``),
from the ``torchpass.placement`` event every node agent posts at the job's end. A job that lost hundreds of ranks must
not turn the comment into a page: the list stops at :data:`SLOTS_MAX_CHARS` and says how many more moved
(``clockwork report JOBID`` lists every one).

A job TorchPass could not recover says how it ended (:func:`ending`): requeued to restore a snapshot (the
last line of defence, ``torchpass.requeued``), or failed and why it was not requeued (``torchpass.not_requeued``),
so an admin reading ``sacct`` sees which way it went.
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


#: The most characters the AdminComment spends on the moved slots (sacct shows the comment as one field).
SLOTS_MAX_CHARS = 240
PLACEMENT = "torchpass.placement"
#: The most characters of the ending's reason in the AdminComment (the report keeps all of it).
ENDING_MAX_CHARS = 120
ENDINGS = {"torchpass.requeued": "requeued", "torchpass.not_requeued": "not requeued"}


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
        **slots_moved(events),
        "ending": ending(events),
        "events": events,
    }


def ending(events: list[dict[str, Any]]) -> str:
    """``requeued: WHY`` or ``not requeued: WHY`` from the newest such event here ('' when neither happened)."""
    said = [e for e in events if e.get("kind") in ENDINGS and isinstance(e.get("fields"), dict)]
    if not said:
        return ""
    last = said[-1]
    return f"{ENDINGS[last['kind']]}: {last['fields'].get('why', '?')}"


def slots_moved(events: list[dict[str, Any]]) -> dict[str, Any]:
    """``slots_moved`` (slot -> {from, to}) and ``slots_moved_total`` of the newest ``torchpass.placement`` event
    here (none: nothing said, {} and 0). The event lists the first slots only on a job that moved very many."""
    placements = [e["fields"] for e in events if e.get("kind") == PLACEMENT and isinstance(e.get("fields"), dict)]
    slots = placements[-1].get("slots") if placements else {}
    listed = {str(k): v for k, v in slots.items() if isinstance(v, dict)} if isinstance(slots, dict) else {}
    total = placements[-1].get("moved") if placements else 0
    return {"slots_moved": listed, "slots_moved_total": max(len(listed), total if isinstance(total, int) else 0)}


def _part(where: dict[str, str]) -> str:
    """`` (stage 0 of the 2x2 pipeline)``: the part of the state a moved slot's rank received, when named."""
    part = str(where.get("part") or "").replace(";", ",")
    return f" ({part})" if part else ""


def _slots_part(moved: dict[str, dict[str, str]], total: int) -> str:
    """``slots moved: 2 node3/0->node5/0, ...`` within :data:`SLOTS_MAX_CHARS` ('' when none moved): the first
    slots that fit, then how many more moved (``clockwork report`` lists them)."""
    order = sorted(moved.items(), key=lambda item: int(item[0]) if item[0].isdigit() else -1)
    items = [f"{slot} {where.get('from', '?')}->{where.get('to', '?')}{_part(where)}" for slot, where in order]
    for shown in range(len(items), -1, -1):
        rest = max(total, len(items)) - shown
        text = ", ".join(items[:shown] + ([f"+{rest} more"] if rest else []))
        if len(text) <= SLOTS_MAX_CHARS or shown == 0:
            return f"slots moved: {text}" if text else ""
    return ""


def summary(report: dict[str, Any], path: Path) -> str:
    """``clockwork: 0 link failovers, 0 migrations, 0 rollbacks[; slots moved: ...]; report=PATH`` (no quotes,
    one line; ``report=PATH`` stays last: readers take everything after it as the path)."""
    counts = ", ".join(f"{n} {label}" for label, n in report["counts"].items())
    moved = _slots_part(report.get("slots_moved") or {}, int(report.get("slots_moved_total") or 0))
    end = str(report.get("ending") or "")[:ENDING_MAX_CHARS].replace(";", ",")
    parts = "".join(f"{part}; " for part in (moved, end) if part)
    return f"clockwork: {counts}; {parts}report={path}"


def write(report: dict[str, Any], reports_dir: Path) -> Path:
    """Write atomically (:mod:`clockwork.contracts.atomic_file`): a reader never sees half a report, nor a crash an
    empty one."""
    reports_dir.mkdir(parents=True, exist_ok=True)
    path = reports_dir / f"{report['job_id']}.json"
    if path.exists():  # an earlier run of a requeued job: kept as JOB.1.json, JOB.2.json, ... (oldest first)
        earlier = 1
        while (reports_dir / f"{report['job_id']}.{earlier}.json").exists():
            earlier += 1
        path.rename(reports_dir / f"{report['job_id']}.{earlier}.json")
    atomic_file.write_text(path, json.dumps(report, indent=2, sort_keys=True) + "\n")
    return path
