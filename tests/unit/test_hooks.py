"""The Slurm hooks: context from the environment, the runner's never-fail rule, and the event log."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_hooks import events, runner
from slurm_hooks.context import ALIASES, CONTEXTS, from_env, resolve_context


@pytest.fixture(autouse=True)
def _restore_clockwork_logger() -> Iterator[None]:
    """runner.main configures the ``clockwork`` logger; put it back (and close its files) afterwards."""
    logger = logging.getLogger("clockwork")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for handler in list(logger.handlers):
        if handler not in saved[0]:
            logger.removeHandler(handler)
            handler.close()
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


# ----- resolve_context ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "context"),
    [
        ("prolog", "prolog_slurmd"),
        ("epilog", "epilog_slurmd"),
        ("prolog_slurmd", "prolog_slurmd"),
        ("epilog_slurmd", "epilog_slurmd"),
        ("prolog_slurmctld", "prolog_slurmctld"),
        ("epilog_slurmctld", "epilog_slurmctld"),
    ],
)
def test_resolve_context_from_argument(name: str, context: str) -> None:
    assert resolve_context(name, {"SLURM_SCRIPT_CONTEXT": "epilog_slurmctld"}) == context


@pytest.mark.parametrize("name", [None, ""])
def test_resolve_context_falls_back_to_slurm_script_context(name: str | None) -> None:
    assert resolve_context(name, {"SLURM_SCRIPT_CONTEXT": "prolog_slurmctld"}) == "prolog_slurmctld"


@pytest.mark.parametrize(("name", "env"), [("bogus", {}), (None, {}), (None, {"SLURM_SCRIPT_CONTEXT": "task"})])
def test_resolve_context_unknown_lists_the_contexts(name: str | None, env: dict[str, str]) -> None:
    with pytest.raises(ValueError) as err:
        resolve_context(name, env)
    msg = str(err.value)
    assert msg.startswith("unknown hook context")
    for known in (*ALIASES, *CONTEXTS):
        assert known in msg


# ----- from_env -------------------------------------------------------------------------------

FULL_ENV = {
    "SLURM_JOB_ID": "1234",
    "SLURM_JOB_UID": "1001",
    "SLURM_JOB_USER": "alice",
    "SLURMD_NODENAME": "node2",
    "SLURM_JOB_NODELIST": "node[1-3]",
    "SLURM_NODELIST": "ignored[1-9]",
    "SLURM_JOB_PARTITION": "high",
    "SLURM_JOB_RESTART_COUNT": "2",
    "SLURM_JOB_EXIT_CODE2": "3:0",
    "SPANK_CLOCKWORK_FT": "off",  # a job that asked for no fault tolerance: the hooks only record events
    "SPANK_CLOCKWORK_CHECKPOINT_DIR": "/ckpt",
    "SPANK_OTHER_PLUGIN": "x",
}


def test_from_env_prolog() -> None:
    ctx = from_env("prolog_slurmd", FULL_ENV)
    assert ctx.context == "prolog_slurmd"
    assert ctx.job_id == 1234
    assert ctx.uid == 1001
    assert ctx.user == "alice"
    assert ctx.node == "node2"
    assert ctx.nodelist == "node[1-3]"
    assert ctx.partition == "high"
    assert ctx.restart_count == 2
    assert ctx.exit_code is None  # only Epilogs carry one
    assert ctx.options == {"ft": "off", "checkpoint_dir": "/ckpt"}
    assert ctx.on_controller is False


def test_from_env_epilog_exit_code() -> None:
    assert from_env("epilog_slurmd", FULL_ENV).exit_code == 3
    assert from_env("epilog_slurmctld", {**FULL_ENV, "SLURM_JOB_EXIT_CODE2": "0:9"}).exit_code == 0
    assert from_env("epilog_slurmd", {"SLURM_JOB_ID": "1"}).exit_code is None


def test_from_env_controller_contexts_run_on_slurmctld() -> None:
    for context in ("prolog_slurmctld", "epilog_slurmctld"):
        ctx = from_env(context, FULL_ENV)
        assert ctx.node == "slurmctld"
        assert ctx.on_controller is True


def test_from_env_minimal() -> None:
    ctx = from_env("prolog_slurmd", {"SLURM_JOB_ID": "7", "SLURM_NODELIST": "n[1-2]"})
    assert ctx.job_id == 7
    assert ctx.uid is None
    assert ctx.user == ""
    assert ctx.node == socket.gethostname()  # slurmd always sets SLURMD_NODENAME; this is the fallback
    assert ctx.nodelist == "n[1-2]"
    assert ctx.partition == ""
    assert ctx.restart_count == 0
    assert ctx.options == {}


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": ""}, {"SLURM_JOB_ID": "abc"}])
def test_from_env_needs_a_job_id(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="SLURM_JOB_ID is not set"):
        from_env("prolog_slurmd", env)


# ----- runner.main ----------------------------------------------------------------------------


@pytest.fixture
def site(tmp_path: Path) -> dict[str, Path]:
    spool = tmp_path / "spool"
    log_file = tmp_path / "hooks.log"
    config = tmp_path / "clockwork.toml"
    config.write_text(f'[log]\nfile = "{log_file}"\n[hooks]\nspool_dir = "{spool}"\n')
    return {"spool": spool, "log": log_file, "config": config}


def test_runner_records_the_prolog_event(site: dict[str, Path]) -> None:
    env = {**FULL_ENV, "CLOCKWORK_CONFIG": str(site["config"])}
    assert runner.main(["prolog"], env) == 0
    path = site["spool"] / "jobs" / "1234" / "node2.jsonl"
    (line,) = path.read_text().splitlines()
    event = json.loads(line)
    assert event["event"] == "job.prolog"
    assert event["job_id"] == 1234
    assert event["node"] == "node2"
    assert event["uid"] == 1001
    assert event["user"] == "alice"
    assert event["nodelist"] == "node[1-3]"
    assert event["partition"] == "high"
    assert event["restart_count"] == 2
    assert event["options"] == {"ft": "off", "checkpoint_dir": "/ckpt"}
    assert "exit_code" not in event
    assert isinstance(event["time"], float)
    assert "job 1234: job.prolog on node2 recorded in" in site["log"].read_text()


def test_runner_records_epilog_and_controller_events(site: dict[str, Path]) -> None:
    env = {**FULL_ENV, "CLOCKWORK_CONFIG": str(site["config"])}
    assert runner.main(["epilog"], env) == 0
    assert runner.main([], {**env, "SLURM_SCRIPT_CONTEXT": "epilog_slurmctld"}) == 0
    assert runner.main(["prolog_slurmctld"], env) == 0
    recorded = {(e["node"], e["event"]): e for e in events.read(site["spool"], 1234)}
    assert set(recorded) == {("node2", "job.epilog"), ("slurmctld", "job.end"), ("slurmctld", "job.start")}
    assert recorded[("node2", "job.epilog")]["exit_code"] == 3
    assert recorded[("slurmctld", "job.end")]["exit_code"] == 3
    assert "exit_code" not in recorded[("slurmctld", "job.start")]


def test_runner_without_job_id_logs_and_returns_0(site: dict[str, Path]) -> None:
    env = {"CLOCKWORK_CONFIG": str(site["config"]), "SLURMD_NODENAME": "node1"}
    assert runner.main(["prolog"], env) == 0
    assert not site["spool"].exists()
    log = site["log"].read_text()
    assert "ERROR" in log
    assert "SLURM_JOB_ID is not set" in log


def test_runner_unknown_context_logs_and_returns_0(site: dict[str, Path]) -> None:
    env = {**FULL_ENV, "CLOCKWORK_CONFIG": str(site["config"])}
    assert runner.main(["bogus"], env) == 0
    assert not site["spool"].exists()
    assert "unknown hook context 'bogus'" in site["log"].read_text()


def test_runner_with_invalid_config_returns_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "clockwork.toml"
    config.write_text(f'[hooks]\nspool_dirr = "{tmp_path / "spool"}"\n')
    env = {**FULL_ENV, "CLOCKWORK_CONFIG": str(config)}
    assert runner.main(["prolog"], env) == 0
    assert list(tmp_path.iterdir()) == [config]  # nothing written anywhere
    err = capsys.readouterr().err
    assert "configuration unusable, hook does nothing" in err
    assert "unknown key 'spool_dirr'" in err


def test_runner_with_missing_config_returns_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {**FULL_ENV, "CLOCKWORK_CONFIG": str(tmp_path / "missing.toml")}
    assert runner.main(["prolog"], env) == 0
    assert "configuration unusable" in capsys.readouterr().err


def test_runner_with_unwritable_spool_returns_0(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    log_file = tmp_path / "hooks.log"
    config = tmp_path / "clockwork.toml"
    config.write_text(f'[log]\nfile = "{log_file}"\n[hooks]\nspool_dir = "{blocker}"\n')
    assert runner.main(["prolog"], {**FULL_ENV, "CLOCKWORK_CONFIG": str(config)}) == 0
    assert "hook failed (ignored" in log_file.read_text()


# ----- the event log --------------------------------------------------------------------------


def test_append_writes_one_json_line_per_event(tmp_path: Path) -> None:
    path = events.append(tmp_path, 5, "node1", "job.prolog", user="bob", options={"ft": "aware"})
    assert path == tmp_path / "jobs" / "5" / "node1.jsonl"
    events.append(tmp_path, 5, "node1", "job.epilog", exit_code=0)
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert {k: first[k] for k in ("job_id", "node", "event", "user", "options")} == {
        "job_id": 5,
        "node": "node1",
        "event": "job.prolog",
        "user": "bob",
        "options": {"ft": "aware"},
    }
    assert second["event"] == "job.epilog"
    assert second["exit_code"] == 0
    assert second["time"] >= first["time"]


def test_read_merges_writers_by_time_and_skips_corrupt_lines(tmp_path: Path) -> None:
    job = events.job_dir(tmp_path, 9)
    job.mkdir(parents=True)

    def line(t: float, node: str, event: str) -> str:
        return json.dumps({"time": t, "job_id": 9, "node": node, "event": event})

    (job / "slurmctld.jsonl").write_text(line(1.0, "slurmctld", "job.start") + "\n" + line(9.0, "slurmctld", "job.end"))
    (job / "node1.jsonl").write_text(
        line(2.0, "node1", "job.prolog") + '\n{"time": 3.0, "event": "trunc\n\n' + line(8.0, "node1", "job.epilog")
    )
    (job / "node2.jsonl").write_text(line(2.5, "node2", "job.prolog") + "\n" + line(7.0, "node2", "job.epilog") + "\n")
    (job / "notes.txt").write_text("not an event file\n")
    got = [(e["time"], e["node"], e["event"]) for e in events.read(tmp_path, 9)]
    assert got == [
        (1.0, "slurmctld", "job.start"),
        (2.0, "node1", "job.prolog"),
        (2.5, "node2", "job.prolog"),
        (7.0, "node2", "job.epilog"),
        (8.0, "node1", "job.epilog"),
        (9.0, "slurmctld", "job.end"),
    ]


def test_read_of_an_unknown_job_is_empty(tmp_path: Path) -> None:
    assert events.read(tmp_path, 12345) == []
