"""``clockwork migrate JOBID --rank R``: finds a TorchPass job's coordinator through the node daemon and asks it.

A real daemon (see ``daemon_harness``) holds the job and its ``torchpass.coordinator`` record, as TorchPass's
node agents post it; real TorchPass coordinator replicas (one active, one passive) and fake ranks stand in
for the job. No torch, no Slurm: the job's nodes are never looked up in Slurm here (``--node`` or a stub).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from clockwork.cli import migrate_cmd
from clockwork.cli.main import run
from clockwork.contracts.jobkey import ENV_JOB_KEY, JobKey
from tests.unit.daemon_harness import RunningDaemon, daemons, scratch, start_daemon, write_config
from tests.unit.test_torchpass_coordinator import Events, FakeRank
from torchpass.config import TorchPassConfig
from torchpass.coordinator.service import Coordinator

pytestmark = pytest.mark.usefixtures("job_key")  # the in-process coordinators need the job key

__all__ = ["daemons", "scratch"]  # fixtures used by name below

JOB = 77
USER = pwd.getpwuid(os.getuid()).pw_name


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("CLOCKWORK_"):
            monkeypatch.delenv(var)


@pytest.fixture
def live(scratch: Path, daemons: list[RunningDaemon]) -> Iterator[tuple[Path, RunningDaemon]]:
    config = write_config(scratch)
    daemon = start_daemon(daemons, config)
    with daemon.client() as client:
        client.register_job(JOB, os.getuid(), USER, ["n1", "n2"], {"ft": "aware", "spares": "standby"})
    yield config, daemon


@contextlib.contextmanager
def _running_job(*, spare_after_s: float = 0.0) -> Iterator[tuple[Coordinator, Coordinator, Events]]:
    """A running 2-rank job: the active replica, a passive one, and the events. Its spare registers with it
    before it starts, or ``spare_after_s`` seconds after."""
    events = Events()
    config = TorchPassConfig(heartbeat_timeout_s=60.0)
    active = Coordinator(2, config, event_sink=events)
    passive = Coordinator(2, config, active=False)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    active.start()
    passive.start()
    passive.leader_hint = active.endpoint
    try:
        ranks = [FakeRank(context, active.endpoint, f"w{i}", r, 42000 + i) for i, r in enumerate(["slot:0", "slot:1"])]
        spare = FakeRank(context, active.endpoint, "w2", "spare", 42002)
        for rank in ranks if spare_after_s else [*ranks, spare]:
            rank.register()
        g0 = ranks[0].await_generation(-1)
        for rank in ranks:
            rank.joined(g0)
        deadline = time.monotonic() + 30
        while not events.of("torchpass.started"):
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.02)
        late = threading.Timer(spare_after_s, spare.register)
        if spare_after_s:
            late.start()
        try:
            yield active, passive, events
        finally:
            if spare_after_s:
                late.join()
    finally:
        active.stop()
        passive.stop()
        context.destroy(linger=0)


@pytest.fixture
def job() -> Iterator[tuple[Coordinator, Coordinator, Events]]:
    """A running 2-rank job with a ready spare."""
    with _running_job() as running:
        yield running


def _closed_endpoint() -> str:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return f"tcp://127.0.0.1:{port}"


def _post_record(
    daemon: RunningDaemon, leader: str, endpoints: list[str], world_size: int = 2, key: str | None = None
) -> None:
    """What an agent posts; the job key is the one the in-process coordinators serve with."""
    fields = {"leader": leader, "endpoints": endpoints, "world_size": world_size, "spares": 1, "agent": 1, "term": 0}
    fields["key"] = key if key is not None else os.environ[ENV_JOB_KEY]
    with daemon.client() as client:
        client.post_event(JOB, "torchpass.coordinator", fields)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_not_a_torchpass_job(capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon]) -> None:
    config, _ = live
    code, _, err = _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "0")
    assert code == 2 and f"job {JOB} is not a TorchPass job" in err and "`torchpass run ...` in the batch script" in err


def test_unknown_job(capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon]) -> None:
    config, _ = live
    code, _, err = _run(capsys, "--config", str(config), "migrate", "78", "--rank", "0", "--node", "n1")
    assert code == 1 and "job 78 is not known to the Clockwork daemon on n1" in err and "srun --jobid 78" in err


def test_unknown_here_asks_the_jobs_nodes(
    capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _ = live
    asked: list[int] = []
    monkeypatch.setattr(migrate_cmd, "local_node_name", lambda cfg: "login1")

    def job_nodes(loaded: object, job_id: int) -> list[str]:
        asked.append(job_id)
        return ["n1"]

    monkeypatch.setattr(migrate_cmd, "_job_nodes", job_nodes)
    code, _, err = _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "0")
    assert asked == [JOB] and code == 2 and "is not a TorchPass job" in err  # found on n1, which has no record


def test_rank_out_of_range(
    capsys: pytest.CaptureFixture[str],
    live: tuple[Path, RunningDaemon],
    job: tuple[Coordinator, Coordinator, Events],
) -> None:
    config, daemon = live
    active, _, _ = job
    _post_record(daemon, active.endpoint, [active.endpoint])
    code, _, err = _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "2")
    assert code == 2 and "rank 2 is out of range: the job trains on ranks 0..1" in err


def test_migrate_through_a_stale_record(
    capsys: pytest.CaptureFixture[str],
    live: tuple[Path, RunningDaemon],
    job: tuple[Coordinator, Coordinator, Events],
) -> None:
    """The record names a dead replica first, then a passive one: the CLI skips the first and follows the
    second's redirect to the leader."""
    config, daemon = live
    active, passive, events = job
    dead = _closed_endpoint()
    _post_record(daemon, dead, [dead, passive.endpoint, active.endpoint])
    code, out, err = _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "1", "--timeout", "0.5")
    assert code == 0, err
    assert f"job {JOB}: rank 1 moves to spare w2 in generation 1" in out
    requested = events.of("torchpass.migration_requested")
    assert requested and requested[0]["slot"] == 1 and requested[0]["by"].startswith("clockwork migrate (uid")
    assert active.info is not None and active.info.handoff is not None and active.info.handoff.source == "w1"


def test_newest_record_wins() -> None:
    events = [
        {"kind": "torchpass.coordinator", "time": 1.0, "fields": {"leader": "tcp://a:1", "term": 0}},
        {"kind": "job.registered", "time": 2.0, "fields": {}},
        {"kind": "torchpass.coordinator", "time": 3.0, "fields": {"leader": "tcp://b:1", "term": 1}},
    ]
    assert migrate_cmd.coordinator_record(events) == {"leader": "tcp://b:1", "term": 1}
    assert migrate_cmd.coordinator_record(events[1:2]) is None


def test_the_refusal_is_shown(
    capsys: pytest.CaptureFixture[str],
    live: tuple[Path, RunningDaemon],
    job: tuple[Coordinator, Coordinator, Events],
) -> None:
    config, daemon = live
    active, _, _ = job
    _post_record(daemon, active.endpoint, [active.endpoint])
    assert _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "0")[0] == 0
    code, _, err = _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "1", "--wait", "0")
    assert code == 1 and "the coordinator refused: cannot migrate slot 1" in err
    assert "a membership change is already in progress" in err and "asking again" not in err
    code, _, err = _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "1", "--wait", "1")
    assert code == 1 and "a membership change is already in progress (waited 1 s)" in err
    assert "asking again for up to 1 s" in err
    code, _, err = _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "1", "--wait", "-1")
    assert code == 2 and "--wait" in err


def test_waits_for_a_spare_to_be_ready(capsys: pytest.CaptureFixture[str], live: tuple[Path, RunningDaemon]) -> None:
    """Asked before the job's spare is ready (it is still starting), the CLI asks again until it is."""
    config, daemon = live
    with _running_job(spare_after_s=1.0) as (active, _, events):
        _post_record(daemon, active.endpoint, [active.endpoint])
        code, out, err = _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "1", "--wait", "30")
        assert code == 0, err
        assert "cannot migrate slot 1: no spare is ready; asking again for up to 30 s" in err
        assert f"job {JOB}: rank 1 moves to spare w2 in generation 1" in out
        assert len(events.of("torchpass.migration_requested")) == 1


def test_a_record_with_the_wrong_key_gets_no_answer(
    capsys: pytest.CaptureFixture[str],
    live: tuple[Path, RunningDaemon],
    job: tuple[Coordinator, Coordinator, Events],
) -> None:
    """The coordinators admit only holders of the job key: with another key the handshake fails, nothing is
    asked, and the CLI says no replica answered."""
    config, daemon = live
    active, _, events = job
    _post_record(daemon, active.endpoint, [active.endpoint], key=JobKey.new().hex)
    code, _, err = _run(capsys, "--config", str(config), "migrate", str(JOB), "--rank", "1", "--timeout", "0.5")
    assert code == 3 and "no coordinator replica of the job answered" in err
    assert not events.of("torchpass.migration_requested")
