"""How the node daemon hosts the node watch: LinkPass's evidence, the kernel echo, the second observer's channel.

The node watch needs LinkPass (its heartbeats are the evidence) and raw ICMP sockets (the daemon runs as
root). The second observer is asked over the daemons' CURVE socket, with this daemon's own keys and each
peer's server key (``NODE.key`` in the key folder, else the shared one); without usable keys the node watch
runs, but makes a verdict only where no other daemon is heard (status says why). Anything missing leaves it off
with the reason in ``clockwork node status``; the daemon's other work goes on.
"""

from __future__ import annotations

import logging

from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.config.nodewatch import NodeWatchConfig
from clockwork.contracts.curve_keys import CurveKeyError, load_daemon_keys, peer_public_key
from clockwork.contracts.daemon_paths import DaemonPaths
from clockworkd.nodewatch.confirm import ConfirmWorker, PeerDirectory
from clockworkd.nodewatch.echo import EchoProber
from clockworkd.nodewatch.judge import outcome_of
from clockworkd.nodewatch.watch import NodeWatch
from clockworkd.server import Daemon
from linkpass.engine import LinkPass

__all__ = ["start_nodewatch"]

log = logging.getLogger("clockwork.daemon")


def _second_observer(
    cfg: NodeWatchConfig, daemon_cfg: DaemonConfig, paths: DaemonPaths, linkpass: LinkPass
) -> ConfirmWorker | str:
    if not daemon_cfg.listen_port:
        return "[daemon] listen_port is 0: the other daemons' sockets cannot be found"
    try:
        keys = load_daemon_keys(paths)
        server_keys = {name: peer_public_key(paths, name, keys) for name in linkpass.peers}
    except (CurveKeyError, OSError, ValueError) as exc:
        return f"no CURVE keys to ask the other daemons with: {exc}"
    endpoints = {name: f"tcp://{peer.addr}:{daemon_cfg.listen_port}" for name, peer in linkpass.peers.items()}
    directory = PeerDirectory(endpoints, keys, server_keys)
    return ConfirmWorker(directory, cfg.confirm_timeout_ms / 1000, lambda view: outcome_of(cfg, view))


def start_nodewatch(
    cfg: NodeWatchConfig, daemon_cfg: DaemonConfig, paths: DaemonPaths, daemon: Daemon, linkpass: LinkPass | str
) -> NodeWatch | str:
    """A started node watch, or the reason it is not running."""
    if not cfg.enabled:
        return "disabled by configuration ([nodewatch] enabled = false)"
    if isinstance(linkpass, str):
        return f"off: it needs LinkPass's heartbeats (LinkPass {linkpass})"
    prober = EchoProber({rail: linkpass.me.nics[rail] for rail in linkpass.rails})
    try:
        prober.open()
    except OSError as exc:
        return f"off: cannot send ICMP echo from this node's NICs ({exc.strerror or exc})"
    confirm = _second_observer(cfg, daemon_cfg, paths, linkpass)
    watch = NodeWatch(
        cfg,
        linkpass,
        prober,
        None if isinstance(confirm, str) else confirm,
        jobs=lambda: daemon.registry.jobs() if daemon.registry is not None else [],
        record=daemon.emit_job_event,
        no_confirm_reason=confirm if isinstance(confirm, str) else "",
    )
    log.info(
        "node %s: node watch on: a peer silent on every rail for %d ms with its kernel silent is lost; second "
        "observer %s",
        paths.node,
        cfg.silent_after_ms,
        "over the CURVE daemon socket" if not isinstance(confirm, str) else f"off ({confirm})",
    )
    return watch
