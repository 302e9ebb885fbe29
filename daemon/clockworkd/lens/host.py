"""How the node daemon hosts Fleet Lens: fabric map and topology, pairwise keys, clock seam, LinkPass,
events, Prometheus metrics and the per-minute history.

Lens reads the same fabric map as LinkPass (``[linkpass] fabric_file``) and authenticates its packets
with a key per pair of nodes, derived like LinkPass's (:mod:`clockwork.contracts.pairwise_keys`, label
``clockwork-lens``) from this node's CURVE secret key and each peer's public key: no node can send probes or
summaries as another and make Lens blame a healthy link. Without a map or usable keys Lens stays off and
``clockwork node status`` says why.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from clockwork.contracts.config.lens import LensConfig
from clockwork.contracts.curve_keys import CurveKeyError
from clockwork.contracts.daemon_paths import DaemonPaths, expand
from clockwork.contracts.pairwise_keys import PairwiseKeys
from clockworkd.daemon_component import Component
from clockworkd.lens.clockseam import ClockSeam, ClockSeamError, load_seams
from clockworkd.lens.history import HistoryWriter
from clockworkd.lens.metrics import MetricsServer
from clockworkd.lens.prober import Lens, load_topology
from clockworkd.lens.suspects import GrayTarget
from clockworkd.lens.topology import TopologyError
from clockworkd.server import Daemon
from linkpass.fabric import FabricError, FabricMap
from linkpass.settings import LinkPassConfig

log = logging.getLogger("clockwork.daemon")

HISTORY_EVERY_S = 60.0
LABEL = b"clockwork-lens"  # the pairwise keys' use: a probe key is no heartbeat key


class HostedLens:
    """Lens plus what the daemon adds around it: the metrics endpoint and the history file."""

    def __init__(self, lens: Lens, metrics: MetricsServer | None, history: HistoryWriter | None) -> None:
        self.lens = lens
        self.metrics = metrics
        self.history = history
        self.next_history = time.monotonic() + HISTORY_EVERY_S
        if history is not None:
            lens.on_snapshot = self._maybe_record

    def _maybe_record(self, snapshot: dict[str, Any]) -> None:
        now = time.monotonic()
        if self.history is not None and now >= self.next_history:
            self.next_history = now + HISTORY_EVERY_S
            self.history.append(snapshot)

    def fds(self) -> list[int]:
        return self.lens.fds()

    def on_readable(self, fd: int) -> None:
        self.lens.on_readable(fd)

    def next_deadline(self) -> float:
        return self.lens.next_deadline()

    def tick(self) -> None:
        self.lens.tick()

    def snapshot(self) -> dict[str, Any]:
        return self.lens.snapshot()

    def status(self) -> dict[str, Any]:
        out = self.lens.status()
        out["metrics"] = f"http://{self.metrics.bind}:{self.metrics.port}/metrics" if self.metrics else "off"
        out["history"] = str(self.history.path) if self.history else "off"
        return out

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.lens.close()


def start_lens(
    cfg: LensConfig, linkpass_cfg: LinkPassConfig, paths: DaemonPaths, daemon: Daemon, gray: GrayTarget | None
) -> Component | str:
    """A started Lens, or the reason it is not running."""
    if not cfg.enabled:
        return "disabled by configuration ([lens] enabled = false)"
    try:
        fabric = FabricMap.load(Path(expand(linkpass_cfg.fabric_file, paths.node)))
        fabric.node(paths.node)
        topology = load_topology(cfg, fabric)
    except (FabricError, TopologyError) as exc:
        return f"disabled: {exc}"
    try:
        keys = PairwiseKeys(
            LABEL, paths.curve_secret_key, paths.curve_keys_dir, [peer.name for peer in fabric.peers(paths.node)]
        )
    except CurveKeyError as exc:
        return f"disabled: no keys to authenticate probes: {exc}"
    except OSError as exc:
        return f"disabled: no keys to authenticate probes ({exc.filename}: {exc.strerror})"
    seam: ClockSeam | None = None
    if cfg.clock_seam_file:
        try:
            seam = load_seams(cfg.clock_seam_file).get(paths.node)
        except ClockSeamError as exc:
            return f"disabled: {exc}"
        log.warning("node %s: lens clock seam in use (%s): synthetic clock for tests", paths.node, seam)
    lens = Lens(
        cfg,
        paths.node,
        fabric,
        topology,
        keys,
        emit=lambda kind, fields: daemon.emit_node_event(kind, fields, "lens"),
        seam=seam,
        gray=gray,
    )
    try:
        lens.start()
    except Exception as exc:
        lens.close()
        log.error("node %s: Fleet Lens cannot start: %s", paths.node, exc)
        return f"disabled: {exc}"
    metrics = None
    if cfg.metrics_port:
        metrics = MetricsServer(lens.cached_snapshot, cfg.metrics_addr, cfg.metrics_port)
        try:
            metrics.start()
        except OSError as exc:
            log.error(
                "node %s: lens metrics endpoint off: %s:%d: %s", paths.node, cfg.metrics_addr, cfg.metrics_port, exc
            )
            metrics = None
    history = None
    if cfg.history_file:
        target = Path(expand(cfg.history_file.replace("{state_dir}", str(paths.state_dir)), paths.node))
        history = HistoryWriter(target, int(cfg.history_max_mb * 1024 * 1024))
    return HostedLens(lens, metrics, history)
