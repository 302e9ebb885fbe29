"""Which peer NICs each NIC probes: all of them on small clusters, K on large ones.

Every node computes the same global plan on its own (no coordinator): the plan depends only on the
topology and a seed, never on process state (no ``hash()``, no set iteration order).

Why the choice matters: end-to-end probes can blame one link only if the link lies on at least two
probed paths that differ elsewhere, i.e. no other link is on every probed path through it. Otherwise
the link and that other link explain the same bad paths and cannot be told apart. A plan of K peers
per NIC is therefore built in two steps:

1. a structured choice: a few peers on the NIC's own leaf (they single out its uplink cheaply) and
   the rest spread over the other leafs in a circulant pattern, so each NIC is also probed by about K
   others (its downlink) and each leaf sends and receives through every spine (inter-switch links);
2. a check of every directed link and a repair for the few it misses: a NIC swaps a peer for one
   whose path covers the weak link, provided the dropped path leaves every link it crossed covered.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from clockwork.contracts import lens_model as model
from clockwork.contracts.lens_model import LinkId, NicId
from clockworkd.lens.topology import Topology

Plan = dict[NicId, tuple[NicId, ...]]

_REPAIR_ROUNDS = 4
_CANDIDATES_PER_NIC_LINK = 96  # a NIC link: every candidate pair crosses it
_CANDIDATES_PER_SWITCH_LINK = 1024  # an ECMP hash sends only 1 in #spines candidate pairs over it


def plan(topology: Topology, k: int = 16, seed: int = 0) -> Plan:
    """Peer NICs per NIC: all same-rail peers when there are at most ``k``, else ``k`` chosen ones.

    On large rails a NIC may end up with ``k + 1`` peers where a repair found no path it could drop.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    chosen: dict[NicId, list[NicId]] = {}
    large = False
    for group in topology.rail_groups():
        if len(group) - 1 <= k:
            for nic in group:
                chosen[nic] = [peer for peer in group if peer != nic]
        else:
            chosen.update(_structured(topology, group, k, seed))
            large = True
    if large:
        _repair(topology, chosen, k, seed)
    return {nic: tuple(sorted(chosen[nic])) for nic in topology.nics()}


def probed_by(plan: Mapping[NicId, Iterable[NicId]]) -> Plan:
    """The inverse plan: for each NIC, the NICs that probe it (what its receiver should expect)."""
    inverse: dict[NicId, list[NicId]] = {nic: [] for nic in plan}
    for src in sorted(plan):
        for dst in plan[src]:
            inverse.setdefault(dst, []).append(src)
    return {nic: tuple(sorted(srcs)) for nic, srcs in sorted(inverse.items())}


def coverage(topology: Topology, plan: Mapping[NicId, Iterable[NicId]]) -> dict[str, Any]:
    """How well the plan lets tomography single out each directed link.

    ``weak`` lists the links without two probed paths that differ elsewhere (some other link lies on
    every probed path through them, or they have fewer than two); ``unprobed`` those on no path.
    """
    incidence = _Incidence(topology)
    for src in sorted(plan):
        for dst in plan[src]:
            incidence.add(src, dst)
    weak = [link for link in topology.links() if not incidence.covered(link)]
    counts = [len(incidence.through(link)) for link in topology.links()]
    return {
        "links": len(counts),
        "paths": incidence.size,
        "min_paths": min(counts, default=0),
        "weak": weak,
        "unprobed": [link for link, n in zip(topology.links(), counts, strict=True) if n == 0],
        "ok": not weak,
    }


# ----- step 1: the structured choice ---------------------------------------------------------------


def _structured(topology: Topology, group: tuple[NicId, ...], k: int, seed: int) -> dict[NicId, list[NicId]]:
    """K peers per NIC of one large rail group: a few on the same leaf, the rest spread over the others."""
    by_switch: dict[str, list[NicId]] = {}
    for nic in group:
        by_switch.setdefault(topology.switch_of(nic), []).append(nic)
    ring = [nic for sw in sorted(by_switch) for nic in by_switch[sw]]  # leaf-major, so offsets cross leafs
    widest = max(len(members) for members in by_switch.values())
    chosen = {}
    i = 0
    for sw in sorted(by_switch):
        members = by_switch[sw]
        local = k if len(by_switch) == 1 else min(len(members) - 1, max(1, k // 8))
        for p, nic in enumerate(members):
            peers = [members[(p + j) % len(members)] for j in range(1, local + 1)]
            taken = {*peers, nic}
            for offset in _offsets(len(ring), widest, k - len(peers), seed):
                peer = _next_off_leaf(topology, ring, i, offset, taken)
                if peer is not None:
                    peers.append(peer)
                    taken.add(peer)
            peers += _fill(group, nic, k - len(peers), taken)
            chosen[nic] = peers
            i += 1
    return chosen


def _offsets(n: int, widest: int, want: int, seed: int) -> list[int]:
    """Ring offsets of the cross-leaf peers, spread evenly.

    Offsets in ``[widest, n - widest]`` never land on the sender's own leaf (leafs are contiguous on
    the ring and none is wider), and the same offsets for every NIC make the pattern circulant: each
    NIC is probed by as many NICs as it probes. Few leafs leave no such range; then offsets spread
    over the whole ring and ``_next_off_leaf`` steps past the own leaf.
    """
    if want < 1:
        return []
    low, span = (widest, n - 2 * widest + 1) if n - 2 * widest + 1 >= want else (1, n - 1)
    return [low + (span * j // want + seed) % span for j in range(want)]


def _next_off_leaf(topology: Topology, ring: list[NicId], i: int, offset: int, taken: set[NicId]) -> NicId | None:
    """The first NIC from ``offset`` on around the ring that is on another leaf and not yet chosen."""
    leaf = topology.switch_of(ring[i])
    for t in range(len(ring)):
        peer = ring[(i + offset + t) % len(ring)]
        if peer not in taken and topology.switch_of(peer) != leaf:
            return peer
    return None


def _fill(group: tuple[NicId, ...], nic: NicId, want: int, taken: set[NicId]) -> list[NicId]:
    """Top up from the rail in ring order when the structured choice came short (tiny leafs)."""
    if want < 1:
        return []
    start = group.index(nic)
    peers = []
    for t in range(1, len(group)):
        peer = group[(start + t) % len(group)]
        if peer not in taken:
            peers.append(peer)
            taken.add(peer)
            if len(peers) == want:
                break
    return peers


# ----- step 2: check and repair --------------------------------------------------------------------


class _Incidence:
    """Probed paths and, per directed link, the paths through it (path ids, so removal is cheap)."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology
        self._paths: dict[int, tuple[LinkId, ...]] = {}
        self._ids: dict[tuple[NicId, NicId], int] = {}
        self._through: dict[LinkId, set[int]] = {}
        self._next_id = 0

    @property
    def size(self) -> int:
        return len(self._paths)

    def add(self, src: NicId, dst: NicId) -> None:
        links = self._topology.path(src, dst)
        if links is None or (src, dst) in self._ids:
            return
        pid = self._next_id
        self._next_id += 1
        self._ids[(src, dst)] = pid
        self._paths[pid] = links
        for link in links:
            self._through.setdefault(link, set()).add(pid)

    def remove(self, src: NicId, dst: NicId) -> None:
        pid = self._ids.pop((src, dst))
        for link in self._paths.pop(pid):
            self._through[link].discard(pid)

    def through(self, link: LinkId) -> set[int]:
        return self._through.get(link, set())

    def shared(self, link: LinkId, without: int | None = None) -> set[LinkId] | None:
        """Links on every probed path through ``link`` (``without`` one path); None when there is none."""
        common: set[LinkId] | None = None
        for pid in self.through(link):
            if pid == without:
                continue
            common = set(self._paths[pid]) if common is None else common.intersection(self._paths[pid])
            if len(common) == 1:
                break  # only the link itself: cannot shrink further
        return common

    def covered(self, link: LinkId, without: int | None = None) -> bool:
        """At least two probed paths through ``link`` and no other link on all of them."""
        if len(self.through(link) - {without}) < 2:
            return False
        return self.shared(link, without) == {link}

    def path_id(self, src: NicId, dst: NicId) -> int:
        return self._ids[(src, dst)]

    def links_of(self, src: NicId, dst: NicId) -> tuple[LinkId, ...]:
        return self._paths[self._ids[(src, dst)]]


def _repair(topology: Topology, chosen: dict[NicId, list[NicId]], k: int, seed: int) -> None:
    """Fix weak links by swapping peers, a few rounds (each fix can weaken another link)."""
    incidence = _Incidence(topology)
    for src in topology.nics():
        for dst in chosen[src]:
            incidence.add(src, dst)
    for _ in range(_REPAIR_ROUNDS):
        weak = [link for link in topology.links() if not incidence.covered(link)]
        fixed = sum(_fix(topology, incidence, chosen, link, k, seed) for link in weak)
        if not fixed:
            return


def _fix(
    topology: Topology, incidence: _Incidence, chosen: dict[NicId, list[NicId]], link: LinkId, k: int, seed: int
) -> bool:
    """Add the probe that best narrows what ``link``'s paths share; drop a redundant peer of its sender."""
    if incidence.covered(link):
        return False  # an earlier fix this round covered it
    common = incidence.shared(link)
    best: tuple[int, bool, NicId, NicId] | None = None
    for src, dst in _candidates(topology, link, seed):
        if src == dst or dst in chosen[src]:
            continue
        links = topology.path(src, dst)
        if links is None or link not in links:
            continue
        left = len(set(links) if common is None else common.intersection(links))
        if common is not None and left >= len(common):
            continue  # does not narrow anything
        over = _victim(incidence, chosen, src, link) is None and len(chosen[src]) >= k
        if over and left > 1:
            continue  # exceed k only for a probe that settles the link
        if best is None or (left, over) < best[:2]:
            best = (left, over, src, dst)
        if left == 1 and not over:
            break
    if best is None:
        return False
    _, _, src, dst = best
    victim = _victim(incidence, chosen, src, link) if len(chosen[src]) >= k else None
    if victim is not None:
        chosen[src].remove(victim)
        incidence.remove(src, victim)
    chosen[src].append(dst)
    incidence.add(src, dst)
    return True


def _victim(incidence: _Incidence, chosen: dict[NicId, list[NicId]], src: NicId, keep: LinkId) -> NicId | None:
    """A peer of ``src`` whose path can go: every link on it stays covered without it."""
    for peer in sorted(chosen[src], reverse=True):
        links = incidence.links_of(src, peer)
        if keep in links:
            continue
        pid = incidence.path_id(src, peer)
        if all(incidence.covered(other, without=pid) for other in links):
            return peer
    return None


def _candidates(topology: Topology, link: LinkId, seed: int) -> list[tuple[NicId, NicId]]:
    """NIC pairs whose probe may cross ``link``, sampled deterministically (seeded by the link name)."""
    physical = topology.physical(link)
    rng = random.Random(zlib.crc32(link.encode()) ^ seed)
    if physical.nic is not None:
        peers = topology.same_rail_peers(physical.nic)
        sample = _sample(rng, peers, _CANDIDATES_PER_NIC_LINK)
        if physical.direction == model.UPLINK:
            return [(physical.nic, peer) for peer in sample]
        return [(peer, physical.nic) for peer in sample]
    a, _, b = link.partition(">")
    srcs = _nics_near(topology, a, b)
    dsts = _nics_near(topology, b, a)
    if not srcs or not dsts:
        return []
    pairs = [(rng.choice(srcs), rng.choice(dsts)) for _ in range(_CANDIDATES_PER_SWITCH_LINK)]
    return [(s, d) for s, d in pairs if topology.rail_group(s) is topology.rail_group(d)]


def _nics_near(topology: Topology, switch: str, away_from: str) -> tuple[NicId, ...]:
    """NICs on ``switch``, or else on its neighbours other than ``away_from`` (a spine's leafs)."""
    if topology.nics_on(switch):
        return topology.nics_on(switch)
    near: list[NicId] = []
    for sw in topology.neighbors(switch):
        if sw != away_from:
            near += topology.nics_on(sw)
    return tuple(near)


def _sample(rng: random.Random, items: tuple[NicId, ...], n: int) -> list[NicId]:
    return list(items) if len(items) <= n else rng.sample(items, n)
