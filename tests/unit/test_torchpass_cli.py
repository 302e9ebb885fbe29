"""``torchpass run``'s command line: an option it does not know before the script is an error at once, with the
nearest known option named, and nothing is started (locally, in a batch script, or in a node's job step).

Each path runs the real command in-process (:func:`torchpass.cli.main`, the console script's entry point) with
whatever would start processes replaced by a recorder; the same call with a valid command line reaches the
recorder, so a test that finds it untouched means the command stopped before it.
"""

from __future__ import annotations

from typing import Any

import pytest

from torchpass.cli import main as cli_main

BATCH_ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n1"}
STEP_ENV = {**BATCH_ENV, "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "3"}


class Started(Exception):
    """Raised by a recorder in place of starting processes: the command got that far."""


@pytest.fixture
def no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "SLURM_STEPID",
        "SLURM_PROCID",
        "CLOCKWORK_FT",
        "SLURM_SPANK_CLOCKWORK_FT",
    ):
        monkeypatch.delenv(name, raising=False)


def _record(monkeypatch: pytest.MonkeyPatch, target: str) -> list[Any]:
    calls: list[Any] = []

    def recorder(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        raise Started(target)

    monkeypatch.setattr(target, recorder)
    return calls


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "nothing was started" in err and "Usage: torchpass run" in err
    return err


def _refused_plain(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli_main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.usefixtures("no_slurm")
def test_local_run_refuses_an_unknown_option_before_the_script(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _record(monkeypatch, "torchpass.launch.launcher.LocalLauncher.__init__")
    err = _refused(capsys, ["run", "--local", "--sparse", "1", "train.py"])
    assert "unknown option --sparse before the script (did you mean --spares?)" in err
    err = _refused(capsys, ["run", "--local", "--nnodes=2", "train.py"])  # torchrun's: say what to do instead
    assert "--nnodes is torchrun's" in err and "sbatch -N" in err
    err = _refused(capsys, ["run", "--frobnicate", "--local", "train.py"])  # nothing close: list what there is
    assert "unknown option --frobnicate" in err and "--spares" in err and "--local" in err
    assert calls == []
    # The control: a valid command line reaches the launcher; the script's own options pass through untouched.
    with pytest.raises(Started):
        cli_main(["run", "--local", "--spares", "1", "--set", "zygote=false", "train.py", "--sparse", "--lr=3"])
    (args, kwargs) = calls[0]
    assert args[1:] == ("train.py", ["--sparse", "--lr=3"]) and kwargs["spares"] == 1
    with pytest.raises(Started):  # `--` ends the options: what follows is the script, even if it starts with -
        cli_main(["run", "--local", "--", "train.py", "--x"])
    assert calls[1][0][1:] == ("train.py", ["--x"])
    with pytest.raises(Started):  # torchrun's --standalone --nproc-per-node G: G ranks on this machine
        cli_main(["run", "--local", "--nproc-per-node", "4", "train.py"])
    assert calls[2][1]["nproc"] == 4
    err = _refused_plain(capsys, ["run", "--local", "--nproc", "3", "--nproc-per-node", "4", "train.py"])
    assert "disagree" in err


def test_batch_script_refuses_an_unknown_option_before_starting_any_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in BATCH_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.delenv("SLURM_STEPID", raising=False)
    calls = _record(monkeypatch, "torchpass.launch.node_steps.NodeSteps.run")
    err = _refused(capsys, ["run", "--spraes", "1", "train.py"])
    assert "unknown option --spraes before the script (did you mean --spares?)" in err
    err = _refused(capsys, ["run", "--nproc-per-noed", "2", "train.py"])  # the misspelling of the issue
    assert "unknown option --nproc-per-noed before the script (did you mean --nproc-per-node?)" in err
    err = _refused_plain(capsys, ["run", "--nproc", "3", "--nproc-per-node", "2", "train.py"])  # not whole nodes
    assert "--nproc 3 is not a multiple of 2" in err
    assert calls == []
    with pytest.raises(Started):  # the control: the same job with a valid command line starts its steps
        cli_main(["run", "--spares", "1", "train.py"])
    with pytest.raises(Started):  # torchrun's spelling, either way: G decided here for every agent
        cli_main(["run", "--nproc_per_node", "2", "train.py"])
    assert [args[0].ranks_per_node for args, _ in calls] == [1, 2]


def test_node_step_refuses_an_unknown_option_before_the_agent_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in STEP_ENV.items():
        monkeypatch.setenv(name, value)
    calls = _record(monkeypatch, "torchpass.launch.slurm_layout.SlurmLayout.from_environ")
    err = _refused(capsys, ["run", "--evnets", "e.jsonl", "train.py"])
    assert "unknown option --evnets before the script (did you mean --events?)" in err
    assert calls == []
    with pytest.raises(Started):
        cli_main(["run", "--events", "e.jsonl", "train.py"])
    assert len(calls) == 1
