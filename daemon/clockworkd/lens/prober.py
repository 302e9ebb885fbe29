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
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from clockworkd.lens import clockgraph, clockpair, clockseam, fastio, peers, tomography, wire
from clockworkd.lens.fastio import (
    R_AUX,
    R_ECHO_SEQ,
    R_FLAGS,
    R_HOLD,
    R_KIND,
    R_LENGTH,
    R_PATH,
    R_RX,
    R_SEQ,
    R_SESSION,
    R_TX,
)
from clockworkd.lens.model import NicId, PathStats, PathVerdict, Suspect, nic_id, split_nic
from clockworkd.lens.pathwindow import PathWindow, Samples, Thresholds, file_blocks, window_stats
from clockworkd.lens.settings import LensConfig
from clockworkd.lens.topology import Topology
from linkpass.fabric import FabricMap

log = logging.getLogger("clockwork.lens")

Emit = Callable[[str, dict[str, Any]], None]
# Clock fits every 8 s (each ~1 ms a pair; drift carries the offset in between), the graph solved every 4 s at
# most. Against 4 s and 2 s, side by side on bench/clocksync.py with the same seams: error p50 2.2/0.6 µs and
# p99 10.3/2.7 µs against 1.7/0.75 and 8.9/2.6 (goal < 20 µs), for 0.3 % of a core less at 16 peers.
CLOCK_EVERY_S = 8.0
SOLVE_EVERY_S = 4.0
FIRST_CLOCK_FIT_S = 1.5  # the first fit as soon as the envelopes have a few sub-windows
GRAY_KINDS = frozenset({"loss", "delay", "jitter", "rate"})  # what LinkPass cannot see by itself
PAIR_FRESH_S = 15.0  # a pair's clock estimate older than this is not used
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
MAX_SUMMARY_PACKETS = 16  # at most this many datagrams per summary round
REMOTE_FRESH_S = 2.5  # a peer's verdicts older than this are no longer used
PAIR_PURE_NS = 20_000  # a coded pair whose packets arrive further apart than this was queued
ENVELOPE_WINDOW_NS = 20_000_000_000
ENVELOPE_SUB_NS = 250_000_000


class GrayTarget(Protocol):
    """Where suspect NIC paths go (LinkPass)."""

    def set_gray(self, peer: str, rail: str, reason: str | None) -> bool: ...


ECHO_RING = 1024  # transmit times kept per path for echoes (10 s of probes at 10 ms)
RTT_MAX_NS = 10_000_000_000


@dataclass
class OutPath:
    peer: NicId
    addr: bytes  # struct sockaddr_in of the peer NIC's probe port
    dst: tuple[int, int]  # (node index, NIC index)
    reverse: int = -1  # index (Lens.in_paths) of the peer's probes to this NIC (what we echo back), -1: none


@dataclass
class LocalNic:
    """One probing NIC. Per outgoing path k, the arrays the C sender reads and advances (row k each)."""

    name: str
    nic: NicId
    index: int
    ip: str
    sock: socket.socket
    out: list[OutPath] = field(default_factory=list)
    train_seq: int = 0
    train_next_peer: int = 0
    first_out: int = 0  # row of out[0] in Lens.ring_seq/ring_tx
    seq: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # newest seq sent per path
    dst_node: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    dst_nic: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    addrs: bytes = b""  # the paths' sockaddr_in, back to back
    rev: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # OutPath.reverse per path
    path_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # (node, NIC) -> in path
    summary_to: dict[str, tuple[tuple[int, int], bytes]] = field(default_factory=dict)  # peer -> (dst, addr)


@dataclass
class SuspectState:
    suspect: Suspect
    seen: int = 0  # evaluations in a row it was found
    missing: int = 0  # evaluations in a row it was not
    raised: bool = False
    raised_at: float = 0.0  # monotonic
    raised_wall: float = 0.0  # unix time (what reports show)
    announced: tuple[str, tuple[str, ...]] = ("", ())  # direction and kinds last announced


class Lens:
    """One node's Fleet Lens. ``start`` -> ``tick``* -> ``close``; ``snapshot`` for the CLI and metrics."""

    def __init__(
        self,
        cfg: LensConfig,
        node: str,
        fabric: FabricMap,
        topology: Topology,
        key: bytes,
        emit: Emit,
        seam: clockseam.ClockSeam | None = None,
        gray: GrayTarget | None = None,
    ) -> None:
        self.cfg = cfg
        self.me = node
        self.fabric = fabric
        self.topology = topology
        self.key = key
        self.emit = emit
        self.seam = seam
        self.gray = gray
        self.interval = cfg.interval_ms / 1000
        self.th = Thresholds(
            self.interval, cfg.window_s, cfg.loss_min_lost, cfg.delay_rise_us, cfg.jitter_rise_us, cfg.rate_drop
        )
        self.nodes = sorted(fabric.nodes)
        self.node_index = {n: i for i, n in enumerate(self.nodes)}
        self.nic_names = {n: sorted(fabric.nodes[n].nics) for n in self.nodes}
        self.reference = cfg.reference_node or self.nodes[0]
        # (node index, NIC index) -> NIC address as the kernel stores it (for the source check)
        self.nic_ip = np.zeros((len(self.nodes), max(len(v) for v in self.nic_names.values())), dtype=np.uint32)
        for n, names in self.nic_names.items():
            for j, name in enumerate(names):
                self.nic_ip[self.node_index[n], j] = np.frombuffer(
                    socket.inet_aton(fabric.nodes[n].nics[name]), dtype=np.uint32
                )[0]
        self.session = int.from_bytes(os.urandom(4), "little")
        self.local: list[LocalNic] = []
        self.incoming: dict[tuple[int, int, int], PathWindow] = {}  # (src node, src NIC, local NIC) -> window
        self.envelopes: dict[tuple[NicId, NicId], clockpair.Envelope] = {}
        self._sent_minima: dict[tuple[NicId, NicId], int] = {}  # newest minimum already told to peers
        self.remote_seen: dict[str, float] = {}  # node -> last summary (monotonic)
        # (src, dst) -> (when, [src, dst, bad, kinds, score, loss, owd_p50_us, owd_p99_us]) as the receiver said
        self.remote_paths: dict[tuple[NicId, NicId], tuple[float, list[Any]]] = {}
        self.summary_seq = 0
        self._summaries_seen: dict[str, deque[tuple[int, int, bytes]]] = {}  # node -> recent (session, seq, tag)
        self.solution: clockgraph.GraphSolution | None = None
        self.pair_estimates: dict[tuple[str, str], tuple[float, clockpair.PairEstimate]] = {}
        self._pair_raw: dict[tuple[str, str], list[Any]] = {}  # summary entry each remote estimate came from
        self.drift: dict[str, float] = {}  # node -> d(offset to the reference)/dt, ns per ns
        self.clock_tracker = clockgraph.SuspectTracker()
        self.clock_suspects: set[tuple[str, str]] = set()  # pairs whose offsets persistently break loops
        self.solved_at_real_ns = 0  # real time of the last solution (benchmarks compare against seam truth)
        self._next_solve = 0.0  # monotonic time of the next full graph solve
        self._solved_pairs: set[tuple[str, str]] = set()  # the pairs the last full solve used
        self.suspects: dict[str, SuspectState] = {}
        self.localizer: tomography.Localizer | None = None
        self.sender = fastio.Sender()  # summaries (a few a second); probes and trains go through _probeio
        # Incoming paths by index (the C receiver names a packet's path by it) and their per-path state
        # that the per-batch filing and the C sender share: arrays, so neither touches a Python object per packet.
        self.in_paths: list[PathWindow] = []
        self.samples, self.rtt_samples = Samples(), Samples()  # every incoming path's, slot = index in in_paths
        self.in_session = np.zeros(0, dtype=np.int64)  # PathWindow.session, as the filing checks it
        self.in_echo_seq = np.zeros(0, dtype=np.int64)  # newest probe received per path (echoed back), -1: none
        self.in_echo_rx = np.zeros(0, dtype=np.int64)  # when it arrived (our clock, ns)
        self.in_rev_out = np.zeros(0, dtype=np.int64)  # row in ring_seq/ring_tx of the reverse path, -1: none
        self.ring_seq = np.zeros((0, ECHO_RING), dtype=np.int64)  # per outgoing path: seq % ECHO_RING -> seq
        self.ring_tx = np.zeros((0, ECHO_RING), dtype=np.int64)  # ... and its transmit time (our clock)
        # The C receiver's output, waiting to be filed (sized at start()).
        self._records = np.zeros((0, fastio.RECORD_FIELDS), dtype=np.int64)
        self._filled = 0  # records read and not yet filed (the first rows of _records)
        self._read_marks: list[tuple[float, int]] = []  # (monotonic time, records) of each of those reads
        self._pending: list[tuple[np.ndarray, ...]] = []  # (t, path, seq, delay) blocks
        self._pending_rtt: list[tuple[np.ndarray, ...]] = []  # (t, path, rtt ns) blocks
        self._summary_queue: list[bytes] = []  # authentic summaries waiting for the next evaluation
        self._bad_told: frozenset[tuple[NicId, NicId, tuple[str, ...]]] = frozenset()  # bad paths last told
        self.pacer: Any = None  # the C thread that sends the probes (_probeio.Pacer), from start() on
        self._pacer_errors = 0  # its send errors already counted in counters["send_errors"]
        self.fits = 0  # clock-fit rounds so far (the rails take turns)
        now = time.monotonic()
        self.next_train = now + 1.0
        self.next_drain = now
        self.next_summary = now + cfg.summary_ms / 1000
        self.next_eval = now + cfg.evaluate_ms / 1000
        self.next_clock = now + FIRST_CLOCK_FIT_S
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
        self.cpu_ns = dict.fromkeys(PHASES, 0)  # CPU time per phase (ns, user + kernel): see PHASES
        self.last_stats: list[tuple[PathStats, PathVerdict | None]] = []
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_stale = True
        self.next_snapshot = 0.0
        self.on_snapshot: Callable[[dict[str, Any]], None] | None = None  # called every SNAPSHOT_EVERY_S (history)

    # ----- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        fastio.probeio()  # raises, naming the fix, when the C extension is not built
        plan = peers.plan(self.topology, self.cfg.peers_per_nic)
        probed_by = peers.probed_by(plan)
        self.localizer = tomography.Localizer(self.topology, plan)
        me = self.fabric.node(self.me)
        ncols = self.nic_ip.shape[1]
        for j, name in enumerate(self.nic_names[self.me]):
            nic = nic_id(self.me, name)
            if nic not in plan:
                continue
            sock = fastio.open_socket(me.nics[name], self.cfg.port, name)
            local = LocalNic(name, nic, j, me.nics[name], sock)
            for peer in plan[nic]:
                pnode, pname = split_nic(peer)
                addr = fastio.sockaddr_in(self.fabric.nodes[pnode].nics[pname], self.cfg.port)
                local.out.append(OutPath(peer, addr, (self.node_index[pnode], self.nic_names[pnode].index(pname))))
            local.path_of = np.full(len(self.nodes) * ncols, -1, dtype=np.int64)
            local.summary_to = {
                peer: (
                    (self.node_index[peer], self.nic_names[peer].index(name)),
                    fastio.sockaddr_in(self.fabric.nodes[peer].nics[name], self.cfg.port),
                )
                for peer in self.nodes
                if peer != self.me and name in self.fabric.nodes[peer].nics
            }
            for src in probed_by.get(nic, ()):
                snode, sname = split_nic(src)
                key = (self.node_index[snode], self.nic_names[snode].index(sname), j)
                self.incoming[key] = PathWindow(
                    src, nic, samples=self.samples, rtts=self.rtt_samples, slot=len(self.in_paths)
                )
                local.path_of[key[0] * ncols + key[1]] = len(self.in_paths)
                self.in_paths.append(self.incoming[key])
            self.local.append(local)
        index = {(pw.dst, pw.src): i for i, pw in enumerate(self.in_paths)}
        rows = 0
        self.in_rev_out = np.full(len(self.in_paths), -1, dtype=np.int64)
        for local in self.local:
            local.first_out = rows
            for k, path in enumerate(local.out):
                path.reverse = index.get((local.nic, path.peer), -1)
                if path.reverse >= 0:
                    self.in_rev_out[path.reverse] = rows + k
            rows += len(local.out)
            local.seq = np.zeros(len(local.out), dtype=np.int64)
            local.dst_node = np.array([p.dst[0] for p in local.out], dtype=np.int64)
            local.dst_nic = np.array([p.dst[1] for p in local.out], dtype=np.int64)
            local.addrs = b"".join(p.addr for p in local.out)
            local.rev = np.array([p.reverse for p in local.out], dtype=np.int64)
        self.ring_seq = np.full((rows, ECHO_RING), -1, dtype=np.int64)
        # Room for the records of a few hundred ms of reads (they wait for the next evaluation), and always
        # for one more read of every NIC at its largest.
        self._records = np.zeros((2 * fastio.RECORDS * max(1, len(self.local)), fastio.RECORD_FIELDS), dtype=np.int64)
        self.ring_tx = np.zeros((rows, ECHO_RING), dtype=np.int64)
        self.in_session = np.full(len(self.in_paths), -1, dtype=np.int64)
        self.in_echo_seq = np.full(len(self.in_paths), -1, dtype=np.int64)
        self.in_echo_rx = np.zeros(len(self.in_paths), dtype=np.int64)
        self._start_pacer()
        log.info(
            "lens on %s: NICs %s, %d outgoing and %d incoming paths, probe every %g ms, reference clock %s%s",
            self.me,
            ",".join(n.name for n in self.local),
            sum(len(n.out) for n in self.local),
            len(self.incoming),
            self.cfg.interval_ms,
            self.reference,
            " (clock seam: TESTS ONLY)" if self.seam else "",
        )

    def _start_pacer(self) -> None:
        """Hand every NIC's outgoing paths to the pacer thread, which probes them from now on.

        One batch per NIC per tick, a probe to every planned peer, one of them (peers take turns every
        ``pair_every`` ticks) a coded pair, sent first: its transmit stamp is the one the clock sync needs;
        the others' go out microseconds later, which only shifts their paths' baselines. The arrays it is
        given stay these objects for the Lens's life (it holds their buffers): the echo arrays are updated
        in place, and only inside ``with self.pacer``.
        """
        seam = (self.seam.offset_ns, self.seam.drift_ppm, self.seam.epoch_ns) if self.seam else None
        self.pacer = fastio.probeio().Pacer(
            self.key,
            self.node_index[self.me],
            self.session,
            round(self.cfg.interval_ms * 1e6),
            self.cfg.pair_every,
            self.in_echo_seq,
            self.in_echo_rx,
            seam,
        )
        for local in self.local:
            if not local.out:
                continue
            rows = slice(local.first_out, local.first_out + len(local.out))
            self.pacer.add_nic(
                local.sock.fileno(),
                local.index,
                local.seq,
                local.dst_node,
                local.dst_nic,
                local.addrs,
                self.ring_seq[rows],
                self.ring_tx[rows],
                local.rev,
            )
        self.pacer.start()

    def close(self) -> None:
        if self.pacer is not None:
            self.pacer.stop()  # before the sockets it sends on close
        for local in self.local:
            local.sock.close()
        self.local.clear()

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
        if now >= self.next_drain or now >= self.next_eval:  # late reads cost no accuracy (arrival stamps)
            self.next_drain = now + DRAIN_EVERY_S
            self._drain_all(now)
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
            self._send_summaries()
            self.next_summary = now + self.cfg.summary_ms / 1000
            t1 = cpu()
            spent["summaries"] += t1 - t0
            t0 = t1
        if now >= self.next_clock:
            self._estimate_own_pairs()
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

    def _send(self, local: LocalNic, messages: list[tuple[bytes, bytes]], counter: str) -> None:
        sent, err = self.sender.send(local.sock.fileno(), messages)
        self.counters[counter] += sent
        if err:
            self.counters["send_errors"] += 1

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
        src_index, probeio = self.node_index[self.me], fastio.probeio()
        for local in self.local:
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
                    self.key,
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

    def _summary_entries(self) -> tuple[list[list[Any]], dict[str, list[list[Any]]], list[list[Any]]]:
        """What this node tells the others: its paths' verdicts and its clock fits (for every peer), and
        new envelope minima (each peer only those of its own paths: the only ones it fits)."""
        verdicts = [
            [s.src, s.dst, int(v.bad), ",".join(v.kinds), v.score, s.loss, s.owd_p50_us, s.owd_p99_us]
            for s, v in self.last_stats
            if v is not None
        ]
        minima: dict[str, list[list[Any]]] = {}
        for pw in self.incoming.values():
            env = self.envelopes.get((pw.src, pw.dst))
            src_node = split_nic(pw.src)[0]
            if env is None or src_node > self.me:
                continue  # a pair is fitted by its lower-named node, which has the other direction itself
            told = self._sent_minima.get((pw.src, pw.dst), -1)
            new = [(t, d) for t, d in env.minima() if t > told][-40:]
            if new:
                self._sent_minima[(pw.src, pw.dst)] = new[-1][0]
                minima.setdefault(src_node, []).append([pw.src, pw.dst, [v for td in new for v in td]])
        pairs = [
            [a, b, est.offset_ns, est.drift_ppm, est.uncertainty_ns, est.at_ns, est.samples]
            for (a, b), (_t, est) in self.pair_estimates.items()
            if a == self.me
        ]
        return verdicts, minima, pairs

    def _summary_bodies(
        self,
        peer: str | None = None,
        entries: tuple[list[list[Any]], dict[str, list[list[Any]]], list[list[Any]]] | None = None,
        shared: list[tuple[str, list[Any], int]] | None = None,
    ) -> list[bytes]:
        """The summary for ``peer`` (None: the part every peer gets) split into bodies that each fit one
        datagram (never a cut message). ``shared``: the verdicts and clock fits with their packed sizes."""
        verdicts, minima, pairs = entries if entries is not None else self._summary_entries()
        if shared is None:
            shared = self._sized([("v", v) for v in verdicts] + [("c", c) for c in pairs])
        items = shared + self._sized([("e", e) for e in minima.get(peer or "", [])])
        bodies: list[bytes] = []
        doc: dict[str, Any] = {"n": self.me, "v": [], "e": [], "c": []}
        empty = size = len(wire.summary_body(doc))
        for key, entry, grows in items:
            if size + grows > wire.MAX_SUMMARY_BODY and any(doc[k] for k in ("v", "e", "c")):
                bodies.append(wire.summary_body(doc))
                doc = {"n": self.me, "v": [], "e": [], "c": []}
                size = empty
            doc[key].append(entry)
            size += grows
        bodies.append(wire.summary_body(doc))
        return bodies[:MAX_SUMMARY_PACKETS]

    @staticmethod
    def _sized(items: list[tuple[str, list[Any]]]) -> list[tuple[str, list[Any], int]]:
        return [(key, entry, wire.packed_size(entry) + 1) for key, entry in items]

    def _send_summaries(self) -> None:
        """Every peer gets the verdicts and clock fits plus its own paths' envelope minima, over each NIC
        that reaches it (the receiver keeps the first copy): one sendmmsg per NIC per round."""
        entries = self._summary_entries()
        shared = self._sized([("v", v) for v in entries[0]] + [("c", c) for c in entries[2]])
        common: list[bytes] | None = None
        src_index = self.node_index[self.me]
        outgoing: list[list[tuple[bytes, bytes]]] = [[] for _ in self.local]
        for peer in self.nodes:
            if peer == self.me:
                continue
            if peer in entries[1]:
                bodies = self._summary_bodies(peer, entries, shared)
            else:
                common = common if common is not None else self._summary_bodies(None, entries, shared)
                bodies = common
            for body in bodies:
                self.summary_seq += 1
                for local, messages in zip(self.local, outgoing, strict=True):
                    to = local.summary_to.get(peer)
                    if to is not None:
                        dst, addr = to
                        head = wire.header(
                            wire.SUMMARY, 0, (src_index, local.index), dst, self.summary_seq, 0, self.session, len(body)
                        )
                        messages.append((wire.sign(self.key, head, body), addr))
        for local, messages in zip(self.local, outgoing, strict=True):
            if messages:
                self._send(local, messages, "summaries_sent")

    # ----- receiving ------------------------------------------------------------------------

    def _drain_all(self, now: float) -> None:
        """Read, authenticate and parse what waits on every NIC (C), and note each path's newest probe for
        the echoes (C); the records wait in the buffer until the evaluation files them (:meth:`_file_records`).

        Why not file them here: the echoes are what cannot wait (their hold times are measured on this
        node's clock, so a longer hold is a larger error with a drifting clock), and the pacer notes them at
        each read; the rest is numpy over the records, whose cost is mostly per call, not per record. Run
        once per evaluation instead of once per read, on warm caches, it costs a fraction.
        """
        start = self._filled
        if len(self._records) - start < fastio.RECORDS * len(self.local):
            self._file_records()
            start = 0
        n = start
        for local in self.local:
            n += self._drain(local, self._records[n:])
        if n > start:
            self.pacer.note_arrivals(self._records[start:], n - start, self.in_session)
            self._read_marks.append((now, n - start))
            self._filled = n

    def _file_records(self) -> None:
        """File the records read since the last evaluation, all at once (numpy), each at its read's time."""
        n, marks = self._filled, self._read_marks
        if not n:
            return
        self._filled, self._read_marks = 0, []
        records = self._records[:n]
        t = np.repeat(np.array([m[0] for m in marks]), [m[1] for m in marks])
        kinds = records[:, R_KIND]
        probes = kinds == wire.PROBE
        if probes.any():
            with self.pacer:  # the transmit rings it writes (and the echoes of a restarted sender's paths)
                self._file_probes(records[probes], t[probes])
        trains = kinds == wire.TRAIN
        if trains.any():
            self._file_trains(records[trains], t[trains])

    def _drain(self, local: LocalNic, out: np.ndarray) -> int:
        """One NIC's waiting datagrams: probe and train records into ``out`` (how many), summaries taken in."""
        try:
            n, rejected, summaries = fastio.probeio().drain(
                local.sock.fileno(),
                self.key,
                self.node_index[self.me],
                local.index,
                self.nic_ip,
                self.nic_ip.shape[1],
                local.path_of,
                out,
                64,  # at most 4096 datagrams per NIC per drain
            )
        except OSError as exc:
            log.warning("lens on %s: receive on %s failed: %s", self.me, local.name, exc)
            return 0
        self.counters["rejected"] += rejected
        self._summary_queue += summaries  # taken in at the next evaluation, all in one go
        return int(n)

    def _take_summaries(self) -> None:
        """The summaries that came in since the last evaluation (authentic; the C receiver checked them).

        Why at the evaluation and not as they arrive: each daemon receives ~30 a second, and taking
        them in one go, right before they are used, runs the same Python code back to back on warm
        caches instead of once per drain from cold (measured ~2x cheaper on the 17-node sandbox).
        """
        queue, self._summary_queue = self._summary_queue, []
        for packet in queue:
            self._on_summary_packet(packet)

    def _on_summary_packet(self, packet: bytes) -> None:
        """An authentic summary: the first copy of each goes on (it comes over every NIC)."""
        head = wire.HEADER.unpack_from(packet)
        sn, seq, session = head[3], head[7], head[9]
        seen = self._summaries_seen.setdefault(self.nodes[sn], deque(maxlen=64))
        copy = (session, seq, packet[-wire.TAG :])  # its tag: the same datagram again
        if copy in seen:  # the copy that came over the other NIC
            return
        seen.append(copy)
        self._on_summary(memoryview(packet))

    def _file_probes(self, p: np.ndarray, t: np.ndarray) -> None:
        """Probes (records in arrival order, read at monotonic times ``t``): numpy over the batch, Python
        only per coded pair. What the sender needed sooner (the newest sequence number of each path, for
        the echoes) the pacer noted at each read, except for a sender that restarted (its new session)."""
        path, seq, session, rx = p[:, R_PATH], p[:, R_SEQ], p[:, R_SESSION], p[:, R_RX]
        rx_clock = self.seam.apply_many(rx) if self.seam else rx
        delay = rx_clock - p[:, R_TX]
        self.counters["probes_received"] += len(p)
        if np.any(session != self.in_session[path]):
            self._file_restarted(path, seq, session, delay, rx_clock, t)
        else:
            self._pending.append((t, path, seq, delay))
        # Round trips: the echo names one of our probes; its transmit time is in the reverse path's ring.
        hold, rows = p[:, R_HOLD], self.in_rev_out[path]
        echoed = np.flatnonzero((hold != wire.NO_ECHO) & (rows >= 0))
        if len(echoed):
            echo_seq, rows = p[echoed, R_ECHO_SEQ], rows[echoed]
            slots = echo_seq % ECHO_RING
            rtt = rx_clock[echoed] - self.ring_tx[rows, slots] - hold[echoed]  # both ends on our clock
            ok = (self.ring_seq[rows, slots] == echo_seq) & (rtt > 0) & (rtt < RTT_MAX_NS)
            if ok.any():
                self._pending_rtt.append((t[echoed[ok]], path[echoed[ok]], rtt[ok]))
        flagged = np.flatnonzero(p[:, R_FLAGS])
        if len(flagged):
            self._file_pairs(p[flagged], rx_clock[flagged])

    def _file_restarted(
        self,
        path: np.ndarray,
        seq: np.ndarray,
        session: np.ndarray,
        delay: np.ndarray,
        rx_clock: np.ndarray,
        t: np.ndarray,
    ) -> None:
        """A batch in which some sender's session changed (it restarted): probe by probe, in arrival order."""
        for i, q, sess, d, rxc, now in zip(
            path.tolist(), seq.tolist(), session.tolist(), delay.tolist(), rx_clock.tolist(), t.tolist(), strict=True
        ):
            pw = self.in_paths[i]
            if sess != self.in_session[i]:
                self._flush_samples()  # the old session's samples go to the window before it starts again
                self.in_session[i] = sess
                self.in_echo_seq[i] = -1
            pw.add_one(now, sess, q, d)  # resets the window at a new session
            if q > self.in_echo_seq[i]:
                self.in_echo_seq[i], self.in_echo_rx[i] = q, rxc

    def _file_pairs(self, p: np.ndarray, rx_clock: np.ndarray) -> None:
        """Coded pairs: a second that follows its first closely enough feeds the path's delay envelope."""
        for i, flags, seq, tx, rx_ns, rxc in zip(
            p[:, R_PATH].tolist(),
            p[:, R_FLAGS].tolist(),
            p[:, R_SEQ].tolist(),
            p[:, R_TX].tolist(),
            p[:, R_RX].tolist(),
            rx_clock.tolist(),
            strict=True,
        ):
            pw = self.in_paths[i]
            if flags == wire.PAIR_FIRST:
                pw.pair_first = (seq, tx, rxc, rx_ns)
            elif flags == wire.PAIR_SECOND and pw.pair_first is not None and pw.pair_first[0] == seq - 1:
                _, tx1, rx1_clock, rx1 = pw.pair_first
                pw.pair_first = None
                self._envelope(pw).add(tx1, rx1_clock, 0 <= rx_ns - rx1 <= PAIR_PURE_NS)

    def _file_trains(self, r: np.ndarray, t: np.ndarray) -> None:
        """Train packets (read at times ``t``), one call per run of the same train (a train usually arrives
        within one read)."""
        path, seq, aux = r[:, R_PATH], r[:, R_SEQ], r[:, R_AUX]
        cuts = np.flatnonzero((path[1:] != path[:-1]) | (seq[1:] != seq[:-1])) + 1
        starts = [0, *cuts.tolist()]
        ends = [*starts[1:], len(r)]
        for a, b in zip(starts, ends, strict=True):
            self.in_paths[int(path[a])].add_train_run(
                int(seq[a]), int(aux[a]) & 0xFFFF, r[a:b, R_RX], r[a:b, R_LENGTH], float(t[a])
            )

    def _flush_samples(self) -> None:
        """File the probes and round trips waiting since the last evaluation into the paths' windows."""
        if self._pending:
            t, path, seq, delay = (np.concatenate(c) for c in zip(*self._pending, strict=True))
            self._pending.clear()
            file_blocks(self.in_paths, t, path, seq, delay)
        if self._pending_rtt:
            t, path, rtt = (np.concatenate(c) for c in zip(*self._pending_rtt, strict=True))
            self._pending_rtt.clear()
            self.rtt_samples.add(t, path, rtt)

    def _envelope(self, pw: PathWindow) -> clockpair.Envelope:
        """The delay envelope of a path this node receives (coded pairs that were not queued feed the clock sync)."""
        env = self.envelopes.get((pw.src, pw.dst))
        if env is None:
            env = self.envelopes[(pw.src, pw.dst)] = clockpair.Envelope(ENVELOPE_WINDOW_NS, ENVELOPE_SUB_NS)
        return env

    def _on_summary(self, packet: memoryview) -> None:
        """Take in a peer's summary; anything malformed is counted and dropped, never raised."""
        now = time.monotonic()
        try:
            doc = wire.parse_summary(packet)
            node = doc["n"]
            if node not in self.node_index or node == self.me:
                raise wire.WireError(f"unknown node {node!r}")
            mine, theirs = self.me + "/", node + "/"
            paths = []
            for v in doc.get("v", []):  # type() is, not isinstance: ~30 entries a summary, 60 summaries a second
                if (
                    len(v) != 8
                    or type(v[0]) is not str
                    or type(v[1]) is not str
                    or type(v[3]) is not str
                    or type(v[4]) not in (float, int)
                ):
                    raise wire.WireError(f"malformed verdict entry {v!r:.80}")
                if v[1].startswith(theirs):  # a daemon speaks only for the paths it receives
                    paths.append(v)
            minima = []
            for src, dst, flat in doc.get("e", []):
                if type(src) is not str or type(dst) is not str or type(flat) is not list or len(flat) % 2:
                    raise wire.WireError("malformed envelope entry")
                if not (dst.startswith(theirs) and src.startswith(mine)):
                    continue  # only the envelopes of this node's own paths: it fits only its own pairs
                if not all(type(x) is int and -(2**63) <= x < 2**63 for x in flat):
                    raise wire.WireError("envelope entry holds a value that is not a 64-bit integer")
                minima.append(((src, dst), flat))
            pairs = []
            for entry in doc.get("c", []):
                a, b, offset, drift, unc, at, samples = entry
                if a != node or b not in self.node_index:
                    continue  # a daemon speaks only for the pairs it fits
                known = self.pair_estimates.get((a, b))
                if known is not None and self._pair_raw.get((a, b)) == entry:
                    pairs.append(((a, b), known[1], entry))  # told again unchanged (fits: every CLOCK_EVERY_S)
                    continue
                if not all(math.isfinite(float(x)) for x in (offset, drift, unc)) or float(unc) <= 0:
                    raise wire.WireError(f"non-finite clock estimate for {a}-{b}")
                est = clockpair.PairEstimate(float(offset), float(drift), float(unc), int(samples), 0.0, int(at))
                pairs.append(((a, b), est, entry))
        except Exception as exc:  # a keyed peer sending nonsense must not stop this loop
            self.counters["rejected"] += 1
            log.debug("lens on %s: summary dropped: %s", self.me, exc)
            return
        self.counters["summaries_received"] += 1
        self.remote_seen[node] = now
        for v in paths:
            self.remote_paths[(v[0], v[1])] = (now, v)
        for key, flat in minima:
            env = self.envelopes.get(key)
            if env is None:
                env = self.envelopes[key] = clockpair.Envelope(ENVELOPE_WINDOW_NS, ENVELOPE_SUB_NS)
            for i in range(0, len(flat), 2):  # a few minima per entry: one at a time beats numpy's setup
                env.add(flat[i], flat[i] + flat[i + 1])
        for key, est, entry in pairs:
            self.pair_estimates[key] = (now, est)
            self._pair_raw[key] = entry

    # ----- clocks ---------------------------------------------------------------------------

    def _estimate_own_pairs(self) -> None:
        """Fit the clock offset to each peer for which this node is the lower-named end.

        A fit costs ~2 ms, so each node fits only its share of the pairs, each from one NIC pair (the
        rails take turns), and tells the others in its summaries; every node then reconciles all pairs.
        """
        at = self._clock_ns()
        rails = self.nic_names[self.me]
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

    def _solve_clocks(self) -> None:
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
        at = self._clock_ns()
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
        persistent = set(self.clock_tracker.update(self.solution))
        for a, b in sorted(persistent - self.clock_suspects):
            log.warning(
                "lens on %s: clock pair %s-%s disagrees with the rest of the probe graph (loop residual): "
                "an asymmetric or faulty path between them",
                self.me,
                a,
                b,
            )
        self.clock_suspects = persistent

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

    # ----- judging and localizing -----------------------------------------------------------

    def evaluate(self, now: float) -> None:
        cpu, spent = time.thread_time_ns, self.cpu_ns
        t0 = cpu()
        self.counters["evaluations"] += 1
        self._file_records()
        t1 = cpu()
        spent["receive"] += t1 - t0  # filing what the reads took in
        t0 = t1
        self._take_summaries()
        t1 = cpu()
        spent["summaries_in"] += t1 - t0
        self._flush_samples()
        t2 = cpu()
        self._solve_clocks()
        t3 = cpu()
        spent["clock_solve"] += t3 - t2
        heard = {pw.src.partition("/")[0] for pw in self.incoming.values() if now - pw.last_rx < self.th.window_s}
        windows = list(self.incoming.values())
        senders = [split_nic(pw.src)[0] for pw in windows]
        for pw in windows:
            if pw.train_got and now - pw.last_rx > 0.2:
                pw.finish_train(now)
        figures = window_stats(
            windows, now, [self.offset_ns(n) for n in senders], [self.offset_rate(n) for n in senders], self.th
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
        fresh = [v for t, v in self.remote_paths.values() if now - t < REMOTE_FRESH_S]
        if any(v.bad for v in verdicts) or any(v[2] for v in fresh):  # built only when there is work
            verdicts += [_remote_verdict(v) for v in fresh]
        found = self.localizer.localize(verdicts) if self.localizer and any(v.bad for v in verdicts) else []
        self._track(found, now)
        self._snapshot_stale = True
        if now >= self.next_snapshot:  # keep the copy other threads read (metrics) fresh, but not per evaluation
            self.next_snapshot = now + SNAPSHOT_EVERY_S
            snapshot = self.snapshot(remote=False)
            if self.on_snapshot is not None:
                self.on_snapshot(snapshot)
        spent["evaluate"] += cpu() - t4

    def _owner(self, suspect: Suspect) -> str:
        if suspect.nic is not None:
            return split_nic(suspect.nic)[0]
        now = time.monotonic()
        alive = [n for n, t in self.remote_seen.items() if now - t < REMOTE_FRESH_S] + [self.me]
        return min(alive)

    def _track(self, found: list[Suspect], now: float) -> None:
        keys = {s.key for s in found}
        for s in found:
            state = self.suspects.get(s.key)
            if state is None:
                state = self.suspects[s.key] = SuspectState(s)
            state.suspect, state.seen, state.missing = s, state.seen + 1, 0
            if not state.raised and state.seen >= self.cfg.raise_after:
                state.raised, state.raised_at, state.raised_wall = True, now, time.time()
                state.announced = (s.direction, s.kinds)
                self._announce("lens.suspect", s, now)
            elif state.raised and state.announced != (s.direction, s.kinds):
                # More evidence changed the picture (one direction became both, loss became dead): say so.
                state.announced = (s.direction, s.kinds)
                self._announce("lens.suspect", s, now, update=True)
        for key in list(self.suspects):
            if key in keys:
                continue
            state = self.suspects[key]
            state.seen, state.missing = 0, state.missing + 1
            if state.missing >= self.cfg.clear_after:
                del self.suspects[key]
                if state.raised:
                    self._announce("lens.clear", state.suspect, now, lasted_s=round(now - state.raised_at, 3))

    def _announce(self, kind: str, s: Suspect, now: float, **extra: Any) -> None:
        fields = {**s.to_dict(), **extra, "by": self.me}
        level = logging.WARNING if kind == "lens.suspect" else logging.INFO
        log.log(
            level,
            "lens on %s: %s %s (%s, %s, confidence %.2f)",
            self.me,
            kind,
            s.link,
            s.direction,
            ",".join(s.kinds),
            s.confidence,
        )
        if self._owner(s) == self.me:
            self.emit(kind, fields)
        self._hand_to_linkpass(s, kind == "lens.suspect")

    def _hand_to_linkpass(self, s: Suspect, gray: bool) -> None:
        """This node's paths through a suspect NIC become gray in LinkPass (and normal again on clear).

        Only gray kinds (loss, delay, jitter, rate) are handed over: a dead path is LinkPass's own
        business, seen faster by its heartbeats, and holding it gray until Lens clears would only
        delay the fail-back.
        """
        if self.gray is None or not self.cfg.linkpass_handoff or s.nic is None:
            return
        if gray and ("dead" in s.kinds or not set(s.kinds) & GRAY_KINDS):
            return
        node, rail = split_nic(s.nic)
        reason = f"lens suspect {s.link} ({','.join(s.kinds)})" if gray else None
        targets = [p for p in self.nodes if p != self.me] if node == self.me else [node]
        for peer in targets:
            self.gray.set_gray(peer, rail, reason)

    # ----- reporting ------------------------------------------------------------------------

    def _build_snapshot(self) -> dict[str, Any]:
        sol = self.solution
        clock: dict[str, dict[str, float]] = {}
        if sol is not None:
            for node, off in sol.offsets_ns.items():
                fit_us = sol.uncertainty_ns.get(node, 0.0) / 1e3
                clock[node] = {
                    "offset_us": round(off / 1e3, 3),
                    "uncertainty_us": round(math.hypot(fit_us, self.cfg.clock_floor_us), 3)
                    if node != sol.reference
                    else 0.0,
                }
        paths = []
        for stats, verdict in self.last_stats:
            entry = stats.to_dict()
            entry["verdict"] = verdict.to_dict() if verdict is not None else None
            paths.append(entry)
        return {
            "node": self.me,
            "enabled": True,
            "interval_ms": self.cfg.interval_ms,
            "time": time.time(),
            "reference": self.reference,
            "clock": clock,
            "clock_at_real_ns": self.solved_at_real_ns,
            "clock_unreachable": list(sol.unreachable) if sol else [],
            "loop_residual_us": round(sol.loop_rms_ns / 1e3, 3) if sol and sol.loop_rms_ns is not None else None,
            "clock_suspect_edges": [list(e) for e in sorted(self.clock_suspects)],
            "paths": paths,
            "suspects": [
                {**st.suspect.to_dict(), "since": st.raised_wall} for st in self.suspects.values() if st.raised
            ],
            **self._accounts(),
        }

    def _accounts(self) -> dict[str, Any]:
        """The counters and CPU time per phase, as of now (the pacer's taken in)."""
        self._take_pacer_stats()
        return {"counters": dict(self.counters), "cpu_ms": {k: round(v / 1e6, 3) for k, v in self.cpu_ns.items()}}

    def _remote_paths(self) -> list[dict[str, Any]]:
        """The other daemons' latest word on the paths they receive (so one daemon shows the whole fabric)."""
        now = time.monotonic()
        out = []
        for t, v in self.remote_paths.values():
            if now - t < REMOTE_FRESH_S:
                verdict = _remote_verdict(v)
                stats = {"src": v[0], "dst": v[1], "loss": v[5], "owd_p50_us": v[6], "owd_p99_us": v[7]}
                out.append({**stats, "verdict": verdict.to_dict()})
        return out

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
        extra = {"remote_paths": self._remote_paths()} if remote else {}
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


def _remote_verdict(v: list[Any]) -> PathVerdict:
    """A peer's summary entry as a verdict."""
    return PathVerdict(v[0], v[1], bool(v[2]), (), tuple(k for k in v[3].split(",") if k), float(v[4]))


def load_topology(cfg: LensConfig, fabric: FabricMap) -> Topology:
    """The configured topology file, or the one inferred per rail from the fabric map."""
    if cfg.topology_file:
        return Topology.load(Path(cfg.topology_file), fabric)
    return Topology.from_fabric(fabric)
