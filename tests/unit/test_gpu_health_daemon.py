"""The GPU health watch inside a real ``clockworkd``: fault file -> policy -> a live migration request to a real
TorchPass coordinator, the job's events naming the signal, ``clockwork node gpus`` in-process, and the health
check's drain verdict once the rank has left the GPU.

The daemon is a real subprocess (``daemon_harness``) whose configuration selects the fault-file source; the job
is real TorchPass coordinator replicas with fake ranks (as in ``test_migrate_cli``); the rank whose GPU is
faulted is a real process that posts its ``torchpass.joined`` event to the daemon itself, with ``LOCAL_RANK=1``
in its environment, so the daemon maps it to gpu1 exactly as on the sandbox. A fault of the whole node (the
NVLink fabric) moves both of the node's ranks together, to one spare node, one after the other.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from clockwork.cli.main import run
from clockwork.contracts import atomic_file
from clockwork.sandbox import gpu_faults
from slurm_hooks.healthcheck import gpu_health_problems
from tests.conftest import until
from tests.unit.daemon_harness import RunningDaemon, daemons, scratch, start_daemon, write_config
from tests.unit.test_migrate_cli import JOB, USER, _post_record, job
from tests.unit.test_torchpass_coordinator import Events, FakeRank
from torchpass.config import TorchPassConfig
from torchpass.coordinator.service import Coordinator

pytestmark = pytest.mark.usefixtures("job_key")  # the in-process coordinators need the job key

__all__ = ["daemons", "job", "scratch"]  # fixtures used by name below

HEALTH = """
[health]
source = "fault-file"
fault_file = "{root}/{{node}}/gpu-faults.json"
emulated_gpus = 2
interval_s = 0.1
raise_after = 2
clear_after = 2
migrate_timeout_s = 2.0
migrate_retry_s = 0.5
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("CLOCKWORK_"):
            monkeypatch.delenv(var)


#: How long a test waits for the daemon to see a change (it reads the GPUs every few tenths of a second).
WAIT_S = 15.0


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def watched(scratch: Path, daemons: list[RunningDaemon]) -> Iterator[tuple[Path, RunningDaemon, Path]]:
    """A daemon reading a GPU fault file, with job JOB registered; yields (config, daemon, fault file)."""
    config = write_config(scratch, extra=HEALTH.format(root=scratch))
    daemon = start_daemon(daemons, config)
    with daemon.client() as client:
        client.register_job(JOB, os.getuid(), USER, ["n1", "n2"], {"ft": "aware", "spares": "standby"})
    yield config, daemon, scratch / "n1" / "gpu-faults.json"


@contextlib.contextmanager
def _rank(daemon: RunningDaemon, slot: int, local: int) -> Iterator[subprocess.Popen[str]]:
    """A process holding ``slot`` on this node, on its local rank ``local``, that told the daemon so itself."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from clockwork.contracts.daemon_client import DaemonClient\n"
        f"with DaemonClient(Path({str(daemon.paths.control_socket)!r})) as c:\n"
        f"    c.post_event({JOB}, 'torchpass.joined', {{'slot': {slot}, 'generation': 0, 'resume_step': 0}})\n"
        "print('joined', flush=True)\n"
        "time.sleep(120)\n"
    )
    env = dict(os.environ, LOCAL_RANK=str(local))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        if not ready:
            pytest.fail("the rank process did not post its joined event within 30 s")
        assert proc.stdout.readline() == "joined\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def rank_process(watched: tuple[Path, RunningDaemon, Path]) -> Iterator[subprocess.Popen[str]]:
    """A process holding slot 1 on this node, on its local rank 1, that told the daemon so itself."""
    with _rank(watched[1], 1, 1) as proc:
        yield proc


def _events(daemon: RunningDaemon, kind: str) -> list[dict[str, Any]]:
    with daemon.client() as client:
        return [e["fields"] for e in client.job_events(JOB) if e["kind"] == kind]


def _gpus(daemon: RunningDaemon) -> dict[str, Any]:
    with daemon.client() as client:
        return client.gpus()


def test_hot_gpu_moves_its_rank_before_it_fails(
    capsys: pytest.CaptureFixture[str],
    watched: tuple[Path, RunningDaemon, Path],
    rank_process: subprocess.Popen[str],
    job: tuple[Coordinator, Coordinator, Events],
) -> None:
    config, daemon, fault_file = watched
    active, passive, coordinator_events = job
    _post_record(daemon, active.endpoint, [passive.endpoint, active.endpoint])

    before = until("two healthy GPUs", lambda: (g := _gpus(daemon))["gpus"] and g, WAIT_S, 0.05)
    assert [(g["index"], g["health"]) for g in before["gpus"]] == [(0, "ok"), (1, "ok")]
    assert before["source"] == "fault-file"
    assert before["gpus"][0]["ranks"] == []
    assert [(r["slot"], r["pid"], r["how"]) for r in before["gpus"][1]["ranks"]] == [
        (1, rank_process.pid, "LOCAL_RANK")
    ]

    gpu_faults.apply(fault_file, 1, "temp", 95.0)
    accepted = until(
        "the accepted migration",
        lambda: [f for f in _events(daemon, "gpu.migration") if f["state"] == "accepted"],
        WAIT_S,
        0.05,
    )
    cause = {"signal": "temperature.slowdown", "value": 95.0, "threshold": 90.0, "gpu": 1, "slot": 1}
    assert {k: accepted[0][k] for k in cause} == cause
    assert accepted[0]["target"] == "w2" and accepted[0]["pid"] == rank_process.pid
    requested = [f for f in _events(daemon, "gpu.migration") if f["state"] == "requested"]
    assert len(requested) == 1 and requested[0]["mapping"] == "LOCAL_RANK"
    raised = [f for f in _events(daemon, "gpu.health") if f["state"] == "raised"]
    assert [(f["signal"], f["gpu"], f["value"], f["threshold"], f["action"], f["ranks"]) for f in raised] == [
        ("temperature.slowdown", 1, 95.0, 90.0, "migrate", [1])
    ]
    # The coordinator took it as a planned migration and knows why.
    moved = coordinator_events.of("torchpass.migration_requested")
    assert [m["slot"] for m in moved] == [1]
    assert "gpu1 temperature.slowdown 95.0 (threshold 90.0)" in moved[0]["by"]

    code, out, err = _cli(capsys, "--config", str(config), "node", "gpus", "--json")
    assert code == 0, err
    shown = json.loads(out)
    gpu1 = shown["gpus"][1]
    assert (gpu1["health"], gpu1["action"], gpu1["reading"]["temperature_c"]) == ("critical", "migrate", 95.0)
    assert [s["signal"] for s in gpu1["signals"]] == ["temperature.slowdown"]
    assert gpu1["drain_reason"] == "gpu1 temperature.slowdown 95.0 (threshold 90.0)"
    assert gpu1["drain_ready"] is False  # slot 1 still trains on it
    assert shown["gpus"][0]["health"] == "ok"
    assert [(m["slot"], m["state"]) for m in shown["migrations"]] == [(1, "accepted")]
    with daemon.client() as client:
        assert gpu_health_problems(client, "n1") == []

    code, out, err = _cli(capsys, "--config", str(config), "node", "gpus")
    assert code == 0, err
    for text in ("GPU health on n1: fault file", "critical", "95 C (limits 90/100)", "temperature.slowdown",
                 "job 77 slot 1", "last signals", "raised", "migration: job 77 slot 1 off gpu1"):  # fmt: skip
        assert text in out, (text, out)

    # The rank leaves (it handed its slot to the spare and exited): now the node may be drained.
    rank_process.kill()
    rank_process.wait()
    with daemon.client() as client:
        problems = until("the drain verdict", lambda: gpu_health_problems(client, "n1"), WAIT_S, 0.05)
    assert problems == ["gpu1 temperature.slowdown 95.0 (threshold 90.0)"]

    # A broken fault file is logged and ignored: the daemon goes on with the previous values.
    atomic_file.write_text(fault_file, "{broken")  # whole, as every writer must (a half-written file reads empty)
    until("the complaint", lambda: "GPU fault file ignored" in daemon.log_text(), WAIT_S, 0.05)
    seen = _gpus(daemon)["read_at"]  # the complaint's reading, or the one just before it
    broken = until("a reading of the broken file", lambda: (g := _gpus(daemon))["read_at"] > seen and g, WAIT_S, 0.05)
    assert "ignored:" in broken["source_state"], broken["source_state"]
    assert broken["gpus"][1]["reading"]["temperature_c"] == 95.0
    assert daemon.proc is not None and daemon.proc.poll() is None

    # Healed: the signal clears after clear_after readings, and the job hears it.
    gpu_faults.apply(fault_file, 1, "clear", None)
    until("the clear", lambda: [f for f in _events(daemon, "gpu.health") if f["state"] == "cleared"], WAIT_S, 0.05)
    after = _gpus(daemon)["gpus"][1]
    assert (after["health"], after["drain_reason"], after["drain_ready"]) == ("ok", "", False)
    assert [(c["signal"], c["state"]) for c in after["history"]] == [
        ("temperature.slowdown", "raised"),
        ("temperature.slowdown", "cleared"),
    ]


def test_a_refused_migration_is_recorded_and_retried(
    watched: tuple[Path, RunningDaemon, Path], rank_process: subprocess.Popen[str]
) -> None:
    _, daemon, fault_file = watched
    # A coordinator record that points at nothing: every request times out.
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dead = context.socket(zmq.ROUTER)
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    dead.close(0)
    context.term()
    _post_record(daemon, f"tcp://127.0.0.1:{port}", [f"tcp://127.0.0.1:{port}"])
    gpu_faults.apply(fault_file, 1, "ecc", 2)
    failed = until(
        "two failed attempts",
        lambda: len(f := [e for e in _events(daemon, "gpu.migration") if e["state"] == "failed"]) >= 2 and f,
        20,
        0.05,
    )
    assert failed[0]["signal"] == "ecc.uncorrected" and failed[0]["value"] == 2
    assert "no coordinator replica of the job answered" in failed[0]["error"]
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_without_nvml_the_daemon_reports_no_gpus(
    capsys: pytest.CaptureFixture[str], scratch: Path, daemons: list[RunningDaemon]
) -> None:
    config = write_config(scratch)  # the default source: NVML, which this machine does not have
    daemon = start_daemon(daemons, config)
    info = until("a first reading", lambda: (g := _gpus(daemon))["enabled"] and g, WAIT_S, 0.05)
    assert info["gpus"] == [] and info["source"] == "nvml"
    assert info["source_state"].startswith("NVML not available")
    code, out, err = _cli(capsys, "--config", str(config), "node", "gpus")
    assert code == 0, err
    assert "NVML not available" in out and "no GPUs" in out
    code, out, err = _cli(capsys, "--config", str(config), "node", "status", "--json")
    assert code == 0, err
    assert json.loads(out)["health"]["gpus"] == 0
    code, out, err = _cli(capsys, "--config", str(config), "node", "status")
    assert code == 0, err
    assert "gpu health:     on: NVML not available" in out and "no GPUs" in out
    with daemon.client() as client:
        client.ping()


def test_disabled_watch(capsys: pytest.CaptureFixture[str], scratch: Path, daemons: list[RunningDaemon]) -> None:
    config = write_config(scratch, extra="[health]\nenabled = false\n")
    start_daemon(daemons, config)
    code, out, err = _cli(capsys, "--config", str(config), "node", "gpus")
    assert code == 0, err
    assert "GPU health on n1: off (disabled by configuration ([health] enabled = false))" in out


AS_OTHER_USER = r"""
import json, sys
from pathlib import Path
from clockwork.contracts.daemon_client import DaemonClient

with DaemonClient(Path(sys.argv[1]), 3.0) as client:
    print(json.dumps(client.gpus()))
"""


def test_another_user_sees_the_gpus_but_not_other_jobs_ranks(
    scratch: Path, watched: tuple[Path, RunningDaemon, Path], rank_process: subprocess.Popen[str]
) -> None:
    """GPU health is node telemetry any local user may read; which job's rank sits on a GPU is not."""
    from tests.unit.daemon_harness import daemon_env
    from tests.unit.test_daemon import NOBODY, require_root_for_second_user

    require_root_for_second_user()
    _, daemon, _ = watched
    mine = until("the rank on gpu1", lambda: (g := _gpus(daemon))["gpus"] and g["gpus"][1]["ranks"] and g, WAIT_S, 0.05)
    assert [r["slot"] for r in mine["gpus"][1]["ranks"]] == [1]
    script = scratch / "gpus_as_nobody.py"
    script.write_text(AS_OTHER_USER)
    script.chmod(0o644)
    proc = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            str(script),
            str(daemon.paths.control_socket),
        ],
        capture_output=True,
        text=True,
        env={**daemon_env(), "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(scratch)},
        cwd=scratch,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout)
    assert [g["index"] for g in theirs["gpus"]] == [0, 1]
    assert theirs["gpus"][1]["ranks"] == [] and theirs["gpus"][1]["health"] == "ok"


@contextlib.contextmanager
def _job_of_two_nodes() -> Iterator[tuple[Coordinator, dict[str, FakeRank], Events]]:
    """A running 4-rank job (slots 0 and 1 on this node) and a spare node of two spare slots (a2.0.0, a2.1.1)."""
    events = Events()
    coordinator = Coordinator(4, TorchPassConfig(heartbeat_timeout_s=60.0), event_sink=events)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    coordinator.start()
    try:
        fakes = {f"w{i}": FakeRank(context, coordinator.endpoint, f"w{i}", f"slot:{i}", 43000 + i) for i in range(4)}
        for k, wid in enumerate(("a2.0.0", "a2.1.1")):
            fakes[wid] = FakeRank(context, coordinator.endpoint, wid, "spare", 43010 + k)
        for fake in fakes.values():
            fake.register()
        g0 = fakes["w0"].await_generation(-1)
        for i in range(4):
            fakes[f"w{i}"].joined(g0)
        until("the job to start", lambda: events.of("torchpass.started"), WAIT_S, 0.02)
        yield coordinator, fakes, events
    finally:
        coordinator.stop()
        context.destroy(linger=0)


def _complete_moves(coordinator: Coordinator, fakes: dict[str, FakeRank], count: int, done: list[str]) -> None:
    """Play the ranks' part of ``count`` planned moves, as each is declared: the departing rank hands its state
    over and leaves, every member joins the new generation (what real ranks do at their next step boundary)."""
    after = 0
    for _ in range(count):
        info = fakes["w3"].await_generation(after)  # slot 3 stays where it is: a member of every generation
        assert info.handoff is not None, info
        source, target = info.handoff.source, info.handoff.target
        fakes[source].call("departed", gen=info.gen, handoff_ok=True, handoff_ms=1.0)
        coordinator.worker_exited(source, f"slot:{info.slot_of(target)}", 0)
        for wid in info.members.values():
            fakes[wid].joined(info, **({"handoff_ok": True, "received": False} if wid == target else {}))
        done.append(f"{source}->{target}")
        after = info.gen


def test_a_fabric_failure_moves_the_nodes_ranks_together_to_one_spare_node(
    capsys: pytest.CaptureFixture[str], scratch: Path, daemons: list[RunningDaemon]
) -> None:
    """The NVLink fabric fails on this node (gpu0 reports it; every GPU of the node shares it): the watch moves
    slots 0 and 1 (gpu0 and gpu1, LOCAL_RANK 0 and 1) together, as ``clockwork migrate --ranks-on`` would: slot 0
    to a spare node with room for both, slot 1 after it to the same node, each once the previous move completed."""
    config = write_config(scratch, extra=HEALTH.format(root=scratch) + "node_move_wait_s = 30.0\n")
    daemon = start_daemon(daemons, config)
    with daemon.client() as client:
        client.register_job(JOB, os.getuid(), USER, ["n1", "n2"], {"ft": "aware", "spares": "standby"})
    with _job_of_two_nodes() as (coordinator, fakes, events), _rank(daemon, 0, 0), _rank(daemon, 1, 1):
        _post_record(daemon, coordinator.endpoint, [coordinator.endpoint], world_size=4)
        until("both ranks mapped", lambda: all(g["ranks"] for g in _gpus(daemon)["gpus"]), WAIT_S, 0.05)
        done: list[str] = []
        driver = threading.Thread(target=_complete_moves, args=(coordinator, fakes, 2, done), daemon=True)
        driver.start()
        gpu_faults.write(scratch / "n1" / "gpu-faults.json", {"gpus": {"0": {"fabric_error": "NVSwitch fatal"}}})

        def node_moves() -> list[dict[str, Any]]:
            moves = [f for f in _events(daemon, "gpu.migration") if f.get("scope") == "node"]
            return [f for f in moves if f["state"] == "accepted"]

        accepted = until("the whole-node move", node_moves, WAIT_S * 3, 0.05)
        driver.join(WAIT_S)
        code, out, err = _cli(capsys, "--config", str(config), "node", "gpus")
    assert done == ["w0->a2.0.0", "w1->a2.1.1"]  # both onto the spare node, in local order, one after the other
    assert [(m["slot"], m["source"]) for m in events.of("torchpass.migration_requested")] == [(0, "w0"), (1, "w1")]
    assert len(events.of("torchpass.migrated")) == 2 and not events.of("torchpass.member_failed")
    (move,) = accepted
    assert (move["scope"], move["slots"], move["signal"], move["gpu"]) == ("node", [0, 1], "fabric.error", 0)
    assert move["target"] == "a2.0.0, a2.1.1"
    requested = [f for f in _events(daemon, "gpu.migration") if f["state"] == "requested"]
    assert [f.get("scope") for f in requested] == ["node"]  # no one-GPU move of gpu0's rank beside it
    assert code == 0, err
    assert "migration: job 77 slots 0, 1 off the node (fabric.error NVSwitch fatal): accepted" in out, out
