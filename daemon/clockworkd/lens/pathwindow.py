"""Per-path measurements over a sliding window, each path's own baseline, and the verdict against it.

The receiver of a directed NIC pair sees everything about it: which sequence numbers arrived (loss),
when each arrived by its own clock against when it left by the sender's (one-way delay, once the
clocks are known), the spacing of consecutive delays (jitter), and how fast a probe train came in
(rate). A path is judged against its *own* history, not a global threshold: a long cable and a short
one differ by design; what matters is a sustained change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from clockworkd.lens.model import NicId, PathStats, PathVerdict

BASELINE_ALPHA = 0.05  # EWMA weight of one healthy window in a path's baseline
TRAIN_STALE_S = 5.0  # a train older than this no longer says anything about the path
DEAD_AFTER_S = 0.25  # a path silent this long (its sender alive elsewhere) is dead, not just lossy


def _quantiles(ordered: np.ndarray) -> tuple[float, float, float]:
    """Min, median and 99th percentile of sorted values (linear interpolation, as numpy's default)."""
    n = len(ordered)

    def q(f: float) -> float:
        pos = f * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))

    return float(ordered[0]), q(0.5), q(0.99)


@dataclass
class Thresholds:
    """What counts as a sustained change (from ``[lens]``)."""

    interval_s: float
    window_s: float
    loss_min_lost: int
    delay_rise_us: float
    jitter_rise_us: float
    rate_drop: float


@dataclass
class Baseline:
    """A path's healthy behaviour: EWMAs over windows judged healthy."""

    windows: int = 0
    loss: float = 0.0
    p50_us: float | None = None
    jitter_us: float | None = None
    rate_mbps: float | None = None

    def learn(self, stats: PathStats) -> None:
        a = 1.0 if self.windows == 0 else max(BASELINE_ALPHA, 1.0 / (self.windows + 1))
        self.windows += 1
        self.loss += a * (stats.loss - self.loss)
        if stats.owd_p50_us is not None:
            self.p50_us = (
                stats.owd_p50_us if self.p50_us is None else self.p50_us + a * (stats.owd_p50_us - self.p50_us)
            )
        if stats.jitter_us is not None:
            j = stats.jitter_us
            self.jitter_us = j if self.jitter_us is None else self.jitter_us + a * (j - self.jitter_us)

    def learn_rate(self, mbps: float) -> None:
        self.rate_mbps = mbps if self.rate_mbps is None else self.rate_mbps + BASELINE_ALPHA * (mbps - self.rate_mbps)


@dataclass
class PathWindow:
    """One incoming directed path: recent samples, train results and the baseline."""

    src: NicId
    dst: NicId
    session: int = -1
    last_seq: int = -1
    last_rx: float = 0.0  # receiver's monotonic time of the newest probe
    # Samples since the last evaluation: probe by probe (add_one: plain lists, appending costs ~0.1 µs) or
    # as arrays (add_block: the receiver files a whole drain at once), kept in arrival order; then one numpy
    # block per evaluation (t = when each sample was filed, seqs, delays) for as long as the window reaches back.
    pending_t: list[float] = field(default_factory=list)
    pending_seq: list[int] = field(default_factory=list)
    pending_d: list[int] = field(default_factory=list)
    pending_blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    blocks: deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=deque)  # (t, seq, d)
    pair_first: tuple[int, int, int, int] | None = None  # (seq, tx, rx on our clock, rx real) awaiting its second
    rtts: deque[tuple[np.ndarray, np.ndarray]] = field(default_factory=deque)  # blocks of (when, round trip ns)
    train_id: int = -1
    train_first_ns: int = 0
    train_last_ns: int = 0
    train_got: int = 0
    train_count: int = 0
    train_bytes: int = 0
    last_rate: tuple[float, float] | None = None  # (monotonic time, Mbit/s)
    prev_rate: tuple[float, float] | None = None  # the train before: a rate verdict needs both slow
    rate_learnt_at: float = -1.0  # time of the train last taught to the baseline
    baseline: Baseline = field(default_factory=Baseline)
    silent_s: float = 0.0  # how long the path has been quiet, as of the last stats()

    def add(self, now: float, session: int, seq: Sequence[int] | np.ndarray, d_ns: Sequence[int] | np.ndarray) -> None:
        """Probes of one batch (in arrival order)."""
        for q, d in zip(list(seq), list(d_ns), strict=True):
            self.add_one(now, session, int(q), int(d))

    def add_one(self, now: float, session: int, seq: int, d_ns: int) -> None:
        """One probe: its sequence number and its delay reading (receiver clock minus sender clock, ns)."""
        if session != self.session:  # the sender restarted: its sequence numbers begin again
            self.session = session
            self.pending_t, self.pending_seq, self.pending_d = [], [], []
            self.pending_blocks.clear()
            self.blocks.clear()
            self.last_seq = -1
        self.pending_t.append(now)
        self.pending_seq.append(seq)
        self.pending_d.append(d_ns)
        if seq > self.last_seq:
            self.last_seq = seq
        self.last_rx = now

    def add_block(self, t: np.ndarray, seq: np.ndarray, d_ns: np.ndarray) -> None:
        """Probes of the path's current session as arrays (arrival order): when filed, seq, delay (ns)."""
        if not len(seq):
            return
        self._close_lists()
        self.pending_blocks.append((np.asarray(t, dtype=np.float64), np.asarray(seq), np.asarray(d_ns)))
        self.last_seq = max(self.last_seq, int(seq.max()))
        self.last_rx = max(self.last_rx, float(t.max()))

    def add_rtts(self, t: np.ndarray, rtt_ns: np.ndarray) -> None:
        """Round trips measured from echoes: when, and the round trip (ns)."""
        if len(rtt_ns):
            self.rtts.append((np.asarray(t, dtype=np.float64), np.asarray(rtt_ns, dtype=np.int64)))

    def _close_lists(self) -> None:
        """Probe-by-probe samples become a block (so that they stay in order with the blocks after them)."""
        if self.pending_seq:
            self.pending_blocks.append(
                (
                    np.array(self.pending_t, dtype=np.float64),
                    np.array(self.pending_seq, dtype=np.int64),
                    np.array(self.pending_d, dtype=np.int64),
                )
            )
            self.pending_t, self.pending_seq, self.pending_d = [], [], []

    def add_train_run(self, train_id: int, count: int, rx_ns: np.ndarray, sizes: np.ndarray, now: float) -> None:
        """Consecutive packets of one train as arrays (what :meth:`add_train` does for each, in one go)."""
        k, n = 0, len(rx_ns)
        while k < n:
            if train_id != self.train_id:
                self.finish_train(now)
                self.train_id, self.train_count, self.train_got, self.train_bytes = train_id, count, 0, 0
                self.train_first_ns = self.train_last_ns = int(rx_ns[k])
            take = min(n - k, max(1, self.train_count - self.train_got))
            rx, size = rx_ns[k : k + take], sizes[k : k + take]
            self.train_bytes += int(size.sum()) - (int(size[0]) if self.train_got == 0 else 0)
            self.train_got += take
            self.train_first_ns = min(self.train_first_ns, int(rx.min()))
            self.train_last_ns = max(self.train_last_ns, int(rx.max()))
            if self.train_got >= self.train_count:
                self.finish_train(now)
            k += take

    def add_train(self, train_id: int, index: int, count: int, rx_ns: int, size: int, now: float) -> None:
        if train_id != self.train_id:
            self.finish_train(now)
            self.train_id, self.train_count, self.train_got, self.train_bytes = train_id, count, 0, 0
            self.train_first_ns = self.train_last_ns = rx_ns
        self.train_got += 1
        self.train_first_ns = min(self.train_first_ns, rx_ns)
        self.train_last_ns = max(self.train_last_ns, rx_ns)
        if self.train_got > 1:
            self.train_bytes += size
        if self.train_got >= self.train_count:
            self.finish_train(now)

    def finish_train(self, now: float) -> None:
        """Turn a complete (or abandoned) train into a rate: bytes after the first over the spread."""
        if self.train_got >= 2 and self.train_last_ns > self.train_first_ns:
            mbps = self.train_bytes * 8 / ((self.train_last_ns - self.train_first_ns) / 1e9) / 1e6
            self.prev_rate, self.last_rate = self.last_rate, (now, mbps)
        self.train_got = 0
        self.train_id = -1

    def stats(self, now: float, offset_ns: float | None, th: Thresholds, offset_rate: float = 0.0) -> PathStats:
        """The window's figures; ``offset_ns`` = receiver clock minus sender clock now (None = unknown),
        changing at ``offset_rate`` ns per ns (the two clocks' relative drift): each sample is corrected
        with the offset of its own moment."""
        self._close_lists()
        if len(self.pending_blocks) == 1:
            self.blocks.append(self.pending_blocks[0])
        elif self.pending_blocks:
            self.blocks.append(tuple(np.concatenate(parts) for parts in zip(*self.pending_blocks, strict=True)))  # type: ignore[arg-type]
        self.pending_blocks.clear()
        horizon = now - th.window_s
        while self.blocks and self.blocks[0][0][-1] < horizon:  # wholly out of the window
            self.blocks.popleft()
        if self.blocks and self.blocks[0][0][0] < horizon:  # partly out: keep its recent part
            t, q, d = self.blocks[0]
            keep = t >= horizon
            self.blocks[0] = (t[keep], q[keep], d[keep])
        if len(self.blocks) == 1:
            ts, seqs, ds = self.blocks[0]
        elif self.blocks:
            ts = np.concatenate([b[0] for b in self.blocks])
            seqs = np.concatenate([b[1] for b in self.blocks])
            ds = np.concatenate([b[2] for b in self.blocks])
        else:
            ts = np.zeros(0)
            seqs = ds = np.zeros(0, dtype=np.int64)
        if len(seqs) > 1:  # distinct sequence numbers (np.unique's count, without its bookkeeping)
            ordered_seqs = np.sort(seqs)
            received = 1 + int(np.count_nonzero(ordered_seqs[1:] != ordered_seqs[:-1]))
        else:
            received = len(seqs)
        # Expected: from the first sequence number of the window to the newest, extended by what the
        # sender should have sent since the newest arrived (a path that went silent loses the rest).
        self.silent_s = now - self.last_rx if received else 0.0
        if received:
            silent = max(0.0, now - self.last_rx - 2 * th.interval_s)
            newest = int(seqs.max()) + int(silent / th.interval_s)
            sent = max(received, newest - int(seqs.min()) + 1)
        else:
            sent = int(th.window_s / th.interval_s)
        loss = 1.0 - received / sent if sent else 0.0
        jitter = None
        p: tuple[float | None, float | None, float | None] = (None, None, None)
        if received:
            if offset_ns is not None:
                corrected = (ds - round(offset_ns)).astype(np.float64)
                if offset_rate:
                    corrected += offset_rate * (now - ts) * 1e9  # the offset was smaller by drift x age
                owd = np.sort(corrected / 1e3)
                p = _quantiles(owd)
            if len(ds) > 1:
                jitter = float(np.mean(np.abs(np.diff(ds)))) / 1e3  # consecutive arrivals
        while self.rtts and self.rtts[0][0][-1] < horizon:  # wholly out of the window
            self.rtts.popleft()
        if self.rtts and self.rtts[0][0][0] < horizon:
            t, r = self.rtts[0]
            keep = t >= horizon
            self.rtts[0] = (t[keep], r[keep])
        rtt_min = rtt_p50 = None
        if self.rtts:
            rt = np.sort(np.concatenate([r for _, r in self.rtts]).astype(np.float64)) / 1e3
            rtt_min, rtt_p50 = float(rt[0]), _quantiles(rt)[1]
        rate = None
        if self.last_rate is not None and now - self.last_rate[0] < TRAIN_STALE_S:
            rate = self.last_rate[1]
        return PathStats(
            self.src,
            self.dst,
            th.window_s,
            sent,
            received,
            round(loss, 6),
            p[0],
            p[1],
            p[2],
            jitter,
            rate,
            rtt_min,
            rtt_p50,
        )

    def judge(self, stats: PathStats, th: Thresholds, sender_alive: bool) -> PathVerdict | None:
        """The path's verdict, learning the baseline from healthy windows; None = cannot tell.

        A path whose sender is silent on every path is not judged: a stopped daemon or a dead node is
        not a link fault (and TorchPass, not Lens, handles a dead node).
        """
        if not sender_alive:
            return None
        b = self.baseline
        reasons: list[str] = []
        kinds: list[str] = []
        score = 0.0
        lost = stats.sent - stats.received
        if stats.received == 0 or self.silent_s > DEAD_AFTER_S:
            reasons.append(
                "no probe arrived in the window"
                if stats.received == 0
                else f"no probe for {self.silent_s * 1000:.0f} ms (the path stopped delivering)"
            )
            kinds.append("dead")
            score = 1.0
        elif lost >= th.loss_min_lost and stats.loss > 3 * b.loss + 0.002:
            reasons.append(f"loss {stats.loss:.1%} ({lost}/{stats.sent}; baseline {b.loss:.2%})")
            kinds.append("loss")
            score = max(score, min(1.0, 0.3 + stats.loss * 10))
        if b.windows >= 4:
            if stats.owd_p50_us is not None and b.p50_us is not None and stats.owd_p50_us - b.p50_us > th.delay_rise_us:
                reasons.append(f"one-way delay p50 {stats.owd_p50_us:.0f} us (baseline {b.p50_us:.0f} us)")
                kinds.append("delay")
                score = max(score, 0.5)
            if (
                stats.jitter_us is not None
                and b.jitter_us is not None
                and stats.jitter_us - b.jitter_us > th.jitter_rise_us
            ):
                reasons.append(f"jitter {stats.jitter_us:.0f} us (baseline {b.jitter_us:.0f} us)")
                kinds.append("jitter")
                score = max(score, 0.4)
        if (
            stats.rate_mbps is not None
            and b.rate_mbps is not None
            and stats.rate_mbps < th.rate_drop * b.rate_mbps
            and self.prev_rate is not None
            and self.prev_rate[1] < th.rate_drop * b.rate_mbps
        ):
            # Two slow trains in a row: one alone can be a sender preempted in the middle of its send.
            reasons.append(f"train rate {stats.rate_mbps:.1f} Mbit/s (baseline {b.rate_mbps:.0f} Mbit/s)")
            kinds.append("rate")
            score = max(score, 0.6)
        bad = bool(kinds)
        if not bad:
            b.learn(stats)
        train = self.last_rate
        if train is not None and train[0] != self.rate_learnt_at:  # each train teaches the baseline once
            self.rate_learnt_at = train[0]
            if b.rate_mbps is None or train[1] >= th.rate_drop * b.rate_mbps:
                b.learn_rate(train[1])
        return PathVerdict(stats.src, stats.dst, bad, tuple(reasons), tuple(kinds), round(score, 3))
