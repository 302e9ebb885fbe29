"""The run-and-report half of the recovery benchmarks (``fsdp_recovery``, ``pp_recovery``, ``nd_recovery``): each
layout's bench has its own workload and arguments, and the same systems, table, goals and JSON line.

:func:`run_systems` runs TorchPass, checkpoint-restart and (where installed) TorchFT alternately, ``--runs`` times
each; :func:`report` prints their medians side by side, TorchPass's split of its recovery, the ratios and the
goals, and ends with the one JSON line every bench ends with.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from support.torchpass_jobs import say

Arm = Callable[[argparse.Namespace, Path], dict[str, Any]]
Rows = dict[str, list[dict[str, Any]]]

GOAL_S = 3.0  # DESIGN.md and the layouts' issues: full width in under 3 s here
GOAL_VS_TORCHFT = 2.0  # ... at least 2x sooner than TorchFT, which drops the whole replica group

_COMMON = ("to_full_width_s", "steps_computed_twice", "samples_skipped", "restarts")
_EXTRA = {
    "torchpass": (
        "detect_ms",
        "spare_ready_ms",
        "transfer_ms",
        "rebuild_ms",
        "transfer_bytes",
        "bytes_moved",
        "total_ms",
    ),
    "torchft": ("steps_at_reduced_width", "group_restarts"),
}


def run_systems(args: argparse.Namespace, systems: Mapping[str, Arm], prefix: str) -> Rows:
    """Each system ``args.runs`` times, alternating which goes first (so that neither always runs on a machine the
    other just warmed), each run in a folder of its own; the folders go unless ``args.keep``."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    rows: Rows = {name: [] for name in systems}
    try:
        for index in range(args.runs):
            for name in list(systems)[index % 2 :] + list(systems)[: index % 2]:
                out = work / f"{name}-{index}"
                out.mkdir()
                row = systems[name](args, out)
                rows[name].append(row)
                say(f"  run {index + 1} {name:<10} {json.dumps(row)}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"  runs kept in {work}")
    return rows


def _ratio(slow: float | None, fast: float | None) -> float | None:
    return round(slow / fast, 2) if slow and fast else None


def summarise(rows: Rows) -> dict[str, dict[str, Any]]:
    """Each system's medians over its runs (None where no run gave the figure)."""

    def median(name: str, key: str) -> float | None:
        values = [r[key] for r in rows[name] if r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    return {name: {key: median(name, key) for key in _COMMON + _EXTRA.get(name, ())} for name in rows}


def report(
    bench: str,
    rows: Rows,
    torchft_note: str,
    *,
    torchft_label: str,
    issue: str,
    describe: Mapping[str, Any],
    began: float,
) -> None:
    """Print the table, TorchPass's split, the ratios and the goals; then the JSON line (``describe``: the bench's
    own settings, first in it; ``began``: ``time.monotonic()`` at the bench's start, for its wall time)."""
    summary = summarise(rows)
    tp, restart, ft = summary["torchpass"], summary["restart"], summary.get("torchft", {})
    say("")
    say(f"{'':<44}{'TorchPass':>12}{'ckpt-restart':>14}{torchft_label:>14}")
    for label, key in (
        ("crash -> first full-width step done (s)", "to_full_width_s"),
        ("steps at reduced width", "steps_at_reduced_width"),
        ("samples skipped", "samples_skipped"),
        ("global steps computed twice", "steps_computed_twice"),
        ("whole-job restarts", "restarts"),
        ("replica-group restarts", "group_restarts"),
    ):
        say(f"{label:<44}{tp.get(key, 0)!s:>12}{restart.get(key, 0)!s:>14}{ft.get(key, '-')!s:>14}")
    if torchft_note:
        say(f"TorchFT: {torchft_note}")
    elif ft.get("to_full_width_s") is None:
        say(
            "TorchFT: the restarted replica group trained no step beside the live one, which ended first (no "
            "full-width figure; a longer job, --steps, gives it the time to heal)"
        )
    say(
        f"TorchPass, medians: detection {tp['detect_ms']} ms, spare ready {tp['spare_ready_ms']} ms, transfer "
        f"{tp['transfer_ms']} ms ({tp['bytes_moved']} bytes moved in all, {tp['transfer_bytes']} the largest part), "
        f"rebuild {tp['rebuild_ms']} ms; fault to every rank training again {tp['total_ms']} ms"
    )
    vs_restart = _ratio(restart["to_full_width_s"], tp["to_full_width_s"])
    vs_torchft = _ratio(ft.get("to_full_width_s"), tp["to_full_width_s"])
    say(
        f"TorchPass at full width {vs_restart}x sooner than checkpoint-restart, "
        + (f"{vs_torchft}x sooner than TorchFT" if vs_torchft else "TorchFT not measured")
    )
    goals: dict[str, bool | None] = {
        f"full_width_under_{GOAL_S:g}s": bool(tp["to_full_width_s"] is not None and tp["to_full_width_s"] < GOAL_S),
        # None, not False, when TorchFT was not measured: no verdict either way
        f"{GOAL_VS_TORCHFT:g}x_faster_to_full_width_than_torchft": (
            None if vs_torchft is None else vs_torchft >= GOAL_VS_TORCHFT
        ),
        "zero_samples_skipped": tp["samples_skipped"] == 0,
    }
    say(f"goals ({issue}): {goals}")
    wall_s = round(time.monotonic() - began, 1)
    say(f"the benchmark took {wall_s} s")
    print(
        json.dumps(
            {
                "bench": bench,
                **describe,
                "summary": summary,
                "runs": rows,
                "speedup_vs_restart": vs_restart,
                "speedup_vs_torchft": vs_torchft,
                "goals_met": goals,
                "torchft": torchft_note or "ok",
                "wall_s": wall_s,
            }
        )
    )
