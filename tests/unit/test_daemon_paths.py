"""``[daemon]`` settings and :class:`DaemonPaths`: one expansion of ``{node}`` that everyone shares."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from clockwork.contracts.config import load_config
from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.daemon_paths import DaemonPaths, local_node_name
from clockwork.contracts.errors import ConfigError


def test_defaults() -> None:
    cfg = DaemonConfig()
    assert (cfg.run_dir, cfg.state_dir, cfg.node_name, cfg.slurm_user) == (
        "/run/clockwork",
        "/var/lib/clockwork",
        "",
        "root",
    )
    assert (cfg.listen_port, cfg.bind_addr, cfg.max_message_bytes, cfg.request_timeout_s) == (16900, "", 65536, 5.0)
    assert cfg.curve_secret_key == "/etc/clockwork/curve/daemon.key_secret"
    assert cfg.curve_public_key == "/etc/clockwork/curve/daemon.key"
    paths = DaemonPaths.from_config(cfg, "node1")
    assert paths.control_socket == Path("/run/clockwork/control.sock")
    assert paths.control_endpoint == "ipc:///run/clockwork/control.sock"
    assert paths.events_endpoint == "ipc:///run/clockwork/events.sock"
    assert paths.pid_file == Path("/run/clockwork/clockworkd.pid")
    assert paths.reports_dir == Path("/var/lib/clockwork/reports")
    assert paths.curve_keys_dir == Path("/etc/clockwork/curve")


def test_node_is_expanded_everywhere(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[daemon]\nrun_dir = "/run/cw/{node}/run"\nstate_dir = "/srv/{node}/state"\nnode_name = "node2"\n'
        'curve_secret_key = "/etc/cw/{node}.key_secret"\ncurve_public_key = "/etc/cw/{node}.key"\n'
    )
    cfg = load_config(path, env={}).config.daemon
    paths = DaemonPaths.from_config(cfg)
    assert paths.node == "node2"
    assert paths.control_socket == Path("/run/cw/node2/run/control.sock")
    assert paths.jobs_dir == Path("/srv/node2/state/jobs")
    assert paths.curve_secret_key == Path("/etc/cw/node2.key_secret")
    assert paths.curve_public_key == Path("/etc/cw/node2.key")
    assert DaemonPaths.from_config(cfg, "node5").events_socket == Path("/run/cw/node5/run/events.sock")


def test_environment_sets_daemon_keys(tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    loaded = load_config(empty, env={"CLOCKWORK_DAEMON_LISTEN_PORT": "0"})
    assert loaded.config.daemon.listen_port == 0
    with pytest.raises(ConfigError, match=r"\[daemon\] max_message_bytes: invalid value '10'"):
        load_config(empty, env={"CLOCKWORK_DAEMON_MAX_MESSAGE_BYTES": "10"})


def test_node_name_defaults_to_the_short_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu17.cluster.example.org")
    assert local_node_name(DaemonConfig()) == "gpu17"
    assert local_node_name(DaemonConfig(node_name="n3")) == "n3"


@pytest.mark.parametrize("node", ["a/b", "..", "."])
def test_unusable_node_names(node: str) -> None:
    with pytest.raises(ConfigError, match="cannot be used in a path"):
        DaemonPaths.from_config(DaemonConfig(), node)


def test_socket_path_length_is_checked() -> None:
    cfg = DaemonConfig(run_dir="/tmp/" + "x" * 100 + "/{node}")
    with pytest.raises(ConfigError, match="longer than 107 bytes"):
        DaemonPaths.from_config(cfg, "node1")
