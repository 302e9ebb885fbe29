"""How the node daemon hosts LinkPass: fabric map, shared key, and events into the jobs' logs.

LinkPass needs an authentication key every daemon of the cluster shares: it is derived from the
daemons' CURVE secret key, which the admin installs on every node (`clockwork keys generate`), so
there is one secret to manage. Without a fabric map or a key LinkPass stays off and ``clockwork node
status`` says why; the daemon's other work goes on.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from clockwork.contracts import atomic_file
from clockwork.contracts.daemon_paths import DaemonPaths, expand
from clockworkd.server import Daemon
from linkpass.engine import LinkPass
from linkpass.fabric import FabricError, FabricMap
from linkpass.settings import LinkPassConfig

log = logging.getLogger("clockwork.daemon")


def start_linkpass(cfg: LinkPassConfig, paths: DaemonPaths, daemon: Daemon) -> LinkPass | str:
    """A started LinkPass engine, or the reason it is not running."""
    if not cfg.enabled:
        return "disabled by configuration ([linkpass] enabled = false)"
    try:
        fabric = FabricMap.load(Path(expand(cfg.fabric_file, paths.node)))
    except FabricError as exc:
        return f"disabled: {exc}"
    try:
        key = hashlib.sha256(b"clockwork-linkpass\0" + paths.curve_secret_key.read_bytes()).digest()
    except OSError as exc:
        return f"disabled: no shared key to authenticate heartbeats ({paths.curve_secret_key}: {exc.strerror})"
    try:
        engine = LinkPass(
            cfg,
            paths.node,
            fabric,
            key,
            emit=lambda kind, fields: daemon.emit_node_event(kind, fields, "linkpass"),
            home_file=paths.state_dir / "linkpass-home.json",
            write_file=atomic_file.write_bytes,
        )
    except (FabricError, ValueError) as exc:  # e.g. a fabric whose heartbeats would not fit one datagram
        return f"disabled: {exc}"
    try:
        engine.start()
    except Exception as exc:
        engine.close()
        log.error("node %s: LinkPass cannot start: %s", paths.node, exc)
        return f"disabled: {exc}"
    return engine
