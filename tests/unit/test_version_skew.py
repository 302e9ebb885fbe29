"""Version skew between the parts of one job (clockwork.contracts.versions): refused at start, both versions named.

A TorchPass inside a user's image may be older or newer than the node's daemon, and a borrowed node's guest may
come from a re-pulled image tag. Here the node daemon is a real clockworkd and the coordinator a real one on its
sockets; the "other release" is this installation's version changed in the test process (the agent's or the
rank's side), or a rank's ``register`` carrying another version, exactly as an older or newer TorchPass would send.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from clockwork import __version__
from clockwork.contracts import versions
from clockwork.contracts.coordinator_client import CoordinatorRefused, CoordinatorRpc
from clockwork.contracts.coordinator_wire import JobState
from clockwork.contracts.errors import VersionSkewError
from tests.conftest import until
from tests.unit.daemon_harness import RunningDaemon, daemons, scratch, start_daemon, write_config
from torchpass.config import TorchPassConfig
from torchpass.coordinator.service import Coordinator
from torchpass.launch.agent import daemon_control_socket

__all__ = ["daemons", "scratch"]  # fixtures used by name below

pytestmark = pytest.mark.usefixtures("job_key")


def test_the_agent_refuses_a_node_daemon_of_another_release(
    scratch: Path, daemons: list[RunningDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(scratch)
    daemon = start_daemon(daemons, config)
    assert daemon_control_socket(str(config)) == str(daemon.paths.control_socket)  # same release: served
    monkeypatch.setattr(versions, "VERSION", "9.9.0")  # the image's TorchPass is newer than the node's daemon
    with pytest.raises(VersionSkewError) as refused:
        daemon_control_socket(str(config))
    message = str(refused.value)
    assert "this TorchPass node agent runs Clockwork/TorchPass 9.9.0, the node daemon" in message
    assert f"runs {__version__};" in message and "`clockwork --version`" in message
    assert refused.value.exit_code == 8  # the agent step ends non-zero, with this line


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _register(zctx: zmq.Context[zmq.Socket[bytes]], coord: Coordinator, wid: str, role: str, version: str) -> None:
    rpc = CoordinatorRpc(zctx, coord.endpoint, 3.0, identity=f"{wid}.r".encode())
    try:
        rpc.call("register", wid=wid, pid=1, host="127.0.0.1", store_port=1, role=role, version=version)
    finally:
        rpc.close()


def test_the_coordinator_refuses_a_rank_of_another_release_and_fails_the_job_before_it_starts(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    coord = Coordinator(2, TorchPassConfig(heartbeat_timeout_s=60.0))
    coord.start()
    try:
        _register(zctx, coord, "w0", "slot:0", __version__)
        with pytest.raises(CoordinatorRefused) as spare:  # a spare of another image: turned away, the job goes on
            _register(zctx, coord, "s9", "spare", "0.0.9")
        assert "s9 (pid 1 on 127.0.0.1) runs 0.0.9" in str(spare.value)
        assert f"the job's coordinator runs Clockwork/TorchPass {__version__}" in str(spare.value)
        assert coord.state is JobState.FORMING
        with pytest.raises(CoordinatorRefused, match=r"w1 \(pid 1 on 127.0.0.1\) runs a version older than 0\.1\.0"):
            _register(zctx, coord, "w1", "slot:1", "")  # a rank too old to say: an initial slot, the job fails
        until("the job to fail", lambda: coord.state is JobState.FAILED, 10)
        assert "version mismatch" in coord.failure_reason
    finally:
        coord.stop()
