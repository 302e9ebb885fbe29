"""What arrives at a node's probe sockets: read into records at every drain, filed at every evaluation.

Why in two steps: the C receiver reads, authenticates and parses what waits on each NIC into int64 records,
and the pacer notes each path's newest probe for the echoes at once (their hold times are measured on this
node's clock, so a longer hold is a larger error with a drifting clock). The rest waits: filing is numpy over
the records, whose cost is mostly per call, not per record, so it runs once per evaluation on warm caches
instead of once per read. Each record is filed at its read's time: into its path's window (probes), the
round-trip samples (echoes), the path's train runs (trains), and the clock sync's delay envelope (coded
pairs that were not queued). Summaries, authentic and whole, are queued for the evaluation too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from clockwork.contracts.lens_model import NicId
from clockworkd.lens import fastio, wire
from clockworkd.lens.clockpair import Envelope
from clockworkd.lens.clockseam import ClockSeam
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
from clockworkd.lens.keys import LensKeys
from clockworkd.lens.pathwindow import file_blocks
from clockworkd.lens.probepaths import ECHO_RING, LocalNic, ProbePaths

log = logging.getLogger("clockwork.lens")

RTT_MAX_NS = 10_000_000_000
PAIR_PURE_NS = 20_000  # a coded pair whose packets arrive further apart than this was queued


class ProbeReceiver:
    """Reads and files ``paths``' incoming packets. ``envelope(src, dst)``: the delay envelope a coded pair
    feeds; ``counters``: Lens's, where the probes received and the datagrams rejected are counted."""

    def __init__(
        self,
        paths: ProbePaths,
        keys: LensKeys,
        seam: ClockSeam | None,
        counters: dict[str, int],
        envelope: Callable[[NicId, NicId], Envelope],
    ) -> None:
        self.paths = paths
        self.keys = keys
        self.seam = seam
        self.counters = counters
        self.envelope = envelope
        self.pacer: Any = None  # the pacer (_probeio.Pacer) that notes the echoes, from attach() on
        # The C receiver's output, waiting to be filed (sized at attach()).
        self._records = np.zeros((0, fastio.RECORD_FIELDS), dtype=np.int64)
        self._filled = 0  # records read and not yet filed (the first rows of _records)
        self._read_marks: list[tuple[float, int]] = []  # (monotonic time, records) of each of those reads
        self._pending: list[tuple[np.ndarray, ...]] = []  # (t, path, seq, delay) blocks
        self._pending_rtt: list[tuple[np.ndarray, ...]] = []  # (t, path, rtt ns) blocks
        self._summary_queue: list[bytes] = []  # authentic summaries waiting for the next evaluation

    def attach(self, pacer: Any) -> None:
        """Start receiving on the opened paths, whose echoes ``pacer`` sends."""
        self.pacer = pacer
        # Room for the records of a few hundred ms of reads (they wait for the next evaluation), and always
        # for one more read of every NIC at its largest.
        local = self.paths.local
        self._records = np.zeros((2 * fastio.RECORDS * max(1, len(local)), fastio.RECORD_FIELDS), dtype=np.int64)

    def drain_all(self, now: float) -> None:
        """Read, authenticate and parse what waits on every NIC (C), and note each path's newest probe for
        the echoes (C); the records wait in the buffer until the evaluation files them (:meth:`file_records`)."""
        local = self.paths.local
        start = self._filled
        if len(self._records) - start < fastio.RECORDS * len(local):
            self.file_records()
            start = 0
        n = start
        for nic in local:
            n += self._drain(nic, self._records[n:])
        if n > start:
            self.pacer.note_arrivals(self._records[start:], n - start, self.paths.in_session)
            self._read_marks.append((now, n - start))
            self._filled = n

    def take_summaries(self) -> list[bytes]:
        """The authentic summaries read since the last call."""
        queue, self._summary_queue = self._summary_queue, []
        return queue

    def file_records(self) -> None:
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

    def flush_samples(self) -> None:
        """File the probes and round trips waiting since the last evaluation into the paths' windows."""
        if self._pending:
            t, path, seq, delay = (np.concatenate(c) for c in zip(*self._pending, strict=True))
            self._pending.clear()
            file_blocks(self.paths.in_paths, t, path, seq, delay)
        if self._pending_rtt:
            t, path, rtt = (np.concatenate(c) for c in zip(*self._pending_rtt, strict=True))
            self._pending_rtt.clear()
            self.paths.rtt_samples.add(t, path, rtt)

    def _drain(self, local: LocalNic, out: np.ndarray) -> int:
        """One NIC's waiting datagrams: probe and train records into ``out`` (how many), summaries queued."""
        paths = self.paths
        try:
            n, rejected, summaries = fastio.probeio().drain(
                local.sock.fileno(),
                self.keys.arg(),
                paths.node_index[paths.me],
                local.index,
                paths.nic_ip,
                paths.nic_ip.shape[1],
                local.path_of,
                out,
                64,  # at most 4096 datagrams per NIC per drain
            )
        except OSError as exc:
            log.warning("lens on %s: receive on %s failed: %s", paths.me, local.name, exc)
            return 0
        self.counters["rejected"] += rejected
        self._summary_queue += summaries  # taken in at the next evaluation, all in one go
        return int(n)

    def _file_probes(self, p: np.ndarray, t: np.ndarray) -> None:
        """Probes (records in arrival order, read at monotonic times ``t``): numpy over the batch, Python
        only per coded pair. What the sender needed sooner (the newest sequence number of each path, for
        the echoes) the pacer noted at each read, except for a sender that restarted (its new session)."""
        paths = self.paths
        path, seq, session, rx = p[:, R_PATH], p[:, R_SEQ], p[:, R_SESSION], p[:, R_RX]
        rx_clock = self.seam.apply_many(rx) if self.seam else rx
        delay = rx_clock - p[:, R_TX]
        self.counters["probes_received"] += len(p)
        if np.any(session != paths.in_session[path]):
            self._file_restarted(path, seq, session, delay, rx_clock, t)
        else:
            self._pending.append((t, path, seq, delay))
        # Round trips: the echo names one of our probes; its transmit time is in the reverse path's ring.
        hold, rows = p[:, R_HOLD], paths.in_rev_out[path]
        echoed = np.flatnonzero((hold != wire.NO_ECHO) & (rows >= 0))
        if len(echoed):
            echo_seq, rows = p[echoed, R_ECHO_SEQ], rows[echoed]
            slots = echo_seq % ECHO_RING
            rtt = rx_clock[echoed] - paths.ring_tx[rows, slots] - hold[echoed]  # both ends on our clock
            ok = (paths.ring_seq[rows, slots] == echo_seq) & (rtt > 0) & (rtt < RTT_MAX_NS)
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
        paths = self.paths
        in_paths, in_session, in_echo_seq, in_echo_rx = (
            paths.in_paths,
            paths.in_session,
            paths.in_echo_seq,
            paths.in_echo_rx,
        )
        for i, q, sess, d, rxc, now in zip(
            path.tolist(), seq.tolist(), session.tolist(), delay.tolist(), rx_clock.tolist(), t.tolist(), strict=True
        ):
            pw = in_paths[i]
            if sess != in_session[i]:
                self.flush_samples()  # the old session's samples go to the window before it starts again
                in_session[i] = sess
                in_echo_seq[i] = -1
            pw.add_one(now, sess, q, d)  # resets the window at a new session
            if q > in_echo_seq[i]:
                in_echo_seq[i], in_echo_rx[i] = q, rxc

    def _file_pairs(self, p: np.ndarray, rx_clock: np.ndarray) -> None:
        """Coded pairs: a second that follows its first closely enough feeds the path's delay envelope."""
        in_paths = self.paths.in_paths
        for i, flags, seq, tx, rx_ns, rxc in zip(
            p[:, R_PATH].tolist(),
            p[:, R_FLAGS].tolist(),
            p[:, R_SEQ].tolist(),
            p[:, R_TX].tolist(),
            p[:, R_RX].tolist(),
            rx_clock.tolist(),
            strict=True,
        ):
            pw = in_paths[i]
            if flags == wire.PAIR_FIRST:
                pw.pair_first = (seq, tx, rxc, rx_ns)
            elif flags == wire.PAIR_SECOND and pw.pair_first is not None and pw.pair_first[0] == seq - 1:
                _, tx1, rx1_clock, rx1 = pw.pair_first
                pw.pair_first = None
                self.envelope(pw.src, pw.dst).add(tx1, rx1_clock, 0 <= rx_ns - rx1 <= PAIR_PURE_NS)

    def _file_trains(self, r: np.ndarray, t: np.ndarray) -> None:
        """Train packets (read at times ``t``), one call per run of the same train (a train usually arrives
        within one read)."""
        path, seq, aux = r[:, R_PATH], r[:, R_SEQ], r[:, R_AUX]
        cuts = np.flatnonzero((path[1:] != path[:-1]) | (seq[1:] != seq[:-1])) + 1
        starts = [0, *cuts.tolist()]
        ends = [*starts[1:], len(r)]
        in_paths = self.paths.in_paths
        for a, b in zip(starts, ends, strict=True):
            in_paths[int(path[a])].add_train_run(
                int(seq[a]), int(aux[a]) & 0xFFFF, r[a:b, R_RX], r[a:b, R_LENGTH], float(t[a])
            )
