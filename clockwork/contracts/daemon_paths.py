"""Where a node daemon keeps its sockets, pid file and state: one place that expands ``{node}``.

The daemon, its client, the CLI and the Slurm hooks all derive these paths from ``[daemon]`` through
:meth:`DaemonPaths.from_config`, so they can never disagree about where a node's daemon listens. The
sandbox's nodes share one filesystem, which is why every path may contain ``{node}``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.errors import ConfigError

CONTROL_SOCKET = "control.sock"
EVENTS_SOCKET = "events.sock"
PID_FILE = "clockworkd.pid"
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_IPC_PATH = 107


def local_node_name(cfg: DaemonConfig) -> str:
    """This node's name: ``node_name`` when set, else the short hostname (what slurmd calls the node)."""
    return cfg.node_name or socket.gethostname().split(".", 1)[0]


def expand(template: str, node: str) -> Path:
    """``template`` with ``{node}`` replaced; the only placeholder, so other braces are left alone."""
    return Path(template.replace("{node}", node))


@dataclass(frozen=True)
class DaemonPaths:
    """Every path of one node's daemon, with ``{node}`` already replaced."""

    node: str
    run_dir: Path
    state_dir: Path
    curve_secret_key: Path
    curve_public_key: Path

    @classmethod
    def from_config(cls, cfg: DaemonConfig, node: str | None = None) -> DaemonPaths:
        """The paths of ``node``'s daemon (default: this node)."""
        name = node or local_node_name(cfg)
        if not name or "/" in name or name in (".", ".."):
            raise ConfigError(f"[daemon] node name {name!r} cannot be used in a path")
        paths = cls(
            node=name,
            run_dir=expand(cfg.run_dir, name),
            state_dir=expand(cfg.state_dir, name),
            curve_secret_key=expand(cfg.curve_secret_key, name),
            curve_public_key=expand(cfg.curve_public_key, name),
        )
        for sock in (paths.control_socket, paths.events_socket):
            if len(str(sock).encode()) > MAX_IPC_PATH:
                raise ConfigError(
                    f"[daemon] run_dir: socket path {sock} is longer than {MAX_IPC_PATH} bytes "
                    "(the limit of a Unix socket path); choose a shorter run_dir"
                )
        return paths

    @property
    def control_socket(self) -> Path:
        return self.run_dir / CONTROL_SOCKET

    @property
    def events_socket(self) -> Path:
        return self.run_dir / EVENTS_SOCKET

    @property
    def pid_file(self) -> Path:
        return self.run_dir / PID_FILE

    @property
    def control_endpoint(self) -> str:
        return f"ipc://{self.control_socket}"

    @property
    def events_endpoint(self) -> str:
        return f"ipc://{self.events_socket}"

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    @property
    def events_dir(self) -> Path:
        return self.state_dir / "events"

    @property
    def reports_dir(self) -> Path:
        return self.state_dir / "reports"

    @property
    def curve_keys_dir(self) -> Path:
        """The admin-installed set of daemon public keys that peers may present."""
        return self.curve_public_key.parent
