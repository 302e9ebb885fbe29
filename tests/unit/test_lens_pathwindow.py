"""Fleet Lens per-path windows: loss, one-way delay, jitter and train rate against each path's own baseline."""

from __future__ import annotations

import numpy as np
import pytest

from clockworkd.lens.pathwindow import TRAIN_STALE_S, PathWindow, Samples, Thresholds, file_blocks, window_stats

TH = Thresholds(interval_s=0.01, window_s=1.0, loss_min_lost=2, delay_rise_us=500, jitter_rise_us=300, rate_drop=0.1)
T0 = 1000.0
OFFSET_NS = 5_000_000  # receiver clock minus sender clock
SESSION = 77


class Feed:
    """Probes into one PathWindow as a receiver sees them: one every interval, seq numbers from 1.

    ``d`` is receive clock minus transmit clock: the one-way delay plus the clock offset.
    """

    def __init__(self, pw: PathWindow | None = None) -> None:
        self.pw = pw or PathWindow("n2/lo", "n1/lo")
        self.seq = 0
        self.t = T0

    def window(
        self,
        owd_us: float | np.ndarray = 20.0,
        missing: set[int] = frozenset(),  # type: ignore[assignment]
        count: int = 100,
        session: int = SESSION,
    ) -> float:
        """``count`` probes (index i lost when in ``missing``); returns the time to judge the window at."""
        owd = np.broadcast_to(np.asarray(owd_us, dtype=np.float64), (count,))
        for i in range(count):
            self.seq += 1
            if i not in missing:
                d = np.array([OFFSET_NS + round(owd[i] * 1e3)], dtype=np.int64)
                self.pw.add(self.t, session, np.array([self.seq], dtype=np.uint32), d)
            self.t += TH.interval_s
        # Half an interval after the newest probe: each window is exactly the last 100 probes.
        return self.t - TH.interval_s / 2

    def judge(self, now: float, alive: bool = True, offset: float | None = OFFSET_NS):
        stats = self.pw.stats(now, offset, TH)
        return stats, self.pw.judge(stats, TH, alive)

    def healthy(self, windows: int, owd_us: float | np.ndarray = 20.0) -> None:
        for _ in range(windows):
            stats, verdict = self.judge(self.window(owd_us))
            assert verdict is not None and not verdict.bad, verdict
            assert stats.loss == 0.0


def _owd(n: int = 100, base: float = 20.0) -> np.ndarray:
    """Deterministic small spread around ``base`` microseconds (a healthy path)."""
    return base + (np.arange(n) * 37 % 11).astype(np.float64)


# ----- statistics -------------------------------------------------------------------------------


def test_clean_stream_has_no_loss_and_offset_corrected_delays() -> None:
    feed = Feed()
    owd = _owd()
    now = feed.window(owd)
    stats, verdict = feed.judge(now)
    assert (stats.src, stats.dst, stats.window_s) == ("n2/lo", "n1/lo", 1.0)
    assert (stats.sent, stats.received, stats.loss) == (100, 100, 0.0)
    expected = np.percentile(owd, [0, 50, 99])
    assert stats.owd_min_us == pytest.approx(expected[0], abs=1e-3)
    assert stats.owd_p50_us == pytest.approx(expected[1], abs=1e-3)
    assert stats.owd_p99_us == pytest.approx(expected[2], abs=1e-3)
    assert stats.jitter_us == pytest.approx(np.mean(np.abs(np.diff(owd))), abs=1e-3)
    assert stats.rate_mbps is None
    assert verdict is not None and not verdict.bad and verdict.kinds == () and verdict.score == 0.0
    assert feed.pw.baseline.windows == 1
    assert feed.pw.baseline.p50_us == pytest.approx(expected[1], abs=1e-3)


def test_unknown_offset_gives_no_delays_but_jitter() -> None:
    feed = Feed()
    stats, _ = feed.judge(feed.window(_owd()), offset=None)
    assert stats.owd_min_us is stats.owd_p50_us is stats.owd_p99_us is None
    assert stats.jitter_us is not None and stats.jitter_us > 0


def test_window_slides() -> None:
    feed = Feed()
    feed.window(count=300)
    stats, _ = feed.judge(feed.t - TH.interval_s / 2)
    assert (stats.sent, stats.received) == (100, 100)  # only the last second


def test_arrival_order_does_not_matter() -> None:
    pw = PathWindow("n2/lo", "n1/lo")
    seq = np.array([3, 1, 2, 5, 4], dtype=np.uint32)
    pw.add(T0, SESSION, seq, np.full(5, OFFSET_NS + 10_000, dtype=np.int64))
    stats = pw.stats(T0, OFFSET_NS, TH)
    assert (stats.sent, stats.received, stats.loss) == (5, 5, 0.0)
    assert stats.owd_p50_us == pytest.approx(10.0)
    assert pw.last_seq == 5


def test_missing_seqs_are_loss() -> None:
    feed = Feed()
    feed.healthy(4, _owd())
    base_windows = feed.pw.baseline.windows
    stats, verdict = feed.judge(feed.window(_owd(), missing={10, 20, 30, 40, 50}))
    assert (stats.sent, stats.received) == (100, 95)
    assert stats.loss == pytest.approx(0.05)
    assert verdict is not None and verdict.bad
    assert verdict.kinds == ("loss",)
    assert "loss 5.0%" in verdict.reasons[0]
    assert 0.3 < verdict.score <= 1.0
    assert feed.pw.baseline.windows == base_windows  # a bad window does not teach the baseline


def test_a_single_lost_probe_is_below_loss_min_lost() -> None:
    feed = Feed()
    feed.healthy(4)
    stats, verdict = feed.judge(feed.window(missing={50}))
    assert stats.received == 99 and stats.sent == 100
    assert verdict is not None and not verdict.bad


def test_a_path_that_went_silent_loses_the_rest_of_the_window() -> None:
    feed = Feed()
    feed.healthy(4)
    feed.window(count=50)
    last_rx = feed.t - TH.interval_s
    now = last_rx + 0.505  # the sender went on for ~half a second; nothing arrived
    stats, verdict = feed.judge(now)
    # 0.505 s minus two intervals of grace: 48 more probes should have come after the newest.
    silent = int((now - last_rx - 2 * TH.interval_s) / TH.interval_s)
    assert silent == 48
    assert stats.received == 50
    assert stats.sent == 50 + silent
    assert stats.loss == pytest.approx(1 - 50 / 98, abs=1e-5)
    # Silent for half a second while its sender lives: the path stopped delivering, it is dead.
    assert verdict is not None and verdict.bad and verdict.kinds == ("dead",)
    assert "stopped delivering" in verdict.reasons[0]


def test_a_short_gap_is_loss_not_death() -> None:
    feed = Feed()
    feed.healthy(4)
    now = feed.window(missing={40, 41, 42})  # three probes lost mid-window, the path delivers again
    stats, verdict = feed.judge(now)
    assert stats.loss == pytest.approx(0.03)
    assert verdict is not None and verdict.kinds == ("loss",)


def test_no_samples_with_the_sender_alive_is_dead() -> None:
    pw = PathWindow("n2/lo", "n1/lo")
    stats = pw.stats(T0, OFFSET_NS, TH)
    assert (stats.sent, stats.received, stats.loss) == (100, 0, 1.0)
    assert stats.owd_p50_us is None and stats.jitter_us is None
    verdict = pw.judge(stats, TH, sender_alive=True)
    assert verdict is not None and verdict.bad
    assert verdict.kinds == ("dead",)
    assert verdict.score == 1.0
    assert pw.baseline.windows == 0


def test_samples_that_aged_out_leave_a_dead_path() -> None:
    feed = Feed()
    feed.healthy(2)
    stats, verdict = feed.judge(feed.t + 5.0)
    assert stats.received == 0
    assert verdict is not None and verdict.kinds == ("dead",)


def test_a_silent_sender_is_not_judged() -> None:
    feed = Feed()
    feed.healthy(3)
    pw = PathWindow("n3/lo", "n1/lo")
    assert pw.judge(pw.stats(T0, None, TH), TH, sender_alive=False) is None
    stats, verdict = feed.judge(feed.window(missing={10, 20, 30}), alive=False)
    assert stats.received == 97
    assert verdict is None
    stats, verdict = feed.judge(feed.t + 3.0, alive=False)
    assert verdict is None
    assert feed.pw.baseline.windows == 3  # nothing learned from a window that was not judged


# ----- baseline rises ---------------------------------------------------------------------------


def test_delay_rise_after_four_healthy_windows() -> None:
    feed = Feed()
    feed.healthy(4, _owd())
    assert feed.pw.baseline.windows == 4
    stats, verdict = feed.judge(feed.window(_owd(base=1020.0)))
    assert stats.loss == 0.0
    assert stats.owd_p50_us == pytest.approx(feed.pw.baseline.p50_us + 1000.0, abs=1e-3)
    assert verdict is not None and verdict.bad
    assert verdict.kinds == ("delay",)
    assert verdict.score == 0.5
    assert "one-way delay p50" in verdict.reasons[0]


def test_a_small_delay_rise_is_fine() -> None:
    feed = Feed()
    feed.healthy(4, _owd())
    _, verdict = feed.judge(feed.window(_owd(base=420.0)))
    assert verdict is not None and not verdict.bad


def test_delay_is_not_judged_before_the_baseline_has_four_windows() -> None:
    feed = Feed()
    feed.healthy(3, _owd())
    _, verdict = feed.judge(feed.window(_owd(base=1020.0)))
    assert verdict is not None and not verdict.bad
    assert feed.pw.baseline.windows == 4


def test_delay_is_not_judged_without_a_clock_offset() -> None:
    feed = Feed()
    for _ in range(4):
        feed.judge(feed.window(_owd()), offset=None)
    _, verdict = feed.judge(feed.window(_owd(base=5020.0)), offset=None)
    assert verdict is not None and not verdict.bad


def test_jitter_rise() -> None:
    feed = Feed()
    feed.healthy(4, _owd())
    swing = 20.0 + np.where(np.arange(100) % 2 == 0, 400.0, 0.0)  # p50 moves by < 500 us
    stats, verdict = feed.judge(feed.window(swing))
    assert stats.jitter_us == pytest.approx(400.0, abs=1.0)
    assert verdict is not None and verdict.bad and verdict.kinds == ("jitter",)


def test_a_session_change_resets_the_window() -> None:
    feed = Feed()
    feed.healthy(4)
    assert feed.pw.last_seq == 400
    feed.seq = 0  # the sender restarted: new session, sequence numbers begin again
    now = feed.window(count=10, session=SESSION + 1)
    assert feed.pw.session == SESSION + 1
    assert feed.pw.last_seq == 10
    stats, verdict = feed.judge(now)
    assert (stats.sent, stats.received, stats.loss) == (10, 10, 0.0)
    assert verdict is not None and not verdict.bad
    assert feed.pw.baseline.windows == 5  # the path's baseline outlives a restart of its sender


def test_the_same_session_keeps_the_window() -> None:
    feed = Feed()
    feed.window(count=20)
    feed.seq = 0
    feed.window(count=10)  # same session, seq numbers seen before: duplicates, not a restart
    stats, _ = feed.judge(feed.t - TH.interval_s / 2)
    assert stats.received == 20
    assert feed.pw.last_seq == 20


# ----- trains -----------------------------------------------------------------------------------


def _train(pw: PathWindow, train_id: int, spread_ns: int, now: float, count: int = 10, got: int | None = None) -> None:
    base = 1_800_000_000_000_000_000
    for i in range(count if got is None else got):
        pw.add_train(train_id, i, count, base + round(i * spread_ns / (count - 1)), 1400, now)


def test_train_rate_from_dispersion() -> None:
    pw = PathWindow("n2/lo", "n1/lo")
    _train(pw, 1, 1_000_000, T0)
    assert pw.last_rate is not None
    expected = 9 * 1400 * 8 / 1e-3 / 1e6
    assert pw.last_rate == (T0, pytest.approx(expected))
    assert pw.train_id == -1 and pw.train_got == 0
    stats = pw.stats(T0 + 1.0, None, TH)
    assert stats.rate_mbps == pytest.approx(expected)
    assert pw.stats(T0 + TRAIN_STALE_S + 0.1, None, TH).rate_mbps is None


def test_train_packets_out_of_order() -> None:
    pw = PathWindow("n2/lo", "n1/lo")
    base = 10**18
    for i in (3, 0, 9, 1, 2, 4, 8, 5, 6, 7):
        pw.add_train(5, i, 10, base + i * 100_000, 1400, T0)
    assert pw.last_rate is not None and pw.last_rate[1] == pytest.approx(9 * 1400 * 8 / 0.9e-3 / 1e6)


def test_an_abandoned_train_still_gives_a_rate() -> None:
    pw = PathWindow("n2/lo", "n1/lo")
    _train(pw, 1, 1_000_000, T0, got=5)  # 5 of 10 arrived, 4 intervals of 1/9 ms
    assert pw.last_rate is None
    pw.finish_train(T0 + 0.5)
    assert pw.last_rate is not None
    assert pw.last_rate[1] == pytest.approx(4 * 1400 * 8 / (4e-3 / 9) / 1e6, rel=1e-5)


def test_a_new_train_finishes_the_previous_one() -> None:
    pw = PathWindow("n2/lo", "n1/lo")
    _train(pw, 1, 1_000_000, T0, got=3)
    pw.add_train(2, 0, 10, 10**18, 1400, T0 + 0.5)
    assert pw.last_rate is not None and pw.last_rate[0] == T0 + 0.5
    assert pw.train_id == 2 and pw.train_got == 1


def test_a_single_packet_gives_no_rate() -> None:
    pw = PathWindow("n2/lo", "n1/lo")
    _train(pw, 1, 1_000_000, T0, got=1)
    pw.finish_train(T0)
    assert pw.last_rate is None


def test_rate_drop_is_bad() -> None:
    feed = Feed()
    now = feed.window()
    _train(feed.pw, 1, 1_000_000, now)
    stats, verdict = feed.judge(now)
    assert verdict is not None and not verdict.bad
    assert feed.pw.baseline.rate_mbps == pytest.approx(100.8)
    # A lasting drop: train after train 20x slower, below rate_drop (10 %) of the baseline. (How a single
    # slow train counts is pinned down end to end in test_lens_prober_loopback.)
    for train_id in (2, 3):
        now = feed.window()
        _train(feed.pw, train_id, 20_000_000, now)
        stats, verdict = feed.judge(now)
    assert stats.rate_mbps == pytest.approx(100.8 / 20)
    assert verdict is not None and verdict.bad and verdict.kinds == ("rate",)
    assert verdict.score == 0.6
    assert "train rate 5.0 Mbit/s" in verdict.reasons[0]
    assert feed.pw.baseline.rate_mbps > 0.9 * 100.8  # slow trains do not drag the baseline down


def test_a_moderate_rate_drop_is_fine() -> None:
    feed = Feed()
    now = feed.window()
    _train(feed.pw, 1, 1_000_000, now)
    feed.judge(now)
    now = feed.window()
    _train(feed.pw, 2, 5_000_000, now)  # a fifth of the baseline: above 10 %
    _, verdict = feed.judge(now)
    assert verdict is not None and not verdict.bad


# ----- batch filing (what the Lens receiver does per drain) --------------------------------------


def _mixed_samples(n: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    t = T0 + np.repeat(np.arange(n // 5) * 0.05, 5)  # one filing time per drain of 5 probes
    seq = np.arange(1, n + 1, dtype=np.int64)
    seq[10], seq[11] = seq[11], seq[10]  # reordered
    d = OFFSET_NS + rng.integers(15_000, 40_000, n)
    return t, seq, d


def test_blocks_give_the_same_figures_as_probe_by_probe() -> None:
    t, seq, d = _mixed_samples()
    one, batch = PathWindow("n2/lo", "n1/lo"), PathWindow("n2/lo", "n1/lo")
    batch.session = one.session = SESSION
    for ti, q, di in zip(t.tolist(), seq.tolist(), d.tolist(), strict=True):
        one.add_one(ti, SESSION, q, di)
    for start in range(0, len(t), 5):
        batch.add_block(t[start : start + 5], seq[start : start + 5], d[start : start + 5])
    rtt = np.full(len(t), 50_000, dtype=np.int64)
    for pw in (one, batch):
        pw.add_rtts(t, rtt + np.arange(len(t)))
    now = float(t[-1]) + 0.005
    assert batch.last_seq == one.last_seq == len(t) and batch.last_rx == one.last_rx
    a, b = one.stats(now, OFFSET_NS, TH), batch.stats(now, OFFSET_NS, TH)
    assert a == b
    assert a.received > 0 and a.owd_p50_us is not None and a.jitter_us is not None and a.rtt_min_us is not None


def test_probe_by_probe_then_blocks_keep_arrival_order() -> None:
    """A restart batch is filed probe by probe, later drains as blocks: jitter must see one ordered stream."""
    t, seq, d = _mixed_samples(20)
    ref, mixed = PathWindow("n2/lo", "n1/lo"), PathWindow("n2/lo", "n1/lo")
    for ti, q, di in zip(t.tolist(), seq.tolist(), d.tolist(), strict=True):
        ref.add_one(ti, SESSION, q, di)
    for ti, q, di in zip(t[:7].tolist(), seq[:7].tolist(), d[:7].tolist(), strict=True):
        mixed.add_one(ti, SESSION, q, di)
    mixed.add_block(t[7:], seq[7:], d[7:])
    now = float(t[-1])
    assert ref.stats(now, OFFSET_NS, TH) == mixed.stats(now, OFFSET_NS, TH)


def test_a_session_change_drops_pending_blocks() -> None:
    pw = PathWindow("n2/lo", "n1/lo")
    pw.add_one(T0, SESSION, 1, OFFSET_NS)
    pw.add_block(np.array([T0 + 0.01]), np.array([2]), np.array([OFFSET_NS]))
    pw.add_one(T0 + 0.02, SESSION + 1, 1, OFFSET_NS)  # the sender restarted
    stats = pw.stats(T0 + 0.03, OFFSET_NS, TH)
    assert stats.received == 1 and pw.last_seq == 1


@pytest.mark.parametrize("split", [[47], [10, 37], [1, 1, 45], [20, 27, 5]])
def test_train_runs_match_packet_by_packet(split: list[int]) -> None:
    """47 packets of a train (then 5 of the next, when the split goes past 47), filed in runs."""
    rng = np.random.default_rng(len(split))
    total = sum(split)
    ids = np.array([5] * min(total, 47) + [6] * max(0, total - 47))
    rx = 10**15 + rng.permutation(total).astype(np.int64) * 20_000
    sizes = np.full(total, 1400, dtype=np.int64)
    one, runs = PathWindow("n2/lo", "n1/lo"), PathWindow("n2/lo", "n1/lo")
    for i in range(total):
        one.add_train(int(ids[i]), i, 47, int(rx[i]), 1400, T0)
    start = 0
    for size in split:
        part = slice(start, start + size)
        for train_id in np.unique(ids[part]):  # a run is one train
            sel = np.flatnonzero(ids[part] == train_id) + start
            runs.add_train_run(int(train_id), 47, rx[sel], sizes[sel], T0)
        start += size
    keys = ("train_id", "train_got", "train_bytes", "train_first_ns", "train_last_ns", "last_rate", "prev_rate")
    assert {k: getattr(runs, k) for k in keys} == {k: getattr(one, k) for k in keys}
    assert one.last_rate is not None


def _windows(n: int, shared: bool) -> list[PathWindow]:
    """``n`` paths into n0, each with its own stores, or all in one pair of stores (as the Lens receiver
    keeps them) under slots that are not their positions."""
    if not shared:
        return [PathWindow(f"n{i}/nic0", "n0/nic0") for i in range(n)]
    samples, rtts = Samples(), Samples()
    return [PathWindow(f"n{i}/nic0", "n0/nic0", samples=samples, rtts=rtts, slot=n - 1 - i) for i in range(n)]


@pytest.mark.parametrize("shared", [False, True], ids=["own-stores", "shared-stores"])
def test_window_stats_of_many_paths_match_numpy_on_each_path_alone(shared: bool) -> None:
    """All paths' figures are computed together (grouped arrays); each must be what numpy gives on that
    path's own samples: no sample counted on a neighbour, whatever the mix of paths, and none of a path
    that shares the stores but is not asked about."""
    rng = np.random.default_rng(11)
    n, now = 24, T0
    windows = _windows(n, shared)
    if shared:  # a path in the same stores, never asked about
        stranger = PathWindow("n99/nic0", "n0/nic0", samples=windows[0].samples, rtts=windows[0].rtts, slot=n)
    kept: list[list[tuple[float, int, int]]] = [[] for _ in range(n)]  # (filed, seq, d) per path
    kept_rtt: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    offsets = [None if i % 7 == 3 else float(rng.integers(-50_000_000, 50_000_000)) for i in range(n)]
    rates = [0.0 if i % 2 else float(rng.normal(0, 5e-5)) for i in range(n)]
    next_seq = [1] * n
    for _ in range(12):
        for i, pw in enumerate(windows):
            k = 0 if (i % 11 == 5 and now > T0 + 1) else int(rng.integers(0, 40))  # one path goes silent
            seq = np.arange(next_seq[i], next_seq[i] + k)
            next_seq[i] += k
            if i % 5 == 1 and k > 3:  # reordered and duplicated probes
                seq[[0, 1]], seq[-1] = seq[[1, 0]], seq[-2]
            t = np.sort(now + rng.uniform(0, 0.25, k))
            d = (30_000 + (offsets[i] or 0) + rng.exponential(3_000, k)).astype(np.int64)
            if i % 6 == 2:  # probe by probe, as after a restart
                for ti, q, di in zip(t.tolist(), seq.tolist(), d.tolist(), strict=True):
                    pw.add_one(ti, SESSION, q, di)
            else:
                pw.session = SESSION
                pw.add_block(t, seq, d)
            kept[i] += zip(t.tolist(), seq.tolist(), d.tolist(), strict=True)
            if i % 4 and k:
                rtt = (60_000 + rng.exponential(1_000, k)).astype(np.int64)
                pw.add_rtts(t, rtt)
                kept_rtt[i] += zip(t.tolist(), rtt.tolist(), strict=True)
        if shared:
            stranger.session = SESSION
            stranger.add_block(np.full(5, now), np.arange(5), np.zeros(5, dtype=np.int64))
            stranger.add_rtts(np.full(5, now), np.ones(5, dtype=np.int64))
        now += 0.25
        got = window_stats(windows, now, offsets, rates, TH)
        for i, stats in enumerate(got):
            inside = [s for s in kept[i] if s[0] >= now - TH.window_s]
            seqs = np.array([s[1] for s in inside], dtype=np.int64)
            d = np.array([s[2] for s in inside], dtype=np.int64)
            assert (stats.src, stats.received) == (windows[i].src, len(np.unique(seqs)))
            if len(inside):
                silent = max(0.0, now - windows[i].last_rx - 2 * TH.interval_s)
                newest = int(seqs.max()) + int(silent / TH.interval_s)
                assert stats.sent == max(len(np.unique(seqs)), newest - int(seqs.min()) + 1)
            if len(inside) and offsets[i] is not None:
                age = now - np.array([s[0] for s in inside])
                owd = ((d - round(offsets[i])).astype(np.float64) + rates[i] * age * 1e9) / 1e3  # type: ignore[arg-type]
                want = np.percentile(owd, [0, 50, 99])
                assert [stats.owd_min_us, stats.owd_p50_us, stats.owd_p99_us] == pytest.approx(want, rel=1e-12)
            else:
                assert stats.owd_p50_us is None
            if len(inside) > 1:
                assert stats.jitter_us == pytest.approx(np.mean(np.abs(np.diff(d))) / 1e3, rel=1e-12)
            else:
                assert stats.jitter_us is None
            rtts = [r for t, r in kept_rtt[i] if t >= now - TH.window_s]
            if rtts:
                want_rtt = [min(rtts) / 1e3, float(np.percentile(np.array(rtts) / 1e3, 50))]
                assert [stats.rtt_min_us, stats.rtt_p50_us] == pytest.approx(want_rtt, rel=1e-12)
            else:
                assert stats.rtt_min_us is None
    assert any(s.received == 0 for s in got) and any(s.owd_p50_us is None and s.received for s in got)


def test_blocks_of_many_paths_filed_at_once_match_each_path_filed_alone() -> None:
    """What the Lens receiver does at each evaluation (one interleaved batch of every path into shared
    stores) gives each path the figures, newest probe and newest arrival of filing it alone."""
    rng = np.random.default_rng(5)
    n = 6
    alone, together = _windows(n, shared=False), _windows(n, shared=True)
    t0 = T0
    for _ in range(5):
        k = 60
        position = rng.integers(0, n - 1, k)  # the last path never hears a probe
        t = np.sort(t0 + rng.uniform(0, 0.5, k))
        seq = np.arange(k, dtype=np.int64) + int(t0 * 100)
        d = OFFSET_NS + rng.integers(10_000, 90_000, k)
        for i, pw in enumerate(alone):
            pw.session = SESSION
            mine = position == i
            pw.add_block(t[mine], seq[mine], d[mine])
        slots = np.array([together[i].slot for i in position.tolist()])
        file_blocks(sorted(together, key=lambda pw: pw.slot), t, slots, seq, d)
        t0 += 0.5
    now = t0 + 0.01
    want = window_stats(alone, now, [OFFSET_NS] * n, [0.0] * n, TH)
    assert window_stats(together, now, [OFFSET_NS] * n, [0.0] * n, TH) == want
    assert [(pw.last_seq, pw.last_rx) for pw in together] == [(pw.last_seq, pw.last_rx) for pw in alone]
    assert want[-1].received == 0 and all(s.received > 0 for s in want[:-1])


def test_a_restart_drops_only_that_paths_samples_from_shared_stores() -> None:
    a, b = _windows(2, shared=True)
    for pw in (a, b):
        pw.add_one(T0, SESSION, 1, OFFSET_NS)
        pw.add_block(np.array([T0 + 0.01]), np.array([2]), np.array([OFFSET_NS]))
    a.add_one(T0 + 0.02, SESSION + 1, 1, OFFSET_NS)  # a's sender restarted
    sa, sb = window_stats([a, b], T0 + 0.03, [OFFSET_NS] * 2, [0.0] * 2, TH)
    assert (sa.received, sb.received) == (1, 2) and (a.last_seq, b.last_seq) == (1, 2)


def test_probes_filed_one_by_one_stay_ahead_of_a_later_batch_in_shared_stores() -> None:
    """After a restart the receiver files a batch probe by probe; the next batch goes in at once. Jitter
    must see the path's probes in arrival order, as when every probe is filed one by one."""
    t, seq, d = _mixed_samples(20)
    (mixed,) = _windows(1, shared=True)
    ref = PathWindow(mixed.src, mixed.dst)
    for ti, q, di in zip(t.tolist(), seq.tolist(), d.tolist(), strict=True):
        ref.add_one(ti, SESSION, q, di)
    for ti, q, di in zip(t[:7].tolist(), seq[:7].tolist(), d[:7].tolist(), strict=True):
        mixed.add_one(ti, SESSION, q, di)
    file_blocks([mixed], t[7:], np.zeros(len(t) - 7, dtype=np.int64), seq[7:], d[7:])
    now = float(t[-1])
    assert mixed.stats(now, OFFSET_NS, TH) == ref.stats(now, OFFSET_NS, TH)
