"""One reading of one GPU, and the interface every reading source implements.

A field that is ``None`` was not reported (the device or driver does not support it, or the source has no such
value): the policy never judges a missing value as healthy or unhealthy, it only judges what was read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

#: Throttle reasons the policy knows (names used in readings and fault files).
THROTTLE_REASONS = ("thermal", "hw_slowdown", "power_brake")
#: Recovery actions the driver may recommend (NVML_GPU_RECOVERY_ACTION_*), by name.
RECOVERY_ACTIONS = (
    "none",
    "gpu_reset",
    "node_reboot",
    "drain_p2p",
    "drain_and_reset",
    "recover_imex_domain",
    "bus_reset",
    "system_reboot",
)


@dataclass
class GpuReading:
    """What a source read from one GPU at one moment (``xids``: XID events since the previous reading)."""

    index: int
    uuid: str = ""
    name: str = ""
    lost: bool = False
    error: str = ""
    temperature_c: float | None = None
    slowdown_c: float | None = None
    shutdown_c: float | None = None
    throttle: tuple[str, ...] = ()
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    rows_pending: bool | None = None
    rows_remap_failed: bool | None = None
    nvlink_errors: int | None = None
    recovery_action: str | None = None
    fabric_error: str | None = None  # '' healthy or on no fabric; the NVLink fabric's failure (a node fault)
    xids: tuple[int, ...] = ()
    pids: tuple[int, ...] | None = None
    unsupported: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible form (lists for tuples) for events and ``clockwork node gpus``."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out


class GpuSource(Protocol):
    """Where readings come from: the real NVML, or a fault file (tests and the sandbox)."""

    name: str

    def read(self) -> list[GpuReading]:
        """Every GPU of the node, read now (an empty list: no GPUs, or none can be seen)."""
        ...

    def describe(self) -> str:
        """One line for ``clockwork node status``/``gpus``: what is read and, when nothing can be, why."""
        ...

    def close(self) -> None: ...


class SourceBusyError(Exception):
    """A read of the GPUs did not return in time (a hung NVML call): no readings this round, the loop goes on."""
