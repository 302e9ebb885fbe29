"""One node's view of every clock of the fabric: the delay envelopes, the pair fits, the reconciled solution.

Why one object: the envelopes (fed by this node's own coded pairs and by the minima its peers tell it), the
pair fits (this node's share and the ones its peers tell), the solution over the probe graph and each node's
drift build on each other, at cadences of their own (envelopes at every probe, fits every CLOCK_EVERY_S, a
full solve every SOLVE_EVERY_S at most, the solution carried forward at every evaluation). Lens asks it for
the one thing the rest needs, the offset and its rate of change between this node's clock and a sender's
(:meth:`ClockKeeper.offset_ns`, :meth:`ClockKeeper.offset_rate`), and for what to tell the other daemons.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from clockwork.contracts.lens_model import NicId, nic_id, split_nic
from clockworkd.lens import clockgraph, clockpair, wire
from linkpass.fabric import FabricMap

log = logging.getLogger("clockwork.lens")

# Clock fits every 8 s (each ~1 ms a pair; drift carries the offset in between), the graph solved every 4 s at
# most. Against 4 s and 2 s, side by side on bench/clocksync.py with the same seams: error p50 2.2/0.6 µs and
# p99 10.3/2.7 µs against 1.7/0.75 and 8.9/2.6 (goal < 20 µs), for 0.3 % of a core less at 16 peers.
CLOCK_EVERY_S = 8.0
SOLVE_EVERY_S = 4.0
FIRST_CLOCK_FIT_S = 1.5  # the first fit as soon as the envelopes have a few sub-windows
PAIR_FRESH_S = 15.0  # a pair's clock estimate older than this is not used
ENVELOPE_WINDOW_NS = 20_000_000_000
ENVELOPE_SUB_NS = 250_000_000


class ClockKeeper:
    """The clocks as ``node`` sees them. ``clock_ns`` reads this node's clock (through the seam in tests)."""

    def __init__(
        self,
        node: str,
        nodes: list[str],
        reference: str,
        fabric: FabricMap,
        clock_ns: Callable[[], int],
        floor_us: float,
    ) -> None:
        self.me = node
        self.nodes = nodes
        self.node_set = frozenset(nodes)
        self.reference = reference
        self.fabric = fabric
        self.rails = sorted(fabric.nodes[node].nics)
        self.clock_ns = clock_ns
        self.floor_us = floor_us  # what software timestamps cannot see, added to every reported uncertainty
        self.envelopes: dict[tuple[NicId, NicId], clockpair.Envelope] = {}
        self._sent_minima: dict[tuple[NicId, NicId], int] = {}  # newest minimum already told to peers
        self.solution: clockgraph.GraphSolution | None = None
        self.pair_estimates: dict[tuple[str, str], tuple[float, clockpair.PairEstimate]] = {}
        self._pair_raw: dict[tuple[str, str], list[Any]] = {}  # summary entry each remote estimate came from
        self.drift: dict[str, float] = {}  # node -> d(offset to the reference)/dt, ns per ns
        self.tracker = clockgraph.SuspectTracker()
        self.suspects: set[tuple[str, str]] = set()  # pairs whose offsets persistently break loops
        self.solved_at_real_ns = 0  # real time of the last solution (benchmarks compare against seam truth)
        self._next_solve = 0.0  # monotonic time of the next full graph solve
        self._solved_pairs: set[tuple[str, str]] = set()  # the pairs the last full solve used
        self.fits = 0  # clock-fit rounds so far (the rails take turns)

    def envelope(self, src: NicId, dst: NicId) -> clockpair.Envelope:
        """The delay envelope of the path ``src`` -> ``dst`` (made on first use)."""
        env = self.envelopes.get((src, dst))
        if env is None:
            env = self.envelopes[(src, dst)] = clockpair.Envelope(ENVELOPE_WINDOW_NS, ENVELOPE_SUB_NS)
        return env

    def fit_own_pairs(self) -> None:
        """Fit the clock offset to each peer for which this node is the lower-named end.

        A fit costs ~2 ms, so each node fits only its share of the pairs, each from one NIC pair (the
        rails take turns), and tells the others in its summaries; every node then reconciles all pairs.
        """
        at = self.clock_ns()
        rails = self.rails
        rail = rails[self.fits % len(rails)]
        self.fits += 1
        for peer in self.nodes:
            if peer <= self.me or rail not in self.fabric.nodes[peer].nics:
                continue
            fwd = self.envelopes.get((nic_id(self.me, rail), nic_id(peer, rail)))
            rev = self.envelopes.get((nic_id(peer, rail), nic_id(self.me, rail)))
            if fwd is None or rev is None:
                continue
            est = clockpair.estimate_pair(fwd.minima(), rev.minima(), at)
            if est is not None:
                self.pair_estimates[(self.me, peer)] = (time.monotonic(), est)

    def solve(self) -> None:
        """Reconcile the pair estimates (each extrapolated to now with its drift) over the probe graph.

        With clocks drifting apart by up to 100 µs a second, a two-second-old solution would bend every
        one-way delay, so every evaluation needs the offsets of now. A full solve (two graph solves, the
        second for the drift, ~3 ms each on 17 nodes) runs when the set of pairs changed or SOLVE_EVERY_S
        passed; in between the last solution is carried forward with its drift, which is what a new
        solve of the same estimates would give (they are refitted only every CLOCK_EVERY_S anyway).
        """
        now = time.monotonic()
        fresh = {pair: est for pair, (t, est) in self.pair_estimates.items() if now - t < PAIR_FRESH_S}
        if not fresh:
            return
        at = self.clock_ns()
        sol = self.solution
        if sol is not None and sol.at_ns is not None and now < self._next_solve and fresh.keys() == self._solved_pairs:
            dt = at - sol.at_ns
            offsets = {n: off + self.drift.get(n, 0.0) * dt for n, off in sol.offsets_ns.items()}
            self.solution = replace(sol, at_ns=at, offsets_ns=offsets)
            self.solved_at_real_ns = time.time_ns()
            return
        self._next_solve = now + SOLVE_EVERY_S
        self._solved_pairs = set(fresh)
        self.solution = clockgraph.solve_graph(fresh, self.reference, at, nodes=self.nodes)
        self.solved_at_real_ns = time.time_ns()
        # The same a second earlier gives each node's drift against the reference: one-way delays
        # over a window are corrected sample by sample with it (100 ppm is 200 µs over a 2 s window).
        before = clockgraph.solve_graph(fresh, self.reference, at - 1_000_000_000, nodes=self.nodes)
        self.drift = {
            n: (off - before.offsets_ns[n]) / 1e9
            for n, off in self.solution.offsets_ns.items()
            if n in before.offsets_ns
        }
        persistent = set(self.tracker.update(self.solution))
        for a, b in sorted(persistent - self.suspects):
            log.warning(
                "lens on %s: clock pair %s-%s disagrees with the rest of the probe graph (loop residual): "
                "an asymmetric or faulty path between them",
                self.me,
                a,
                b,
            )
        self.suspects = persistent

    def offset_ns(self, src_node: str) -> float | None:
        """Receiver (this node) clock minus ``src_node``'s clock, when the clocks are reconciled."""
        if src_node == self.me:
            return 0.0
        sol = self.solution
        if sol is None or src_node not in sol.offsets_ns or self.me not in sol.offsets_ns:
            return None
        return sol.relative(src_node, self.me)

    def offset_rate(self, src_node: str) -> float:
        """How fast that offset changes (ns per ns): this node's drift minus the sender's."""
        return self.drift.get(self.me, 0.0) - self.drift.get(src_node, 0.0)

    # ----- what the summaries carry ---------------------------------------------------------

    def minima_to_tell(self, received: Iterable[tuple[NicId, NicId]]) -> dict[str, list[list[Any]]]:
        """The envelope minima of the paths this node receives (``(src, dst)`` each) not told yet, by the
        peer that is to hear them: each peer only those of its own paths (the only ones it fits)."""
        minima: dict[str, list[list[Any]]] = {}
        for src, dst in received:
            env = self.envelopes.get((src, dst))
            src_node = split_nic(src)[0]
            if env is None or src_node > self.me:
                continue  # a pair is fitted by its lower-named node, which has the other direction itself
            told = self._sent_minima.get((src, dst), -1)
            new = [(t, d) for t, d in env.minima() if t > told][-40:]
            if new:
                self._sent_minima[(src, dst)] = new[-1][0]
                minima.setdefault(src_node, []).append([src, dst, [v for td in new for v in td]])
        return minima

    def pairs_to_tell(self) -> list[list[Any]]:
        """This node's own pair fits, as every peer hears them."""
        return [
            [a, b, est.offset_ns, est.drift_ppm, est.uncertainty_ns, est.at_ns, est.samples]
            for (a, b), (_t, est) in self.pair_estimates.items()
            if a == self.me
        ]

    def told_estimate(self, node: str, entry: list[Any]) -> clockpair.PairEstimate | None:
        """A pair fit ``node`` told (a summary's entry), checked: None when the pair is not ``node``'s to tell
        (a daemon speaks only for the pairs it fits), an exception when the entry is malformed."""
        a, b, offset, drift, unc, at, samples = entry
        if a != node or b not in self.node_set:
            return None
        known = self.pair_estimates.get((a, b))
        if known is not None and self._pair_raw.get((a, b)) == entry:
            return known[1]  # told again unchanged (fits: every CLOCK_EVERY_S)
        if not all(math.isfinite(float(x)) for x in (offset, drift, unc)) or float(unc) <= 0:
            raise wire.WireError(f"non-finite clock estimate for {a}-{b}")
        return clockpair.PairEstimate(float(offset), float(drift), float(unc), int(samples), 0.0, int(at))

    def take_told(self, now: float, estimate: clockpair.PairEstimate, entry: list[Any]) -> None:
        """Keep a pair fit a peer told (checked by :meth:`told_estimate`), as of ``now`` (monotonic)."""
        key = (entry[0], entry[1])
        self.pair_estimates[key] = (now, estimate)
        self._pair_raw[key] = entry

    # ----- reporting ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The clock part of Lens's snapshot: each node's offset to the reference, with its uncertainty."""
        sol = self.solution
        clock: dict[str, dict[str, float]] = {}
        if sol is not None:
            for node, off in sol.offsets_ns.items():
                fit_us = sol.uncertainty_ns.get(node, 0.0) / 1e3
                clock[node] = {
                    "offset_us": round(off / 1e3, 3),
                    "uncertainty_us": round(math.hypot(fit_us, self.floor_us), 3) if node != sol.reference else 0.0,
                }
        return {
            "reference": self.reference,
            "clock": clock,
            "clock_at_real_ns": self.solved_at_real_ns,
            "clock_unreachable": list(sol.unreachable) if sol else [],
            "loop_residual_us": round(sol.loop_rms_ns / 1e3, 3) if sol and sol.loop_rms_ns is not None else None,
            "clock_suspect_edges": [list(e) for e in sorted(self.suspects)],
        }
