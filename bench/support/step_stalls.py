"""Stall figures from the step logs of ``bench/linkpass_failover.py``'s all-reduce loop (pure functions).

Each rank logs ``STEP MONOTONIC_TIME`` per all-reduce; a stall is the longest gap between two consecutive steps
in a window around a fault. Kept apart from the harness so the arithmetic can be read (and tested) alone.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence


def parse_step_lines(text: str) -> list[tuple[int, float]]:
    """``STEP TIME`` lines -> [(step, time)]; a torn last line (no newline yet) is left for the next read."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out.append((int(parts[0]), float(parts[1])))
            except ValueError:
                continue
    return out


def window_stall(times: Sequence[float], start: float, end: float, now: float, *, overlap: bool = True) -> float:
    """The longest gap between consecutive step times that belongs to the window [start, end).

    ``overlap``: a gap belongs when it overlaps the window (the stall a fault caused, including the
    step interval it began in); otherwise only gaps that begin inside the window count (what happened
    after a fault was lifted). A stall still open at ``now`` (no step since the last one) counts up to
    ``now``.
    """
    best = 0.0
    for prev, nxt in itertools.pairwise(times):
        inside = (nxt > start and prev < end) if overlap else (start <= prev < end)
        if inside:
            best = max(best, nxt - prev)
    if times:
        last = times[-1]
        open_inside = last < end and (last > start or overlap)
        if open_inside and now > last:
            best = max(best, now - last)
    elif now > start:
        best = max(best, min(now, end) - start)
    return best


def typical_gap(times: Sequence[float], start: float, end: float) -> float | None:
    """Median gap between steps that completed in [start, end): the normal step time."""
    inside = [t for t in times if start <= t < end]
    gaps = [b - a for a, b in itertools.pairwise(inside)]
    return statistics.median(gaps) if gaps else None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isnan(seconds) else round(seconds * 1000.0, 1)


def fmt_ms(seconds: float | None) -> str:
    value = ms(seconds)
    return "-" if value is None else f"{value:.0f}"
