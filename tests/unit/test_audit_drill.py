"""The drill's wait for fail-back: it waits out LinkPass's hold-down (flap damping) and a slow recovery of the
path instead of failing the node, and fails a path that never comes back or a route that does not follow it.

The route is scripted here (``route_device`` replaced) and the drill's clock is a fake one that moves only
when the drill sleeps, so the times it reports are exact however loaded the machine: what is tested is when
the wait ends and what it reports; the sandbox audit test drills real NICs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from clockwork.audit import drill

STEP_S = 0.02  # the drill's sleep between two looks at the route


class _Clock:
    """The drill's ``time``: it stands still but for the drill's sleeps (whole nanoseconds: no rounding drift)."""

    def __init__(self) -> None:
        self.ns = 0

    def monotonic(self) -> float:
        return self.ns / 1e9

    def sleep(self, seconds: float) -> None:
        self.ns += round(seconds * 1e9)


def _scripted(monkeypatch: pytest.MonkeyPatch, back_after_s: float | None) -> Callable[[], float]:
    """Traffic is routed through nic0 again ``back_after_s`` after the wait starts (never when None); returns
    the drill's clock, which reads 0 when the wait starts."""
    clock = _Clock()
    monkeypatch.setattr(drill, "time", clock)
    monkeypatch.setattr(
        drill,
        "route_device",
        lambda dst, src: "nic0" if back_after_s is not None and clock.monotonic() >= back_after_s else "nic1",
    )
    monkeypatch.setattr(drill, "ROUTE_GRACE_S", 0.3)
    monkeypatch.setattr(drill, "HOLDDOWN_WAIT_MAX_S", 1.5)
    return clock.monotonic


def test_traffic_back_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, 0.1)
    back, state = drill._failback("10.0.0.2", "10.0.0.1", "nic0", 1.0, lambda: "alive")
    assert back is not None and 0.1 <= back <= 0.1 + STEP_S and state is None  # once the route came back (0.1 s)


def test_a_hold_down_longer_than_the_timeout_is_waited_out(monkeypatch: pytest.MonkeyPatch) -> None:
    elapsed = _scripted(monkeypatch, 0.8)
    back, state = drill._failback(
        "10.0.0.2", "10.0.0.1", "nic0", 0.3, lambda: "holddown" if elapsed() < 0.7 else "alive"
    )
    assert back is not None and 0.8 <= back <= 0.8 + STEP_S and state is None  # past the timeout, at the route


def test_a_hold_down_without_end_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, None)
    back, state = drill._failback("10.0.0.2", "10.0.0.1", "nic0", 0.3, lambda: "holddown")
    assert back is None and state == "holddown"


def test_an_alive_path_whose_route_never_comes_back_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _scripted(monkeypatch, None)
    asked: list[float] = []
    back, state = drill._failback("10.0.0.2", "10.0.0.1", "nic0", 0.3, lambda: asked.append(clock()) or "alive")
    assert back is None and state == "alive"
    # past the timeout, the grace for LinkPass's next evaluation, and no more
    assert 0.3 + 0.3 <= asked[-1] <= 0.3 + 0.3 + STEP_S, asked


def test_a_path_still_dead_at_the_timeout_is_waited_for_while_linkpass_converges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A busy daemon may not yet have heard the peer on the NIC again when the timeout passes (or may not
    answer for its state): that is not a fault while LinkPass brings the path back before the cap."""
    elapsed = _scripted(monkeypatch, 0.9)
    states = iter(["dead: no heartbeat on nic0 for 50 ms", None])
    back, state = drill._failback(
        "10.0.0.2", "10.0.0.1", "nic0", 0.3, lambda: next(states, "holddown" if elapsed() < 0.8 else "alive")
    )
    assert back is not None and 0.9 <= back <= 0.9 + STEP_S and state is None  # past the timeout, at the route


def test_a_path_that_stays_dead_is_reported_dead_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _scripted(monkeypatch, None)
    asked: list[float] = []
    back, state = drill._failback(
        "10.0.0.2", "10.0.0.1", "nic0", 0.3, lambda: asked.append(clock()) or "dead: nic0 down"
    )
    assert back is None and state == "dead: nic0 down"
    # waited to the cap (HOLDDOWN_WAIT_MAX_S past the timeout), and no more
    assert 0.3 + 1.5 <= asked[-1] <= 0.3 + 1.5 + STEP_S, asked
