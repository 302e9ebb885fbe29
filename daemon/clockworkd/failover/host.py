"""How the node daemon hosts LinkPass: fabric map, pairwise keys, and events into the jobs' logs.

Heartbeats carry a MAC under a key per pair of nodes, derived from this node's CURVE secret key and the
peer's public key (:mod:`clockwork.contracts.pairwise_keys`): the key pairs the admin installs for the
daemon-to-daemon plane (`clockwork keys generate`, one per node or one for the cluster), so there is no other
secret to manage, and with one pair per node no node can sign a heartbeat or a down notice for another.
Without a fabric map or usable keys LinkPass stays off and ``clockwork node status`` says why; the daemon's
other work goes on.
"""

from __future__ import annotations

import logging
from pathlib import Path

from clockwork.contracts import atomic_file
from clockwork.contracts.curve_keys import CurveKeyError
from clockwork.contracts.daemon_paths import DaemonPaths, expand
from clockwork.contracts.pairwise_keys import PairwiseKeys
from clockworkd.server import Daemon
from linkpass.engine import LinkPass
from linkpass.fabric import FabricError, FabricMap
from linkpass.settings import LinkPassConfig

log = logging.getLogger("clockwork.daemon")

LABEL = b"clockwork-linkpass"  # the pairwise keys' use: a heartbeat key is no Lens key


def start_linkpass(cfg: LinkPassConfig, paths: DaemonPaths, daemon: Daemon) -> LinkPass | str:
    """A started LinkPass engine, or the reason it is not running."""
    if not cfg.enabled:
        return "disabled by configuration ([linkpass] enabled = false)"
    try:
        fabric = FabricMap.load(Path(expand(cfg.fabric_file, paths.node)))
    except FabricError as exc:
        return f"disabled: {exc}"
    try:
        keys = PairwiseKeys(
            LABEL, paths.curve_secret_key, paths.curve_keys_dir, [peer.name for peer in fabric.peers(paths.node)]
        )
    except CurveKeyError as exc:
        return f"disabled: no keys to authenticate heartbeats: {exc}"
    except OSError as exc:
        return f"disabled: no keys to authenticate heartbeats ({exc.filename}: {exc.strerror})"
    try:
        engine = LinkPass(
            cfg,
            paths.node,
            fabric,
            keys,
            emit=lambda kind, fields: daemon.emit_node_event(kind, fields, "linkpass"),
            home_file=paths.state_dir / "linkpass-home.json",
            write_file=atomic_file.write_bytes,
        )
    except (FabricError, ValueError) as exc:  # e.g. more path peers than one heartbeat datagram lists
        return f"disabled: {exc}"
    try:
        engine.start()
    except Exception as exc:
        engine.close()
        log.error("node %s: LinkPass cannot start: %s", paths.node, exc)
        return f"disabled: {exc}"

    def heartbeats_age() -> float:
        """Seconds since the heartbeat thread's last round (0 without one: the loop's tick restarts it)."""
        io = engine.io
        return 0.0 if io is None else max(0.0, engine.clock() - io.last_round)

    daemon.watchdog.watch("linkpass.heartbeats", heartbeats_age)
    return engine
