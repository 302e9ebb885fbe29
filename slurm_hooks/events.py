"""The job event log the hooks keep in the spool: one JSON object per line, one file per node.

One file per writer (``jobs/JOBID/NODE.jsonl``) means concurrent hooks on different nodes never
interleave writes even on a shared spool, and the Epilog/report can merge them by time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def job_dir(spool: Path, job_id: int) -> Path:
    return spool / "jobs" / str(job_id)


def append(spool: Path, job_id: int, writer: str, kind: str, **fields: Any) -> Path:
    """Append one event; the single small ``write`` of an O_APPEND file is atomic."""
    path = job_dir(spool, job_id) / f"{writer}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"time": time.time(), "job_id": job_id, "node": writer, "event": kind, **fields}
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return path


def read(spool: Path, job_id: int) -> list[dict[str, Any]]:
    """Every event of a job from every writer, oldest first; unreadable lines are skipped."""
    events = []
    for path in sorted(job_dir(spool, job_id).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("time", 0), int | float):
                events.append(record)
    return sorted(events, key=lambda e: e.get("time", 0))
