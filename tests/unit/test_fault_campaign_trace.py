"""The fault campaign's trace and figures (``bench/support/fault_trace.py``), without a job: the same seed gives the
same trace, every fault falls in its own window, caps hold, every kind shows before any repeats, Young/Daly's
interval, and the per-fault figures read from step logs (time to full width, recomputed steps, YOCO)."""

from __future__ import annotations

import itertools
import math

import pytest

from bench.support.fault_trace import (
    QUICK_KINDS,
    Fault,
    FaultKind,
    checkpoint_every_steps,
    make_trace,
    outcomes,
    percentile,
    poisson_trace,
    recomputed_total,
    summary,
    young_daly_interval_s,
)


def test_same_seed_same_trace_and_another_seed_another() -> None:
    a = make_trace(7, 10, 100.0, 3)
    assert a == make_trace(7, 10, 100.0, 3)
    assert a != make_trace(8, 10, 100.0, 3)


@pytest.mark.parametrize("seed", range(50))
def test_one_fault_per_window_inside_its_middle(seed: int) -> None:
    trace = make_trace(seed, 12, 60.0, 4)
    window = 60.0 / 12
    for i, fault in enumerate(trace):
        assert i * window + 0.2 * window - 1e-3 <= fault.at_s <= i * window + 0.8 * window + 1e-3
        assert 0 <= fault.slot < 4


@pytest.mark.parametrize("seed", range(50))
def test_every_kind_before_repeats_and_caps_hold(seed: int) -> None:
    trace = make_trace(seed, 14, 100.0, 3, caps={FaultKind.NODE_CRASH: 2})
    first = [f.kind for f in trace[: len(QUICK_KINDS)]]
    assert sorted(k.value for k in first) == sorted(k.value for k in QUICK_KINDS)
    assert sum(f.kind is FaultKind.NODE_CRASH for f in trace) <= 2


def test_quick_trace_of_four_with_one_crash() -> None:
    trace = make_trace(1, 4, 20.0, 3, caps={FaultKind.NODE_CRASH: 1})
    assert len(trace) == 4 and len({f.kind for f in trace}) == 4
    assert all(f.hold_s >= 0 for f in trace)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        make_trace(1, 0, 10.0, 3)
    with pytest.raises(ValueError):
        make_trace(1, 3, 10.0, 3, kinds=[FaultKind.NODE_CRASH], caps={FaultKind.NODE_CRASH: 1})


@pytest.mark.parametrize("seed", range(30))
def test_poisson_trace_gaps_caps_and_duration(seed: int) -> None:
    trace = poisson_trace(seed, 600.0, 8.0, 3, caps={FaultKind.NODE_CRASH: 2}, min_gap_s=3.0)
    assert trace == poisson_trace(seed, 600.0, 8.0, 3, caps={FaultKind.NODE_CRASH: 2}, min_gap_s=3.0)
    times = [f.at_s for f in trace]
    assert all(b - a >= 3.0 - 1e-3 for a, b in itertools.pairwise(times)) and times[-1] < 600.0
    assert sum(f.kind is FaultKind.NODE_CRASH for f in trace) <= 2
    assert 600.0 / 8.0 * 0.6 < len(trace) < 600.0 / 3.0  # about one per mean gap (floored at 3 s)


def test_young_daly() -> None:
    assert young_daly_interval_s(0.5, 100.0) == pytest.approx(10.0)
    assert checkpoint_every_steps(0.5, 100.0, 0.1) == 100
    assert checkpoint_every_steps(0.0, 100.0, 0.1) == 1
    with pytest.raises(ValueError):
        young_daly_interval_s(1.0, 0.0)


def _log(steps: list[int], t0: float = 0.0, dt: float = 1.0) -> list[tuple[int, float]]:
    return [(s, t0 + i * dt) for i, s in enumerate(steps)]


def test_outcomes_no_recompute_and_full_width() -> None:
    fault = Fault(at_s=2.5, kind=FaultKind.NODE_STOP, slot=0)
    logs = {0: _log([0, 1, 2, 3, 4, 5]), 1: _log([0, 1, 2, 3, 4, 5])}
    (out,) = outcomes(logs, [(fault, 2.5)])
    assert out.recomputed == 0 and out.full_width_s == pytest.approx(1.5)  # steps begun at 3 and 4: done at 4
    assert summary([out])["yoco_rate"] == 1.0


def test_outcomes_restart_recomputes_since_the_checkpoint() -> None:
    crash = Fault(at_s=4.5, kind=FaultKind.RANK_KILL, slot=1)
    stop = Fault(at_s=20.0, kind=FaultKind.NODE_STOP, slot=0)
    steps = [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]  # checkpoint after step 1: steps 2..4 again after the crash
    logs = {0: _log(steps), 1: _log(steps)}
    first, second = outcomes(logs, [(stop, 20.0), (crash, 4.5)])
    assert first.fault is crash and first.recomputed == 3
    assert second.full_width_s is None  # nothing after t = 20: never back
    assert recomputed_total(logs) == 3
    s = summary([first, second])
    assert s["yoco_rate"] == 0.0 and s["never_full_width"] == 1


def test_full_width_waits_for_the_stalled_slot_to_resume() -> None:
    """A crash injected while the ranks still stepped: the survivors begin two more steps, then every slot stalls
    until the replacement's first step at t = 7.9. Full width is that resume (5.5 s after the fault), not the two
    steps begun before the crash took effect."""
    crash = Fault(at_s=2.4, kind=FaultKind.NODE_CRASH, slot=1)
    normal = [(s, s * 0.1) for s in range(30)]  # 0.1 s steps up to t = 2.9
    resumed = [(s, 7.9 + (s - 29) * 0.1) for s in range(29, 40)]  # the step in flight (29) again, from t = 7.9
    logs = {0: normal + resumed, 1: normal[:26] + resumed}
    (out,) = outcomes(logs, [(crash, 2.4)])
    assert out.full_width_s == pytest.approx(5.5)
    assert out.recomputed == 1


def test_a_stall_that_the_next_fault_caused_is_not_this_ones() -> None:
    """A node stop (no stall here), then 2 s later a kill restarts the whole job: the restart's gap, which begins at
    the last step before the kill, is the kill's, not the stop's."""
    stop = Fault(at_s=1.0, kind=FaultKind.NODE_STOP, slot=0)
    kill = Fault(at_s=3.05, kind=FaultKind.RANK_KILL, slot=1)
    log = [(s, s * 0.1) for s in range(31)] + [(s, 10.0 + (s - 24) * 0.1) for s in range(24, 40)]
    first, second = outcomes({0: log, 1: log}, [(stop, 1.0), (kill, 3.05)])
    assert first.full_width_s == pytest.approx(0.2) and first.recomputed == 0
    assert second.full_width_s == pytest.approx(6.95) and second.recomputed == 7


def test_a_hiccup_long_after_the_last_fault_is_not_its_stall() -> None:
    """What stopped a soak: a NIC down (held 2 s) that the job trained through, then a 75 ms hiccup 15 s later with
    no fault after it. The NIC down's time to full width is its slots' next steps, not the hiccup's end."""
    nic = Fault(at_s=89.0, kind=FaultKind.NIC_DOWN, slot=1, hold_s=2.0)
    log = [(s, s * 0.0115) for s in range(9050)] + [(s, 104.2 + (s - 9050) * 0.0115) for s in range(9050, 9500)]
    (out,) = outcomes({0: log, 1: log}, [(nic, 89.0)])
    assert out.full_width_s is not None and out.full_width_s < 0.05 and out.recomputed == 0
    # the same hiccup while the NIC is still down (1 s after the fault) is the fault's
    late = [(s, t) for s, t in log if t < 90.0] + [(s, 90.075 + (s - 7827) * 0.0115) for s in range(7827, 8000)]
    (held,) = outcomes({0: late}, [(nic, 89.0)])
    assert held.full_width_s == pytest.approx(1.075, abs=0.02)


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile([3.0], 99) == 3.0
    assert math.isclose(percentile([1.0, 2.0], 100), 2.0)
