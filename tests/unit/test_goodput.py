"""``clockwork simulate``'s model: the published anchors, Daly's formula against a Monte Carlo of the same
process, TorchPass's limits, and the command itself (in-process)."""

from __future__ import annotations

import json
import random

import pytest

from clockwork.cli.goodput import PUBLISHED_MTTF, GoodputInputs, daly_wall_hours, mttf_hours, simulate
from clockwork.cli.main import run


def test_mttf_passes_through_the_published_points_and_falls_with_scale() -> None:
    for gpus, mttf in PUBLISHED_MTTF:
        assert mttf_hours(gpus) == pytest.approx(mttf)
    values = [mttf_hours(n) for n in (512, 1024, 4096, 16384, 32768)]
    assert values == sorted(values, reverse=True)
    with pytest.raises(ValueError, match="gpus"):
        mttf_hours(0)


def _monte_carlo(work: float, mttf: float, tau: float, delta: float, restart: float, runs: int) -> float:
    """The process Daly models: segments of tau work + delta checkpoint must each run uninterrupted; a failure
    loses the segment so far and costs a restart, which a failure may also interrupt."""
    rng = random.Random(7)
    total = 0.0
    segments = round(work / tau)
    for _ in range(runs):
        clock = 0.0
        for _ in range(segments):
            while True:
                failure = rng.expovariate(1 / mttf)
                if failure >= tau + delta:
                    clock += tau + delta
                    break
                clock += failure
                while (failure := rng.expovariate(1 / mttf)) < restart:  # the restart itself may fail
                    clock += failure
                clock += restart
        total += clock
    return total / runs


@pytest.mark.parametrize(("mttf", "tau", "delta", "restart"), [(8.0, 0.5, 0.02, 0.2), (1.5, 0.25, 0.05, 0.5)])
def test_daly_matches_a_monte_carlo_of_the_same_process(mttf: float, tau: float, delta: float, restart: float) -> None:
    expected = daly_wall_hours(40.0, mttf, tau, delta, restart)
    simulated = _monte_carlo(40.0, mttf, tau, delta, restart, runs=400)
    assert simulated == pytest.approx(expected, rel=0.03)
    assert expected > 40.0 * (1 + delta / tau)  # failures cost something beyond the checkpoints


def test_torchpass_limits() -> None:
    ideal = simulate(GoodputInputs(gpus=1024, torchpass_recovery_s=0, step_s=0, live_fraction=1.0))
    assert ideal.torchpass_wall_h == pytest.approx(720 * (1 + (60 / 3600) / 0.5))  # only the checkpoints left
    none_live = simulate(GoodputInputs(gpus=1024, live_fraction=0.0))
    assert none_live.torchpass_wall_h == pytest.approx(none_live.ckpt_wall_h)  # no live repair: the same
    default = simulate(GoodputInputs(gpus=16384))
    assert default.torchpass_wall_h < default.ckpt_wall_h and default.torchpass_goodput > default.ckpt_goodput
    with pytest.raises(ValueError, match="live_fraction"):
        simulate(GoodputInputs(gpus=8, live_fraction=1.5))


def test_simulate_command_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["simulate", "--json", "--gpus", "1024", "--gpus", "16384"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["gpus"] for r in doc["results"]] == [1024, 16384]
    assert doc["results"][0]["mttf_h"] == 7.9 and doc["results"][1]["mttf_h"] == 1.8
    assert all(r["torchpass_goodput"] > r["checkpoint_restart_goodput"] for r in doc["results"])
    assert any("Kokolis" in s for s in doc["sources"]) and any("Daly" in s for s in doc["sources"])
    assert run(["simulate"]) == 0
    out = capsys.readouterr().out
    assert "16384" in out and "Sources:" in out and "Kokolis" in out
    assert run(["simulate", "--live-fraction", "2"]) == 2
    assert "--live-fraction" in capsys.readouterr().err
