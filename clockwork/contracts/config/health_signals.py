"""The catalogue of GPU health signals: each name, what raises it, and the action it takes by default.

Kept apart from the policy (which evaluates them) so that the ``[health]`` settings can check action overrides
against the names without importing the policy. ``xid.N`` (one per XID number) is not listed: its default action
comes from ``[health] xid_migrate`` / ``xid_warn`` (others are recorded).
"""

from __future__ import annotations

#: name -> (default action, what raises it). Actions: record < warn < drain < migrate (each includes the ones
#: before it: migrate = warn the job, migrate its ranks on the GPU now, drain the node once they left).
SIGNALS: dict[str, tuple[str, str]] = {
    "temperature.near_slowdown": ("warn", "temperature within temp_warn_margin_c of the GPU's slowdown threshold"),
    "temperature.slowdown": ("migrate", "temperature at the slowdown threshold (less temp_migrate_margin_c)"),
    "temperature.shutdown": ("migrate", "temperature at the GPU's shutdown threshold"),
    "throttle.thermal": ("warn", "clocks reduced by software or hardware thermal slowdown"),
    "throttle.hw_slowdown": ("warn", "clocks reduced by hardware slowdown (power supply, external signal)"),
    "throttle.power_brake": ("warn", "clocks reduced by the external power brake"),
    "ecc.corrected": ("warn", "volatile corrected ECC errors at ecc_corrected_warn or more"),
    "ecc.uncorrected": ("migrate", "a volatile uncorrected (double-bit) ECC error since the driver loaded"),
    "ecc.aggregate_uncorrected": ("record", "uncorrected ECC errors in the GPU's lifetime"),
    "rows.pending": ("drain", "a row remapping waits for a GPU reset"),
    "rows.remap_failed": ("migrate", "a row remapping failed (no spare rows left)"),
    "nvlink.errors": ("warn", "NVLink CRC/replay/recovery errors at nvlink_errors_warn or more between readings"),
    "recovery.drain_p2p": ("drain", "the driver recommends draining peer-to-peer traffic"),
    "recovery.reset": ("migrate", "the driver recommends a GPU or bus reset"),
    "recovery.reboot": ("migrate", "the driver recommends a node or system reboot"),
    "recovery.other": ("drain", "the driver recommends another recovery action (e.g. of the IMEX domain)"),
    "gpu.lost": ("migrate", "the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)"),
    "fabric.error": ("migrate", "the NVLink fabric (NVSwitch, fabric manager) failed to take the GPU in: a node fault"),
    "gpu.unreadable": ("record", "NVML failed reading the GPU for another reason"),
}

#: Signals of the whole node rather than of the GPU that reports them: every GPU of an NVSwitch node reads its
#: fabric state from the same switches and fabric manager. Raised at ``migrate``, they move every rank of the node
#: together (a whole-node migration) instead of one GPU's rank. ``[health] xid_node`` adds XIDs to them.
NODE_SIGNALS = ("fabric.error",)

#: Action -> severity shown for a GPU whose worst raised signal takes that action.
SEVERITY = {"": "ok", "record": "info", "warn": "warning", "drain": "degraded", "migrate": "critical"}
ACTION_RANK = {"": 0, "record": 1, "warn": 2, "drain": 3, "migrate": 4}
