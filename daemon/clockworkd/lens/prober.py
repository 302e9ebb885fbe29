"""The Fleet Lens component the node daemon hosts: probe, measure, sync clocks, judge, localize.

No thread per peer. One C thread, the pacer (``_probeio.Pacer``), sends every probe interval one batch
per NIC (``sendmmsg``: a probe to every planned peer NIC, one of them a coded pair) without the GIL; the
daemon's event loop calls :meth:`Lens.tick`, which drains every NIC's socket (``recvmmsg``) every 50 ms.
Reading that lazily costs nothing in accuracy because the kernel stamps each packet on arrival
(SO_TIMESTAMPNS).

Every ``summary_ms``, and at once when one of its paths turns bad or heals, each daemon tells the others
what it measured on the paths it receives (their verdicts and the new minima of their delay envelopes),
so every daemon holds the whole picture:
each path's forward and reverse envelopes for clock sync, every path's verdict for localization.
Every ``evaluate_ms`` paths are judged against their own baselines, clocks are reconciled over the
probe graph, and the topology's tomography names the links that explain the bad paths. A suspect is
raised after ``raise_after`` evaluations in a row and cleared after ``clear_after`` without it; the
daemon whose node owns the link records ``lens.suspect``/``lens.clear`` (so each shows up once), and
every daemon hands its own paths through a suspect NIC to LinkPass as gray.

This module is the conductor: when each part runs, and what it costs. The parts are their own modules:
``probepaths`` (the NICs, paths and the arrays the C side shares), ``receiving`` (reading and filing what
arrives), ``clockkeeper`` (envelopes, pair fits, the clock solution), ``summaries`` (what the daemons tell
each other) and ``suspects`` (raising, clearing and announcing suspect links).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clockwork.contracts.config.lens import LensConfig
from clockwork.contracts.lens_model import PathStats, PathVerdict, split_nic
from clockworkd.lens import budget, fastio, peers, tomography, wire
from clockworkd.lens.clockkeeper import CLOCK_EVERY_S, FIRST_CLOCK_FIT_S, ClockKeeper
from clockworkd.lens.clockseam import ClockSeam
from clockworkd.lens.keys import LensKeys, PeerKeys
from clockworkd.lens.pathwindow import Thresholds, window_stats
from clockworkd.lens.probepaths import ProbePaths
from clockworkd.lens.receiving import ProbeReceiver
from clockworkd.lens.summaries import SummaryEntries, SummaryExchange, remote_verdict, verdict_entries
from clockworkd.lens.suspects import Emit, GrayTarget, LinkSuspects
from clockworkd.lens.topology import Topology
from linkpass.fabric import FabricMap

log = logging.getLogger("clockwork.lens")

#: Where Lens's CPU time goes (its snapshot's ``cpu_ms``; bench/lens_overhead.py prints it): the pacer's
#: probes, the reads, trains, summaries sent, own clock fits; and, within each evaluation, summaries taken
#: in, the samples filed and each path's figures, the clock graph solve, and the rest (judging, localizing,
#: tracking suspects, the snapshot).
PHASES = (
    "probes",
    "receive",
    "trains",
    "summaries",
    "clock_fits",
    "summaries_in",
    "path_stats",
    "clock_solve",
    "evaluate",
)
# Sockets are read this often; the kernel holds and stamps what arrives meanwhile. Not less often, though each
# read has a fixed cost (~0.1 ms): an echo answers the newest probe seen at the last read, and its hold time
# (probe received -> echo sent) is measured on the echoing node's clock, whose drift scales the error with the
# hold. At 0.1 s (tried: -0.2 to -0.4 % of a core at 16 peers) a 100 ppm drift put one one-way delay below 0.
DRAIN_EVERY_S = 0.05
SNAPSHOT_EVERY_S = 2.0  # the copy metrics read is rebuilt this often (and whenever the CLI asks)


class Lens:
    """One node's Fleet Lens. ``start`` -> ``tick``* -> ``close``; ``snapshot`` for the CLI and metrics."""

    def __init__(
        self,
        cfg: LensConfig,
        node: str,
        fabric: FabricMap,
        topology: Topology,
        key: bytes | PeerKeys,
        emit: Emit,
        seam: ClockSeam | None = None,
        gray: GrayTarget | None = None,
    ) -> None:
        self.cfg = cfg
        self.me = node
        self.fabric = fabric
        self.topology = topology
        self.seam = seam
        self.schedule = budget.schedule(
            topology, cfg.peers_per_nic, cfg.interval_ms, cfg.probe_budget_per_s, cfg.pair_every
        )
        self.interval = self.schedule.interval_ms / 1000
        self.th = Thresholds(
            self.interval, cfg.window_s, cfg.loss_min_lost, cfg.delay_rise_us, cfg.jitter_rise_us, cfg.rate_drop
        )
        self.paths = ProbePaths(fabric, node)
        nodes = self.paths.nodes
        # One key every node shares (bytes), or pairwise keys: a node tags packets only as itself.
        self.keys = LensKeys(nodes, node, key)
        self.reference = cfg.reference_node or nodes[0]
        self.session = int.from_bytes(os.urandom(4), "little")
        self.counters = {
            "probes_sent": 0,
            "probes_received": 0,
            "trains_sent": 0,
            "summaries_sent": 0,
            "summaries_received": 0,
            "rejected": 0,
            "send_errors": 0,
            "probe_ticks_skipped": 0,
            "evaluations": 0,
        }
        self.clocks = ClockKeeper(node, nodes, self.reference, fabric, self._clock_ns, cfg.clock_floor_us)
        self.receiver = ProbeReceiver(self.paths, self.keys, seam, self.counters, self.clocks.envelope)
        self.summaries = SummaryExchange(node, nodes, self.keys, self.session, self.counters, self.clocks)
        self.suspects = LinkSuspects(cfg, node, nodes, emit, gray, self.summaries.peers_alive)
        self.localizer: tomography.Localizer | None = None
        self._bad_told: frozenset[tuple[str, str, tuple[str, ...]]] = frozenset()  # bad paths last told
        self.pacer: Any = None  # the C thread that sends the probes (_probeio.Pacer), from start() on
        self._pacer_errors = 0  # its send errors already counted in counters["send_errors"]
        now = time.monotonic()
        self.next_train = now + 1.0
        self.next_drain = now
        self.next_summary = now + cfg.summary_ms / 1000
        self.next_eval = now + cfg.evaluate_ms / 1000
        self.next_clock = now + FIRST_CLOCK_FIT_S
        self.cpu_ns = dict.fromkeys(PHASES, 0)  # CPU time per phase (ns, user + kernel): see PHASES
        self.last_stats: list[tuple[PathStats, PathVerdict | None]] = []
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_stale = True
        self.next_snapshot = 0.0
        self.on_snapshot: Callable[[dict[str, Any]], None] | None = None  # called every SNAPSHOT_EVERY_S (history)

    # ----- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        fastio.probeio()  # raises, naming the fix, when the C extension is not built
        plan = self.schedule.plan
        self.localizer = tomography.Localizer(self.topology, plan)
        self.paths.open(plan, peers.probed_by(plan), self.cfg.port)
        self.pacer = self.paths.start_pacer(
            self.keys.arg(), self.session, round(self.schedule.interval_ms * 1e6), self.cfg.pair_every, self.seam
        )
        self.receiver.attach(self.pacer)
        log.info(
            "lens on %s: NICs %s, %d outgoing and %d incoming paths, probe every %g ms, reference clock %s%s",
            self.me,
            ",".join(n.name for n in self.paths.local),
            sum(len(n.out) for n in self.paths.local),
            len(self.paths.incoming),
            self.schedule.interval_ms,
            self.reference,
            " (clock seam: TESTS ONLY)" if self.seam else "",
        )

    def close(self) -> None:
        if self.pacer is not None:
            self.pacer.stop()  # before the sockets it sends on close
        self.paths.close()

    # ----- event loop hooks -----------------------------------------------------------------

    def fds(self) -> list[int]:
        return []  # read lazily, every DRAIN_EVERY_S: the kernel's arrival stamps make that exact

    def on_readable(self, fd: int) -> None:  # pragma: no cover - never registered
        pass

    def next_deadline(self) -> float:
        deadlines = [self.next_drain, self.next_summary, self.next_clock, self.next_eval]
        if self.cfg.train_interval_ms > 0:
            deadlines.append(self.next_train)
        return min(deadlines)

    def tick(self) -> None:
        # Each phase's CPU time (this thread's, user + kernel) is added up in cpu_ns: what Lens costs and
        # where (bench/lens_overhead.py prints it). One clock read per phase that runs (~0.5 µs each).
        # The probes are the pacer thread's (its own CPU time, taken from it at each drain).
        now = time.monotonic()
        cpu, spent = time.thread_time_ns, self.cpu_ns
        t0 = cpu()
        if self.keys.refresh() and self.pacer is not None:  # a key file changed: the pacer tags with the new keys
            self.pacer.set_keys(self.keys.arg())
        if now >= self.next_drain or now >= self.next_eval:  # late reads cost no accuracy (arrival stamps)
            self.next_drain = now + DRAIN_EVERY_S
            self.receiver.drain_all(now)
            self._take_pacer_stats()
            t1 = cpu()
            spent["receive"] += t1 - t0
            t0 = t1
        if self.cfg.train_interval_ms > 0 and now >= self.next_train:
            self._send_trains()
            self.next_train = now + self.cfg.train_interval_ms / 1000
            t1 = cpu()
            spent["trains"] += t1 - t0
            t0 = t1
        if now >= self.next_summary:
            self.send_summaries()
            self.next_summary = now + self.cfg.summary_ms / 1000
            t1 = cpu()
            spent["summaries"] += t1 - t0
            t0 = t1
        if now >= self.next_clock:
            self.clocks.fit_own_pairs()
            self.next_clock = now + CLOCK_EVERY_S
            t1 = cpu()
            spent["clock_fits"] += t1 - t0
            t0 = t1
        if now >= self.next_eval:
            self.evaluate(now)  # accounts for its own phases
            self.next_eval = now + self.cfg.evaluate_ms / 1000

    # ----- sending --------------------------------------------------------------------------

    def _clock_ns(self) -> int:
        t = time.time_ns()
        return self.seam.apply(t) if self.seam else t

    def _take_pacer_stats(self) -> None:
        """The pacer's probes sent, send errors and CPU time into counters and cpu_ns."""
        if self.pacer is None:
            return
        stats = self.pacer.stats()
        self.counters["probes_sent"] = stats["sent"]
        self.counters["probe_ticks_skipped"] = stats["late"]
        self.counters["send_errors"] += stats["errors"] - self._pacer_errors
        self._pacer_errors = stats["errors"]
        self.cpu_ns["probes"] = stats["cpu_ns"]

    def _send_trains(self) -> None:
        count = max(2, self.cfg.train_bytes // wire.TRAIN_PACKET)
        src_index, probeio = self.paths.node_index[self.me], fastio.probeio()
        for local in self.paths.local:
            if not local.out:
                continue
            path = local.out[local.train_next_peer % len(local.out)]
            local.train_next_peer += 1
            local.train_seq += 1
            tx = self._clock_ns()
            for first in range(0, count, probeio.MAX_TRAIN):
                n = min(probeio.MAX_TRAIN, count - first)
                sent, err = probeio.send_train(
                    local.sock.fileno(),
                    self.keys.arg(),  # the C code takes the destination node's key from a table
                    src_index,
                    local.index,
                    path.dst[0],
                    path.dst[1],
                    path.addr,
                    local.train_seq,
                    tx,
                    self.session,
                    first,
                    n,
                    count,
                    wire.TRAIN_PACKET,
                )
                self.counters["trains_sent"] += sent
                if err:
                    self.counters["send_errors"] += 1
                    break

    def summary_entries(self) -> SummaryEntries:
        """What this node tells the others now: its paths' verdicts and its clock fits (for every peer), and
        the envelope minima not told yet (each peer only those of its own paths: the only ones it fits)."""
        received = ((pw.src, pw.dst) for pw in self.paths.incoming.values())
        return SummaryEntries(
            verdict_entries(self.last_stats), self.clocks.minima_to_tell(received), self.clocks.pairs_to_tell()
        )

    def send_summaries(self) -> None:
        """Tell every peer this round's summary (see :mod:`clockworkd.lens.summaries`)."""
        self.summaries.send(self.summary_entries(), self.paths.local)

    # ----- judging and localizing -----------------------------------------------------------

    def evaluate(self, now: float) -> None:
        cpu, spent = time.thread_time_ns, self.cpu_ns
        t0 = cpu()
        self.counters["evaluations"] += 1
        self.receiver.file_records()
        t1 = cpu()
        spent["receive"] += t1 - t0  # filing what the reads took in
        t0 = t1
        self.summaries.take_in(self.receiver.take_summaries())
        t1 = cpu()
        spent["summaries_in"] += t1 - t0
        self.receiver.flush_samples()
        t2 = cpu()
        self.clocks.solve()
        t3 = cpu()
        spent["clock_solve"] += t3 - t2
        incoming = self.paths.incoming
        heard = {pw.src.partition("/")[0] for pw in incoming.values() if now - pw.last_rx < self.th.window_s}
        windows = list(incoming.values())
        senders = [split_nic(pw.src)[0] for pw in windows]
        for pw in windows:
            if pw.train_got and now - pw.last_rx > 0.2:
                pw.finish_train(now)
        clocks = self.clocks
        figures = window_stats(
            windows, now, [clocks.offset_ns(n) for n in senders], [clocks.offset_rate(n) for n in senders], self.th
        )
        results: list[tuple[PathStats, PathVerdict | None]] = [
            (stats, pw.judge(stats, self.th, src_node in heard))
            for pw, src_node, stats in zip(windows, senders, figures, strict=True)
        ]
        self.last_stats = results
        bad = frozenset((v.src, v.dst, v.kinds) for _, v in results if v is not None and v.bad)
        if bad != self._bad_told:  # a path turned bad, changed or healed: the others hear it now, not next round
            self._bad_told = bad
            self.next_summary = now
        t4 = cpu()
        spent["path_stats"] += (t4 - t3) + (t2 - t1)  # filing the samples, then each path's figures
        verdicts = [v for _, v in results if v is not None]
        fresh = self.summaries.fresh_verdicts(now)
        if any(v.bad for v in verdicts) or any(v[2] for v in fresh):  # built only when there is work
            verdicts += [remote_verdict(v) for v in fresh]
        found = self.localizer.localize(verdicts) if self.localizer and any(v.bad for v in verdicts) else []
        self.suspects.track(found, now)
        self._snapshot_stale = True
        if now >= self.next_snapshot:  # keep the copy other threads read (metrics) fresh, but not per evaluation
            self.next_snapshot = now + SNAPSHOT_EVERY_S
            snapshot = self.snapshot(remote=False)
            if self.on_snapshot is not None:
                self.on_snapshot(snapshot)
        spent["evaluate"] += cpu() - t4

    # ----- reporting ------------------------------------------------------------------------

    def _build_snapshot(self) -> dict[str, Any]:
        paths = []
        for stats, verdict in self.last_stats:
            entry = stats.to_dict()
            entry["verdict"] = verdict.to_dict() if verdict is not None else None
            paths.append(entry)
        return {
            "node": self.me,
            "enabled": True,
            "interval_ms": self.schedule.interval_ms,
            "probe_schedule": self.schedule.to_dict(),
            "time": time.time(),
            **self.clocks.snapshot(),
            "paths": paths,
            "suspects": self.suspects.raised(),
            **self._accounts(),
        }

    def _accounts(self) -> dict[str, Any]:
        """The counters and CPU time per phase, as of now (the pacer's taken in)."""
        self._take_pacer_stats()
        return {"counters": dict(self.counters), "cpu_ms": {k: round(v / 1e6, 3) for k, v in self.cpu_ns.items()}}

    def snapshot(self, remote: bool = True) -> dict[str, Any]:
        """The latest evaluation (what ``clockwork lens`` and the metrics show), with the counters and CPU
        times as of now: the pacer sends on while a busy event loop puts off the next evaluation.

        ``remote``: add ``remote_paths``, the other daemons' word on the paths they receive, so that one daemon
        shows the whole fabric. Only ``clockwork lens`` reads it, and at 16 peers it is hundreds of paths (a
        few ms to build): it is built when asked for, never for the periodic copy (metrics, history).
        """
        if self._snapshot_stale:  # built on demand, in the event loop's thread
            self._snapshot = self._build_snapshot()
            self._snapshot_stale = False
        if self._snapshot is None:
            return {"node": self.me, "enabled": True, "paths": [], "suspects": [], "clock": {}}
        extra = {"remote_paths": self.summaries.remote_path_entries()} if remote else {}
        return {**self._snapshot, **extra, **self._accounts()}

    def cached_snapshot(self) -> dict[str, Any] | None:
        """The last snapshot built (at most SNAPSHOT_EVERY_S old): safe to read from another thread."""
        return self._snapshot

    def status(self) -> dict[str, Any]:
        snap = self.snapshot(remote=False)
        return {
            "enabled": True,
            "node": self.me,
            "paths": len(snap.get("paths", [])),
            "bad_paths": sum(1 for p in snap.get("paths", []) if p.get("verdict") and p["verdict"]["bad"]),
            "suspects": [s["link"] for s in snap.get("suspects", [])],
            **self._accounts(),
        }


def load_topology(cfg: LensConfig, fabric: FabricMap) -> Topology:
    """The configured topology file, or the one inferred per rail from the fabric map."""
    if cfg.topology_file:
        return Topology.load(Path(cfg.topology_file), fabric)
    return Topology.from_fabric(fabric)
