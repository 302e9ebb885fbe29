"""What a job was given, as another allocation on its behalf must ask for it: GRES, account, QOS, time.

A borrowed node stands in for one of the job's own, so its holder allocation and the replacement's job step
must come with the same generic resources (GPUs: with ``ConstrainDevices=yes`` a step that asked for none sees
none), be billed to the same account, and end no later than the job itself. :class:`JobResources` is that
part of a job record, read from ``squeue --json`` (22.05 openapi strings and plain numbers, 23.02+
``{"set", "number"}`` numbers) or ``scontrol -o show job`` by
:meth:`clockwork.contracts.slurm.cli_backend.CliBackend.job_resources`.

GRES per node: the job's ``tres_per_node`` (what ``--gres=gpu:2`` and ``--gpus-per-node=2`` both become,
``gres:gpu:2`` in 22.05, ``gres/gpu:2`` later), else, for ``--gpus=N`` (a per-job count), the allocated
``gres/*`` TRES divided by the job's nodes when it divides evenly (an uneven split has no per-node form: the
holder then asks for none, and the docs say so).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clockwork.contracts.slurm.backend import json_number

__all__ = ["JobResources", "gres_per_node", "parse_resources_json", "parse_resources_scontrol"]

#: Slurm's INFINITE / NO_VAL for 32-bit time limits (minutes): no limit.
_NO_LIMIT = 0xFFFFFFFE


@dataclass(frozen=True)
class JobResources:
    """The resources of one job that a stand-in allocation asks for again."""

    job_id: int
    account: str
    qos: str
    gres: str
    """Per node, as ``--gres`` takes it (``gpu:2``, ``gpu:h100:8,nic:1``); "" when the job has none."""
    time_limit_s: float | None
    """The job's time limit; None when unlimited or unknown."""
    start_time: float
    """Epoch seconds; 0 while pending."""

    def remaining_s(self, now: float) -> float | None:
        """Seconds the job may still run (None: no limit); never negative."""
        if self.time_limit_s is None:
            return None
        if self.start_time <= 0:
            return self.time_limit_s
        return max(0.0, self.start_time + self.time_limit_s - now)

    def time_option_minutes(self, now: float) -> int | None:
        """``--time`` in whole minutes, rounded down so the stand-in never outlives the job; None: no limit.
        0 when less than a minute is left (Slurm counts time limits in minutes: nothing fits)."""
        left = self.remaining_s(now)
        return None if left is None else math.floor(left / 60)


def _gres_entries(spec: str) -> list[str]:
    """``gres:gpu:2,gres/nic:1,cpu:4`` -> ``["gpu:2", "nic:1"]`` (the GRES entries, without their prefix)."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        for prefix in ("gres:", "gres/"):
            if part.startswith(prefix) and len(part) > len(prefix):
                out.append(part[len(prefix) :])
    return out


def gres_per_node(tres_per_node: str, alloc_tres: str, nodes: int) -> str:
    """The job's GRES per node as ``--gres`` takes it (see the module docstring for the rules)."""
    entries = _gres_entries(tres_per_node)
    if entries:
        return ",".join(entries)
    if nodes <= 0:
        return ""
    per_node = []
    for part in alloc_tres.split(","):
        name, _, count = part.strip().partition("=")
        if not name.startswith("gres/") or not count.isdigit():
            continue
        gres = name[len("gres/") :]
        if ":" not in gres and any(other.startswith(gres + ":") for other in _alloc_names(alloc_tres)):
            continue  # gres/gpu=8 next to gres/gpu:h100=8: ask by the typed name only
        total = int(count)
        if total % nodes:
            return ""  # no per-node form for an uneven split
        per_node.append(f"{gres}:{total // nodes}")
    return ",".join(per_node)


def _alloc_names(alloc_tres: str) -> list[str]:
    return [p.split("=", 1)[0][len("gres/") :] for p in alloc_tres.split(",") if p.strip().startswith("gres/")]


def parse_resources_json(doc: Mapping[str, Any], job_id: int) -> JobResources | None:
    """The job's resources from a ``squeue --json`` document (None when the job is not in it)."""
    for job in doc.get("jobs") or []:
        if json_number(job.get("job_id")) != job_id:
            continue
        limit = json_number(job.get("time_limit"))
        nodes = json_number(job.get("node_count")) or 0
        return JobResources(
            job_id=job_id,
            account=str(job.get("account") or ""),
            qos=str(job.get("qos") or ""),
            gres=gres_per_node(str(job.get("tres_per_node") or ""), str(job.get("tres_alloc_str") or ""), nodes),
            time_limit_s=None if limit is None or limit <= 0 or limit >= _NO_LIMIT else 60.0 * limit,
            start_time=float(json_number(job.get("start_time")) or 0),
        )
    return None


def _duration_s(text: str) -> float | None:
    """Slurm's ``[days-]hours:minutes:seconds`` (or ``minutes:seconds``/``minutes``); None for UNLIMITED."""
    text = text.strip()
    if not text or text.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    days = 0
    if "-" in text:
        head, text = text.split("-", 1)
        days = int(head)
    parts = [int(p) for p in text.split(":")]
    if len(parts) == 3:
        h, m, s = parts
    elif len(parts) == 2:
        h, m, s = (0, *parts) if days == 0 else (*parts, 0)
    else:
        h, m, s = (0, parts[0], 0) if days == 0 else (parts[0], 0, 0)
    return float(((days * 24 + h) * 60 + m) * 60 + s)


def parse_resources_scontrol(fields: Mapping[str, str], job_id: int, start_time: float) -> JobResources:
    """The job's resources from one ``scontrol -o show job`` record (``start_time``: StartTime as epoch
    seconds, which the caller converts: scontrol prints local time)."""
    nodes = json_number(fields.get("NumNodes", "").split("-")[0]) or 0
    return JobResources(
        job_id=job_id,
        account=fields.get("Account", ""),
        qos=fields.get("QOS", ""),
        gres=gres_per_node(fields.get("TresPerNode", ""), fields.get("TRES", ""), nodes),
        time_limit_s=_duration_s(fields.get("TimeLimit", "")),
        start_time=start_time,
    )
