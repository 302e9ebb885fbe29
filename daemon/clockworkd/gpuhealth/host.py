"""How the node daemon hosts the GPU health watch: the source its configuration selects, and job events.

The source is chosen by ``[health] source`` of the daemon's own configuration (root's file, or the daemon's own
environment): a job's user has no say. The fault-file source is for tests and the sandbox; the daemon says so
in its log when it uses one. A node without NVML runs the watch with no GPUs (``clockwork node gpus`` says why).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from clockwork.contracts.config.health import HealthConfig
from clockwork.contracts.daemon_paths import DaemonPaths, expand
from clockworkd.daemon_component import Component
from clockworkd.gpuhealth.faultfile import FaultFileSource
from clockworkd.gpuhealth.guarded import GuardedSource
from clockworkd.gpuhealth.nvml import NvmlSource
from clockworkd.gpuhealth.readings import GpuSource
from clockworkd.gpuhealth.watch import HealthWatch
from clockworkd.server import Daemon

log = logging.getLogger("clockwork.daemon")


def make_source(cfg: HealthConfig, paths: DaemonPaths) -> GpuSource:
    """The source ``[health] source`` names."""
    if cfg.source == "fault-file":
        path = Path(expand(cfg.fault_file.replace("{state_dir}", str(paths.state_dir)), paths.node))
        log.warning("node %s: GPU health reads the TEST fault file %s, not the GPUs", paths.node, path)
        return FaultFileSource(path, cfg.emulated_gpus, paths.node)
    return NvmlSource(paths.node)


def start_health(cfg: HealthConfig, paths: DaemonPaths, daemon: Daemon) -> Component | str:
    """A started GPU health watch, or the reason it is not running."""
    if not cfg.enabled:
        return "disabled by configuration ([health] enabled = false)"
    if daemon.registry is None:
        return "disabled: the daemon has no registry (not started)"
    try:
        source = GuardedSource(make_source(cfg, paths), daemon.watchdog)  # a hung read never stops the loop
    except Exception as exc:  # never stop the daemon for its GPU watch
        log.error("node %s: GPU health watch cannot start: %s", paths.node, exc)
        return f"disabled: {exc}"

    def emit(job_id: int, kind: str, fields: dict[str, Any]) -> None:
        daemon.emit_job_event(job_id, kind, fields, by="gpu-health")

    def nics_down() -> dict[str, str]:
        """The fabric NICs LinkPass sees down (none without LinkPass): a NIC fault is the whole node's."""
        down = getattr(daemon.components.get("linkpass"), "down_nics", None)
        return dict(down()) if callable(down) else {}

    def hcas_down() -> dict[str, str]:
        """The HCAs behind the NICs LinkPass avoids (none without LinkPass, or on NICs without an HCA)."""
        avoid = getattr(daemon.components.get("linkpass"), "avoid_hcas", None)
        return dict(avoid()) if callable(avoid) else {}

    return HealthWatch(cfg, paths.node, source, daemon.registry, emit, nics_down=nics_down, hcas_down=hcas_down)
