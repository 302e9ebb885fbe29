"""``torchpass guest SCRIPT``: the replacement rank's agent on a borrowed node (a job step of the holder).

The borrowed node is not one of the training job's nodes, so its agent is not in the agents' mesh
(:mod:`torchpass.launch.mesh` knows its peers from the job's node list). It needs less than a mesh agent: it starts
one spare process on this node, gives it a :class:`~torchpass.launch.proxy.CoordinatorProxy` as its coordinator, and
keeps that proxy pointed at whichever replica of the job's coordinator leads. It finds the leader by asking
the replicas (``TORCHPASS_GUEST_ENDPOINTS``, the leading agent first): the leader answers, a passive replica
answers with the leader's address. The job key (``TORCHPASS_JOB_KEY``) authenticates every socket as for
any rank of the job.

To the coordinator the guest's process is an ordinary spare (worker id ``gHOLDER.N``, no agent): it takes a
vacant slot, receives the training state from a surviving replica, and its liveness is its own heartbeats.
The guest exits with its process's status; the holder allocation (and so the node) is given back by the
training job's Epilog. This module imports no torch.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType

import zmq

from torchpass.config import ENV_CONFIG, TorchPassConfig
from torchpass.launch.borrow import ENV_GUEST_ENDPOINTS, ENV_GUEST_JOB, ENV_GUEST_WORLD
from torchpass.launch.proxy import CoordinatorProxy
from torchpass.launch.slurm_layout import SlurmLayoutError, resolve_address
from torchpass.rank.control import CoordinatorLost, CoordinatorRefused, CoordinatorRpc, JobStopped
from torchpass.rank_env import ENV_DAEMON_SOCKET, ENV_GLOO_HOST, LaunchEnv

__all__ = ["GuestAgent", "LeaderFinder"]

log = logging.getLogger("clockwork.torchpass.guest")


class LeaderFinder:
    """Which coordinator replica leads, as the replicas themselves say (polled every ``interval_s``)."""

    def __init__(self, endpoints: Sequence[str], interval_s: float = 1.0, timeout_s: float = 1.0) -> None:
        if not endpoints:
            raise SlurmLayoutError(f"{ENV_GUEST_ENDPOINTS} is empty: the guest cannot find the job's coordinator")
        self.endpoints = list(endpoints)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.leader = self.endpoints[0]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    def current(self) -> str:
        """The leader as last found (the first endpoint until an answer says otherwise)."""
        return self.leader

    def probe(self) -> str | None:
        """Ask the replicas once, the presumed leader first; the leader's endpoint, or None if nobody knows."""
        order = [self.leader, *(e for e in self.endpoints if e != self.leader)]
        for endpoint in order:
            rpc = CoordinatorRpc(self._ctx, endpoint, timeout_s=self.timeout_s)
            try:
                rpc.call("status")
                return endpoint
            except CoordinatorRefused as exc:
                if exc.leader.startswith("tcp://"):
                    return exc.leader
            except (CoordinatorLost, JobStopped):
                continue
            finally:
                rpc.close()
        return None

    def start(self, on_change: Callable[[], None]) -> None:
        """Poll in a thread; ``on_change()`` after the leader moved."""

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                found = self.probe()
                if found is not None and found != self.leader:
                    log.warning("the job's coordinator leads from %s now (was %s)", found, self.leader)
                    self.leader = found
                    on_change()

        self._thread = threading.Thread(target=run, name="torchpass-guest-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the polling and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._ctx.term()


class GuestAgent:
    """The borrowed node's agent: one spare process, a proxy to the leading coordinator, nothing else."""

    def __init__(
        self,
        script: str,
        script_args: list[str],
        config: TorchPassConfig,
        environ: Mapping[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        env = dict(os.environ if environ is None else environ)
        missing = [
            v for v in (ENV_GUEST_ENDPOINTS, ENV_GUEST_WORLD, ENV_GUEST_JOB, "TORCHPASS_JOB_KEY") if not env.get(v)
        ]
        if missing:
            raise SlurmLayoutError(
                f"{', '.join(missing)} unset: `torchpass guest` is started by a training job's agent on a "
                "borrowed node, not by hand"
            )
        self.script, self.script_args, self.config, self.python, self.environ = script, script_args, config, python, env
        self.job_id = env[ENV_GUEST_JOB]
        self.world_size = int(env[ENV_GUEST_WORLD])
        self.holder = env.get("SLURM_JOB_ID", "0")
        self.node = env.get("SLURMD_NODENAME") or os.uname().nodename.split(".", 1)[0]
        self.address = resolve_address(self.node)
        self.finder = LeaderFinder([e for e in env[ENV_GUEST_ENDPOINTS].split(",") if e])
        self.proxy = CoordinatorProxy(self.address, self.finder.current)
        self._child: subprocess.Popen[bytes] | None = None
        self._signal: int | None = None

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signal = signum
        if self._child is not None and self._child.poll() is None:
            self._child.terminate()

    def run(self) -> int:
        """Start the proxy and the spare; return the spare's exit status (128 + N on signal N)."""
        found = self.finder.probe()
        if found is not None:
            self.finder.leader = found
        endpoint = self.proxy.start()
        self.finder.start(self.proxy.leader_changed)
        wid = f"g{self.holder}.0"
        launch = LaunchEnv(endpoint, wid, "spare", self.world_size, self.address, self.job_id, True)
        env = dict(self.environ)
        env.update(launch.to_environ())
        env[ENV_CONFIG] = self.config.to_json()
        env[ENV_GLOO_HOST] = self.address
        env[ENV_DAEMON_SOCKET] = ""  # this node's daemon does not know the training job
        env.setdefault("PYTHONUNBUFFERED", "1")
        print(
            f"torchpass: guest on borrowed node {self.node} ({self.address}), holder job {self.holder}, for job "
            f"{self.job_id}: spare {wid}, coordinator {self.finder.current()}",
            file=sys.stderr,
        )
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._child = subprocess.Popen([self.python, self.script, *self.script_args], env=env)
            code = self._child.wait()
            return 128 + self._signal if self._signal is not None else code
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self._child is not None and self._child.poll() is None:
                self._child.kill()
                self._child.wait()
            self.finder.stop()
            self.proxy.stop()
