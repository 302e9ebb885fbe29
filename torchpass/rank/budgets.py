"""Host memory and storage budgets, checked at start: what the job's snapshots and peer copies will hold, against
what each node and the snapshot filesystem have.

Why at start: with 100-200 GB of training state per GPU, a snapshot staging arena or a round of peer copies that
does not fit is a SIGBUS (a full /dev/shm), an OOM kill or an ENOSPC in the middle of the run, hours in. Every
number is known once the model and optimizers exist, so each rank measures its own share and the ranks agree on
one verdict before the first step (:mod:`torchpass.rank.budget_gate`, which does the measuring and the collective; this
module is the arithmetic, pure, and the readings, behind one small seam).

What is counted, per node (the G ranks of a node share its memory and its /dev/shm):

* **snapshot staging** (when snapshots are on: ``snapshot_interval_s`` or ``snapshot_every_steps``): each rank's
  arena, a /dev/shm file the size of the part of the state it writes (:mod:`torchpass.snapshot.staging`), at most
  ``snapshot_arena_max`` (a larger share is staged through it a window at a time,
  :mod:`torchpass.snapshot.windowed`), kept for the job. It must fit the node's free /dev/shm, and, being memory,
  its MemAvailable;
* **peer copies** (pure FSDP, or HSDP with ``peer_copies_in_hsdp``): per rank, 3 copies of its own shard (2 with
  ``peer_copy_sync``) and 2 of each of its ``peer_copies`` neighbours' (:mod:`torchpass.sharded.peer_copy`), in host
  memory: ``(3 + 2 r)`` shards. Snapshot staging and peer copies together must fit MemAvailable;
* **snapshot retention**, for the job: ``snapshot_keep`` complete snapshots plus the one being written (the
  oldest goes only once the new one exists), each the sum of every rank's shard file, on the snapshot filesystem
  (shared by every node): its free space plus what the job's snapshots already there hold, and the snapshot quota
  (the smaller of the job's ``snapshot_quota`` and the site's ``[snapshots] quota``).

When something does not fit, ``budget_policy = "refuse"`` (the default) stops the job before its first step,
naming each shortfall, the numbers and the setting to change; ``"degrade"`` switches the feature off (snapshots,
or peer copies) with a warning and trains without it. Memory shared by both goes to peer copies first (they
rebuild a lost shard without a rollback; snapshots are the slower, second line), so snapshots are switched off
first. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

__all__ = [
    "PEER_COPIES",
    "SNAPSHOTS",
    "JobVerdict",
    "NodeReadings",
    "RankUse",
    "Shortfall",
    "Verdict",
    "judge",
    "mem_available",
    "read_node",
    "size_text",
]

SNAPSHOTS = "snapshots"
PEER_COPIES = "peer_copies"
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size_text(nbytes: int) -> str:
    """``1.5 GiB``: a size as people read it (binary units, as Slurm and ``df -h`` print them)."""
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{nbytes} B"
    return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {_UNITS[unit]}"  # three figures


# ----- readings: the one seam ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeReadings:
    """What one node has, read at start (None: could not be read; that budget is then not checked)."""

    mem_available: int | None  # /proc/meminfo MemAvailable
    shm_free: int | None  # free bytes of /dev/shm (what an unprivileged writer may use)
    snapshot_free: int | None  # free bytes of the filesystem holding the snapshot folder
    snapshot_used: int = 0  # bytes of this job's snapshots already there (read by one rank only)


def mem_available(meminfo: str) -> int | None:
    """MemAvailable, in bytes, from the text of /proc/meminfo."""
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "MemAvailable":
            number, *unit = rest.split()
            return int(number) * (1024 if unit and unit[0].lower() == "kb" else 1)
    return None


class _StatVfs(Protocol):
    @property
    def f_bavail(self) -> int: ...

    @property
    def f_frsize(self) -> int: ...


def _free(path: Path, statvfs: Callable[[str], _StatVfs]) -> int | None:
    """Free bytes of the filesystem holding ``path`` (or its nearest existing parent: the folder may not exist)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                st = statvfs(str(candidate))
            except OSError:
                return None
            return int(st.f_bavail) * int(st.f_frsize)
    return None


def _used(folder: Path) -> int:
    """Bytes of the snapshot files under ``folder`` (one level of ``step-*`` folders)."""
    total = 0
    try:
        for step in os.scandir(folder):
            if step.is_dir() and step.name.startswith("step-"):
                total += sum(entry.stat().st_size for entry in os.scandir(step.path) if entry.is_file())
    except OSError:
        pass
    return total


def read_node(
    snapshot_dir: Path,
    *,
    count_snapshots: bool = False,
    meminfo: Path = Path("/proc/meminfo"),
    shm: Path = Path("/dev/shm"),
    statvfs: Callable[[str], _StatVfs] = os.statvfs,
) -> NodeReadings:
    """This node's readings (``count_snapshots``: also add up the job's snapshots already in ``snapshot_dir``).
    ``meminfo``, ``shm`` and ``statvfs`` are the seam the arithmetic's tests replace."""
    try:
        available = mem_available(meminfo.read_text())
    except OSError:
        available = None
    return NodeReadings(
        mem_available=available,
        shm_free=_free(shm, statvfs) if shm.is_dir() else None,
        snapshot_free=_free(snapshot_dir, statvfs),
        snapshot_used=_used(snapshot_dir) if count_snapshots else 0,
    )


# ----- the arithmetic ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankUse:
    """One rank's share of every budget, and its node's readings."""

    node: str
    readings: NodeReadings
    arena: int = 0  # its snapshot staging arena (0: snapshots off)
    shard_file: int = 0  # what it writes per snapshot (0: snapshots off)
    state: int = 0  # one copy of what its peer copies hold (0: no peer copies)
    copies: int = 0  # copies of that size it keeps: own + 2 per neighbour


@dataclass(frozen=True)
class Shortfall:
    """One budget that does not fit: the feature, where, the numbers, and what to change. A node's budget that
    several nodes miss is one shortfall: the worst node's numbers, and how many others miss it too."""

    feature: str  # SNAPSHOTS or PEER_COPIES
    where: str  # "in /dev/shm", "in host memory", "on the snapshot filesystem", "under the snapshot quota"
    needed: int
    available: int
    why: str  # how ``needed`` is made up
    change: str  # the settings that make it fit
    nodes: tuple[str, ...] = ()  # the nodes that miss it, the worst first (none: the job's budget)

    def line(self) -> str:
        place = self.where
        if self.nodes:
            others = len(self.nodes) - 1
            place += f" on {self.nodes[0]}" + (f" (and {others} other node{'s' * (others > 1)})" if others else "")
        return (
            f"{self.feature}: {size_text(self.needed)} needed, {size_text(self.available)} available {place} "
            f"({self.why}); {self.change}"
        )


def _merged(shortfalls: list[Shortfall]) -> list[Shortfall]:
    """One shortfall per (feature, where): the worst node's, naming every node that misses it."""
    groups: dict[tuple[str, str], list[Shortfall]] = {}
    for short in shortfalls:
        groups.setdefault((short.feature, short.where), []).append(short)
    out = []
    for group in groups.values():
        group.sort(key=lambda s: (s.available - s.needed, s.nodes))
        nodes = tuple(node for s in group for node in s.nodes)
        out.append(dataclasses.replace(group[0], nodes=nodes))
    return out


@dataclass(frozen=True)
class Verdict:
    """The ranks' one decision: refuse (every shortfall), or the features switched off to fit."""

    refuse: bool
    off: frozenset[str]
    shortfalls: tuple[Shortfall, ...]

    def message(self) -> str:
        """What the job's output and its failure reason say."""
        lines = "\n".join(f"  - {s.line()}" for s in self.shortfalls)
        if self.refuse:
            return (
                "the job's host memory and storage budgets do not fit, so it stops before its first step "
                f"(budget_policy = refuse; budget_policy = degrade trains without what does not fit):\n{lines}"
            )
        off = " and ".join(sorted(self.off))
        return f"training without {off}, which the job's budgets do not fit (budget_policy = degrade):\n{lines}"


SHM_CHANGE = (
    "lower snapshot_arena_max, turn snapshots off (snapshot_interval_s = 0 and snapshot_every_steps = 0; sbatch "
    "--clockwork-snapshot=off), enlarge /dev/shm, or set budget_policy = degrade"
)
SNAPSHOT_CHANGE = (
    "lower snapshot_arena_max, turn snapshots off (snapshot_interval_s = 0 and snapshot_every_steps = 0; sbatch "
    "--clockwork-snapshot=off), or set budget_policy = degrade"
)


def judge(uses: Sequence[RankUse], *, keep: int, quota: int, policy: str) -> Verdict:
    """The verdict for every rank's ``uses`` (the same on every rank: it depends on them alone). ``keep``:
    ``snapshot_keep``; ``quota``: the job's snapshot quota in bytes (0: none); ``policy``: ``budget_policy``."""
    nodes: dict[str, list[RankUse]] = {}
    for use in uses:
        nodes.setdefault(use.node, []).append(use)
    snapshots, peers = any(u.arena for u in uses), any(u.copies for u in uses)
    short: list[Shortfall] = []
    for name, mine in sorted(nodes.items()):
        shm = min((u.readings.shm_free for u in mine if u.readings.shm_free is not None), default=None)
        arena = sum(u.arena for u in mine)
        if snapshots and shm is not None and arena > shm:
            why = f"{len(mine)} rank(s) x a staging arena of up to {size_text(max(u.arena for u in mine))}"
            short.append(Shortfall(SNAPSHOTS, "in /dev/shm", arena, shm, why, SHM_CHANGE, (name,)))
    fs = [u.readings.snapshot_free for u in uses if u.readings.snapshot_free is not None]
    if snapshots:
        per_snapshot = sum(u.shard_file for u in uses)
        disk = (keep + 1) * per_snapshot
        why = f"snapshot_keep = {keep} snapshots and the one being written, {size_text(per_snapshot)} each"
        if fs:
            free = min(fs) + max(u.readings.snapshot_used for u in uses)
            if disk > free:
                change = (
                    "lower snapshot_keep, point snapshot_dir (CLOCKWORK_SNAPSHOT_DIR) at a larger filesystem, "
                    "or set budget_policy = degrade"
                )
                short.append(Shortfall(SNAPSHOTS, "on the snapshot filesystem", disk, free, why, change))
        if quota and disk > quota:
            change = (
                "lower snapshot_keep, or raise snapshot_quota (the site's [snapshots] quota is a ceiling only the "
                "admins can raise), or set budget_policy = degrade"
            )
            short.append(Shortfall(SNAPSHOTS, "under the snapshot quota", disk, quota, why, change))
    # Host memory: peer copies go only where they alone do not fit; snapshots give way to them where both do not.
    memory = {
        name: (
            min((u.readings.mem_available for u in mine if u.readings.mem_available is not None), default=None),
            sum(u.state * u.copies for u in mine) if peers else 0,
            sum(u.arena for u in mine) if snapshots else 0,
            mine,
        )
        for name, mine in sorted(nodes.items())
    }
    for name, (mem, held, _staged, mine) in memory.items():
        if mem is not None and held > mem:
            biggest = max(mine, key=lambda u: u.state)
            why = (
                f"{len(mine)} rank(s) x {biggest.copies} copies of a shard of up to {size_text(biggest.state)}: 3 own "
                "(2 with peer_copy_sync) + 2 per neighbour"
            )
            change = "lower peer_copies (0: off), or set budget_policy = degrade"
            short.append(Shortfall(PEER_COPIES, "in host memory", held, mem, why, change, (name,)))
    peers_fit = not any(s.feature == PEER_COPIES for s in short)
    for name, (mem, held, staged, mine) in memory.items():
        kept = held if peers_fit else 0
        if mem is not None and staged and kept + staged > mem:
            why = f"{len(mine)} rank(s) x a staging arena of up to {size_text(max(u.arena for u in mine))}"
            if kept:
                why += f", beside {size_text(kept)} of peer copies"
            short.append(Shortfall(SNAPSHOTS, "in host memory", kept + staged, mem, why, SNAPSHOT_CHANGE, (name,)))
    merged = _merged(short)
    refuse = bool(merged) and policy != "degrade"
    return Verdict(refuse, frozenset() if refuse else frozenset(s.feature for s in merged), tuple(merged))


# ----- the verdict, carried to newcomers -----------------------------------------------------------------


class _Store(Protocol):
    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


@dataclass
class JobVerdict:
    """This rank's copy of the job's verdict: undecided until the first generation's ranks decided it (or this
    rank took it from the members of a generation it joined: :meth:`publish` before the generation's arrival
    barrier, :meth:`adopt` after it)."""

    decided: bool = False
    off: frozenset[str] = field(default_factory=frozenset)

    KEY = "budget/off"

    def decide(self, off: frozenset[str]) -> None:
        self.decided, self.off = True, off

    def publish(self, store: _Store) -> None:
        if self.decided:
            store.set(self.KEY, ",".join(sorted(self.off)) or "-")

    def adopt(self, store: _Store) -> None:
        if not self.decided and store.check([self.KEY]):
            text = store.get(self.KEY).decode()
            self.decide(frozenset(name for name in text.split(",") if name and name != "-"))
