"""``clockwork node ...`` and ``clockwork keys generate``, run in-process against a live daemon.

The daemon is a real subprocess (see ``daemon_harness``) under /tmp/cwd-XXXX; the CLI gets that
configuration with ``--config`` and a clean environment (no CLOCKWORK_* of the caller's shell).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from clockwork.cli.main import run
from tests.unit.daemon_harness import RunningDaemon, daemons, scratch, start_daemon, write_config

__all__ = ["daemons", "scratch"]  # fixtures used by name below


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("CLOCKWORK_"):
            monkeypatch.delenv(var)


@pytest.fixture
def live(scratch: Path, daemons: list[RunningDaemon]) -> Iterator[tuple[Path, RunningDaemon]]:
    """A daemon for node n1 with one job and one event; yields (config file, daemon)."""
    config = write_config(scratch)
    daemon = start_daemon(daemons, config)
    with daemon.client() as client:
        client.register_job(100, 1000, "alice", ["n1", "n2"], {"ft": "aware"})
        client.post_event(100, "link.failover", {"nic": "nic0"})
    yield config, daemon


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_node_status_json(capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon]) -> None:
    config, daemon = live
    code, out, err = _run(capsys, "--config", str(config), "node", "status", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert daemon.proc is not None and info["pid"] == daemon.proc.pid
    assert info["node"] == "n1"
    assert info["peer_plane"].startswith("disabled: no CURVE keys at ")
    assert [j["job_id"] for j in info["jobs"]] == [100]
    assert [e["kind"] for e in info["recent_events"]] == ["job.registered", "link.failover"]


def test_node_status_table(capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon]) -> None:
    config, daemon = live
    code, out, err = _run(capsys, "--config", str(config), "node", "status", "--node", "n1")
    assert code == 0, err
    assert "clockworkd on n1: up " in out and f"pid {daemon.proc.pid if daemon.proc else '?'}" in out
    assert "peer plane:     disabled: no CURVE keys" in out
    assert "1 running, 1 known" in out
    for text in ("100", "alice (1000)", "running", "n1,n2", "ft=aware", "recent events", "link.failover"):
        assert text in out, text


def test_node_events(capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon]) -> None:
    config, _ = live
    code, out, err = _run(capsys, "--config", str(config), "node", "events", "100", "--json")
    assert code == 0, err
    events = json.loads(out)
    assert [e["kind"] for e in events] == ["job.registered", "link.failover"]
    assert events[1]["fields"] == {"nic": "nic0"}
    code, out, err = _run(capsys, "--config", str(config), "node", "events", "100")
    assert code == 0, err
    assert "job 100: 2 events" in out and "link.failover" in out and '{"nic": "nic0"}' in out


def test_node_events_of_an_unknown_job(capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon]) -> None:
    config, _ = live
    code, out, err = _run(capsys, "--config", str(config), "node", "events", "999")
    assert code == 5
    assert out == ""
    assert err == ("clockwork: clockworkd on n1 refused job_events: job 999 is not registered on this node (node n1)\n")


def test_node_without_a_daemon(capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon]) -> None:
    config, daemon = live
    code, _, err = _run(capsys, "--config", str(config), "node", "status", "--node", "n2")
    assert code == 6
    n2_socket = daemon.paths.run_dir.parent.parent / "n2" / "run" / "control.sock"
    assert err == f"clockwork: no clockworkd on n2: {n2_socket} does not exist (is the daemon running?)\n"


def test_node_option_needs_node_in_run_dir(
    capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon]
) -> None:
    config, daemon = live
    shared = f"daemon.run_dir={daemon.paths.run_dir}"
    code, _, err = _run(capsys, "--config", str(config), "--set", shared, "node", "status", "--node", "n2")
    assert code == 1
    assert "the daemon of n2 cannot be reached from n1" in err
    assert "run the command on n2" in err
    # Without --node the same run_dir reaches this host's daemon.
    code, out, err = _run(capsys, "--config", str(config), "--set", shared, "node", "status", "--json")
    assert code == 0, err
    assert json.loads(out)["node"] == "n1"


def test_keys_generate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = tmp_path / "curve"
    code, out, err = _run(capsys, "keys", "generate", "--dir", str(folder))
    assert code == 0, err
    secret = folder / "daemon.key_secret"
    assert f"secret key: {secret}" in out
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "daemon.key").stat().st_mode) == 0o644
    code, _, err = _run(capsys, "keys", "generate", "--dir", str(folder))
    assert code == 1
    assert (
        err
        == f"clockwork: keys generate: {folder / 'daemon.key'} already exists; remove it first to make a new key pair\n"
    )
    code, out, err = _run(capsys, "keys", "generate", "--dir", str(folder), "--name", "node7")
    assert code == 0, err
    assert (folder / "node7.key").is_file()
