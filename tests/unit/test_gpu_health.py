"""The GPU health watch's parts on their own: ``[health]`` settings, the policy (thresholds, hysteresis,
actions), the fault-file source, the NVML source (without NVML here, and through a stand-in module, since no GPU
exists on this machine), the rank <-> GPU mapping, and the sandbox's GPU fault files.

The daemon hosting the watch, the CLI and the migration through a real coordinator are in
``test_gpu_health_daemon.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from clockwork.contracts.config import load_config
from clockwork.contracts.config.health import HealthConfig
from clockwork.contracts.errors import ConfigError
from clockwork.sandbox import gpu_faults
from clockworkd.gpuhealth.faultfile import FaultFileSource
from clockworkd.gpuhealth.nvml import NvmlSource
from clockworkd.gpuhealth.policy import Policy
from clockworkd.gpuhealth.ranks import gpu_of, ranks_in, read_environ
from clockworkd.gpuhealth.readings import GpuReading


def _gpu(index: int = 0, **values: Any) -> GpuReading:
    base: dict[str, Any] = {"temperature_c": 50.0, "slowdown_c": 90.0, "shutdown_c": 95.0, "uuid": f"GPU-{index}"}
    base.update(values)
    return GpuReading(index=index, **base)


def _run(policy: Policy, *readings: GpuReading, start: float = 0.0) -> list[list[tuple[str, str, str]]]:
    """Evaluate one reading per second; per reading, the (signal, state, action) changes."""
    out = []
    for i, reading in enumerate(readings):
        changes = policy.evaluate([reading], start + i)
        out.append([(c.signal, c.state, c.action) for c in changes])
    return out


# ----- settings ---------------------------------------------------------------------------------


def test_defaults_are_valid_and_the_policy_takes_them() -> None:
    cfg = HealthConfig()
    assert (cfg.source, cfg.enabled, cfg.raise_after, cfg.clear_after) == ("nvml", True, 2, 3)
    policy = Policy(cfg)
    assert policy.action_of("xid.79") == "migrate"
    assert policy.action_of("xid.92") == "warn"
    assert policy.action_of("xid.13") == "record"
    assert policy.action_of("temperature.slowdown") == "migrate"


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('actions = "bogus.signal=warn"', "[health] actions: unknown signal 'bogus.signal'"),
        ('actions = "ecc.corrected=explode"', "[health] actions: invalid action 'explode' for ecc.corrected"),
        ('actions = "ecc.corrected"', "[health] actions: invalid item 'ecc.corrected' (expected SIGNAL=ACTION"),
        ('xid_migrate = "48,abc"', "[health] xid_migrate: invalid XID 'abc' in '48,abc'"),
        ('xid_warn = "-3"', "[health] xid_warn: invalid XID '-3'"),
        ('source = "fault-file"', "[health] fault_file: empty, but source = 'fault-file' needs the file"),
        ('source = "gpu-magic"', "[health] source: invalid value 'gpu-magic' (expected one of nvml, fault-file)"),
        ("interval_s = 0.0", "[health] interval_s: invalid value 0.0 (expected a number >= 0.05)"),
    ],
)
def test_bad_settings_name_the_key_and_value(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "clockwork.toml"
    path.write_text(f"[health]\n{toml}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert message in str(err.value)


def test_overrides_and_xid_lists_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "clockwork.toml"
    path.write_text('[health]\nactions = "throttle.hw_slowdown=migrate, xid.31=warn"\nxid_warn = "13"\n')
    policy = Policy(load_config(path, env={}).config.health)
    assert policy.action_of("throttle.hw_slowdown") == "migrate"
    assert policy.action_of("xid.31") == "warn"
    assert policy.action_of("xid.13") == "warn"
    assert policy.action_of("xid.63") == "record"  # no longer in xid_warn
    assert policy.action_of("throttle.thermal") == "warn"


# ----- policy -----------------------------------------------------------------------------------


def test_one_hot_sample_does_not_raise_two_do() -> None:
    policy = Policy(HealthConfig(raise_after=2))
    changes = _run(
        policy,
        _gpu(temperature_c=95.0 - 5),
        _gpu(temperature_c=50.0),
        _gpu(temperature_c=91.0),
        _gpu(temperature_c=92.0),
    )
    assert changes == [[], [], [], [("temperature.slowdown", "raised", "migrate")]]
    signal = policy.gpus[0].raised["temperature.slowdown"]
    assert (signal.value, signal.threshold) == (92.0, 90.0)
    assert policy.health(0) == ("critical", "migrate")


def test_temperature_tiers_follow_the_devices_own_thresholds() -> None:
    policy = Policy(HealthConfig(raise_after=1, temp_warn_margin_c=5.0, temp_migrate_margin_c=2.0))
    # This GPU slows down at 80 C and shuts down at 85 C: the tiers move with it.
    hot = {"slowdown_c": 80.0, "shutdown_c": 85.0}
    changes = _run(
        policy, _gpu(temperature_c=75.0, **hot), _gpu(temperature_c=78.0, **hot), _gpu(temperature_c=85.0, **hot)
    )
    assert changes[0] == [("temperature.near_slowdown", "raised", "warn")]
    assert changes[1] == [("temperature.slowdown", "raised", "migrate")]  # 80 - 2 = 78
    assert changes[2] == [("temperature.shutdown", "raised", "migrate")]
    # Only the highest tier is present: the lower ones clear after clear_after readings.
    assert set(policy.gpus[0].raised) >= {"temperature.shutdown"}


def test_hysteresis_holds_a_signal_until_the_gpu_is_clearly_cooler() -> None:
    cfg = HealthConfig(raise_after=1, clear_after=2, temp_hysteresis_c=3.0, temp_warn_margin_c=5.0)
    policy = Policy(cfg)
    temps = [91.0, 89.0, 88.0, 89.5, 86.0, 86.0]
    changes = _run(policy, *(_gpu(temperature_c=t) for t in temps))
    assert changes[0] == [("temperature.slowdown", "raised", "migrate")]
    assert changes[1:4] == [[], [], []]  # 89, 88, 89.5 are above 90 - 3: held, no flapping
    assert changes[4] == [("temperature.near_slowdown", "raised", "warn")]  # 86 < 87: slowdown absent (1 of 2)
    assert changes[5] == [("temperature.slowdown", "cleared", "migrate")]
    assert policy.health(0) == ("warning", "warn")


def test_no_threshold_no_temperature_judgement() -> None:
    policy = Policy(HealthConfig(raise_after=1))
    assert _run(policy, _gpu(temperature_c=120.0, slowdown_c=None, shutdown_c=None)) == [[]]


def test_counters_raise_at_once_and_clear_after_clear_after() -> None:
    policy = Policy(HealthConfig(raise_after=3, clear_after=2, ecc_corrected_warn=10))
    changes = _run(
        policy,
        _gpu(ecc_uncorrected=1, ecc_corrected=10, rows_pending=True),
        _gpu(ecc_uncorrected=1, ecc_corrected=10, rows_pending=True),
        _gpu(ecc_uncorrected=0, ecc_corrected=0, rows_pending=False),
        _gpu(ecc_uncorrected=0, ecc_corrected=0, rows_pending=False),
    )
    assert sorted(changes[0]) == [
        ("ecc.corrected", "raised", "warn"),
        ("ecc.uncorrected", "raised", "migrate"),
        ("rows.pending", "raised", "drain"),
    ]
    assert changes[1] == changes[2] == []
    assert sorted(c[:2] for c in changes[3]) == [
        ("ecc.corrected", "cleared"),
        ("ecc.uncorrected", "cleared"),
        ("rows.pending", "cleared"),
    ]


def test_xid_events_hold_for_xid_hold_s() -> None:
    policy = Policy(HealthConfig(xid_hold_s=10.0))
    assert _run(policy, _gpu(xids=(79, 13))) == [[("xid.79", "raised", "migrate"), ("xid.13", "raised", "record")]]
    for t in range(1, 10):
        assert policy.evaluate([_gpu()], float(t)) == []
    assert {c.signal for c in policy.evaluate([_gpu()], 10.0)} == {"xid.79", "xid.13"}
    assert policy.gpus[0].raised == {}


def test_lost_gpu_keeps_its_identity_and_migrates() -> None:
    policy = Policy(HealthConfig())
    policy.evaluate([_gpu(uuid="GPU-abc", name="H200")], 0.0)
    changes = policy.evaluate([GpuReading(index=0, lost=True, error="GPU is lost")], 1.0)
    assert [(c.signal, c.action, c.uuid) for c in changes] == [("gpu.lost", "migrate", "GPU-abc")]


def test_nvlink_errors_count_between_readings() -> None:
    policy = Policy(HealthConfig(raise_after=1, nvlink_errors_warn=100))
    changes = _run(policy, _gpu(nvlink_errors=5000), _gpu(nvlink_errors=5050), _gpu(nvlink_errors=5200))
    assert changes == [[], [], [("nvlink.errors", "raised", "warn")]]  # a high total alone is history, not news
    assert policy.gpus[0].raised["nvlink.errors"].value == 150


@pytest.mark.parametrize(
    ("action", "signal", "policy_action"),
    [
        ("gpu_reset", "recovery.reset", "migrate"),
        ("drain_and_reset", "recovery.reset", "migrate"),
        ("node_reboot", "recovery.reboot", "migrate"),
        ("drain_p2p", "recovery.drain_p2p", "drain"),
        ("recover_imex_domain", "recovery.other", "drain"),
    ],
)
def test_driver_recovery_action(action: str, signal: str, policy_action: str) -> None:
    policy = Policy(HealthConfig())
    assert _run(policy, _gpu(recovery_action=action)) == [[(signal, "raised", policy_action)]]
    assert _run(Policy(HealthConfig()), _gpu(recovery_action="none")) == [[]]


def test_throttle_reasons_are_level_signals() -> None:
    policy = Policy(HealthConfig(raise_after=2, actions="throttle.power_brake=migrate"))
    changes = _run(policy, _gpu(throttle=("power_brake", "thermal")), _gpu(throttle=("power_brake", "thermal")))
    assert changes[0] == []
    assert sorted(changes[1]) == [("throttle.power_brake", "raised", "migrate"), ("throttle.thermal", "raised", "warn")]


def test_history_is_bounded() -> None:
    policy = Policy(HealthConfig(history=3, xid_hold_s=0.0))
    for t in range(5):
        policy.evaluate([_gpu(xids=(31,))], 2.0 * t)  # raised
        policy.evaluate([_gpu()], 2.0 * t + 1)  # cleared: held for 0 s
    assert [(c.signal, c.state, c.time) for c in policy.gpus[0].history] == [
        ("xid.31", "cleared", 7.0),
        ("xid.31", "raised", 8.0),
        ("xid.31", "cleared", 9.0),
    ]


# ----- fault-file source ------------------------------------------------------------------------


def _write(path: Path, doc: Any, mode: int = 0o644) -> None:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    path.chmod(mode)


def test_missing_file_is_healthy_gpus(tmp_path: Path) -> None:
    source = FaultFileSource(tmp_path / "none.json", 2, "n1")
    readings = source.read()
    assert [r.index for r in readings] == [0, 1]
    assert readings[1].temperature_c == 40.0 and readings[1].slowdown_c == 90.0 and readings[1].ecc_uncorrected == 0
    assert Policy(HealthConfig(raise_after=1)).evaluate(readings, 0.0) == []


def test_injected_values_and_xids_once(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    _write(path, {"gpus": {"1": {"temperature_c": 95, "ecc_uncorrected": 2, "xids": [79], "throttle": ["thermal"]}}})
    source = FaultFileSource(path, 2, "n1")
    first = source.read()
    assert first[0].temperature_c == 40.0 and first[0].xids == ()
    assert (first[1].temperature_c, first[1].ecc_uncorrected, first[1].xids, first[1].throttle) == (
        95.0,
        2,
        (79,),
        ("thermal",),
    )
    assert source.read()[1].xids == ()  # an event is delivered once
    _write(path, {"gpus": {"1": {"xids": [79, 48]}}})
    assert source.read()[1].xids == (48,)
    _write(path, {"gpus": {}})  # cleared
    assert source.read()[1].temperature_c == 40.0
    _write(path, {"gpus": {"1": {"xids": [64]}}})
    assert source.read()[1].xids == (64,)  # counting starts again after a clear


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ("{not json", "not JSON"),
        ({"gpus": {"0": {"temperature": 95}}}, "gpus.0.temperature: unknown field"),
        ({"gpus": {"0": {"temperature_c": "hot"}}}, "gpus.0.temperature_c: must be a non-negative number, got 'hot'"),
        ({"gpus": {"0": {"ecc_uncorrected": 1.5}}}, "must be a non-negative integer, got 1.5"),
        ({"gpus": {"0": {"lost": 1}}}, "gpus.0.lost: must be true or false, got 1"),
        ({"gpus": {"0": {"xids": [0]}}}, "must be a list of positive XID numbers"),
        ({"gpus": {"0": {"throttle": ["sleepy"]}}}, "must be a list of thermal, hw_slowdown, power_brake"),
        ({"gpus": {"0": {"recovery_action": "pray"}}}, "recovery_action: must be one of none"),
        ({"gpus": {"5": {}}}, "gpus.5: not a GPU index 0..1"),
        ({"gpus": [1]}, 'expected {"gpus"'),
        ({"gpus": {}, "extra": 1}, "unknown top-level key(s) extra"),
    ],
)
def test_malformed_file_is_logged_once_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, doc: Any, problem: str
) -> None:
    path = tmp_path / "gpu.json"
    _write(path, {"gpus": {"0": {"temperature_c": 93}}})
    source = FaultFileSource(path, 2, "n1")
    assert source.read()[0].temperature_c == 93.0
    _write(path, doc)
    with caplog.at_level(logging.WARNING, logger="clockwork.daemon.health"):
        for _ in range(3):
            readings = source.read()
            assert readings[0].temperature_c == 93.0  # the previous good values stay in effect
    complaints = [r.getMessage() for r in caplog.records if "GPU fault file ignored" in r.getMessage()]
    assert len(complaints) == 1 and problem in complaints[0], complaints
    assert problem in source.describe()
    _write(path, {"gpus": {"0": {"temperature_c": 60}}})
    assert source.read()[0].temperature_c == 60.0 and source.problem == ""


def test_file_writable_by_others_is_not_trusted(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    _write(path, {"gpus": {"0": {"temperature_c": 99}}}, mode=0o666)
    source = FaultFileSource(path, 1, "n1")
    assert source.read()[0].temperature_c == 40.0
    assert "writable by group or others (mode 666)" in source.problem


def test_symlinked_fault_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    _write(target, {"gpus": {"0": {"temperature_c": 99}}})
    link = tmp_path / "gpu.json"
    link.symlink_to(target)
    source = FaultFileSource(link, 1, "n1")
    assert source.read()[0].temperature_c == 40.0
    assert "cannot open" in source.problem


# ----- NVML source --------------------------------------------------------------------------------


def test_without_nvml_no_gpus_said_once(caplog: pytest.LogCaptureFixture) -> None:
    class NoLibrary:
        class NVMLError(Exception):
            pass

        def nvmlInit(self) -> None:
            raise self.NVMLError("NVML Shared Library Not Found")

    with caplog.at_level(logging.INFO, logger="clockwork.daemon.health"):
        source = NvmlSource("n1", nvml=NoLibrary())
        assert source.read() == [] and source.read() == []
    assert "NVML not available: NVMLError: NVML Shared Library Not Found" in source.describe()
    assert sum("sees no GPUs" in r.getMessage() for r in caplog.records) == 1
    source.close()


def test_the_real_binding_never_fails_the_watch() -> None:
    """The real nvidia-ml-py: without a driver (this machine) no GPUs and the reason; with one, GPUs."""
    source = NvmlSource("n1")
    try:
        readings = source.read()
        if source.describe().startswith("NVML not available"):
            assert readings == []
        else:  # a GPU machine: tests/device/nvml_check.py checks the values themselves
            assert source.describe().startswith("NVML, driver ")
            assert [r.index for r in readings] == list(range(len(readings)))
    finally:
        source.close()


class FakeNvml:
    """A stand-in for ``pynvml`` with two GPUs: gpu0 healthy-ish, gpu1 whose NVML calls report the GPU lost.

    Only what NvmlSource calls; constants have pynvml's values. Used because no GPU exists on this machine."""

    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = 38
    NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = 52
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
    nvmlEventTypeXidCriticalError = 8
    nvmlClocksEventReasonSwThermalSlowdown = 0x20
    nvmlClocksEventReasonHwThermalSlowdown = 0x40
    nvmlClocksEventReasonHwSlowdown = 0x08
    nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self) -> None:
        self.events = [SimpleNamespace(device="h0", eventData=48)]
        self.shut = False

    def _check(self, handle: str) -> None:
        if handle == "h1":
            raise self.NVMLError(self.NVML_ERROR_GPU_IS_LOST)

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.1"

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"h{index}"

    def nvmlDeviceGetIndex(self, handle: str) -> int:
        return int(handle[1:])

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlEventSetFree(self, _: str) -> None: ...
    def nvmlDeviceRegisterEvents(self, handle: str, types: int, _: str) -> None:
        assert types == self.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, _: str, timeout_ms: int) -> Any:
        assert timeout_ms == 0
        if not self.events:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        self._check(handle)
        return b"GPU-1234"

    def nvmlDeviceGetName(self, handle: str) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        return 71

    def nvmlDeviceGetTemperatureV(self, handle: str, sensor: int) -> int:
        raise self.NVMLError(13)  # Function Not Found: a driver older than the binding

    def nvmlDeviceGetTemperatureThreshold(self, handle: str, which: int) -> int:
        if which == self.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return 87

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:
        return 0x40 | 0x80 | 0x1

    def nvmlDeviceGetTotalEccErrors(self, handle: str, kind: int, counter: int) -> int:
        return {(0, 0): 3, (1, 0): 1, (1, 1): 4}[(kind, counter)]

    def nvmlDeviceGetRemappedRows(self, handle: str) -> tuple[int, int, int, int]:
        return (0, 1, 1, 0)

    def nvmlDeviceGetFieldValues(self, handle: str, ids: list[int]) -> list[Any]:
        values = {38: 7, 52: 5, 230: 1}

        def one(i: int) -> Any:
            return SimpleNamespace(nvmlReturn=0, valueType=3, value=SimpleNamespace(ullVal=values[i]))

        return [one(i) for i in ids]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        return [SimpleNamespace(pid=4242)]


def test_nvml_readings_through_a_stand_in() -> None:
    fake = FakeNvml()
    source = NvmlSource("n1", nvml=fake)
    gpu0, gpu1 = source.read()
    assert (gpu0.uuid, gpu0.name, gpu0.temperature_c, gpu0.slowdown_c, gpu0.shutdown_c) == (
        "GPU-1234",
        "NVIDIA H200",
        71.0,
        87.0,
        None,
    )
    assert "shutdown threshold" in gpu0.unsupported
    assert "temperature (V)" in gpu0.unsupported  # the older call answered instead
    assert gpu0.throttle == ("thermal", "power_brake")
    assert (gpu0.ecc_corrected, gpu0.ecc_uncorrected, gpu0.ecc_aggregate_uncorrected) == (3, 1, 4)
    assert (gpu0.rows_pending, gpu0.rows_remap_failed) == (True, False)
    assert gpu0.nvlink_errors == 12
    assert gpu0.recovery_action == "gpu_reset"
    assert gpu0.pids == (4242,)
    assert gpu0.xids == (48,)
    assert gpu1.lost and gpu1.error.startswith("GPU is lost")
    assert source.read()[0].xids == ()  # the event was drained once
    assert source.describe() == "NVML, driver 570.1, 2 GPUs"
    source.close()
    assert fake.shut and source.read() == []


# ----- ranks <-> GPUs -------------------------------------------------------------------------------


def _event(kind: str, pid: int, node: str = "n1", **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "node": node, "by": f"uid 1000 pid {pid}", "fields": fields}


def test_live_ranks_from_the_jobs_events() -> None:
    events = [
        _event("torchpass.joined", 11, slot=0, generation=0),
        _event("torchpass.joined", 12, slot=1, generation=0),
        _event("torchpass.joined", 13, node="n2", slot=2, generation=0),  # another node's rank
        _event("torchpass.departed", 99, worker="a1.0", generation=1),  # the coordinator's, not a rank's
        _event("torchpass.joined", 14, slot=3, generation=0),
        _event("torchpass.departed", 14, generation=1),  # handed its slot on
        _event("torchpass.joined", 15, slot=1, generation=2),  # a new process for slot 1 (12 died)
    ]
    alive = {11, 13, 15, 14, 99}
    assert ranks_in(events, "n1", alive.__contains__) == [(0, 11, 0), (1, 15, 2)]


def test_gpu_of_a_rank() -> None:
    readings = [GpuReading(index=0, uuid="GPU-aaaa", pids=(50,)), GpuReading(index=1, uuid="GPU-bbbb", pids=())]
    envs: dict[int, dict[str, str] | None] = {
        50: {"LOCAL_RANK": "1"},  # NVML's process list wins over the environment
        51: {},
        52: {"LOCAL_RANK": "1"},
        53: {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "3,0"},
        54: {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-bbbb"},
        55: {"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0"},
        56: None,
        57: {"LOCAL_RANK": "x"},
    }
    found = {pid: gpu_of(pid, readings, envs.__getitem__) for pid in envs}
    assert found[50] == (0, "NVML compute processes")
    assert found[51] == (0, "LOCAL_RANK")
    assert found[52] == (1, "LOCAL_RANK")
    assert found[53] == (0, "LOCAL_RANK + CUDA_VISIBLE_DEVICES")
    assert found[54] == (1, "LOCAL_RANK + CUDA_VISIBLE_DEVICES (UUID)")
    assert found[55][0] is None and "beyond CUDA_VISIBLE_DEVICES" in found[55][1]
    assert found[56] == (None, "unknown (environment unreadable)")
    assert found[57][0] is None


def test_read_environ_of_a_real_process() -> None:
    env = dict(os.environ, LOCAL_RANK="3")
    code = "import time; print('up', flush=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"  # past exec: its own environment
        found = read_environ(proc.pid)
        assert found is not None and found["LOCAL_RANK"] == "3"
        assert gpu_of(proc.pid, [])[0] == 3
    finally:
        proc.kill()
        proc.wait()
    assert read_environ(proc.pid) is None


# ----- the sandbox's GPU fault files ----------------------------------------------------------------


def test_sandbox_gpu_fault_requests() -> None:
    assert gpu_faults.parse("0", "temp", "95", 1) == (0, "temp", 95.0)
    assert gpu_faults.parse("1", "ecc", "2", 2) == (1, "ecc", 2)
    assert gpu_faults.parse("0", "xid", "79", 1) == (0, "xid", 79)
    assert gpu_faults.parse("0", "clear", None, 1) == (0, "clear", None)
    for args, message in [
        (("1", "temp", "95", 1), "invalid GPU index '1' (the sandbox's nodes have GPUs 0..0)"),
        (("x", "temp", "95", 1), "invalid GPU index 'x'"),
        (("0", "fire", "1", 1), "unknown fault 'fire' (expected one of temp, ecc, xid, clear)"),
        (("0", "temp", "hot", 1), "fault gpu temp: invalid value 'hot' (expected degrees C, 0..200)"),
        (("0", "ecc", "-1", 1), "fault gpu ecc: invalid value '-1' (expected an error count >= 0)"),
        (("0", "xid", "0", 1), "fault gpu xid: invalid value '0' (expected an XID number >= 1)"),
        (("0", "temp", None, 1), "fault gpu temp needs a VALUE"),
        (("0", "clear", "1", 1), "takes no value"),
    ]:
        with pytest.raises(ConfigError) as err:
            gpu_faults.parse(*args)
        assert message in str(err.value)


def test_sandbox_gpu_fault_file_is_what_the_source_reads(tmp_path: Path) -> None:
    path = gpu_faults.fault_file(tmp_path, "node2")
    source = FaultFileSource(path, 2, "node2")
    assert gpu_faults.apply(path, 0, "temp", 95.0) == {"temperature_c": 95.0}
    assert gpu_faults.apply(path, 0, "xid", 79) == {"temperature_c": 95.0, "xids": [79]}
    assert gpu_faults.summary(gpu_faults.apply(path, 1, "ecc", 1)) == "ecc=1"
    assert (path.stat().st_mode & 0o777) == 0o644
    readings = source.read()
    assert (readings[0].temperature_c, readings[0].xids, readings[1].ecc_uncorrected) == (95.0, (79,), 1)
    assert gpu_faults.apply(path, 0, "clear", None) == {}
    assert source.read()[0].temperature_c == 40.0
    assert json.loads(path.read_text()) == {"gpus": {"1": {"ecc_uncorrected": 1}}}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gpu", "node2", "0"], "`fault gpu` needs NODE INDEX temp|ecc|xid VALUE or NODE INDEX clear"),
        (["gpu", "node2"], "`fault gpu` needs NODE INDEX"),
        (["link", "node1", "nic0", "down", "now"], "`fault link` takes at most NODE NIC VALUE"),
    ],
)
def test_sandbox_fault_gpu_usage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    """Usage errors come before anything touches a sandbox (none exists at tmp_path)."""
    from clockwork.cli.main import run

    assert run(["sandbox", "--state", str(tmp_path), "fault", *argv]) == 2
    assert message in capsys.readouterr().err


def test_sandbox_fault_help_lists_the_gpu_forms(capsys: pytest.CaptureFixture[str]) -> None:
    from clockwork.cli.main import run

    assert run(["sandbox", "fault", "--help"]) == 0
    out = capsys.readouterr().out
    for text in ("gpu NODE INDEX temp C", "gpu NODE INDEX ecc N", "gpu NODE INDEX xid N", "gpu NODE INDEX clear"):
        assert text in out


def test_a_binding_without_event_wait_loses_only_the_xids() -> None:
    class OldBinding(FakeNvml):
        nvmlEventSetWait_v2 = None  # type: ignore[assignment]

    source = NvmlSource("n1", nvml=OldBinding())
    first = source.read()
    assert [r.temperature_c for r in first] == [71.0, None] and first[0].xids == ()
    assert "no XID events" in source.describe()
    assert source.read()[0].temperature_c == 71.0


# ----- the watch's actions, in-process (a real registry, a fault file) --------------------------------


def test_watch_warns_every_running_job_when_no_rank_is_known(tmp_path: Path) -> None:
    from clockworkd.gpuhealth.watch import HealthWatch
    from clockworkd.registry import Registry

    registry = Registry(tmp_path / "state", "n1")
    registry.register(5, 1000, "alice", ["n1"], {})
    registry.register(6, 1001, "bob", ["n1"], {})
    registry.register(7, 1002, "carol", ["n1"], {})
    registry.unregister(7)
    emitted: list[tuple[int, str, dict[str, Any]]] = []
    path = tmp_path / "gpu.json"
    cfg = HealthConfig(source="fault-file", fault_file=str(path), raise_after=1, clear_after=1)
    watch = HealthWatch(cfg, "n1", FaultFileSource(path, 1, "n1"), registry, lambda *e: emitted.append(e))
    watch.tick()
    assert emitted == []
    _write(path, {"gpus": {"0": {"temperature_c": 87, "ecc_aggregate_uncorrected": 3}}})
    watch.tick()
    # near_slowdown (warn) goes to the running jobs; the aggregate count (record) only to the log and history.
    assert [(job, kind, f["signal"], f["state"]) for job, kind, f in emitted] == [
        (5, "gpu.health", "temperature.near_slowdown", "raised"),
        (6, "gpu.health", "temperature.near_slowdown", "raised"),
    ]
    assert emitted[0][2]["ranks"] == [] and emitted[0][2]["threshold"] == 85.0
    snapshot = watch.snapshot()
    assert [s["signal"] for s in snapshot["gpus"][0]["signals"]] == [
        "ecc.aggregate_uncorrected",
        "temperature.near_slowdown",
    ]
    assert snapshot["gpus"][0]["health"] == "warning" and snapshot["gpus"][0]["drain_reason"] == ""
    emitted.clear()
    _write(path, {"gpus": {}})
    watch.tick()
    assert [(job, f["signal"], f["state"]) for job, _, f in emitted] == [
        (5, "temperature.near_slowdown", "cleared"),
        (6, "temperature.near_slowdown", "cleared"),
    ]
    watch.close()


def test_watch_survives_a_failing_source(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from clockworkd.gpuhealth.watch import HealthWatch
    from clockworkd.registry import Registry

    class Broken:
        name = "broken"

        def read(self) -> list[GpuReading]:
            raise RuntimeError("driver wedged")

        def describe(self) -> str:
            return "broken"

        def close(self) -> None: ...

    watch = HealthWatch(HealthConfig(), "n1", Broken(), Registry(tmp_path, "n1"), lambda *e: None)
    with caplog.at_level(logging.ERROR, logger="clockwork.daemon.health"):
        watch.tick()
        watch.tick()
    assert watch.failures == 2
    assert "GPU health watch failed this round" in caplog.text
    assert watch.next_deadline() > 0
    watch.close()
