"""Per-path measurements over a sliding window, each path's own baseline, and the verdict against it.

The receiver of a directed NIC pair sees everything about it: which sequence numbers arrived (loss),
when each arrived by its own clock against when it left by the sender's (one-way delay, once the
clocks are known), the spacing of consecutive delays (jitter), and how fast a probe train came in
(rate). A path is judged against its *own* history, not a global threshold: a long cable and a short
one differ by design; what matters is a sustained change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from clockwork.contracts.lens_model import NicId, PathStats, PathVerdict

BASELINE_ALPHA = 0.05  # EWMA weight of one healthy window in a path's baseline
TRAIN_STALE_S = 5.0  # a train older than this no longer says anything about the path
FLOAT_PAD = float(np.finfo(np.float64).max)  # pads sorted rows: sorts after any figure, and pad - pad is 0, not nan
DEAD_AFTER_S = 0.25  # a path silent this long (its sender alive elsewhere) is dead, not just lossy


class Samples:
    """Samples of any number of paths in one set of arrays: when each was filed, its path's slot, its values.

    Why one set for all paths: a window's figures take a few numpy calls per block of samples, and a call
    on a few hundred samples costs more to set up than to run. Kept per path, every evaluation paid those
    calls for every path (trimming, merging, then gathering them all again); kept together, it pays them
    once.
    """

    def __init__(self) -> None:
        self._kept: tuple[np.ndarray, ...] | None = None  # the window as of the last read
        self._new: list[tuple[np.ndarray, ...]] = []  # blocks added since

    def add(self, t: np.ndarray, slot: np.ndarray, *values: np.ndarray) -> None:
        """A block: filing times, the slot of each sample's path, and the value columns (the same
        columns on every call)."""
        if len(t):
            self._new.append((np.asarray(t, dtype=np.float64), np.asarray(slot, dtype=np.int64), *values))

    def window(self, horizon: float) -> tuple[np.ndarray, ...] | None:
        """All samples filed at or after ``horizon`` (older ones are dropped for good), in the order they
        were added: (filed, slot, values...); None when there are none."""
        parts = self._new if self._kept is None else [self._kept, *self._new]
        self._new = []
        if not parts:
            return None
        cols = parts[0] if len(parts) == 1 else tuple(np.concatenate(c) for c in zip(*parts, strict=True))
        inside = cols[0] >= horizon
        if not inside.all():
            cols = tuple(c[inside] for c in cols)
        self._kept = cols if len(cols[0]) else None
        return self._kept

    def forget(self, slot: int) -> None:
        """Drop every sample of one path (its sender restarted: its sequence numbers begin again)."""
        parts = self._new if self._kept is None else [self._kept, *self._new]
        self._kept = None
        self._new = [tuple(c[p[1] != slot] for c in p) for p in parts]


def file_blocks(
    windows: Sequence[PathWindow], t: np.ndarray, slot: np.ndarray, seq: np.ndarray, d_ns: np.ndarray
) -> None:
    """Probes of many paths at once, arrival order: ``windows[k]`` is the path of slot k, and all of them
    share one store (what the Lens receiver files at each evaluation). Each path's newest sequence number
    and arrival are noted as :meth:`PathWindow.add_block` would."""
    if not len(t):
        return
    for pw in windows:  # probes filed one by one (after a restart) go in first: arrival order
        pw._close_lists()
    windows[0].samples.add(t, slot, seq, d_ns)
    n = len(windows)
    newest_seq = np.full(n, -1, dtype=np.int64)
    newest_t = np.full(n, -np.inf)
    np.maximum.at(newest_seq, slot, seq)
    np.maximum.at(newest_t, slot, t)
    for k in np.flatnonzero(newest_t > -np.inf).tolist():
        pw = windows[k]
        pw.last_seq = max(pw.last_seq, int(newest_seq[k]))
        pw.last_rx = max(pw.last_rx, float(newest_t[k]))


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
    # Samples filed one by one (add_one: plain lists, appending costs ~0.1 µs) wait here until the window is
    # read; blocks go straight to the stores, which may hold many paths' samples (see Samples).
    pending_t: list[float] = field(default_factory=list)
    pending_seq: list[int] = field(default_factory=list)
    pending_d: list[int] = field(default_factory=list)
    samples: Samples = field(default_factory=Samples)  # (filed, slot, seq, delay ns)
    slot: int = 0  # this path's number in the stores it may share with other paths
    pair_first: tuple[int, int, int, int] | None = None  # (seq, tx, rx on our clock, rx real) awaiting its second
    rtts: Samples = field(default_factory=Samples)  # round trips from echoes: (when, slot, ns)
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
            self.samples.forget(self.slot)
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
        self.samples.add(t, np.full(len(seq), self.slot), np.asarray(seq), np.asarray(d_ns))
        self.last_seq = max(self.last_seq, int(seq.max()))
        self.last_rx = max(self.last_rx, float(t.max()))

    def add_rtts(self, t: np.ndarray, rtt_ns: np.ndarray) -> None:
        """Round trips measured from echoes: when, and the round trip (ns)."""
        self.rtts.add(t, np.full(len(rtt_ns), self.slot), np.asarray(rtt_ns, dtype=np.int64))

    def _close_lists(self) -> None:
        """Probe-by-probe samples become a block (so that they stay in order with the blocks after them)."""
        if self.pending_seq:
            self.samples.add(
                np.array(self.pending_t, dtype=np.float64),
                np.full(len(self.pending_seq), self.slot),
                np.array(self.pending_seq, dtype=np.int64),
                np.array(self.pending_d, dtype=np.int64),
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


def _grouped(stores: Sequence[Samples], slots: Sequence[int], horizon: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """The window's samples of the paths (store, slot) (one per path, in the order asked), grouped by path
    with each path's arrival order kept: each sample's path position, and its columns (filed, values...)."""
    asked: dict[int, tuple[Samples, list[int], list[int]]] = {}
    for position, (store, slot) in enumerate(zip(stores, slots, strict=True)):
        entry = asked.setdefault(id(store), (store, [], []))
        entry[1].append(slot)
        entry[2].append(position)
    pieces = []
    for store, slot_list, positions in asked.values():
        cols = store.window(horizon)
        if cols is None:
            continue
        lookup = np.full(max(int(cols[1].max()), max(slot_list)) + 1, -1, dtype=np.int64)
        lookup[slot_list] = positions
        position = lookup[cols[1]]
        pieces.append((position, cols[0], *cols[2:]))
    if not pieces:
        return np.zeros(0, dtype=np.int64), []
    cols = pieces[0] if len(pieces) == 1 else tuple(np.concatenate(c) for c in zip(*pieces, strict=True))
    if cols[0].min() < 0:  # samples of paths not asked about
        asked_for = cols[0] >= 0
        cols = tuple(c[asked_for] for c in cols)
    # A stable sort of 16-bit keys is numpy's radix sort: ~4x faster than on int64 for a window's thousands
    key = cols[0].astype(np.int16) if len(stores) < 2**15 else cols[0]
    order = np.argsort(key, kind="stable")
    return cols[0][order], [c[order] for c in cols[1:]]


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
    for pw in windows:
        pw._close_lists()
    group, cols = _grouped([pw.samples for pw in windows], [pw.slot for pw in windows], horizon)
    counts = np.bincount(group, minlength=n)
    starts = np.cumsum(counts) - counts
    received = np.zeros(n, dtype=np.int64)
    seq_min = seq_max = np.zeros(n, dtype=np.int64)
    p0 = p50 = p99 = jitter = np.zeros(n)
    if len(group):
        ts, seqs, ds = cols
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
    rtt_group, rtt_cols = _grouped([pw.rtts for pw in windows], [pw.slot for pw in windows], horizon)
    rtt_counts = np.bincount(rtt_group, minlength=n)
    rtt_min = rtt_p50 = np.zeros(n)
    if len(rtt_group):
        rtt = rtt_cols[1].astype(np.float64) / 1e3
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
