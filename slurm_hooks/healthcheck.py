"""``clockwork-healthcheck``: Slurm's HealthCheckProgram for Clockwork nodes.

It heals what is Clockwork's own (a dead or hung clockworkd is restarted, never a reason to drain),
and judges only the node's health: fabric NICs that are down or without carrier, GPUs that fell off
the bus, and GPUs the daemon's health watch wants drained (``[health]``) once no rank uses them. An
unhealthy node is drained with a reason starting ``clockwork:``; a node is resumed only
when its drain reason starts with ``clockwork:`` (one that this check set), never one an admin or
another tool drained. A link fault that Fleet Lens shows on the links of several nodes of the same switch
is a switch's, not the node's, and drains nothing (:mod:`slurm_hooks.link_faults`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from clockwork.contracts.atomic_file import write_bytes
from clockwork.contracts.config import load_config
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.logging_setup import configure_logging
from clockwork.contracts.slurm import from_config
from slurm_hooks.link_faults import LinkFault, judge_links
from slurm_hooks.supervisor import ensure_daemon

log = logging.getLogger("clockwork.health")

REASON_PREFIX = "clockwork:"
SYS_NET = Path("/sys/class/net")


def nic_faults(names: list[str], sys_net: Path = SYS_NET) -> list[LinkFault]:
    """The required NICs that are missing, down or without carrier (each must exist, be up, have carrier)."""
    problems = []
    for name in names:
        dev = sys_net / name
        if not dev.exists():
            problems.append(LinkFault(name, f"{name} missing"))
            continue
        operstate = (dev / "operstate").read_text().strip()
        try:
            carrier = (dev / "carrier").read_text().strip()
        except OSError:  # reading carrier of an admin-down device fails with EINVAL
            carrier = "0"
        if operstate != "up" or carrier != "1":
            problems.append(LinkFault(name, f"{name} down ({operstate}, carrier {carrier})"))
    return problems


def nics_down_for(record: Path, faults: list[LinkFault], now: float) -> dict[str, float]:
    """Seconds each NIC of ``faults`` (read from the kernel, not Lens's suspects) has been down, as the health
    checks saw it: its first sighting is kept in ``record`` (NIC -> wall-clock time) from one run to the next,
    and a NIC no longer down is forgotten. The bound on waiting for Lens's verdict needs this memory: each run of
    the check is a new process. An unreadable record counts as empty (the wait starts again: a drain comes later,
    never wrongly early); one that cannot be written is logged."""
    try:
        seen = {str(k): float(v) for k, v in json.loads(record.read_text()).items()}
    except FileNotFoundError:
        seen = {}
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        log.warning("%s unreadable (%s); counting NIC downtime afresh", record, exc)
        seen = {}
    since = {f.nic: min(seen.get(f.nic, now), now) for f in faults if not f.from_lens}
    if since != seen:
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(record, json.dumps(since, sort_keys=True).encode(), mode=0o644)
        except OSError as exc:
            log.warning("cannot record NIC downtime in %s (%s)", record, exc)
    return {nic: now - t for nic, t in since.items()}


def gpu_problems() -> list[str]:
    """GPUs NVML cannot reach (fallen off the bus). A node without NVML or GPUs has none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library: no GPUs to judge
        return []
    problems = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            except pynvml.NVMLError as exc:
                problems.append(f"gpu{index} unreachable ({exc})")
    finally:
        pynvml.nvmlShutdown()
    return problems


def read_lens(client: DaemonClient, node: str) -> dict[str, Any] | None:
    """The daemon's Fleet Lens snapshot (every raised suspect of the fabric, the paths this node receives);
    None when the daemon cannot answer or Lens is off there: no evidence either way."""
    try:
        with client:
            snapshot = client.lens()
    except ClockworkError as exc:
        log.warning("%s: Fleet Lens not readable (%s); no lens verdict", node, exc)
        return None
    return snapshot if snapshot.get("enabled", True) else None


def lens_faults(snapshot: dict[str, Any] | None, node: str) -> list[LinkFault]:
    """Fleet Lens suspects on this node's own NIC links (the health check asks only when ``[lens]
    drain_suspect_nodes`` is on). No snapshot is not evidence against the node: no fault then."""
    out = []
    for suspect in (snapshot or {}).get("suspects") or []:
        nic = suspect.get("nic") or ""
        if nic.partition("/")[0] == node:
            kinds = ",".join(suspect.get("kinds") or []) or "gray"
            text = f"lens suspects {nic} link ({kinds}, {suspect.get('direction')})"
            out.append(LinkFault(nic.partition("/")[2], text, from_lens=True))
    return out


def gpu_health_problems(client: DaemonClient, node: str) -> list[str]:
    """GPUs the daemon's health watch wants drained and that no job's rank uses any more.

    The watch already moved the ranks off a failing GPU (or the job ended); it marks a GPU ``drain_ready`` only
    then, so a drain never lands on a GPU that a rank still trains on. A daemon that cannot answer is not
    evidence against the node: no problem is reported then.
    """
    try:
        with client:
            reply = client.gpus()
    except ClockworkError as exc:
        log.warning("%s: GPU health not readable (%s); no GPU verdict", node, exc)
        return []
    return [str(gpu["drain_reason"]) for gpu in reply.get("gpus") or [] if gpu.get("drain_ready")]


def main() -> int:
    """Always exits 0: slurmd only logs a failing health check; the drain decision is made here."""
    os.environ.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    try:
        loaded = load_config()
        configure_logging(loaded.config.log, component="health")
    except Exception as exc:
        configure_logging(None, component="health")
        log.error("configuration unusable, health check does nothing: %s", exc)
        return 0
    cfg = loaded.config
    try:
        paths = DaemonPaths.from_config(cfg.daemon)
        node = paths.node
        check = ensure_daemon(cfg.daemon, loaded.path)
        if not check.ok:
            log.error("%s: clockworkd cannot run (%s); not a node fault, no drain", node, check.detail)
        nics = [n.strip() for n in cfg.hooks.health_nics.split(",") if n.strip()]
        links = nic_faults(nics)
        lens = None
        if cfg.lens.enabled and check.ok and (links or cfg.lens.drain_suspect_nodes):
            lens = read_lens(DaemonClient.from_config(cfg.daemon, node), node)
        if cfg.lens.drain_suspect_nodes:
            links += [f for f in lens_faults(lens, node) if f.nic not in {x.nic for x in links}]
        down_for = nics_down_for(paths.state_dir / "health" / "nics_down.json", links, time.time())
        judged = judge_links(node, links, lens, cfg.hooks.switch_fault_nodes, down_for, cfg.hooks.lens_verdict_wait_s)
        for line in judged.switch_faults:
            log.warning("%s: not drained: %s", node, line)
        for line in judged.deferred.values():
            log.info("%s: not drained yet: %s", node, line)
        problems = judged.drain + gpu_problems()
        if cfg.health.enabled and cfg.health.drain and check.ok:
            problems += gpu_health_problems(DaemonClient.from_config(cfg.daemon, node), node)
        slurm = from_config(cfg.slurm)
        info = next((n for n in slurm.nodes() if n.name == node), None)
        if info is None:
            log.error("%s: Slurm does not know this node; nothing to do", node)
            return 0
        ours = info.has("DRAIN") and info.reason.startswith(REASON_PREFIX)
        if problems:
            reason = f"{REASON_PREFIX} " + "; ".join(problems)
            if not info.has("DRAIN") or (ours and info.reason != reason):
                slurm.drain(node, reason)
                log.warning("%s drained: %s", node, reason)
        elif ours and judged.deferred:
            log.info("%s stays drained (%s) until Fleet Lens has judged its links", node, info.reason)
        elif ours:
            slurm.resume(node)
            log.info("%s healthy again: resumed (was drained: %s)", node, info.reason)
    except Exception:
        log.exception("health check failed (no drain: Clockwork's own failure is not the node's)")
    return 0


def console_main() -> None:
    raise SystemExit(main())
