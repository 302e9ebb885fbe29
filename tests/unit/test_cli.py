"""The ``clockwork`` and ``clockworkd`` command lines, run in-process: output, sources and exit codes.

Every test starts from a clean environment: no CLOCKWORK_* variable of the caller's shell, and
CLOCKWORK_CONFIG naming an empty file under tmp_path (so /etc/clockwork/clockwork.toml is never read).
Nothing here needs root, and nothing touches a real sandbox: the only sandbox state folders used are
under tmp_path, and the root check is exercised by pretending to be uid 1000.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from clockwork import __version__
from clockwork.cli.main import SUBCOMMANDS, run
from clockwork.contracts.config import sections
from clockwork.contracts.config.example import render
from clockwork.sandbox import cluster
from clockworkd.agent import agent
from clockworkd.agent import main as agent_main

ALL_KEYS = [f"{name}.{f.name}" for name, cls in sections().items() for f in dataclasses.fields(cls)]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in list(os.environ):
        if var.startswith("CLOCKWORK_"):
            monkeypatch.delenv(var)
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    monkeypatch.setenv("CLOCKWORK_CONFIG", str(empty))
    return empty


def _defaults() -> dict[str, object]:
    return {
        f"{name}.{f.name}": getattr(cls(), f.name) for name, cls in sections().items() for f in dataclasses.fields(cls)
    }


def _show_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert run([*args, "config", "show", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ----- clockwork config ---------------------------------------------------------------------


def test_config_show_json_defaults(capsys: pytest.CaptureFixture[str], clean_env: Path) -> None:
    out = _show_json(capsys)
    assert out["file"] == str(clean_env)
    assert list(out["settings"]) == ALL_KEYS
    for key, default in _defaults().items():
        assert out["settings"][key] == {"value": default, "source": "default"}


def test_config_show_json_set_and_environment(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv("CLOCKWORK_SANDBOX_NICS", "3")
    monkeypatch.setenv("CLOCKWORK_SANDBOX_NODES", "5")
    out = _show_json(capsys, "--set", "sandbox.nodes=7", "--set", "log.level=debug")
    settings = out["settings"]
    assert settings["sandbox.nodes"] == {"value": 7, "source": "command line"}
    assert settings["log.level"] == {"value": "debug", "source": "command line"}
    assert settings["sandbox.nics"] == {"value": 3, "source": "environment CLOCKWORK_SANDBOX_NICS"}
    assert settings["sandbox.accounting"] == {"value": False, "source": "default"}


def test_config_show_json_with_config_option(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "site.toml"
    path.write_text('[slurm]\nbackend = "cli"\n')
    out = _show_json(capsys, "--config", str(path))  # beats CLOCKWORK_CONFIG (the empty file)
    assert out["file"] == str(path)
    assert out["settings"]["slurm.backend"] == {"value": "cli", "source": f"file {path}"}


def test_config_show_table_lists_every_setting(capsys: pytest.CaptureFixture[str], clean_env: Path) -> None:
    assert run(["config", "show"]) == 0
    out = capsys.readouterr().out
    for key in ALL_KEYS:
        assert key in out, key
    assert "source" in out
    assert '"/var/spool/clockwork"' in out


def test_config_example_is_render(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["config", "example"]) == 0
    assert capsys.readouterr().out == render()


def test_set_malformed(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--set", "bogus", "config", "show"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("clockwork: ")
    assert "expected SECTION.KEY=VALUE" in captured.err
    assert captured.out == ""


def test_set_unknown_key_names_the_known_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--set", "sandbox.nodez=1", "config", "show"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clockwork: ")
    known = ", ".join(f.name for f in dataclasses.fields(sections()["sandbox"]))
    assert f"unknown key 'nodez' in [sandbox] (known keys: {known})" in err


def test_set_bad_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--set", "sandbox.nodes=0", "config", "show"]) == 2
    err = capsys.readouterr().err
    assert err == "clockwork: command line: [sandbox] nodes: invalid value '0' (expected an integer >= 1)\n"


def test_bad_environment_value(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOCKWORK_SANDBOX_ACCOUNTING", "maybe")
    assert run(["config", "show"]) == 2
    assert capsys.readouterr().err.startswith("clockwork: environment CLOCKWORK_SANDBOX_ACCOUNTING: ")


def test_missing_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent.toml"
    assert run(["--config", str(missing), "config", "show"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clockwork: ")
    assert f"{missing} does not exist" in err


# ----- clockwork sandbox (never as root, never on a real sandbox) -----------------------------


def test_sandbox_up_needs_root(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cluster.os.geteuid() == 1000  # the guard below must see a non-root user
    state = tmp_path / "sandbox-state"
    assert run(["sandbox", "--state", str(state), "up", "--nodes", "2"]) == 77
    err = capsys.readouterr().err
    assert err.startswith("clockwork: clockwork sandbox up needs root")
    assert "sudo" in err
    assert "uid 1000" in err
    assert not state.exists()  # refused before building anything


def test_sandbox_slurm_release_follows_the_precedence(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    """``[sandbox] slurm``: command line > environment > file > default (22.05, the host's: nothing to build)."""
    host = "Slurm 22.05: the host's own packages, nothing to build\n"
    assert run(["sandbox", "prepare"]) == 0
    assert capsys.readouterr().out == host
    clean_env.write_text('[sandbox]\nslurm = "24.11"\n')
    monkeypatch.setenv("CLOCKWORK_SANDBOX_SLURM", "22.05")
    assert run(["sandbox", "prepare"]) == 0
    assert capsys.readouterr().out == host
    monkeypatch.setenv("CLOCKWORK_SANDBOX_SLURM", "24.11")
    assert run(["sandbox", "prepare", "--slurm", "22.05"]) == 0
    assert capsys.readouterr().out == host
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr("clockwork.sandbox.slurm_release.CACHE_DIR", clean_env.parent / "cache")  # not built
    assert run(["sandbox", "prepare"]) == 77  # 24.11 from the environment: its root is built as root only
    assert "clockwork sandbox prepare needs root" in capsys.readouterr().err
    assert run(["sandbox", "prepare", "--slurm", "23.02"]) == 2
    assert "[sandbox] slurm: invalid value '23.02' (expected one of 22.05, 24.11, 26.05)" in capsys.readouterr().err


def test_sandbox_status_without_a_sandbox(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    state = tmp_path / "no-sandbox"
    state.mkdir()
    assert run(["sandbox", "--state", str(state), "status"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"no sandbox running at {state.resolve()} (phase: absent)"


def test_sandbox_status_json_without_a_sandbox(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run(["sandbox", "--state", str(tmp_path), "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "state_dir": str(tmp_path.resolve()),
        "phase": "absent",
        "running": False,
    }


def test_sandbox_fault_bad_kind_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run(["sandbox", "--state", str(tmp_path), "fault", "melt", "node1", "nic0", "down"]) == 2
    err = capsys.readouterr().err
    assert "Usage:" in err
    assert "'melt' is not one of" in err
    for kind in ("link", "port", "blackhole", "loss", "rate", "clear"):
        assert kind in err


# ----- version and help -----------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--version"]) == 0
    assert capsys.readouterr().out == f"clockwork, version {__version__}\n"


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    commands = out.split("Commands:", 1)[1].split()
    for name in ("sandbox", "config", "demo"):
        assert name in commands
    assert "--set SECTION.KEY=VALUE" in out


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_lazy_subcommand_loads_and_explains_itself(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run([name, "--help"]) == 0
    assert f"Usage: clockwork {name}" in capsys.readouterr().out


# ----- clockworkd -----------------------------------------------------------------------------


def test_clockworkd_check_config_prints_every_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "node.toml"
    path.write_text("[sandbox]\nnodes = 5\n")
    monkeypatch.setenv("CLOCKWORK_LOG_LEVEL", "debug")
    monkeypatch.setattr(sys, "argv", ["clockworkd", "--check-config", "--config", str(path)])
    agent_main()  # returns normally: exit status 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" = ", 1)[0] for line in lines] == ALL_KEYS
    assert f"sandbox.nodes = 5  (file {path})" in lines
    assert "log.level = 'debug'  (environment CLOCKWORK_LOG_LEVEL)" in lines
    assert "sandbox.accounting = False  (default)" in lines


def test_clockworkd_check_config_with_click_runner(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('[hooks]\nspool_dir = "/srv/cw"\n')
    result = CliRunner().invoke(agent, ["--check-config", "--config", str(path)])
    assert result.exit_code == 0, result.output
    for key in ALL_KEYS:
        assert f"{key} = " in result.output
    assert f"hooks.spool_dir = '/srv/cw'  (file {path})" in result.output


def test_clockworkd_refuses_to_start_beside_a_live_daemon(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without --check-config clockworkd runs the daemon; here the run folder's pid file is already locked."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = tmp_path / "node.toml"
    path.write_text(f'[daemon]\nrun_dir = "{run_dir}"\nstate_dir = "{tmp_path / "state"}"\nnode_name = "n1"\n')
    pid_file = run_dir / "clockworkd.pid"
    pid_file.write_text("4242\n")
    monkeypatch.setattr(sys, "argv", ["clockworkd", "--config", str(path), "--foreground"])
    with open(pid_file) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a running daemon holds
        with pytest.raises(SystemExit) as exit_info:
            agent_main()
    assert exit_info.value.code == 5
    err = capsys.readouterr().err
    assert err == f"clockworkd: another clockworkd (pid 4242) is running: it holds {pid_file}\n"
    assert pid_file.read_text() == "4242\n"
    assert not (tmp_path / "state").exists()


def test_clockworkd_bad_config_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[sandbox]\nnodez = 5\n")
    monkeypatch.setattr(sys, "argv", ["clockworkd", "--check-config", "--config", str(path)])
    with pytest.raises(SystemExit) as exit_info:
        agent_main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"clockworkd: {path}: unknown key 'nodez' in [sandbox]")
