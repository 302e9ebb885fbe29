"""The fault-file source: GPUs whose readings come from a JSON file (tests and the sandbox, never a job's user).

The file (``[health] fault_file``, one per node; ``clockwork sandbox fault gpu`` writes it) overrides the
healthy baseline per GPU index::

    {"gpus": {"0": {"temperature_c": 95, "ecc_uncorrected": 1, "xids": [79]}}}

Fields are those of :class:`GpuReading` (``xids`` lists every XID injected so far: the ones not seen before are
this reading's events). The baseline of a GPU is 40 C with a slowdown threshold of 90 C and a shutdown threshold
of 100 C, no throttling, no ECC errors, no pending rows, no NVLink errors, no recovery action.

The file selects what the daemon believes about its GPUs, so it is trusted only when the daemon's own
configuration names it and when it is owned by root or the daemon's user and not writable by group or others.
A missing file means healthy GPUs; an unreadable, malformed or untrusted file is logged once (per change of the
file) and ignored: the previous good values stay in effect.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from clockworkd.gpuhealth.readings import RECOVERY_ACTIONS, THROTTLE_REASONS, GpuReading

log = logging.getLogger("clockwork.daemon.health")

BASELINE = {"temperature_c": 40.0, "slowdown_c": 90.0, "shutdown_c": 100.0}
MAX_FILE_BYTES = 1 << 20
_TYPES: dict[str, tuple[type, ...]] = {
    "uuid": (str,),
    "name": (str,),
    "lost": (bool,),
    "error": (str,),
    "temperature_c": (int, float),
    "slowdown_c": (int, float),
    "shutdown_c": (int, float),
    "ecc_corrected": (int,),
    "ecc_uncorrected": (int,),
    "ecc_aggregate_uncorrected": (int,),
    "rows_pending": (bool,),
    "rows_remap_failed": (bool,),
    "nvlink_errors": (int,),
    "fabric_error": (str,),
}


class FaultFileError(ValueError):
    """The fault file cannot be used (its text says what is wrong, naming the file and the field)."""


def baseline(index: int, node: str) -> GpuReading:
    """A healthy emulated GPU."""
    return GpuReading(
        index=index,
        uuid=f"GPU-fault-{node}-{index}",
        name="emulated GPU (fault file)",
        ecc_corrected=0,
        ecc_uncorrected=0,
        ecc_aggregate_uncorrected=0,
        rows_pending=False,
        rows_remap_failed=False,
        nvlink_errors=0,
        recovery_action="none",
        fabric_error="",
        **BASELINE,  # type: ignore[arg-type]
    )


def parse_gpu(path: Path, key: str, data: Any, start: GpuReading) -> tuple[GpuReading, list[int]]:
    """``start`` with the file's values for one GPU applied, and the GPU's full injected XID list."""
    if not isinstance(data, dict):
        raise FaultFileError(f"{path}: gpus.{key} must be a map of fields")
    known = {f.name for f in fields(GpuReading)} - {"index", "pids", "unsupported"}
    changes: dict[str, Any] = {}
    xids: list[int] = []
    for name, value in data.items():
        where = f"{path}: gpus.{key}.{name}"
        if name not in known:
            raise FaultFileError(f"{where}: unknown field (known: {', '.join(sorted(known))})")
        if name == "xids":
            if not isinstance(value, list) or not all(type(x) is int and x > 0 for x in value):
                raise FaultFileError(f"{where}: must be a list of positive XID numbers, got {value!r}")
            xids = list(value)
        elif name == "throttle":
            if not isinstance(value, list) or not all(v in THROTTLE_REASONS for v in value):
                raise FaultFileError(f"{where}: must be a list of {', '.join(THROTTLE_REASONS)}, got {value!r}")
            changes[name] = tuple(value)
        elif name == "recovery_action":
            if value not in RECOVERY_ACTIONS:
                raise FaultFileError(f"{where}: must be one of {', '.join(RECOVERY_ACTIONS)}, got {value!r}")
            changes[name] = value
        else:
            types = _TYPES[name]
            if bool in types:
                kind, ok = "true or false", type(value) is bool
            elif float in types:
                kind, ok = "a non-negative number", type(value) in (int, float) and value >= 0
            elif int in types:
                kind, ok = "a non-negative integer", type(value) is int and value >= 0
            else:
                kind, ok = "a string", isinstance(value, str)
            if not ok:
                raise FaultFileError(f"{where}: must be {kind}, got {value!r}")
            changes[name] = float(value) if float in types else value
    return replace(start, **changes), xids


class FaultFileSource:
    """GPUs 0..count-1 read from ``path`` (see the module docstring)."""

    name = "fault-file"

    def __init__(self, path: Path, count: int, node: str) -> None:
        self.path = path
        self.count = count
        self.node = node
        self._good: dict[int, tuple[GpuReading, list[int]]] = {}
        self._seen_xids: dict[int, int] = {}
        self._complaint = ""
        self.problem = ""

    def describe(self) -> str:
        state = f"; ignored: {self.problem}" if self.problem else ""
        return f"fault file {self.path} ({self.count} emulated GPUs){state}"

    def _load(self) -> dict[int, tuple[GpuReading, list[int]]]:
        """The file's GPUs (FaultFileError when the file cannot be used; {} when it does not exist)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise FaultFileError(f"{self.path}: cannot open: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if info.st_uid not in (0, os.geteuid()):
                raise FaultFileError(f"{self.path}: owned by uid {info.st_uid}, not root or the daemon's user")
            if info.st_mode & 0o022:
                raise FaultFileError(f"{self.path}: writable by group or others (mode {info.st_mode & 0o777:o})")
            raw = os.read(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
        if len(raw) > MAX_FILE_BYTES:
            raise FaultFileError(f"{self.path}: larger than {MAX_FILE_BYTES} bytes")
        try:
            doc = json.loads(raw or b"{}")
        except ValueError as exc:
            raise FaultFileError(f"{self.path}: not JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("gpus", {}), dict):
            raise FaultFileError(f'{self.path}: expected {{"gpus": {{"INDEX": {{...}}}}}}')
        unknown = set(doc) - {"gpus"}
        if unknown:
            raise FaultFileError(f"{self.path}: unknown top-level key(s) {', '.join(sorted(unknown))} (only 'gpus')")
        out: dict[int, tuple[GpuReading, list[int]]] = {}
        for key, data in doc.get("gpus", {}).items():
            if not key.isdigit() or int(key) >= self.count:
                raise FaultFileError(f"{self.path}: gpus.{key}: not a GPU index 0..{self.count - 1}")
            index = int(key)
            out[index] = parse_gpu(self.path, key, data, baseline(index, self.node))
        return out

    def read(self) -> list[GpuReading]:
        try:
            self._good = self._load()
            self.problem = self._complaint = ""
        except FaultFileError as exc:
            self.problem = str(exc)
            if self._complaint != self.problem:  # once per distinct problem, not every second
                self._complaint = self.problem
                log.warning("node %s: GPU fault file ignored, previous values kept: %s", self.node, exc)
        out = []
        for index in range(self.count):
            reading, xids = self._good.get(index, (baseline(index, self.node), []))
            seen = self._seen_xids.get(index, 0)
            if len(xids) < seen:  # the file was cleared: start counting again
                seen = 0
            out.append(replace(reading, xids=tuple(xids[seen:])))
            self._seen_xids[index] = len(xids)
        return out

    def close(self) -> None:
        return None
