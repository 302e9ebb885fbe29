"""The smallest set of directed links that explains the bad paths (binary network tomography).

Probes only say "the path from A to B is bad"; a path crosses several links (NIC uplink, switch
links, NIC downlink). A faulty link makes every probed path through it bad, and a healthy link sits
on good paths too, so:

1. each link gets the share of its probed paths that are bad, ``bad / (bad + good)``; a link whose
   paths are mostly good is exonerated (below ``min_share``), which is what makes one noisy verdict
   harmless, while a link on many bad paths and one misjudged good path stays a suspect;
2. a greedy set cover picks, over and over, the eligible link that explains the most still
   unexplained bad paths (weighted by its share; ties go to fewer good paths, then more bad ones),
   until no eligible link explains anything more. Bad paths no eligible link explains are noise
   and are reported as unexplained, never pinned on a link.
3. the two directions of one cable found together become one suspect (a NIC's uplink and downlink
   are ``BOTH``), so a suspect's key is the cable and is raised and cleared once.

Paths without a verdict are unknown: neither good nor bad. Counting is done with numpy over a
path/link incidence built once (``Localizer``), so a 16,384-node fabric with 16 probes per NIC is
solved in a small fraction of a second.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from clockwork.contracts import lens_model as model
from clockwork.contracts.lens_model import NicId, PathVerdict, Suspect
from clockworkd.lens.topology import Topology

MIN_SHARE = 0.5  # a link with fewer bad than good probed paths through it is exonerated
MAX_EXAMPLES = 4
_UNKNOWN, _GOOD, _BAD = 0, 1, 2


@dataclass(frozen=True)
class Diagnosis:
    """What one evaluation found: the suspects, and the bad paths no suspect explains (noise)."""

    suspects: tuple[Suspect, ...]
    unexplained: tuple[tuple[NicId, NicId], ...] = ()
    bad_paths: int = 0
    good_paths: int = 0


@dataclass
class _Evidence:
    """Per-link counts for one evaluation; bad paths by id, good ones only counted."""

    bad: dict[int, list[int]] = field(default_factory=dict)  # link index -> bad path ids through it
    good: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # link index -> good paths

    def share(self, link: int) -> float:
        bad = len(self.bad.get(link, ()))
        total = bad + int(self.good[link])
        return bad / total if total else 0.0


def localize(topology: Topology, verdicts: Iterable[PathVerdict]) -> list[Suspect]:
    """The suspect links for these path verdicts (simple entry point; use ``Localizer`` when repeating)."""
    return Localizer(topology).localize(verdicts)


class Localizer:
    """Path/link incidence built once for a topology and probe plan; ``localize`` per evaluation.

    Verdicts for pairs outside the plan are fine: their paths are added on first sight.
    """

    def __init__(
        self,
        topology: Topology,
        plan: Mapping[NicId, Iterable[NicId]] | None = None,
        min_share: float = MIN_SHARE,
    ) -> None:
        self._topology = topology
        self._min_share = min_share
        self._links = topology.links()
        self._link_index = {link: i for i, link in enumerate(self._links)}
        self._pairs: list[tuple[NicId, NicId]] = []
        self._path_links: list[tuple[int, ...]] = []
        self._ids: dict[NicId, dict[NicId, int]] = {}
        self._built = -1
        self._entry_link = np.zeros(0, dtype=np.int32)
        self._entry_path = np.zeros(0, dtype=np.int32)
        for src in sorted(plan or {}):
            for dst in (plan or {})[src]:
                self._path_id(src, dst)
        self._arrays()

    @property
    def paths(self) -> int:
        """How many probe paths the incidence holds."""
        return len(self._pairs)

    def localize(self, verdicts: Iterable[PathVerdict]) -> list[Suspect]:
        """The suspects, most confident first."""
        return list(self.diagnose(verdicts).suspects)

    def diagnose(self, verdicts: Iterable[PathVerdict]) -> Diagnosis:
        """Suspects plus the bad paths left unexplained and the verdict counts."""
        state, kinds = self._collect(verdicts)
        evidence = self._evidence(state, kinds)
        chosen, unexplained = self._cover(evidence)
        suspects = self._suspects(chosen, evidence, kinds)
        return Diagnosis(
            suspects=tuple(suspects),
            unexplained=tuple(sorted(self._pairs[pid] for pid in unexplained)),
            bad_paths=len(kinds),
            good_paths=state.count(_GOOD),
        )

    # ----- incidence ------------------------------------------------------------------------------

    def _path_id(self, src: NicId, dst: NicId) -> int | None:
        """The id of a probe path, indexing it on first sight; None when the topology has no such path."""
        pid = self._ids.get(src, {}).get(dst)
        if pid is not None:
            return pid
        links = self._topology.path(src, dst)
        if links is None:
            return None
        pid = len(self._pairs)
        self._pairs.append((src, dst))
        self._path_links.append(tuple(self._link_index[link] for link in links))
        self._ids.setdefault(src, {})[dst] = pid
        return pid

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat (link, path) incidence pairs, rebuilt only when new paths were indexed."""
        if self._built != len(self._pairs):
            lengths = np.fromiter((len(p) for p in self._path_links), dtype=np.int64, count=len(self._path_links))
            total = int(lengths.sum())
            self._entry_link = np.fromiter(chain.from_iterable(self._path_links), dtype=np.int32, count=total)
            self._entry_path = np.repeat(np.arange(len(self._pairs), dtype=np.int32), lengths)
            self._built = len(self._pairs)
        return self._entry_link, self._entry_path

    # ----- evidence -------------------------------------------------------------------------------

    def _collect(self, verdicts: Iterable[PathVerdict]) -> tuple[bytearray, dict[int, tuple[str, ...]]]:
        """Per path: unknown/good/bad (the last verdict for a pair wins), and the kinds of the bad ones."""
        state = bytearray(len(self._pairs))
        kinds: dict[int, tuple[str, ...]] = {}
        ids = self._ids
        for verdict in verdicts:
            pid = ids.get(verdict.src, {}).get(verdict.dst)
            if pid is None:
                pid = self._path_id(verdict.src, verdict.dst)
                if pid is None:
                    continue  # not a path of this topology (unknown NIC, other rail)
                state.append(_UNKNOWN)
            if verdict.bad:
                state[pid] = _BAD
                kinds[pid] = verdict.kinds
            else:
                state[pid] = _GOOD
                kinds.pop(pid, None)
        return state, kinds

    def _evidence(self, state: bytearray, kinds: Mapping[int, tuple[str, ...]]) -> _Evidence:
        entry_link, entry_path = self._arrays()
        states = np.frombuffer(bytes(state), dtype=np.uint8)
        good = np.bincount(entry_link[states[entry_path] == _GOOD], minlength=len(self._links))
        bad: dict[int, list[int]] = {}
        for pid in sorted(kinds):
            for link in self._path_links[pid]:
                bad.setdefault(link, []).append(pid)
        return _Evidence(bad, good)

    # ----- the cover ------------------------------------------------------------------------------

    def _cover(self, evidence: _Evidence) -> tuple[list[tuple[int, set[int]]], set[int]]:
        """Greedy set cover of the bad paths by eligible links (lazy: a link's gain only ever falls).

        Returns the chosen links with the bad paths each explained, and the bad paths left over.
        """
        uncovered = {pid for pids in evidence.bad.values() for pid in pids}
        heap = []
        for link, pids in evidence.bad.items():
            share = evidence.share(link)
            if share >= self._min_share:
                heap.append((-len(pids) * share, int(evidence.good[link]), -len(pids), self._links[link], link))
        heapq.heapify(heap)
        chosen: list[tuple[int, set[int]]] = []
        while heap and uncovered:
            gain, good, most, name, link = heapq.heappop(heap)
            explained = uncovered.intersection(evidence.bad[link])
            fresh = -len(explained) * evidence.share(link)
            if not explained:
                continue
            if fresh > gain and heap and (fresh, good, most, name) > heap[0][:4]:
                heapq.heappush(heap, (fresh, good, most, name, link))  # stale: others may now gain more
                continue
            chosen.append((link, explained))
            uncovered -= explained
        return chosen, uncovered

    # ----- suspects -------------------------------------------------------------------------------

    def _suspects(
        self, chosen: list[tuple[int, set[int]]], evidence: _Evidence, kinds: Mapping[int, tuple[str, ...]]
    ) -> list[Suspect]:
        """One suspect per cable: both directions of a cable found together merge into one."""
        by_cable: dict[str, list[tuple[int, float]]] = {}
        for link, explained in chosen:
            name = self._topology.physical(self._links[link]).name
            by_cable.setdefault(name, []).append((link, self._confidence(link, explained, evidence)))
        suspects = [self._suspect(found, evidence, kinds) for found in by_cable.values()]
        return sorted(suspects, key=lambda s: (-s.confidence, s.link))

    def _suspect(
        self, found: list[tuple[int, float]], evidence: _Evidence, kinds: Mapping[int, tuple[str, ...]]
    ) -> Suspect:
        links = sorted(
            found, key=lambda f: (self._topology.physical(self._links[f[0]]).direction != model.UPLINK, f[0])
        )
        directed = tuple(self._links[link] for link, _ in links)
        physical = self._topology.physical(directed[0])
        direction = physical.direction
        if len(directed) == 2 and physical.nic is not None:
            direction = model.BOTH
        bad = sorted({pid for link, _ in links for pid in evidence.bad[link]})
        good = sum(int(evidence.good[link]) for link, _ in links)
        return Suspect(
            link=physical.name,
            links=directed,
            switch=physical.switch,
            port=physical.port,
            nic=physical.nic,
            direction=direction,
            kinds=tuple(sorted({kind for pid in bad for kind in kinds[pid]})),
            confidence=round(max(conf for _, conf in links), 3),
            evidence={
                "bad_paths": len(bad),
                "good_paths": good,
                "examples": [f"{s} -> {d}" for s, d in sorted(self._pairs[pid] for pid in bad)[:MAX_EXAMPLES]],
            },
        )

    def _confidence(self, link: int, explained: set[int], evidence: _Evidence) -> float:
        """How sure the link is the cause of the bad paths it explains, in [0, 1].

        Three factors: the share of its probed paths that are bad; how uniquely it explains them
        (each other link on those paths lowers it by how much of them it also covers, times its own
        share, so two links that explain the same paths equally get 1/2 each); and how much evidence
        there is (one bad path is a coin flip, three are 7/8).
        """
        others: Counter[int] = Counter()
        for pid in explained:
            others.update(other for other in self._path_links[pid] if other != link)
        rivals = sum((n / len(explained) * evidence.share(other)) ** 2 for other, n in others.items())
        support = 1.0 - 0.5 ** len(evidence.bad[link])
        return evidence.share(link) * support / (1.0 + rivals)
