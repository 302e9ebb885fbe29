"""The audit's checks of one node on its own: fabric NICs, kernel settings, the node daemon, GPUs.

Each check returns plain data (what was seen), never a verdict: :mod:`clockwork.audit.verdict` judges,
so the same figures can be judged again (for example with other thresholds) from the JSON report.
"""

from __future__ import annotations

import logging
from typing import Any

from clockwork.audit.measure import nic_facts
from clockwork.contracts.config.schema import ClockworkConfig
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.errors import ClockworkError
from linkpass import sysctls

log = logging.getLogger("clockwork.audit")


def kernel_settings(cfg: ClockworkConfig, nics: list[str]) -> dict[str, Any]:
    """The sysctls LinkPass depends on, as wanted and as they are (rp_filter per NIC too: the kernel
    applies the stricter of ``all`` and the device's own)."""
    wanted = sysctls.parse(cfg.linkpass.sysctls)
    keys = list(wanted) + [f"net.ipv4.conf.{nic}.rp_filter" for nic in nics]
    return {"wanted": wanted, "actual": sysctls.read(keys)}


def daemon_health(cfg: ClockworkConfig, node: str) -> dict[str, Any]:
    """Does this node's clockworkd answer, and are LinkPass and Fleet Lens running in it? Plus Lens's view."""
    out: dict[str, Any] = {}
    try:
        with DaemonClient.from_config(cfg.daemon, node) as client:
            status = client.status()
            out["answered"] = True
            out["version"] = status.get("version")
            out["uptime_s"] = status.get("uptime_s")
            for name in ("linkpass", "lens"):
                comp = status.get(name) or {}
                out[name] = {"enabled": comp.get("enabled") is True, "state": comp.get("state") or comp.get("note")}
            if out["lens"]["enabled"]:
                out["lens_snapshot"] = client.lens()
    except ClockworkError as exc:
        out["answered"] = False
        out["error"] = str(exc)
    return out


def gpu_health() -> dict[str, Any]:
    """Each GPU as NVML reports it (temperature against its own slowdown threshold, uncorrected ECC).
    A node without NVML has no GPUs to audit: that is reported, not failed."""
    try:
        import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception as exc:
        return {"available": False, "reason": f"NVML not available ({type(exc).__name__}: {exc})"}
    gpus = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            gpu: dict[str, Any] = {"index": index}
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                gpu["name"] = pynvml.nvmlDeviceGetName(handle)
                gpu["temperature_c"] = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
                gpu["slowdown_c"] = pynvml.nvmlDeviceGetTemperatureThreshold(
                    handle, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
                )
                try:
                    gpu["ecc_uncorrected"] = pynvml.nvmlDeviceGetTotalEccErrors(
                        handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                    )
                except pynvml.NVMLError:
                    gpu["ecc_uncorrected"] = None  # ECC off or not supported
            except pynvml.NVMLError as exc:
                gpu["error"] = str(exc)
            gpus.append(gpu)
    finally:
        pynvml.nvmlShutdown()
    return {"available": True, "gpus": gpus}


def node_report(cfg: ClockworkConfig, node: str, fabric_nics: dict[str, str], node_addr: str) -> dict[str, Any]:
    """Everything the worker tells the driver when it says hello."""
    return {
        "node": node,
        "node_addr": node_addr,
        "nics": {nic: {"ip": ip, **nic_facts(nic)} for nic, ip in sorted(fabric_nics.items())},
        "kernel": kernel_settings(cfg, sorted(fabric_nics)),
        "daemon": daemon_health(cfg, node),
        "gpu": gpu_health(),
    }
