"""Synthetic clocks for testing clock sync on one machine (the clock seam), and the file that sets them.

Why: on one test machine every emulated node stamps its packets with the same real clock, so clock sync
would trivially find zero offsets. Each node passes every timestamp it takes through its :class:`ClockSeam`
instead (the C pacer does the same with the seam's three numbers), which gives it a clock off by a known
offset and drifting at a known rate: the estimates can then be checked against the truth. Only tests and
benchmarks set one (``[lens] clock_seam_file``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from clockwork.contracts.errors import ConfigError

__all__ = ["ClockSeam", "ClockSeamError", "load_seams"]

IntArray = npt.NDArray[np.int64]


class ClockSeamError(ConfigError):
    """A clock seam file is missing, is not JSON, or holds an unknown key or a bad value."""


@dataclass(frozen=True)
class ClockSeam:
    """A synthetic clock for one emulated node: ``real + offset + drift * (real - epoch)``.

    Why: on one test machine every emulated node stamps packets with the same real clock, so clock
    sync would trivially find zero offsets. Passing every timestamp a node takes through its seam
    gives it a clock that is off by a known offset and drifts at a known rate, so the estimate can be
    checked against the truth.
    """

    offset_ns: int = 0
    drift_ppm: float = 0.0
    epoch_ns: int = 0

    def apply(self, t_ns: int) -> int:
        """This node's clock reading at real time ``t_ns``."""
        return t_ns + self.offset_ns + round(self.drift_ppm * 1e-6 * (t_ns - self.epoch_ns))

    def apply_many(self, t_ns: npt.ArrayLike) -> IntArray:
        """:meth:`apply` over an int64 array (rounds half to even where :meth:`apply` does too)."""
        t = np.asarray(t_ns, dtype=np.int64)
        drift = np.rint(self.drift_ppm * 1e-6 * (t - np.int64(self.epoch_ns)).astype(np.float64)).astype(np.int64)
        return t + np.int64(self.offset_ns) + drift

    def truth_offset(self, other: ClockSeam, at_real_ns: int) -> int:
        """``clock_other - clock_self`` at real time ``at_real_ns`` (what sync should find)."""
        return other.apply(at_real_ns) - self.apply(at_real_ns)


_SEAM_TOP_KEYS = {"epoch_ns", "nodes"}
_SEAM_NODE_KEYS = {"offset_us", "drift_ppm"}
_MAX_SEAM_OFFSET_US = 1e9  # 1000 s: anything larger is a unit mistake
_MAX_SEAM_DRIFT_PPM = 1e4


def _seam_number(path: Path, where: str, value: Any, limit: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClockSeamError(f"{path}: {where}: expected a number, got {json.dumps(value)}")
    if not math.isfinite(value) or abs(value) > limit:
        raise ClockSeamError(f"{path}: {where}: {value} is out of range (|value| <= {limit:g})")
    return float(value)


def load_seams(path: str | Path) -> dict[str, ClockSeam]:
    """Read ``{"epoch_ns": E, "nodes": {"node1": {"offset_us": 12.5, "drift_ppm": -40}}}``.

    ``epoch_ns`` is required (drift counts from it; a forgotten epoch of 0 would turn 40 ppm into
    days of offset at today's timestamps). A node's ``offset_us`` and ``drift_ppm`` default to 0.
    Every error names the file and the offending key.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ClockSeamError(f"{p}: cannot read clock seam file: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClockSeamError(f"{p}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    if not isinstance(data, dict):
        raise ClockSeamError(f"{p}: expected a JSON object at the top level")
    unknown = sorted(set(data) - _SEAM_TOP_KEYS)
    if unknown:
        raise ClockSeamError(f"{p}: unknown key {unknown[0]!r} (known: epoch_ns, nodes)")
    for key in sorted(_SEAM_TOP_KEYS):
        if key not in data:
            raise ClockSeamError(f"{p}: missing key {key!r}")
    epoch = data["epoch_ns"]
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise ClockSeamError(f"{p}: epoch_ns: expected an integer (ns), got {json.dumps(epoch)}")
    nodes = data["nodes"]
    if not isinstance(nodes, dict):
        raise ClockSeamError(f"{p}: nodes: expected an object of node name -> seam")
    seams: dict[str, ClockSeam] = {}
    for name, spec in nodes.items():
        if not name:
            raise ClockSeamError(f"{p}: nodes: empty node name")
        if not isinstance(spec, dict):
            raise ClockSeamError(f"{p}: nodes.{name}: expected an object with offset_us and drift_ppm")
        bad = sorted(set(spec) - _SEAM_NODE_KEYS)
        if bad:
            raise ClockSeamError(f"{p}: nodes.{name}: unknown key {bad[0]!r} (known: drift_ppm, offset_us)")
        offset_us = _seam_number(p, f"nodes.{name}.offset_us", spec.get("offset_us", 0), _MAX_SEAM_OFFSET_US)
        drift = _seam_number(p, f"nodes.{name}.drift_ppm", spec.get("drift_ppm", 0), _MAX_SEAM_DRIFT_PPM)
        seams[name] = ClockSeam(offset_ns=round(offset_us * 1000.0), drift_ppm=drift, epoch_ns=epoch)
    return seams
