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
from typing import Any

import numpy as np

from clockworkd.lens.model import NicId, PathStats, PathVerdict

BASELINE_ALPHA = 0.05  # EWMA weight of one healthy window in a path's baseline
TRAIN_STALE_S = 5.0  # a train older than this no longer says anything about the path
FLOAT_PAD = float(np.finfo(np.float64).max)  # pads sorted rows: sorts after any figure, and pad - pad is 0, not nan
DEAD_AFTER_S = 0.25  # a path silent this long (its sender alive elsewhere) is dead, not just lossy


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
        with the offset of its own moment. One path of :func:`window_stats`."""
        return window_stats([self], now, [offset_ns], [offset_rate], th)[0]

    def _window(self, horizon: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The samples filed at or after ``horizon`` (arrival order): when filed, seq, delay."""
        self._close_lists()
        self.blocks.extend(self.pending_blocks)
        self.pending_blocks.clear()
        inside = _in_window(self.blocks, horizon)
        return inside if inside else (np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    def _rtt_window(self, horizon: float) -> np.ndarray:
        """The round trips measured at or after ``horizon`` (ns)."""
        inside = _in_window(self.rtts, horizon)
        return inside[1] if inside else np.zeros(0, dtype=np.int64)

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


def _in_window(blocks: deque[Any], horizon: float) -> Any:
    """Drop the samples before ``horizon`` from blocks of arrays (time first, each block in time order)
    and merge the rest into one block, left as the only one; None when nothing is left."""
    while blocks and blocks[0][0][-1] < horizon:  # wholly out of the window
        blocks.popleft()
    if blocks and blocks[0][0][0] < horizon:  # partly out: keep its recent part
        keep = blocks[0][0] >= horizon
        blocks[0] = tuple(a[keep] for a in blocks[0])
    if len(blocks) > 1:
        merged = tuple(np.concatenate(parts) for parts in zip(*blocks, strict=True))
        blocks.clear()
        blocks.append(merged)
    return blocks[0] if blocks else None


def _sorted_rows(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each group's values sorted, one row per group, padded (after the values) with ``FLOAT_PAD``.

    ``values`` holds the groups one after the other (``starts``/``counts``). One sort along the rows
    of a padded matrix is exact and far cheaper than a sort of all values by (group, value).
    """
    rows = np.full((len(counts), int(counts.max())), FLOAT_PAD)
    group = np.repeat(np.arange(len(counts)), counts)
    rows[group, np.arange(len(values)) - starts[group]] = values
    rows.sort(axis=1)
    return rows


def _spread(values: np.ndarray, at: np.ndarray, n: int) -> np.ndarray:
    """``values`` of groups ``at`` placed into an array of ``n`` groups (zero elsewhere)."""
    out = np.zeros(n, dtype=values.dtype)
    out[at] = values
    return out


def _row_quantiles(rows: np.ndarray, counts: np.ndarray, fractions: Sequence[float]) -> list[np.ndarray]:
    """Quantiles of each row's first ``counts`` values (linear interpolation, as numpy's default);
    rows without values get 0 (callers mask them)."""
    last = np.maximum(counts - 1, 0)
    index = np.arange(len(counts))
    out = []
    for f in fractions:
        pos = f * last
        lo = np.floor(pos).astype(np.int64)
        a, b = rows[index, lo], rows[index, np.minimum(lo + 1, last)]
        out.append(np.where(counts > 0, a + (b - a) * (pos - lo), 0.0))
    return out


def window_stats(
    windows: Sequence[PathWindow],
    now: float,
    offsets_ns: Sequence[float | None],
    offset_rates: Sequence[float],
    th: Thresholds,
) -> list[PathStats]:
    """Every path's figures over its window (see :meth:`PathWindow.stats`), computed together.

    Why together: each figure is a handful of numpy calls, and on a window of a few hundred samples
    a call costs more to set up than to run; one pass over all paths' samples (grouped by path) makes
    an evaluation's cost grow with the samples rather than with paths x calls.
    """
    n = len(windows)
    horizon = now - th.window_s
    parts = [pw._window(horizon) for pw in windows]
    rtt_parts = [pw._rtt_window(horizon) for pw in windows]
    counts = np.fromiter((len(p[1]) for p in parts), dtype=np.int64, count=n)
    starts = np.cumsum(counts) - counts
    received = np.zeros(n, dtype=np.int64)
    seq_min = seq_max = np.zeros(n, dtype=np.int64)
    p0 = p50 = p99 = jitter = np.zeros(n)
    if counts.any():
        group = np.repeat(np.arange(n), counts)
        ts = np.concatenate([p[0] for p in parts])
        seqs = np.concatenate([p[1] for p in parts])
        ds = np.concatenate([p[2] for p in parts])
        # distinct sequence numbers per path (a duplicated probe counts once): a path whose numbers rise
        # in arrival order, as nearly always, has as many as it has samples; only the others are sorted
        filled = np.flatnonzero(counts)
        seq_min = np.minimum.reduceat(seqs, starts[filled])
        seq_max = np.maximum.reduceat(seqs, starts[filled])
        received = counts[filled].copy()
        same = group[1:] == group[:-1]
        unordered = np.unique(group[1:][same & (seqs[1:] <= seqs[:-1])])
        for i in np.searchsorted(filled, unordered).tolist():
            a = int(starts[filled[i]])
            received[i] = len(np.unique(seqs[a : a + int(counts[filled[i]])]))
        received, seq_min, seq_max = (_spread(v, filled, n) for v in (received, seq_min, seq_max))
        # one-way delays, each sample corrected with the clock offset of its own moment
        offset = np.array([0 if o is None else round(o) for o in offsets_ns], dtype=np.int64)
        rate = np.asarray(offset_rates, dtype=np.float64)
        corrected = (ds - offset[group]).astype(np.float64)
        corrected += rate[group] * (now - ts) * 1e9  # the offset was smaller by drift x age
        owd_rows = _sorted_rows(corrected / 1e3, starts, counts)
        p0, p50, p99 = _row_quantiles(owd_rows, counts, (0.0, 0.5, 0.99))
        # jitter: mean absolute change between consecutive arrivals of the same path
        steps = np.abs(np.diff(ds))[same].astype(np.float64)
        jitter = np.bincount(group[1:][same], weights=steps, minlength=n) / np.maximum(counts - 1, 1) / 1e3
    rtt_counts = np.fromiter((len(r) for r in rtt_parts), dtype=np.int64, count=n)
    rtt_min = rtt_p50 = np.zeros(n)
    if rtt_counts.any():
        rtt = np.concatenate(rtt_parts).astype(np.float64) / 1e3
        rtt_rows = _sorted_rows(rtt, np.cumsum(rtt_counts) - rtt_counts, rtt_counts)
        rtt_min, rtt_p50 = _row_quantiles(rtt_rows, rtt_counts, (0.0, 0.5))
    received_l, seq_min_l, seq_max_l, counts_l = received.tolist(), seq_min.tolist(), seq_max.tolist(), counts.tolist()
    p0_l, p50_l, p99_l, jitter_l = p0.tolist(), p50.tolist(), p99.tolist(), jitter.tolist()
    rtt_min_l, rtt_p50_l, rtt_counts_l = rtt_min.tolist(), rtt_p50.tolist(), rtt_counts.tolist()
    out = []
    for i, pw in enumerate(windows):
        got = received_l[i]
        # Expected: from the first sequence number of the window to the newest, extended by what the
        # sender should have sent since the newest arrived (a path that went silent loses the rest).
        pw.silent_s = now - pw.last_rx if got else 0.0
        if got:
            silent = max(0.0, now - pw.last_rx - 2 * th.interval_s)
            newest = seq_max_l[i] + int(silent / th.interval_s)
            sent = max(got, newest - seq_min_l[i] + 1)
        else:
            sent = int(th.window_s / th.interval_s)
        loss = 1.0 - got / sent if sent else 0.0
        owd = (p0_l[i], p50_l[i], p99_l[i]) if got and offsets_ns[i] is not None else (None, None, None)
        rate_mbps = None
        if pw.last_rate is not None and now - pw.last_rate[0] < TRAIN_STALE_S:
            rate_mbps = pw.last_rate[1]
        has_rtt = rtt_counts_l[i] > 0
        out.append(
            PathStats(
                pw.src,
                pw.dst,
                th.window_s,
                sent,
                got,
                round(loss, 6),
                owd[0],
                owd[1],
                owd[2],
                jitter_l[i] if counts_l[i] > 1 else None,
                rate_mbps,
                rtt_min_l[i] if has_rtt else None,
                rtt_p50_l[i] if has_rtt else None,
            )
        )
    return out
