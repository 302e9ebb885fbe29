"""The RDMA path, through the sysfs seam: a node whose ``ib3`` died gives the processes of the next generation
``NCCL_IB_HCA=^mlx5_3`` and an explicit ``NCCL_SOCKET_IFNAME``, and its GPU health watch moves the node's ranks
into such processes.

No machine here has an HCA: ``/sys/class/net/ibN/device/infiniband/mlx5_N`` is a folder tree in tmp_path, read
by the same code that reads /sys on a cluster. The LinkPass engine, the node agent's environment and the GPU
health policy are the real ones; the daemon's status is the engine's own ``status()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from clockwork.contracts.config.health import HealthConfig
from clockwork.contracts.errors import ClockworkError
from clockworkd.gpuhealth import watch as watch_module
from clockworkd.gpuhealth.faultfile import FaultFileSource
from clockworkd.gpuhealth.policy import Policy
from clockworkd.gpuhealth.watch import HealthWatch
from clockworkd.registry import Registry
from linkpass.engine import LinkPass
from linkpass.fabric import FabricMap
from linkpass.hca import SysfsHcas
from linkpass.settings import LinkPassConfig
from tests.conftest import until
from torchpass.config import TorchPassConfig
from torchpass.fabric_env import (
    NCCL_IB_HCA,
    NCCL_SOCKET_IFNAME,
    exclude_hcas,
    fabric_environment,
    nccl_path,
    parse_version,
)
from torchpass.launch.agent import SlurmAgent
from torchpass.launch.node_fabric import NodeFabric

RAILS = ("ib0", "ib1", "ib2", "ib3")
FABRIC = {
    "nodes": {
        f"node{n}": {"addr": f"10.0.0.{n}", "nics": {rail: f"10.{k + 1}.0.{n}" for k, rail in enumerate(RAILS)}}
        for n in (1, 2)
    }
}


def fake_sysfs(root: Path) -> Path:
    """ibK -> mlx5_K, as mlx5_core lays it out; ``eth0`` has no RDMA device."""
    for k, rail in enumerate(RAILS):
        (root / "class" / "net" / rail / "device" / "infiniband" / f"mlx5_{k}").mkdir(parents=True)
    (root / "class" / "net" / "eth0" / "device").mkdir(parents=True)
    return root


def node1_engine(sysfs: Path, events: list[tuple[str, dict[str, Any]]]) -> LinkPass:
    engine = LinkPass(
        LinkPassConfig(apply_sysctls=False),
        "node1",
        FabricMap.parse(FABRIC),
        b"k" * 32,
        lambda kind, fields: events.append((kind, fields)),
        hca_of=SysfsHcas(sysfs).hca_of,
    )
    engine.nic_up = dict.fromkeys(RAILS, True)  # what start() reads from the kernel
    return engine


def kill_ib3(engine: LinkPass) -> None:
    """ib3 loses carrier, as the kernel's link event reports it."""
    engine.nic_up["ib3"] = False
    engine.nic_down_reason["ib3"] = "ib3 carrier lost"


def agent_environment(fabric: NodeFabric, environ: dict[str, str]) -> dict[str, str]:
    """The environment the node agent gives a process it starts now: SlurmAgent._environment, on an agent with
    only what that method reads (a whole agent binds its coordinator's ports and joins a mesh)."""
    layout = SimpleNamespace(ranks_per_node=4, world_size=8, address="10.0.0.1", job_id=77, index=0)
    agent = SimpleNamespace(
        environ=environ,
        layout=layout,
        proxy=SimpleNamespace(endpoint="tcp://10.0.0.1:29501"),
        config=TorchPassConfig(),
        daemon_socket="/run/clockwork/node1.sock",
        fabric=fabric,
    )
    return SlurmAgent._environment(cast(Any, agent), "w9", "spare", 3)


def test_sysfs_maps_netdevs_to_hcas(tmp_path: Path) -> None:
    hcas = SysfsHcas(fake_sysfs(tmp_path))
    assert hcas.hca_of("ib3") == "mlx5_3"
    assert hcas.hca_of("eth0") is None  # a PCI device without RDMA
    assert hcas.hca_of("nope") is None
    assert hcas.hca_of("../x") is None


def test_next_generation_of_a_node_whose_ib3_died_excludes_mlx5_3(tmp_path: Path) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    engine = node1_engine(fake_sysfs(tmp_path / "sys"), events)
    status = {"linkpass": engine.status()}
    fabric = NodeFabric("node1", "10.0.0.1", {}, lambda: status, interfaces={"lo": ["127.0.0.1"], "cw0": ["10.0.0.1"]})

    before = agent_environment(fabric, {"PATH": "/usr/bin"})
    assert NCCL_IB_HCA not in before  # every HCA healthy: NCCL picks as usual
    assert before[NCCL_SOCKET_IFNAME] == "=cw0" and before["GLOO_SOCKET_IFNAME"] == "cw0"

    kill_ib3(engine)
    status["linkpass"] = engine.status()
    assert status["linkpass"]["avoid_hcas"] == {"mlx5_3": "ib3: ib3 carrier lost"}
    after = agent_environment(fabric, {"PATH": "/usr/bin"})
    assert after[NCCL_IB_HCA] == "^mlx5_3"
    assert after[NCCL_SOCKET_IFNAME] == "=cw0"  # the node address's device, explicitly
    assert after["TORCHPASS_ROLE"] == "spare"  # the process that takes a moved slot at the next generation

    # The GPU health watch's policy turns the avoided HCA into a whole-node move after hca_down_move_s.
    policy = Policy(dataclasses.replace(HealthConfig(), hca_down_move_s=1.0))
    down = {hca: (100.0, why) for hca, why in engine.avoid_hcas().items()}
    assert policy.node_fault({}, 100.5, down) is None
    fault = policy.node_fault({}, 101.0, down)
    assert fault is not None and fault.signal == "hca.down" and fault.value == "mlx5_3"
    assert "NCCL_IB_HCA" in fault.why


def test_a_user_inclusion_list_is_narrowed_not_replaced(tmp_path: Path) -> None:
    engine = node1_engine(fake_sysfs(tmp_path / "sys"), [])
    kill_ib3(engine)
    environ = {NCCL_IB_HCA: "mlx5_0:1,mlx5_3:1"}  # the job's own choice of HCAs
    fabric = NodeFabric("node1", "10.0.0.1", environ, lambda: {"linkpass": engine.status()}, interfaces={})
    env = agent_environment(fabric, environ)
    assert env[NCCL_IB_HCA] == "mlx5_0:1"
    assert NCCL_SOCKET_IFNAME not in env  # no device holds the address: left alone, and said so
    assert fabric.last is not None and any("no interface holds" in note for note in fabric.last[1])


def test_no_daemon_or_a_shared_loopback_says_why_nothing_is_set() -> None:
    env = fabric_environment({}, {}, "10.0.0.1", {"lo": ["127.0.0.1", "10.0.0.1"]})
    assert env.env == {} and "shares lo" in env.notes[0]
    fabric = NodeFabric("node1", "10.0.0.1", {}, None, interfaces={"cw0": ["10.0.0.1"]})
    assert "no node daemon" in fabric.current().notes[0]


def test_exclusions_merge() -> None:
    assert exclude_hcas(None, ["mlx5_3"]) == "^mlx5_3"
    assert exclude_hcas("^mlx5_1", ["mlx5_3", "mlx5_1"]) == "^mlx5_1,mlx5_3"
    assert exclude_hcas("=mlx5_0,mlx5_3", ["mlx5_3"]) == "=mlx5_0"
    assert exclude_hcas("mlx5_3", ["mlx5_3"]) == "^mlx5_3"
    assert exclude_hcas("mlx5_0", []) == "mlx5_0"


def test_which_nccl_versions_get_port_failover() -> None:
    assert parse_version((2, 29, 7)) == (2, 29, 7)
    assert parse_version(22907) == (2, 29, 7) and parse_version(2708) == (2, 7, 8)
    assert parse_version("2.21.5+cuda12.4") == (2, 21, 5) and parse_version("x") is None
    assert nccl_path((2, 29, 7)).port_failover and nccl_path((2, 30, 0)).port_failover
    assert not nccl_path((2, 29, 6)).port_failover and not nccl_path((2, 21, 5)).port_failover
    assert not nccl_path(None).port_failover
    assert "no CUDA" in nccl_path(None, cuda=False).why


def _watch_with_ranks_here(tmp_path: Path, engine: LinkPass, clock: Callable[[], float]) -> tuple[Any, list[Any]]:
    """The GPU health watch of node1 with job 5's slots 2 and 3 running here, fed LinkPass's avoid_hcas."""
    registry = Registry(tmp_path / "state", "node1")
    registry.register(5, 1000, "alice", ["node1", "node2"], {})
    registry.append_event(5, "torchpass.coordinator", {"leader": "tcp://x:1", "endpoints": [], "key": "k"})
    for slot, pid in ((2, 4002), (3, 4003)):
        registry.append_event(5, "torchpass.joined", {"slot": slot, "generation": 0}, by=f"uid 1000 pid {pid}")
    path = tmp_path / "gpu.json"
    cfg = HealthConfig(source="fault-file", fault_file=str(path), hca_down_move_s=1.0, migrate_retry_s=3600.0)
    emitted: list[tuple[int, str, dict[str, Any]]] = []
    watch = HealthWatch(
        cfg,
        "node1",
        FaultFileSource(path, 2, "node1"),
        registry,
        lambda *e: emitted.append(e),
        clock=clock,
        alive=lambda pid: True,
        environ={4002: {"LOCAL_RANK": "0"}, 4003: {"LOCAL_RANK": "1"}}.get,
        hcas_down=engine.avoid_hcas,
    )
    return watch, emitted


@pytest.mark.parametrize("spare", [True, False], ids=["spare-ready", "no-spare"])
def test_the_health_watch_moves_the_nodes_ranks_or_says_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spare: bool
) -> None:
    def request(record: dict[str, Any], slot: int, timeout_s: float, requester: str, **kw: Any) -> dict[str, Any]:
        if not spare:
            raise ClockworkError(f"cannot migrate slot {slot}: no spare is ready (waited 30 s)")
        return {"target": f"w{slot + 10}", "generation": 7}

    monkeypatch.setattr(watch_module, "request_migration", request)
    engine = node1_engine(fake_sysfs(tmp_path / "sys"), [])
    now = [1000.0]
    watch, emitted = _watch_with_ranks_here(tmp_path, engine, lambda: now[0])

    def moves() -> list[dict[str, Any]]:
        watch.tick()
        return [f for _, kind, f in emitted if kind == "gpu.migration" and f["state"] in ("accepted", "failed")]

    try:
        watch.tick()
        kill_ib3(engine)
        watch.tick()  # seen now: the move waits hca_down_move_s
        assert not [f for _, k, f in emitted if k == "gpu.migration"]
        now[0] += 1.0
        (done,) = until("the node move's outcome", moves, 10, 0.02)
    finally:
        watch.close()
    assert (done["signal"], done["value"], done["slots"], done["scope"]) == ("hca.down", "mlx5_3", [2, 3], "node")
    assert "NCCL_IB_HCA" in done["why"]
    if spare:
        assert done["state"] == "accepted" and "consequence" not in done
    else:
        assert done["state"] == "failed" and "no spare is ready" in done["error"]
        assert done["consequence"].startswith("TorchPass cannot act")
