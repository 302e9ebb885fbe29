"""The GPU health watch's node-level faults: which faults are the whole node's, and what the watch asks for then.

A fault of one GPU moves that GPU's rank (``test_gpu_health.py``). A fault of what the node's GPUs share (the
NVLink fabric: NVSwitches and the fabric manager; the same failure on every GPU at once; a fabric NIC LinkPass
has seen down too long) must move every rank of the node together, to one spare node, as ``clockwork migrate
--ranks-on`` does: scattered over lone spare slots, a node's intra-node groups would cross the network. The
policy decides (pure, time passed in); the watch turns the decision into one request per rank in slot order,
with the group size and the spare the previous one took (here through a recording stand-in for the coordinator
client: the real round trip through a daemon is in ``test_gpu_health_daemon.py``).
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import pytest

from clockwork.contracts.config import load_config
from clockwork.contracts.config.health import HealthConfig
from clockwork.contracts.errors import ConfigError
from clockworkd.gpuhealth import watch as watch_module
from clockworkd.gpuhealth.faultfile import FaultFileSource
from clockworkd.gpuhealth.nvml import NvmlSource
from clockworkd.gpuhealth.policy import Policy
from clockworkd.gpuhealth.readings import GpuReading
from clockworkd.gpuhealth.watch import HealthWatch
from clockworkd.registry import Registry
from tests.conftest import until
from tests.unit.test_gpu_health import FakeNvml


def _gpu(index: int, **values: Any) -> GpuReading:
    base: dict[str, Any] = {"temperature_c": 50.0, "slowdown_c": 90.0, "shutdown_c": 95.0, "uuid": f"GPU-{index}"}
    return GpuReading(index=index, **{**base, **values})


def _healthy(count: int) -> list[GpuReading]:
    return [_gpu(i) for i in range(count)]


# ----- the policy's decision ----------------------------------------------------------------------


def test_a_fabric_failure_is_the_whole_nodes() -> None:
    policy = Policy(HealthConfig())
    policy.evaluate(_healthy(4), 0.0)
    assert policy.node_fault() is None
    changes = policy.evaluate([_gpu(0), _gpu(1), _gpu(2, fabric_error="fabric registration failed"), _gpu(3)], 1.0)
    assert [(c.gpu, c.signal, c.action) for c in changes] == [(2, "fabric.error", "migrate")]
    fault = policy.node_fault()
    assert fault is not None and (fault.signal, fault.gpu, fault.value) == (
        "fabric.error",
        2,
        "fabric registration failed",
    )
    assert fault.cause() == {
        "signal": "fabric.error",
        "value": "fabric registration failed",
        "threshold": None,
        "gpu": 2,
        "scope": "node",
    }


def test_one_gpus_fault_is_not_the_nodes_unless_its_xid_is_listed_as_a_node_fault() -> None:
    policy = Policy(HealthConfig())
    policy.evaluate([_gpu(0, xids=(79,)), _gpu(1)], 0.0)  # fallen off the bus: that GPU's rank moves, alone
    assert policy.action_of("xid.79") == "migrate" and policy.node_fault() is None
    node_xids = Policy(HealthConfig(xid_node="145"))
    assert node_xids.action_of("xid.145") == "migrate"  # a node XID migrates even if xid_migrate omits it
    node_xids.evaluate([_gpu(0), _gpu(1, xids=(145,))], 0.0)
    fault = node_xids.node_fault()
    assert fault is not None and (fault.signal, fault.gpu) == ("xid.145", 1)


def test_every_gpu_failing_at_once_is_a_node_fault_one_after_the_other_is_not() -> None:
    policy = Policy(HealthConfig(node_window_s=10.0))
    policy.evaluate([_gpu(0, xids=(48,)), _gpu(1, xids=(48,))], 0.0)
    fault = policy.node_fault()
    assert fault is not None and (fault.signal, fault.gpu) == ("gpu.all", None)
    assert fault.value == "gpu0 xid.48, gpu1 xid.48" and fault.cause()["gpu"] == "all"
    apart = Policy(HealthConfig(node_window_s=10.0))
    apart.evaluate([_gpu(0, xids=(48,)), _gpu(1)], 0.0)
    assert apart.node_fault() is None  # one GPU: its own rank moves
    apart.evaluate([_gpu(0), _gpu(1, xids=(48,))], 30.0)  # the other, 30 s later: two GPU faults, not the node's
    assert apart.node_fault() is None
    single = Policy(HealthConfig())
    single.evaluate([_gpu(0, xids=(48,))], 0.0)
    assert single.node_fault() is None  # a node of one GPU: a GPU fault, as always


def test_a_nic_down_too_long_is_a_node_fault_only_when_asked_for() -> None:
    down = {"nic1": (100.0, "carrier lost")}
    off = Policy(HealthConfig())
    off.evaluate(_healthy(2), 0.0)
    assert off.node_fault(down, 10_000.0) is None  # LinkPass rides a dead NIC out: the default
    on = Policy(HealthConfig(nic_down_move_s=30.0))
    on.evaluate(_healthy(2), 0.0)
    assert on.node_fault(down, 120.0) is None
    fault = on.node_fault(down, 131.0)
    assert fault is not None and (fault.signal, fault.value, fault.gpu) == ("nic.down", "nic1", None)
    assert "nic1 down for 31 s (carrier lost)" in fault.why


def test_bad_node_xids_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "clockwork.toml"
    path.write_text('[health]\nxid_node = "145,x"\n')
    with pytest.raises(ConfigError, match=r"\[health\] xid_node: invalid XID 'x'"):
        load_config(path, env={})


# ----- sources: the fault file and NVML's fabric info -----------------------------------------------


def test_the_fault_file_injects_a_fabric_failure(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"gpus": {"1": {"fabric_error": "NVSwitch fatal error"}}}))
    path.chmod(0o644)
    gpu0, gpu1 = FaultFileSource(path, 2, "n1").read()
    assert (gpu0.fabric_error, gpu1.fabric_error) == ("", "NVSwitch fatal error")


class _FabricInfo(ctypes.Structure):
    _fields_ = [("status", ctypes.c_uint), ("cliqueId", ctypes.c_uint32), ("state", ctypes.c_ubyte)]


class FabricNvml(FakeNvml):
    """The stand-in with NVML's fabric info: gpu0's fabric training completed with a failure."""

    NVML_GPU_FABRIC_STATE_COMPLETED = 3
    c_nvmlGpuFabricInfo_t = _FabricInfo

    def nvmlDeviceGetGpuFabricInfo(self, handle: str, ref: Any) -> int:
        self._check(handle)
        info = ref._obj  # what ctypes.byref wraps
        info.state, info.status = 3, 999
        return 0

    def nvmlErrorString(self, code: int) -> bytes:
        return b"Unknown Error" if code == 999 else b"Success"


def test_nvml_reads_the_fabric_state() -> None:
    source = NvmlSource("n1", nvml=FabricNvml())
    gpu0, _ = source.read()
    assert gpu0.fabric_error == "fabric registration failed: Unknown Error"
    plain, _ = NvmlSource("n1", nvml=FakeNvml()).read()  # a binding without fabric info: not judged
    assert plain.fabric_error is None and "fabric info" in plain.unsupported


# ----- the watch: one request per rank, as clockwork migrate --ranks-on -----------------------------


def _joined(registry: Registry, job: int, slot: int, pid: int) -> None:
    registry.append_event(job, "torchpass.joined", {"slot": slot, "generation": 0}, by=f"uid 1000 pid {pid}")


def test_a_node_fault_moves_the_nodes_ranks_together_and_a_gpu_fault_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks of slots 2 and 3 run here on gpu0 and gpu1 (LOCAL_RANK 0 and 1). A temperature fault of gpu1 moves
    slot 3 alone; a fabric failure then moves both, slot 2 first asking for room for 2, slot 3 following the
    spare slot 2 took; one gpu.migration story with scope node and both slots."""
    asked: list[dict[str, Any]] = []

    def request(record: dict[str, Any], slot: int, timeout_s: float, requester: str, **kw: Any) -> dict[str, Any]:
        asked.append({"slot": slot, "group": kw.get("group", 1), "near": kw.get("near", ""), "by": requester})
        return {"target": f"a4.{len(asked)}.{slot - 2}", "generation": len(asked)}

    monkeypatch.setattr(watch_module, "request_migration", request)
    registry = Registry(tmp_path / "state", "n1")
    registry.register(5, 1000, "alice", ["n1", "n2"], {})
    registry.append_event(5, "torchpass.coordinator", {"leader": "tcp://x:1", "endpoints": [], "key": "k"})
    _joined(registry, 5, 2, 4002)
    _joined(registry, 5, 3, 4003)
    environ = {4002: {"LOCAL_RANK": "0"}, 4003: {"LOCAL_RANK": "1"}}
    path = tmp_path / "gpu.json"
    cfg = HealthConfig(source="fault-file", fault_file=str(path), raise_after=1, migrate_retry_s=3600.0)
    emitted: list[tuple[int, str, dict[str, Any]]] = []
    watch = HealthWatch(
        cfg,
        "n1",
        FaultFileSource(path, 2, "n1"),
        registry,
        lambda *e: emitted.append(e),
        alive=lambda pid: True,
        environ=environ.get,
    )

    def accepted(scope: str) -> list[dict[str, Any]]:
        watch.tick()
        return [
            f
            for _, kind, f in emitted
            if kind == "gpu.migration" and f.get("scope", "gpu") == scope and f["state"] == "accepted"
        ]

    try:
        path.write_text(json.dumps({"gpus": {"1": {"temperature_c": 95}}}))
        until("the one-GPU move", lambda: accepted("gpu"), 10, 0.02)
        assert [(a["slot"], a["group"], a["near"]) for a in asked] == [(3, 1, "")]  # gpu1's rank, alone
        path.write_text(json.dumps({"gpus": {"1": {"temperature_c": 95}, "0": {"fabric_error": "NVSwitch down"}}}))
        (moved,) = until("the whole-node move to be accepted", lambda: accepted("node"), 10, 0.02)
    finally:
        watch.close()
    node = asked[1:]
    assert [(a["slot"], a["group"], a["near"]) for a in node] == [(2, 2, ""), (3, 1, "a4.2.0")], asked
    assert "gpu0 fabric.error" in node[0]["by"]
    assert (moved["slots"], moved["signal"], moved["gpu"], moved["value"]) == (
        [2, 3],
        "fabric.error",
        0,
        "NVSwitch down",
    )
    assert moved["target"] == "a4.2.0, a4.3.1" and moved["pids"] == [4002, 4003]
    states = [f["state"] for _, k, f in emitted if k == "gpu.migration" and f.get("scope") == "node"]
    assert states == ["requested", "accepted"]  # asked once, and no one-GPU move of slot 2 beside it
    assert [f["slot"] for _, k, f in emitted if k == "gpu.migration" and "slot" in f] == [3, 3]
