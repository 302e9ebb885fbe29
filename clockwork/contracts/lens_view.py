"""The cluster's Fleet Lens view, merged from every node daemon's snapshot (the ``lens`` op's replies).

Every node daemon reports only the paths it *receives*, its view of the clocks and the suspects it computed;
:func:`merge` turns one snapshot per daemon into one cluster view. Pure functions of the replies, no I/O: the
``clockwork lens`` commands draw it (:mod:`clockwork.cli.lens_render`) and the audit judges it
(:mod:`clockwork.audit.verdict`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from clockwork.contracts.lens_model import NicId, split_nic

__all__ = ["Merged", "is_bad", "merge", "natural_key", "nic_sort_key", "number", "rail_of", "verdict_of"]


@dataclass
class Merged:
    """The cluster view from every daemon's snapshot.

    ``paths`` maps (src, dst) to the path dict (``PathStats.to_dict()`` plus ``verdict``);
    ``suspects`` is highest confidence first; ``clock`` maps node to its offset estimate against
    ``reference``; ``loop_residual_us`` and ``counters`` are per reporting node.
    """

    paths: dict[tuple[NicId, NicId], dict[str, Any]] = field(default_factory=dict)
    suspects: list[dict[str, Any]] = field(default_factory=list)
    clock: dict[str, dict[str, Any]] = field(default_factory=dict)
    reference: str | None = None
    nodes: list[str] = field(default_factory=list)
    time: float | None = None
    loop_residual_us: dict[str, float | None] = field(default_factory=dict)
    counters: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def nics(self) -> list[NicId]:
        """Every NIC that appears in a path, rail by rail, nodes in natural order."""
        return sorted({nic for pair in self.paths for nic in pair}, key=nic_sort_key)

    def bad_paths(self) -> list[tuple[NicId, NicId]]:
        return [pair for pair, path in self.paths.items() if is_bad(path)]


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that puts node2 before node10 (people number nodes, strings do not)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def rail_of(nic: NicId) -> str:
    return split_nic(nic)[1]


def nic_sort_key(nic: NicId) -> tuple[Any, ...]:
    node, rail = split_nic(nic)
    return (natural_key(rail), natural_key(node))


def verdict_of(path: Mapping[str, Any]) -> Mapping[str, Any]:
    """The path's verdict, empty when the receiver has none yet (no baseline) or sent junk."""
    verdict = path.get("verdict")
    return verdict if isinstance(verdict, Mapping) else {}


def is_bad(path: Mapping[str, Any]) -> bool:
    return verdict_of(path).get("bad") is True


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def merge(snapshots: Iterable[Mapping[str, Any] | None]) -> Merged:
    """One cluster view from the daemons' snapshots (``None`` for a daemon that did not answer).

    A path is reported by its receiver only; should two snapshots carry the same path, the newer one
    wins. Each daemon localizes faults from what it sees, so the same link can be suspected by
    several: the highest confidence is kept. Clock offsets are a cluster-wide solution whose best
    copy is the reference holder's, else the first daemon's that has one.
    """
    snaps = [s for s in snapshots if isinstance(s, Mapping)]
    merged = Merged()
    times = [t for s in snaps if (t := number(s.get("time"))) is not None]
    merged.time = max(times) if times else None
    merged.nodes = sorted({str(s.get("node")) for s in snaps if s.get("node")}, key=natural_key)

    for snap in sorted(snaps, key=lambda s: number(s.get("time")) or 0.0):
        node = str(snap.get("node") or "")
        for path in snap.get("paths") or ():
            if isinstance(path, Mapping) and path.get("src") and path.get("dst"):
                merged.paths[(str(path["src"]), str(path["dst"]))] = dict(path)
        if node:
            merged.loop_residual_us[node] = number(snap.get("loop_residual_us"))
            counters = snap.get("counters")
            merged.counters[node] = dict(counters) if isinstance(counters, Mapping) else {}

    best: dict[str, dict[str, Any]] = {}
    for snap in snaps:
        for sus in snap.get("suspects") or ():
            if not isinstance(sus, Mapping) or not sus.get("link"):
                continue
            link = str(sus["link"])
            conf = number(sus.get("confidence")) or 0.0
            if link not in best or conf > (number(best[link].get("confidence")) or 0.0):
                best[link] = dict(sus)
    merged.suspects = sorted(best.values(), key=lambda s: (-(number(s.get("confidence")) or 0.0), str(s["link"])))

    references = [str(s["reference"]) for s in snaps if s.get("reference")]
    merged.reference = references[0] if references else None
    with_clock = [s for s in snaps if isinstance(s.get("clock"), Mapping) and s["clock"]]
    holders = [s for s in with_clock if s.get("node") == merged.reference]
    source = next(iter(holders or with_clock), None)
    if source is not None:
        merged.clock = {str(n): dict(e) for n, e in source["clock"].items() if isinstance(e, Mapping)}
        merged.reference = str(source.get("reference") or merged.reference or "") or None
    return merged
