"""Which TorchPass rank of which job runs on which GPU of this node.

The daemon already hears from every rank: a TorchPass rank posts its events to its node's daemon from its own
process, so each ``torchpass.joined`` event recorded here names the rank's slot and, in the event's ``by``, the
kernel-verified pid of the process holding it. A rank that handed its slot on posts ``torchpass.departed``
(from the same pid); a dead pid holds nothing.

The GPU of a live rank, in order of trust:

1. NVML's compute processes of each GPU (``GpuReading.pids``): the driver's own answer, right even when
   ``CUDA_VISIBLE_DEVICES`` renumbers the devices (not available on the fault-file source, nor in some
   containers);
2. the rank's environment (``/proc/PID/environ``; the daemon runs as root): TorchPass binds a rank to
   ``cuda:LOCAL_RANK`` (``LOCAL_RANK`` unset = 0), which ``CUDA_VISIBLE_DEVICES`` maps to a GPU index or UUID
   when set. On the CPU sandbox, where nothing uses a GPU, this gives GPU index = local rank on the node (its
   local index J of the node's G ranks under Slurm: :mod:`torchpass.launch.node_ranks`).

When neither answers, the rank's GPU is unknown: the watch warns the job but moves nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clockworkd.gpuhealth.readings import GpuReading

JOINED = "torchpass.joined"
DEPARTED = "torchpass.departed"
_PID = re.compile(r"\bpid (\d+)$")


@dataclass(frozen=True)
class LiveRank:
    """A TorchPass rank process on this node, and the GPU it uses (None: unknown)."""

    job_id: int
    slot: int
    pid: int
    generation: int
    gpu: int | None
    how: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "slot": self.slot,
            "pid": self.pid,
            "generation": self.generation,
            "gpu": self.gpu,
            "how": self.how,
        }


def pid_of(event: dict[str, Any]) -> int | None:
    """The pid in an event's ``by`` (``"uid U pid P"``, set by the daemon from the poster's credentials)."""
    match = _PID.search(str(event.get("by", "")))
    return int(match.group(1)) if match else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ranks_in(
    events: Iterable[dict[str, Any]], node: str, alive: Callable[[int], bool] = pid_alive
) -> list[tuple[int, int, int]]:
    """(slot, pid, generation) of every live rank process whose events were recorded on ``node``."""
    holding: dict[int, tuple[int, int]] = {}  # pid -> (slot, generation)
    for event in events:
        if event.get("node") != node:
            continue
        kind = event.get("kind")
        raw_fields = event.get("fields")
        fields: dict[str, Any] = raw_fields if isinstance(raw_fields, dict) else {}
        pid = pid_of(event)
        if pid is None:
            continue
        if kind == JOINED and isinstance(fields.get("slot"), int):
            holding[pid] = (int(fields["slot"]), int(fields.get("generation") or 0))
        elif kind == DEPARTED and "worker" not in fields:  # the rank's own departure (not the coordinator's)
            holding.pop(pid, None)
    newest: dict[int, tuple[int, int]] = {}  # slot -> (generation, pid): one process per slot
    for pid, (slot, gen) in holding.items():
        if alive(pid) and (slot not in newest or gen > newest[slot][0]):
            newest[slot] = (gen, pid)
    return sorted((slot, pid, gen) for slot, (gen, pid) in newest.items())


def read_environ(pid: int, proc: Path = Path("/proc")) -> dict[str, str] | None:
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def gpu_of(
    pid: int, readings: list[GpuReading], environ: Callable[[int], dict[str, str] | None] = read_environ
) -> tuple[int | None, str]:
    """The GPU index ``pid`` uses and how that was found (see the module docstring)."""
    for r in readings:
        if r.pids is not None and pid in r.pids:
            return r.index, "NVML compute processes"
    env = environ(pid)
    if env is None:
        return None, "unknown (environment unreadable)"
    local = env.get("LOCAL_RANK", "0").strip() or "0"
    if not local.isdigit():
        return None, f"unknown (LOCAL_RANK={local!r})"
    ordinal = int(local)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ordinal, "LOCAL_RANK"
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if ordinal >= len(items):
        return None, f"unknown (LOCAL_RANK {ordinal} beyond CUDA_VISIBLE_DEVICES={visible!r})"
    item = items[ordinal]
    if item.isdigit():
        return int(item), "LOCAL_RANK + CUDA_VISIBLE_DEVICES"
    for r in readings:
        if r.uuid and (r.uuid == item or r.uuid.startswith(item)):
            return r.index, "LOCAL_RANK + CUDA_VISIBLE_DEVICES (UUID)"
    return None, f"unknown (CUDA_VISIBLE_DEVICES entry {item!r} names no GPU here)"
