"""The budgets checked at start, on real local jobs (``torchpass run --local``): pure FSDP (1 x 4, peer copies on)
with a snapshot every 4 steps, under a site quota of 1 KiB on snapshots (the admin's ``[snapshots] quota``, read
from ``$CLOCKWORK_CONFIG`` as on a cluster).

* ``budget_policy = refuse`` (the default): the job stops before its first step, with the shortfall, its numbers and
  the settings to change in its failure reason and output; no rank committed a step, nothing was written;
* ``budget_policy = degrade``: the job trains without snapshots, with a warning, and keeps its peer copies; a rank
  killed mid-run is replaced by a spare that takes the job's verdict from the survivors (it writes no snapshot
  either), and every slot ends bitwise equal.

The rank script is tests/unit/test_torchpass_fsdp.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.local_jobs import assert_bitwise_equal, load_final
from tests.unit.test_torchpass_fsdp import NPROC, STEPS, _run

SETTINGS = ("snapshot_every_steps=4", "snapshot_dir={dir}/{{job}}")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The admin's clockwork.toml with a snapshot quota far too small for any snapshot."""
    path = tmp_path / "clockwork.toml"
    path.write_text('[snapshots]\nquota = "1K"\n')
    monkeypatch.setenv("CLOCKWORK_CONFIG", str(path))
    return tmp_path


def _settings(base: Path, *more: str) -> tuple[str, ...]:
    return (*(s.format(dir=base / "snapshots") for s in SETTINGS), *more)


def test_a_job_over_its_snapshot_quota_is_refused_before_its_first_step(site: Path) -> None:
    run = _run(site, "refused", mesh="1x4", settings=_settings(site))
    assert run.returncode != 0
    (budget,) = run.logged("torchpass.budget")
    assert budget["verdict"] == "refused" and budget["off"] == [], budget
    (line,) = budget["shortfalls"]
    assert line.startswith("snapshots: ") and "needed, 1.00 KiB available under the snapshot quota" in line, line
    assert "lower snapshot_keep, or raise snapshot_quota" in line, line
    reasons = [f["reason"] for f in run.of_kind("torchpass.failed")]
    assert reasons and "budgets do not fit, so it stops before its first step" in reasons[0], run.output[-4000:]
    assert line in reasons[0], reasons[0]
    print(f"refused: {reasons[0]}")
    assert not list(site.glob("refused/journal-slot*")), "a rank committed a step"
    assert not (site / "snapshots").exists()


def test_degrade_trains_without_snapshots_and_a_newcomer_keeps_to_it(site: Path) -> None:
    kill = f"2:{STEPS // 2}:reducescatter:1"
    run = _run(
        site, "degraded", mesh="1x4", kill=kill, after_copy=True, settings=_settings(site, "budget_policy=degrade")
    )
    run.check_ok()
    (budget,) = run.logged("torchpass.budget")
    assert budget["verdict"] == "degraded" and budget["off"] == ["snapshots"], budget
    warned = [line for line in run.output.splitlines() if "WARNING" in line and "training without snapshots" in line]
    assert warned, run.output[-4000:]
    assert (run.out / ("killed-" + kill.replace(":", "-"))).exists()
    assert [f["slots"] for f in run.of_kind("torchpass.recovered")] == [[2]]
    assert not (site / "snapshots").exists(), sorted(p.name for p in (site / "snapshots").rglob("*"))
    assert run.logged("torchpass.peer_ring"), "peer copies were switched off too"
    expected = load_final(run.out, 0)
    assert expected["committed"] == STEPS - 1
    for slot in range(1, NPROC):
        assert_bitwise_equal(load_final(run.out, slot), expected, f"slot {slot}")


def test_a_job_that_fits_trains_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "clockwork.toml"
    path.write_text('[snapshots]\nquota = "10G"\n')
    monkeypatch.setenv("CLOCKWORK_CONFIG", str(path))
    # Each rank's shard is staged through a 16 KiB arena, a window at a time: that is what the budget counts.
    run = _run(tmp_path, "fits", mesh="1x4", settings=_settings(tmp_path, "snapshot_arena_max=16K"))
    run.check_ok()
    (budget,) = run.logged("torchpass.budget")
    assert budget["verdict"] == "fits" and not budget["shortfalls"], budget
    (node,) = budget["nodes"].values()
    assert node["ranks"] == NPROC and node["staging"] == NPROC * 16384 and node["peer_copies"] > 0, budget
    assert budget["snapshots"]["per_snapshot"] > NPROC * 16384, budget
    assert run.complete_snapshots(tmp_path / "snapshots" / "local", [3, 7, 11])
