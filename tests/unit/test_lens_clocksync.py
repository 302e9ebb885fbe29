"""Fleet Lens clock sync against synthetic probes whose true clock offsets and drifts are known.

Each emulated node has a :class:`ClockSeam` (offset up to +-50 ms, drift up to +-100 ppm). Probes go
out as coded pairs every 10 ms; each probe's delay is a 10 us floor, plus queueing (a share of probes
wait an exponential time, and in bursts both probes of a pair wait the same, so the pair still looks
pure), plus 1-7 us of Gaussian timestamp jitter per direction. A few first probes get a late transmit
stamp (``d`` too *small*), which breaks the pair's spacing so the pair reads impure. Purity is decided
the way the prober does: receive spacing equals send spacing within 5 us.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from clockwork.contracts.errors import ConfigError
from clockworkd.lens.clockgraph import SuspectTracker, solve_graph
from clockworkd.lens.clockpair import Envelope, PairEstimate, _EnvelopeDesign, estimate_pair
from clockworkd.lens.clockseam import ClockSeam, ClockSeamError, load_seams

START = 1_800_000_000_000_000_000  # real time at the start of a run, ns (today's kernel clocks)
US = 1_000
S = 1_000_000_000
WINDOW_S = 20


def _probes(
    rng: np.random.Generator,
    src: ClockSeam,
    dst: ClockSeam,
    *,
    seconds: float = WINDOW_S,
    start: int = START,
    jitter_us: float = 3.0,
    queued: float = 0.3,
    queue_us: float = 20.0,
    burst: float = 0.1,
    glitch: float = 0.003,
    floor_us: float = 10.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One directed path's coded pairs: (tx of first probe on src's clock, its rx on dst's, pure)."""
    n = int(seconds * 100)  # a pair every 10 ms
    t1 = start + np.arange(n, dtype=np.int64) * 10_000_000 + rng.integers(0, 1_000_000, n)
    t2 = t1 + 20 * US

    def queueing() -> np.ndarray:
        return np.where(rng.random(n) < queued, rng.exponential(queue_us, n), 0.0)

    q1, q2 = queueing(), queueing()
    both = rng.random(n) < burst
    shared = rng.exponential(queue_us, n)
    q1, q2 = np.where(both, shared, q1), np.where(both, shared, q2)
    d1 = floor_us + q1 + rng.normal(0.0, jitter_us, n)
    d2 = floor_us + q2 + rng.normal(0.0, jitter_us, n)
    tx1, tx2 = src.apply_many(t1), src.apply_many(t2)
    late = rng.random(n) < glitch
    tx1 = tx1 + np.where(late, (rng.uniform(20, 60, n) * US).astype(np.int64), 0)
    rx1 = dst.apply_many(t1 + np.rint(d1 * US).astype(np.int64))
    rx2 = dst.apply_many(t2 + np.rint(d2 * US).astype(np.int64))
    pure = np.abs((rx2 - rx1) - (tx2 - tx1)) < 5 * US
    return tx1, rx1, pure


def _random_seam(rng: np.random.Generator) -> ClockSeam:
    return ClockSeam(int(rng.uniform(-50e6, 50e6)), float(rng.uniform(-100, 100)), START)


def _envelope(probes: tuple[np.ndarray, np.ndarray, np.ndarray]) -> Envelope:
    env = Envelope()
    for tx, rx, pure in zip(*(a.tolist() for a in probes), strict=True):  # as the prober files coded pairs
        env.add(tx, rx, pure)
    return env


def _pair_trial(rng: np.random.Generator, a: ClockSeam, b: ClockSeam) -> tuple[PairEstimate, int, float]:
    """Estimate, true offset (clock_b - clock_a) and true drift at the end of a 20 s window."""
    fwd = _probes(rng, a, b, jitter_us=rng.uniform(1, 7), queued=rng.uniform(0.1, 0.6), queue_us=rng.uniform(5, 50))
    rev = _probes(rng, b, a, jitter_us=rng.uniform(1, 7), queued=rng.uniform(0.1, 0.6), queue_us=rng.uniform(5, 50))
    end = START + WINDOW_S * S
    est = estimate_pair(_envelope(fwd).minima(), _envelope(rev).minima(), a.apply(end))
    assert est is not None
    return est, a.truth_offset(b, end), b.drift_ppm - a.drift_ppm


# ----- pairwise estimates --------------------------------------------------------------------------


def test_pairwise_offsets_drift_and_uncertainty_over_many_random_pairs() -> None:
    rng = np.random.default_rng(20260501)
    errors, sigmas, drift_errors = [], [], []
    for _ in range(120):
        est, truth, drift = _pair_trial(rng, _random_seam(rng), _random_seam(rng))
        errors.append(est.offset_ns - truth)
        sigmas.append(est.uncertainty_ns)
        drift_errors.append(est.drift_ppm - drift)
        assert est.floor_ns == pytest.approx(10 * US, abs=8 * US)  # symmetric jitter pulls minima low
    err = np.abs(np.array(errors))
    sig = np.array(sigmas)
    assert np.percentile(err, 99) < 20 * US
    assert np.mean(err < 4 * sig) >= 0.95  # the uncertainty is honest...
    assert np.median(sig) < 5 * US  # ...and not uselessly wide
    assert np.mean(err < sig) >= 0.45  # roughly one sigma: about two thirds within it
    assert np.max(np.abs(drift_errors)) < 2.0


def test_mesh_of_six_nodes_pairwise_and_graph_solution() -> None:
    rng = np.random.default_rng(7)
    names = [f"node{i}" for i in range(6)]
    seams = {n: _random_seam(rng) for n in names}
    end = START + WINDOW_S * S
    edges: dict[tuple[str, str], PairEstimate] = {}
    for a, b in itertools.combinations(names, 2):
        est, truth, drift = _pair_trial(rng, seams[a], seams[b])
        assert abs(est.offset_ns - truth) < 20 * US
        assert abs(est.drift_ppm - drift) < 2.0
        edges[(a, b)] = est
    at = seams["node0"].apply(end)
    sol = solve_graph(edges, "node0", at)
    assert sol.unreachable == ()
    assert sol.suspect_edges == ()
    assert sol.loop_rms_ns is not None and sol.loop_rms_ns < 10 * US
    for n in names:
        truth = seams["node0"].truth_offset(seams[n], end)
        assert abs(sol.offsets_ns[n] - truth) < 10 * US
        assert abs(sol.offsets_ns[n] - truth) < 4 * max(sol.uncertainty_ns[n], 1.0) + 1.0
    assert sol.offsets_ns["node0"] == 0.0 and sol.uncertainty_ns["node0"] == 0.0
    assert sol.relative("node2", "node4") == pytest.approx(sol.offsets_ns["node4"] - sol.offsets_ns["node2"])


def test_offset_extrapolates_with_drift() -> None:
    rng = np.random.default_rng(11)
    a, b = ClockSeam(-30_000_000, 90.0, START), ClockSeam(45_000_000, -95.0, START)
    est, _, _ = _pair_trial(rng, a, b)
    later = START + (WINDOW_S + 10) * S  # 10 s after the window: 1.85 ms more offset from drift
    assert est.offset_at(a.apply(later)) == pytest.approx(a.truth_offset(b, later), abs=20 * US)
    assert est.uncertainty_at(a.apply(later)) > est.uncertainty_ns


def test_pure_flag_keeps_late_transmit_stamps_out() -> None:
    """5 % of first probes stamped 20-60 us late: with the pure flag they cannot drag the envelope down."""
    rng = np.random.default_rng(3)
    a, b = _random_seam(rng), _random_seam(rng)
    fwd = _envelope(_probes(rng, a, b, glitch=0.05, jitter_us=2))
    rev = _envelope(_probes(rng, b, a, glitch=0.0, jitter_us=2))
    end = START + WINDOW_S * S
    truth = a.truth_offset(b, end)
    clean = estimate_pair(fwd.minima(), rev.minima(), a.apply(end))
    dirty = estimate_pair(fwd.minima(pure_only=False), rev.minima(pure_only=False), a.apply(end))
    assert clean is not None and dirty is not None
    assert abs(clean.offset_ns - truth) < 3 * US
    assert abs(dirty.offset_ns - truth) > 5 * US  # what the flag saves us from


def test_too_few_samples_give_none() -> None:
    fwd = [(START + i * S, 50_000 + i) for i in range(3)]
    rev = [(START + i * S, -30_000 + i) for i in range(10)]
    assert estimate_pair(fwd, rev, START) is None
    assert estimate_pair([], rev, START) is None
    assert estimate_pair(rev, [], START) is None
    assert estimate_pair([*fwd, (START + 5 * S, 50_100)], rev, START) is not None


def test_noise_free_envelopes_are_exact() -> None:
    """Straight lines in, exact offset/drift/floor out (the arithmetic at 1.8e18 ns loses nothing)."""
    theta0, rho, floor = 12_345_678, 37e-6, 9_000  # B ahead by 12.3 ms, drifting +37 ppm
    fwd = [(START + k * S // 4, floor + theta0 + round(rho * k * S / 4)) for k in range(80)]
    rev_a_times = [START + k * S // 4 + 1_000 for k in range(80)]
    rev = [(t + theta0 + round(rho * (t - START)), floor - theta0 - round(rho * (t - START))) for t in rev_a_times]
    est = estimate_pair(fwd, rev, START)
    assert est is not None
    assert est.offset_ns == pytest.approx(theta0, abs=5)
    assert est.drift_ppm == pytest.approx(37.0, abs=0.01)
    assert est.floor_ns == pytest.approx(floor, abs=5)
    assert est.samples == 160 and est.forward_samples == est.reverse_samples == 80


# ----- the envelope --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["random", "one_direction_weightless", "no_spread_in_time"])
def test_closed_form_envelope_fit_is_weighted_least_squares(case: str) -> None:
    rng = np.random.default_rng(7)
    tf, tr = np.sort(rng.uniform(-8, 0, 40)), np.sort(rng.uniform(-8, 0, 35))
    yf = 3e7 + 80e3 * tf + rng.normal(0, 900, tf.size) + rng.exponential(5e3, tf.size)
    yr = -3e7 - 80e3 * tr + rng.normal(0, 400, tr.size)
    wf, wr = rng.uniform(0, 2, tf.size), rng.uniform(0, 2, tr.size)
    if case == "one_direction_weightless":
        wr[:] = 0.0
    if case == "no_spread_in_time":
        tf[:], tr[:] = -1.0, -2.0
    x = np.zeros((tf.size + tr.size, 3))
    x[: tf.size, 0], x[tf.size :, 1], x[: tf.size, 2], x[tf.size :, 2] = 1.0, 1.0, tf, -tr
    w = np.concatenate([wf, wr])
    expected = np.linalg.lstsq(x * np.sqrt(w)[:, None], np.concatenate([yf, yr]) * np.sqrt(w), rcond=None)[0]
    np.testing.assert_allclose(_EnvelopeDesign(tf, yf, tr, yr).solve(w), expected, rtol=1e-9, atol=1e-6)


def test_envelope_keeps_sub_window_minima_and_bounded_memory() -> None:
    env = Envelope(window_ns=2 * S, sub_window_ns=S // 4)
    for k in range(1000):  # 10 s of probes at 10 ms
        tx = START + k * 10_000_000
        env.add(tx, tx + 10_000 + (k % 25) * 100, pure=k % 25 != 0)  # lowest d of a sub-window is impure
    assert len(env) <= 9
    mins = env.minima()
    assert len(mins) == 8
    assert [tx for tx, _ in mins] == sorted(tx for tx, _ in mins)
    assert all(d == 10_100 for _, d in mins)  # lowest pure
    assert all(d == 10_000 for _, d in env.minima(pure_only=False))
    env.drop_before(START + 9 * S)
    assert len(env.minima()) == 4
    assert env.samples == 1000


def test_envelope_late_samples_and_clock_steps() -> None:
    env = Envelope(window_ns=2 * S, sub_window_ns=S // 4)
    env.add(START + 10 * S, START + 10 * S + 500)
    env.add(START + 7 * S, START + 7 * S + 100)  # 3 s late: older than the window
    assert env.stale == 1 and env.minima() == [(START + 10 * S, 500)]
    env.add(START + 10 * S + 50, START + 10 * S + 50 + 400)  # newest first, then one a little older
    env.add(START + 10 * S - 100, START + 10 * S - 100 + 300)  # reordered into the sub-window before
    assert env.stale == 1
    assert env.minima() == [(START + 10 * S - 100, 300), (START + 10 * S + 50, 400)]
    env.add(START - 3600 * S, START - 3600 * S + 700)  # sender's clock stepped back an hour
    assert env.resets == 1 and env.minima() == [(START - 3600 * S, 700)]
    with pytest.raises(ValueError):
        Envelope(window_ns=S, sub_window_ns=2 * S)


# ----- the probe graph -----------------------------------------------------------------------------


def _graph(rng: np.random.Generator, n: int, sigma_ns: float = 1_000.0) -> tuple[np.ndarray, dict]:
    truth = rng.uniform(-50e6, 50e6, n)
    truth[0] = 0.0
    edges = {
        (f"n{a}", f"n{b}"): PairEstimate(truth[b] - truth[a] + rng.normal(0, sigma_ns), 0.0, sigma_ns, 160, 10_000.0)
        for a, b in itertools.combinations(range(n), 2)
    }
    return truth, edges


def test_graph_flags_the_corrupted_edge_and_keeps_the_rest() -> None:
    rng = np.random.default_rng(2)
    truth, edges = _graph(rng, 6)
    bad = ("n2", "n4")
    e = edges[bad]
    edges[bad] = PairEstimate(e.offset_ns + 40 * US, 0.0, e.uncertainty_ns, e.samples, e.floor_ns)  # asymmetric path
    sol = solve_graph(edges, "n0")
    assert sol.suspect_edges == (bad,)
    assert sol.suspect_residuals_ns[bad] == pytest.approx(40 * US, abs=5 * US)
    assert bad not in sol.edge_residuals_ns
    for i in range(6):
        assert abs(sol.offsets_ns[f"n{i}"] - truth[i]) < 4 * US
    assert sol.reduced_chi2 is not None and sol.reduced_chi2 < 3
    # without the snooping every edge of the bad one's loops would look bad, and nodes would move
    raw = solve_graph(edges, "n0", suspect_sigma=float("inf"))
    assert raw.suspect_edges == ()
    assert raw.reduced_chi2 is not None and raw.reduced_chi2 > 10
    assert raw.uncertainty_ns["n3"] > sol.uncertainty_ns["n3"]  # inflated by the misfit


def test_persistent_suspects_need_repeated_flags() -> None:
    rng = np.random.default_rng(4)
    tracker = SuspectTracker(need=3, of=5)
    flagged: tuple = ()
    for round_ in range(5):
        _, edges = _graph(rng, 5)
        e = edges[("n1", "n3")]
        if round_ != 1:  # one clean solve in between does not clear it
            edges[("n1", "n3")] = PairEstimate(e.offset_ns - 30 * US, 0.0, e.uncertainty_ns, 1, 1.0)
        flagged = tracker.update(solve_graph(edges, "n0"))
        if round_ < 3:
            assert flagged == ()
    assert flagged == (("n1", "n3"),)


def test_unreachable_nodes_are_reported_not_zeroed() -> None:
    est = PairEstimate(1_000.0, 0.0, 100.0, 10, 10_000.0)
    edges = {("a", "b"): est, ("b", "c"): est, ("x", "y"): est}
    sol = solve_graph(edges, "a", nodes=["a", "b", "c", "x", "y", "lonely"])
    assert sol.unreachable == ("lonely", "x", "y")
    assert set(sol.offsets_ns) == {"a", "b", "c"}
    assert sol.offsets_ns["c"] == pytest.approx(2_000.0)
    assert sol.uncertainty_ns["c"] == pytest.approx(100.0 * 2**0.5)
    assert sol.loop_rms_ns is None and sol.reduced_chi2 is None  # a tree: nothing to cross-check
    alone = solve_graph({}, "a", nodes=["b"])
    assert alone.offsets_ns == {"a": 0.0} and alone.unreachable == ("b",)
    with pytest.raises(ValueError):
        solve_graph({("a", "a"): est}, "a")


def test_graph_uses_drift_at_the_requested_time() -> None:
    est = PairEstimate(1_000.0, 50.0, 100.0, 10, 10_000.0, at_ns=START, drift_uncertainty_ppm=0.1)
    sol = solve_graph({("a", "b"): est}, "a", START + S)
    assert sol.offsets_ns["b"] == pytest.approx(1_000.0 + 50_000.0)
    assert sol.uncertainty_ns["b"] == pytest.approx((100.0**2 + 100.0**2) ** 0.5)


def test_graph_of_a_thousand_nodes() -> None:
    rng = np.random.default_rng(9)
    n = 1000
    truth = rng.uniform(-50e6, 50e6, n)
    truth[0] = 0.0
    edges = {}
    for a in range(n):
        for b in rng.choice(n, 6, replace=False):
            if a != b and (f"n{b}", f"n{a}") not in edges:
                sigma = float(rng.uniform(300, 3_000))
                edges[(f"n{a}", f"n{b}")] = PairEstimate(truth[b] - truth[a] + rng.normal(0, sigma), 0.0, sigma, 1, 1.0)
    sol = solve_graph(edges, "n0")
    err = np.array([sol.offsets_ns[f"n{i}"] - truth[i] for i in range(n)])
    sig = np.array([sol.uncertainty_ns[f"n{i}"] for i in range(1, n)])
    assert np.percentile(np.abs(err), 99) < 4 * US
    assert np.mean(np.abs(err[1:]) < 3 * sig) > 0.95
    assert sol.reduced_chi2 == pytest.approx(1.0, abs=0.2)


# ----- clock seams ---------------------------------------------------------------------------------


def test_clock_seam_arithmetic() -> None:
    seam = ClockSeam(offset_ns=12_500, drift_ppm=-40.0, epoch_ns=START)
    assert seam.apply(START) == START + 12_500
    assert seam.apply(START + 10 * S) == START + 10 * S + 12_500 - 400_000
    other = ClockSeam(offset_ns=-1_000, drift_ppm=60.0, epoch_ns=START)
    assert seam.truth_offset(other, START + S) == (-1_000 + 60_000) - (12_500 - 40_000)
    t = START + np.arange(0, 10 * S, 123_456_789, dtype=np.int64)
    assert seam.apply_many(t).tolist() == [seam.apply(int(x)) for x in t]


def _write(tmp_path: Path, data: object) -> Path:
    p = tmp_path / "seams.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_load_seams(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        {"epoch_ns": START, "nodes": {"node1": {"offset_us": 12.5, "drift_ppm": -40}, "node2": {"drift_ppm": 3}}},
    )
    seams = load_seams(p)
    assert seams == {
        "node1": ClockSeam(12_500, -40.0, START),
        "node2": ClockSeam(0, 3.0, START),
    }


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON"),
        ([], "JSON object"),
        ({"nodes": {}}, "missing key 'epoch_ns'"),
        ({"epoch_ns": 1, "nodes": {}, "extra": 1}, "unknown key 'extra'"),
        ({"epoch_ns": "1", "nodes": {}}, "epoch_ns"),
        ({"epoch_ns": 1.5, "nodes": {}}, "epoch_ns"),
        ({"epoch_ns": 1, "nodes": []}, "nodes"),
        ({"epoch_ns": 1, "nodes": {"n1": 5}}, "nodes.n1"),
        ({"epoch_ns": 1, "nodes": {"n1": {"offset_ns": 5}}}, "nodes.n1: unknown key 'offset_ns'"),
        ({"epoch_ns": 1, "nodes": {"n1": {"drift_ppm": "fast"}}}, "nodes.n1.drift_ppm"),
        ({"epoch_ns": 1, "nodes": {"n1": {"drift_ppm": True}}}, "nodes.n1.drift_ppm"),
        ({"epoch_ns": 1, "nodes": {"n1": {"drift_ppm": 1e6}}}, "nodes.n1.drift_ppm"),
        ({"epoch_ns": 1, "nodes": {"n1": {"offset_us": 1e12}}}, "nodes.n1.offset_us"),
    ],
)
def test_load_seams_errors_name_file_and_key(tmp_path: Path, content: object, needle: str) -> None:
    p = _write(tmp_path, content)
    with pytest.raises(ClockSeamError) as info:
        load_seams(p)
    assert str(p) in str(info.value)
    assert needle in str(info.value)
    assert isinstance(info.value, ConfigError) and info.value.exit_code == 2


def test_load_seams_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ClockSeamError, match="cannot read"):
        load_seams(tmp_path / "nope.json")
