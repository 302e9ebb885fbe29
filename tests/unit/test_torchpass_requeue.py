"""The last line of defence (torchpass.launch.requeue): which failures a Slurm requeue is asked for, and how the
job's report and AdminComment say which way it went.

The decision lists a real snapshot folder (manifests written by the store's own writer); ``scontrol`` is the
sandbox's job (tests/integration/test_snapshot_sandbox.py requeues a real job); here only its answers are fed in.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from clockwork.contracts.coordinator_wire import FailureKind
from clockwork.contracts.snapshots.store import FORMAT, snapshot_path, write_manifest
from slurm_hooks import report
from torchpass.config import TorchPassConfig
from torchpass.launch.requeue import decide, requeue


def _config(tmp_path: Path, **settings: Any) -> TorchPassConfig:
    return TorchPassConfig(snapshot_dir=str(tmp_path / "snaps-{job}"), **settings)


def _snapshot(tmp_path: Path, step: int, *, complete: bool = True) -> Path:
    folder = snapshot_path(tmp_path / "snaps-42", step)
    folder.mkdir(parents=True)
    if complete:
        write_manifest(folder, {"format": FORMAT, "step": step})
    return folder


ENV = {"SLURM_JOB_ID": "42"}


@pytest.mark.parametrize("kind", [FailureKind.CAPACITY, FailureKind.STATE_LOST])
def test_a_loss_new_nodes_can_undo_is_requeued_to_the_newest_complete_snapshot(
    tmp_path: Path, kind: FailureKind
) -> None:
    _snapshot(tmp_path, 10)
    newest = _snapshot(tmp_path, 20)
    _snapshot(tmp_path, 30, complete=False)  # being written when the job failed: never restored
    decision = decide(kind, _config(tmp_path), ENV)
    assert decision.requeue and decision.step == 20 and decision.snapshot == str(newest), decision
    assert decision.fields() == {"why": decision.why, "snapshot": str(newest), "step": 20}


@pytest.mark.parametrize(
    ("kind", "settings", "env", "said"),
    [
        (FailureKind.SCRIPT, {}, ENV, "a script failure: a requeued job would fail the same way"),
        (FailureKind.LIMIT, {}, ENV, "a limit failure"),
        (FailureKind.CAPACITY, {"requeue_on_loss": False}, ENV, "requeue_on_loss is off"),
        (FailureKind.CAPACITY, {}, {}, "not a Slurm job"),
        (FailureKind.CAPACITY, {}, {**ENV, "SLURM_RESTART_COUNT": "3"}, "requeued 3 time(s) already (max_requeues=3)"),
        (FailureKind.CAPACITY, {"max_requeues": 0}, ENV, "max_requeues=0"),
        (FailureKind.CAPACITY, {"restore": "never"}, ENV, "restore='never'"),
    ],
)
def test_failures_a_requeue_cannot_undo_end_the_job(
    tmp_path: Path, kind: FailureKind, settings: dict[str, Any], env: dict[str, str], said: str
) -> None:
    _snapshot(tmp_path, 20)
    decision = decide(kind, _config(tmp_path, **settings), env)
    assert not decision.requeue and said in decision.why, decision


def test_without_a_complete_snapshot_the_job_is_not_started_over(tmp_path: Path) -> None:
    _snapshot(tmp_path, 20, complete=False)
    decision = decide(FailureKind.STATE_LOST, _config(tmp_path), ENV)
    assert not decision.requeue and "no complete snapshot in" in decision.why and "start over" in decision.why


def test_scontrol_s_refusal_is_reported_in_its_own_words() -> None:
    calls: list[list[str]] = []

    def refused(argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", "Requested operation is presently disabled for job 42\n")

    def accepted(argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, "", "")

    def missing(argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(2, "No such file or directory", "scontrol")

    assert requeue("42", refused) == "scontrol requeue 42: Requested operation is presently disabled for job 42"
    assert calls == [["scontrol", "requeue", "42"]]
    assert requeue("42", accepted) == ""
    assert "No such file or directory" in requeue("42", missing)


def _ended(kind: str, why: str) -> list[dict[str, Any]]:
    return [
        {"kind": "torchpass.failed", "fields": {"reason": "no spare", "cause": "capacity"}},
        {"kind": kind, "fields": {"why": why}},
    ]


def test_the_admin_comment_says_which_way_the_job_went(tmp_path: Path) -> None:
    counts = {label: 0 for label in report.COUNTED.values()}
    requeued = {"counts": counts, "ending": report.ending(_ended("torchpass.requeued", "requeued to restore step 40"))}
    line = report.summary(requeued, tmp_path / "42.json")
    assert "; requeued: requeued to restore step 40; report=" in line
    refused = report.ending(
        _ended("torchpass.not_requeued", "no complete snapshot in /s; a requeued job would start over")
    )
    line = report.summary({"counts": counts, "ending": refused + " " + "x" * 300}, tmp_path / "42.json")
    said = line.split("; not requeued: ", 1)[1].split("; report=")[0]
    assert said.startswith("no complete snapshot in /s, a requeued") and len(said) < report.ENDING_MAX_CHARS
    assert report.ending([{"kind": "torchpass.migrated", "fields": {}}]) == ""


def test_a_requeued_job_s_earlier_reports_are_kept(tmp_path: Path) -> None:
    first = report.write({"job_id": 42, "run": 1}, tmp_path)
    report.write({"job_id": 42, "run": 2}, tmp_path)
    report.write({"job_id": 42, "run": 3}, tmp_path)
    assert first == tmp_path / "42.json" and '"run": 3' in first.read_text()
    assert '"run": 1' in (tmp_path / "42.1.json").read_text() and '"run": 2' in (tmp_path / "42.2.json").read_text()
