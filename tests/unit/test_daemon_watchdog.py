"""A hung NVML call does not blind the daemon: the GPU read runs on its own thread, the loop keeps serving LinkPass
and requests, and the watchdog names the stuck part and for how long.

The NVML library is the only stand-in (no GPU here): ``HungNvml`` is ``pynvml`` whose temperature call blocks until
the test releases it, like a wedged driver. Everything else is real: an in-process ``Daemon`` serving its control
socket, two real LinkPass engines sending UDP heartbeats over loopback (SO_BINDTODEVICE: root), the real
``NvmlSource`` and ``HealthWatch``.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.config.health import HealthConfig
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import DaemonPaths
from clockworkd.gpuhealth.guarded import PART, GuardedSource
from clockworkd.gpuhealth.nvml import NvmlSource
from clockworkd.gpuhealth.readings import SourceBusyError
from clockworkd.gpuhealth.watch import HealthWatch
from clockworkd.server import Daemon
from clockworkd.watchdog import Watchdog
from linkpass.engine import LinkPass
from tests.conftest import until
from tests.unit.linkpass_engines import loopback_engines
from tests.unit.test_gpu_health import FakeNvml

KEY = b"w" * 32
IPS = {"n1": "127.0.0.51", "n2": "127.0.0.52"}


class HungNvml(FakeNvml):
    """``pynvml`` whose temperature read blocks while ``hang`` is set, until ``release`` is."""

    def __init__(self) -> None:
        super().__init__()
        self.hang = threading.Event()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.blocked = 0  # calls that blocked: a hung call must never be joined by another

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        if self.hang.is_set():
            self.blocked += 1
            self.entered.set()
            self.release.wait()
        return super().nvmlDeviceGetTemperature(handle, sensor)


def test_a_hung_read_raises_busy_at_once_keeps_one_thread_stuck_and_is_named_stuck() -> None:
    nvml = HungNvml()
    dog = Watchdog("n1", stuck_after_s=0.0)
    source = GuardedSource(NvmlSource("n1", nvml=nvml), dog, wait_s=0.05)
    try:
        assert len(source.read()) == 2  # healthy: readings come back through the worker
        nvml.hang.set()
        with pytest.raises(SourceBusyError, match="did not return within"):
            source.read()
        assert nvml.entered.is_set()
        for _ in range(3):  # while it hangs, each read refuses at once: no second thread joins the stuck one
            with pytest.raises(SourceBusyError, match="still running"):
                source.read()
        assert nvml.blocked == 1 and source.hung_reads == 1
        assert [s["part"] for s in dog.stuck()] == [PART]
        assert dog.stuck()[0]["thread"].startswith("gpu-health-read")
        assert "a read has hung for" in source.describe()
        nvml.hang.clear()
        nvml.release.set()
        until("the hung read to return", lambda: source.busy_for() is None, timeout_s=10)
        assert len(source.read()) == 2 and dog.stuck() == []
    finally:
        nvml.release.set()
        source.close()


def test_the_watchdog_logs_a_stuck_part_with_its_stack_once_and_its_recovery(caplog: pytest.LogCaptureFixture) -> None:
    dog = Watchdog("n1", stuck_after_s=0.0)
    release = threading.Event()
    inside = threading.Event()

    def stuck_part() -> None:
        with dog.working("disk"):
            inside.set()
            release.wait()

    worker = threading.Thread(target=stuck_part, name="slow-disk")
    worker.start()
    try:
        inside.wait(10)
        with caplog.at_level(logging.WARNING, "clockwork.daemon.watchdog"):
            dog.check()
            dog.check()
            release.set()
            worker.join(10)
            dog.check()
    finally:
        release.set()
    stuck = [r.getMessage() for r in caplog.records if "stuck for" in r.getMessage()]
    assert len(stuck) == 1 and "disk stuck for" in stuck[0] and "thread slow-disk" in stuck[0]
    assert "in stuck_part" in stuck[0]  # where the thread is
    assert any("disk is moving again" in r.getMessage() for r in caplog.records)


@pytest.fixture
def engines() -> Iterator[dict[str, LinkPass]]:
    if os.geteuid() != 0:
        pytest.fail("LinkPass binds its heartbeat sockets to a device (SO_BINDTODEVICE), which needs root")
    with loopback_engines(IPS, KEY) as out:
        yield out


def test_linkpass_and_requests_go_on_while_an_nvml_call_hangs(tmp_path: Path, engines: dict[str, LinkPass]) -> None:
    root = Path(os.path.realpath("/tmp")) / f"cw-wd-{os.getpid()}"  # a short path: the control socket's name
    cfg = DaemonConfig(
        run_dir=str(root / "run"),
        state_dir=str(tmp_path / "state"),
        node_name="n1",
        slurm_user=pwd.getpwuid(os.getuid()).pw_name,
        listen_port=0,
    )
    paths = DaemonPaths.from_config(cfg)
    daemon = Daemon(cfg, paths)
    daemon.start()
    daemon.watchdog.stuck_after_s = 0.3
    nvml = HungNvml()
    assert daemon.registry is not None
    health = HealthWatch(
        HealthConfig(interval_s=0.05),
        "n1",
        GuardedSource(NvmlSource("n1", nvml=nvml), daemon.watchdog, wait_s=0.1),
        daemon.registry,
        daemon.emit_job_event,
    )
    n1 = engines["n1"]
    daemon.components["linkpass"] = n1
    daemon.components["health"] = health
    loop = threading.Thread(target=daemon.serve, name="daemon-loop")
    loop.start()
    try:
        until("the health watch to read the GPUs", lambda: health.reads >= 2, timeout_s=20)
        nvml.hang.set()
        until("an NVML call to hang", nvml.entered.is_set, timeout_s=20)
        # The loop goes on: LinkPass's tick (its decisions) keeps running, its thread keeps hearing n2.
        ticked, heard = n1.next_tick, n1.last_heard().get("n2", 0.0)
        until("LinkPass to tick on", lambda: n1.next_tick > ticked, timeout_s=20)
        until("n1 to hear n2 on", lambda: n1.last_heard().get("n2", 0.0) > heard, timeout_s=20)
        reads = health.reads

        def stuck_parts() -> list[str]:
            with DaemonClient(paths, timeout_s=3.0) as client:  # the loop answers requests meanwhile
                return [s["part"] for s in client.status()["watchdog"]["stuck"]]

        until("status to name the hung GPU read", lambda: stuck_parts() == [PART], timeout_s=20)
        with DaemonClient(paths, timeout_s=3.0) as client:
            status = client.status()
        assert status["health"]["busy_rounds"] >= 1 and "a read has hung for" in status["health"]["source"]
        assert status["watchdog"]["stuck"][0]["for_s"] >= 0.3
        assert health.reads == reads and nvml.blocked == 1  # no new readings, and no second stuck thread
        nvml.hang.clear()
        nvml.release.set()
        until("GPU reads to resume", lambda: health.reads > reads and health.busy_rounds == 0, timeout_s=20)
        assert stuck_parts() == []
    finally:
        nvml.release.set()
        daemon.request_stop()
        loop.join(20)
        shutil.rmtree(root, ignore_errors=True)
        assert not loop.is_alive()
