"""``torchpass guest SCRIPT``: the replacement rank's agent on a borrowed node (a job step of the holder).

The borrowed node is not one of the training job's nodes, so its agent is not in the agents' mesh
(:mod:`torchpass.launch.mesh` knows its peers from the job's node list). It needs less than a mesh agent: it starts
one spare process per GPU on this node, G of them as on any node of the job (``TORCHPASS_RANKS_PER_NODE``,
which the borrowing agent sets), gives them a :class:`~torchpass.launch.proxy.CoordinatorProxy` as their coordinator,
and keeps that proxy pointed at whichever replica of the job's coordinator leads. A borrowed node therefore
offers G spare slots, one per local index, like a standby node: a node crash (G ranks at once) is rebuilt on it
in one generation, its ranks together and in local order. It finds the leader by asking
the replicas (``TORCHPASS_GUEST_ENDPOINTS``, the leading agent first): the leader answers, a passive replica
answers with the leader's address. The job key (``TORCHPASS_JOB_KEY``) authenticates every socket as for
any rank of the job.

To the coordinator each of the guest's processes is an ordinary spare (worker id ``gHOLDER.N``, or
``gHOLDER.J.J`` with local index J on a node of several ranks; no agent): it takes a vacant slot, receives the
training state from a surviving replica, and its liveness is its own heartbeats. Each gets ``LOCAL_RANK`` J and
``LOCAL_WORLD_SIZE`` G (:func:`torchpass.launch.node_ranks.rank_environment`: a step that sees fewer GPUs than G stops
before any spare starts). The guest exits once all its processes have, with the first failure's status; the
holder allocation (and so the node) is given back by the training job's Epilog. This module imports no torch.
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
from torchpass.launch.node_ranks import rank_environment
from torchpass.launch.proxy import CoordinatorProxy
from torchpass.launch.slurm_layout import ENV_RANKS_PER_NODE, SlurmLayoutError, resolve_address
from torchpass.rank.control import CoordinatorLost, CoordinatorRefused, CoordinatorRpc, JobStopped
from torchpass.rank_env import ENV_DAEMON_SOCKET, ENV_GLOO_HOST, LaunchEnv

__all__ = ["GuestAgent", "LeaderFinder", "guest_worker_id"]

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


def guest_worker_id(holder: str, local: int, per_node: int) -> str:
    """The worker id of the guest's spare on local index ``local``: ``gH.0`` on a node of one rank (the id of
    before), ``gH.J.J`` on a node of several (process J, local index J: :func:`torchpass.coordinator.placement` groups a
    node's spares by ``gH`` and orders them by J)."""
    return f"g{holder}.0" if per_node == 1 else f"g{holder}.{local}.{local}"


class GuestAgent:
    """The borrowed node's agent: G spare processes, a proxy to the leading coordinator, nothing else."""

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
        per_node = env.get(ENV_RANKS_PER_NODE, "1").strip() or "1"
        if not per_node.isdigit() or int(per_node) < 1:
            raise SlurmLayoutError(f"{ENV_RANKS_PER_NODE}={per_node!r} is not a positive integer")
        self.per_node = int(per_node)
        rank_environment(env, 0, self.per_node)  # a borrowed node with too few GPUs stops here
        self.holder = env.get("SLURM_JOB_ID", "0")
        self.node = env.get("SLURMD_NODENAME") or os.uname().nodename.split(".", 1)[0]
        self.address = resolve_address(self.node)
        self.finder = LeaderFinder([e for e in env[ENV_GUEST_ENDPOINTS].split(",") if e])
        self.proxy = CoordinatorProxy(self.address, self.finder.current)
        self._children: list[subprocess.Popen[bytes]] = []
        self._signal: int | None = None

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signal = signum
        for child in self._children:
            if child.poll() is None:
                child.terminate()

    def _environment(self, endpoint: str, wid: str, local: int) -> dict[str, str]:
        """What spare ``wid`` on local index ``local`` is told: the job's coordinator (through the proxy), its
        place on this node, and that this node's daemon does not know the training job."""
        launch = LaunchEnv(endpoint, wid, "spare", self.world_size, self.address, self.job_id, True)
        env = dict(self.environ)
        env.update(rank_environment(self.environ, local, self.per_node))
        env.update(launch.to_environ())
        env[ENV_CONFIG] = self.config.to_json()
        env[ENV_GLOO_HOST] = self.address
        env[ENV_DAEMON_SOCKET] = ""
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def run(self) -> int:
        """Start the proxy and one spare per local index; once every spare has ended, return the first failed
        one's exit status (0 when none failed; 128 + N when the guest was stopped by signal N)."""
        found = self.finder.probe()
        if found is not None:
            self.finder.leader = found
        endpoint = self.proxy.start()
        self.finder.start(self.proxy.leader_changed)
        wids = [guest_worker_id(self.holder, local, self.per_node) for local in range(self.per_node)]
        print(
            f"torchpass: guest on borrowed node {self.node} ({self.address}), holder job {self.holder}, for job "
            f"{self.job_id}: {self.per_node} spare slot(s) {', '.join(wids)}, coordinator {self.finder.current()}",
            file=sys.stderr,
        )
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for local, wid in enumerate(wids):
                argv = [self.python, self.script, *self.script_args]
                self._children.append(subprocess.Popen(argv, env=self._environment(endpoint, wid, local)))
            codes = [child.wait() for child in self._children]
            return 128 + self._signal if self._signal is not None else next((c for c in codes if c), 0)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for child in self._children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            self.finder.stop()
            self.proxy.stop()
