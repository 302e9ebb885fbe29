"""The real source: every GPU of the node read through NVML (nvidia-ml-py's ``pynvml``).

Each field is read on its own and a field the device or driver does not support is left ``None`` and named in
``unsupported`` (logged once per GPU), so an older driver or a consumer GPU degrades to fewer signals, never to
a failure. ``NVML_ERROR_GPU_IS_LOST`` on any call marks the GPU lost (fallen off the bus). XID events come from
an NVML event set registered for critical XID errors on every GPU, drained without waiting at each reading.
Without NVML (no driver, no library: a CPU node, or this repository's CI) the source reports no GPUs and says
why once.

``nvml`` (the module) can be given to the constructor: tests pass a stand-in, since no GPU exists there.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from clockworkd.gpuhealth.readings import RECOVERY_ACTIONS, GpuReading

log = logging.getLogger("clockwork.daemon.health")

NVLINK_FIELDS = (
    "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
)
MAX_EVENTS_PER_READ = 256
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class _Lost(Exception):
    """The GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlSource:
    """Every GPU NVML can see (see the module docstring)."""

    name = "nvml"

    def __init__(self, node: str, nvml: Any = None) -> None:
        self.node = node
        self.nvml = nvml
        self.note = ""
        self.driver = ""
        self._handles: list[Any] = []
        self._events: Any = None
        self._pending_xids: dict[int, list[int]] = {}
        self._told_unsupported: set[tuple[int, str]] = set()
        self._open()

    # ----- setup ------------------------------------------------------------------------------

    def _open(self) -> None:
        try:
            if self.nvml is None:
                import pynvml

                self.nvml = pynvml
            self.nvml.nvmlInit()
        except Exception as exc:  # no library, no driver, no permission: no GPUs to watch
            self.note = f"NVML not available: {type(exc).__name__}: {exc}"
            self.nvml = None
            log.info("node %s: GPU health watch sees no GPUs: %s", self.node, self.note)
            return
        nv = self.nvml
        try:
            self.driver = _text(nv.nvmlSystemGetDriverVersion())
        except Exception:
            self.driver = "?"
        try:
            count = int(nv.nvmlDeviceGetCount())
        except Exception as exc:
            self.note = f"NVML cannot count the GPUs: {exc}"
            log.error("node %s: %s", self.node, self.note)
            return
        for index in range(count):
            try:
                self._handles.append(nv.nvmlDeviceGetHandleByIndex(index))
            except Exception as exc:  # kept as None: that GPU reads as lost or unreadable
                log.error("node %s: gpu%d: no NVML handle: %s", self.node, index, exc)
                self._handles.append(None)
        self._register_xid_events()
        log.info("node %s: GPU health watch reads %d GPUs through NVML (driver %s)", self.node, count, self.driver)

    def _register_xid_events(self) -> None:
        nv = self.nvml
        try:
            self._events = nv.nvmlEventSetCreate()
        except Exception as exc:
            self.note = f"no XID events: {exc}"
            log.warning("node %s: GPU health watch gets no XID events: %s", self.node, exc)
            return
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self._events)
            except Exception as exc:
                log.warning("node %s: gpu%d: XID events not available: %s", self.node, index, exc)

    def describe(self) -> str:
        if self.nvml is None:
            return self.note
        extra = f"; {self.note}" if self.note else ""
        return f"NVML, driver {self.driver}, {len(self._handles)} GPUs{extra}"

    def close(self) -> None:
        if self.nvml is None:
            return
        try:
            if self._events is not None:
                self.nvml.nvmlEventSetFree(self._events)
            self.nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("node %s: NVML shutdown: %s", self.node, exc)
        self.nvml = None

    # ----- reading ----------------------------------------------------------------------------

    def _is(self, exc: BaseException, code_name: str) -> bool:
        return getattr(exc, "value", None) == getattr(self.nvml, code_name, object())

    def _field(self, reading: GpuReading, label: str, call: Any, *args: Any) -> Any:
        """One NVML call; None (and ``label`` in ``unsupported``) when the GPU cannot answer it."""
        try:
            return call(*args)
        except self.nvml.NVMLError as exc:
            if self._is(exc, "NVML_ERROR_GPU_IS_LOST"):
                raise _Lost() from None
            reading.unsupported = (*reading.unsupported, label)
            if (reading.index, label) not in self._told_unsupported:
                self._told_unsupported.add((reading.index, label))
                log.info("node %s: gpu%d: %s not available: %s", self.node, reading.index, label, exc)
            return None
        except (AttributeError, TypeError) as exc:  # an older binding without that function
            reading.unsupported = (*reading.unsupported, label)
            if (reading.index, label) not in self._told_unsupported:
                self._told_unsupported.add((reading.index, label))
                log.info("node %s: gpu%d: %s not in this nvidia-ml-py: %s", self.node, reading.index, label, exc)
            return None

    def _field_values(self, reading: GpuReading, handle: Any, names: tuple[str, ...]) -> dict[str, float | None]:
        """NVML field values by constant name (None: the binding lacks the constant or the GPU the field)."""
        nv = self.nvml
        ids = [(n, getattr(nv, n)) for n in names if hasattr(nv, n)]
        out: dict[str, float | None] = dict.fromkeys(names)
        if not ids:
            return out
        values = self._field(reading, "field values", nv.nvmlDeviceGetFieldValues, handle, [i for _, i in ids])
        if values is None:
            return out
        for (name, _), value in zip(ids, values, strict=False):
            if int(value.nvmlReturn) != 0:  # NVML_SUCCESS
                continue
            member = _VALUE_MEMBER.get(int(value.valueType))
            if member is not None:
                out[name] = float(getattr(value.value, member))
        return out

    def _read_one(self, index: int, handle: Any) -> GpuReading:
        nv = self.nvml
        reading = GpuReading(index=index)
        reading.uuid = _text(self._field(reading, "uuid", nv.nvmlDeviceGetUUID, handle) or "")
        reading.name = _text(self._field(reading, "name", nv.nvmlDeviceGetName, handle) or "")
        sensor = nv.NVML_TEMPERATURE_GPU
        temp = None
        if hasattr(nv, "nvmlDeviceGetTemperatureV"):  # the current call; the plain one goes away in CUDA 14
            temp = self._field(reading, "temperature (V)", nv.nvmlDeviceGetTemperatureV, handle, sensor)
        if temp is None:
            temp = self._field(reading, "temperature", nv.nvmlDeviceGetTemperature, handle, sensor)
        reading.temperature_c = None if temp is None else float(temp)
        for attr, const in (("slowdown_c", "SLOWDOWN"), ("shutdown_c", "SHUTDOWN")):
            value = self._field(
                reading,
                f"{const.lower()} threshold",
                nv.nvmlDeviceGetTemperatureThreshold,
                handle,
                getattr(nv, f"NVML_TEMPERATURE_THRESHOLD_{const}"),
            )
            setattr(reading, attr, None if value is None else float(value))
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        mask = self._field(reading, "throttle reasons", reasons, handle)
        if mask is not None:
            reading.throttle = self._throttle_names(int(mask))
        ecc: dict[str, int | None] = {}
        for label, kind, counter in (
            ("ecc_corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
            ("ecc_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
            ("ecc_aggregate_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
        ):
            value = self._field(
                reading, label, nv.nvmlDeviceGetTotalEccErrors, handle, getattr(nv, kind), getattr(nv, counter)
            )
            ecc[label] = None if value is None else int(value)
        reading.ecc_corrected = ecc["ecc_corrected"]
        reading.ecc_uncorrected = ecc["ecc_uncorrected"]
        reading.ecc_aggregate_uncorrected = ecc["ecc_aggregate_uncorrected"]
        rows = self._field(reading, "remapped rows", nv.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            reading.rows_pending = bool(rows[2])
            reading.rows_remap_failed = bool(rows[3])
        fields = self._field_values(reading, handle, (*NVLINK_FIELDS, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"))
        nvlink = [fields[n] for n in NVLINK_FIELDS if fields[n] is not None]
        reading.nvlink_errors = int(sum(v for v in nvlink if v is not None)) if nvlink else None
        action = fields["NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"]
        if action is not None:
            code = int(action)
            reading.recovery_action = RECOVERY_ACTIONS[code] if 0 <= code < len(RECOVERY_ACTIONS) else f"code {code}"
        else:
            reading.unsupported = (*reading.unsupported, "recovery action")
        reading.fabric_error = self._fabric_error(reading, handle)
        procs = self._field(reading, "compute processes", nv.nvmlDeviceGetComputeRunningProcesses, handle)
        reading.pids = None if procs is None else tuple(int(p.pid) for p in procs)
        return reading

    def _fabric_error(self, reading: GpuReading, handle: Any) -> str | None:
        """The NVLink fabric's verdict on this GPU: on an NVSwitch node the fabric manager trains every GPU into
        the fabric, and a GPU whose training completed with a failure status cannot reach its node-mates over
        NVLink, a fault of what the whole node shares. '' when healthy, not on a fabric or still training; None
        when NVML cannot say (a GPU or binding without fabric info)."""
        nv = self.nvml
        info_type = getattr(nv, "c_nvmlGpuFabricInfo_t", None)
        if info_type is None:  # an nvidia-ml-py older than fabric info
            reading.unsupported = (*reading.unsupported, "fabric info")
            return None
        info = info_type()
        if self._field(reading, "fabric info", nv.nvmlDeviceGetGpuFabricInfo, handle, ctypes.byref(info)) is None:
            return None
        if int(info.state) != int(getattr(nv, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)) or int(info.status) == 0:
            return ""
        try:
            why = _text(nv.nvmlErrorString(int(info.status)))
        except Exception:
            why = f"status {int(info.status)}"
        return f"fabric registration failed: {why}"

    def _throttle_names(self, mask: int) -> tuple[str, ...]:
        nv = self.nvml
        bits = {
            "thermal": ("nvmlClocksEventReasonSwThermalSlowdown", "nvmlClocksEventReasonHwThermalSlowdown"),
            "hw_slowdown": ("nvmlClocksEventReasonHwSlowdown",),
            "power_brake": ("nvmlClocksEventReasonHwPowerBrakeSlowdown",),
        }
        out = []
        for name, consts in bits.items():
            values = [getattr(nv, c, None) or getattr(nv, c.replace("Event", "Throttle"), 0) for c in consts]
            if any(mask & int(v) for v in values if v):
                out.append(name)
        return tuple(out)

    def _drain_xids(self) -> None:
        """Collect every XID event waiting in the event set (no waiting)."""
        nv = self.nvml
        if self._events is None:
            return
        for _ in range(MAX_EVENTS_PER_READ):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as exc:
                if not self._is(exc, "NVML_ERROR_TIMEOUT"):
                    log.warning("node %s: reading XID events failed: %s", self.node, exc)
                return
            except Exception as exc:  # a binding without the call: no XID events, said once
                self.note = f"no XID events: {type(exc).__name__}: {exc}"
                log.warning("node %s: %s", self.node, self.note)
                self._events = None
                return
            try:
                index = int(nv.nvmlDeviceGetIndex(data.device))
            except Exception:
                index = self._index_of(data.device)
            if index >= 0:
                self._pending_xids.setdefault(index, []).append(int(data.eventData))
                log.warning("node %s: gpu%d: XID %d", self.node, index, int(data.eventData))

    def _index_of(self, device: Any) -> int:
        """Which of our handles an event's device is (by pointer value), -1 when none."""
        try:
            wanted = ctypes.cast(device, ctypes.c_void_p).value
            for index, handle in enumerate(self._handles):
                if handle is not None and ctypes.cast(handle, ctypes.c_void_p).value == wanted:
                    return index
        except (TypeError, ctypes.ArgumentError):
            pass
        return -1

    def read(self) -> list[GpuReading]:
        if self.nvml is None:
            return []
        self._drain_xids()
        out = []
        for index, handle in enumerate(self._handles):
            xids = tuple(self._pending_xids.pop(index, []))
            if handle is None:
                out.append(GpuReading(index=index, error="no NVML handle", xids=xids))
                continue
            try:
                reading = self._read_one(index, handle)
            except _Lost:
                reading = GpuReading(index=index, lost=True, error="GPU is lost (fallen off the bus)")
            except Exception as exc:  # never let one GPU's failure stop the watch
                reading = GpuReading(index=index, error=f"{type(exc).__name__}: {exc}")
            reading.xids = xids
            out.append(reading)
        return out
