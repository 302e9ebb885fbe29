"""The node agent: one per node of a Slurm job, in the node's own job step.

Inside ``sbatch --no-kill --clockwork-ft --clockwork-spares=standby -N (N+S)``, ``torchpass run train.py`` in
the batch script starts one job step per node (:mod:`torchpass.launch.node_steps`), and each becomes its node's
agent (``srun --ntasks-per-node=1 torchpass run train.py``, one step with a task per node, works too). Agent
K runs G processes, one per GPU (:mod:`torchpass.launch.node_ranks`): rank slots K*G .. K*G+G-1 when K is one of the
N/G training nodes, G spares otherwise. It runs a coordinator replica, and takes part in the
agents' mesh (:mod:`torchpass.launch.mesh`), which elects the replica that leads. There is no process whose loss
ends the job: the leader's node may crash like any other, and the lowest agent still heard takes over from
the replicated state.

What an agent does for its node:

* starts its training processes (ranks or spares) with the environment TorchPass's ranks expect: the
  coordinator endpoint is the agent's :class:`~torchpass.launch.proxy.CoordinatorProxy` (forwarding to whichever
  replica leads), each process binds its store server and gloo to the node's address (what the node name
  resolves to), knows its local index (``LOCAL_RANK``, its GPU) and dies with the agent, so the agent's
  silence is the whole node's: its G processes are counted lost together;
* watches each process through a pidfd and tells the leader at once when one exits (through the mesh); when
  one exits with an error while the node itself is fine, starts a new spare with the same local index (the
  same GPU) in its place, so a lost process does not cost a node, and the node offers that GPU as a spare slot;
* kills a process when the leader counts it lost (evicted), and leaves the job when the leader counts the
  whole agent lost (a node that was silent too long: its slots already went to spares);
* follows its node daemon's node-silent verdicts (:mod:`torchpass.launch.node_verdicts`; ``fabric_verdicts``): a node
  the daemons judge dead, in about a tenth of a second, is handed to the mesh at once;
* reports: every event of the agent, its coordinator replica while it leads and its rank goes to the node
  daemon when the job runs under Clockwork (``--clockwork-ft``, or ``CLOCKWORK_CONFIG`` set), and to
  ``--events FILE``. Every agent
  posts a ``torchpass.coordinator`` event (``{leader, endpoints, world_size, ...}``) to its node's daemon at
  the start and whenever the leader changes: that is how ``clockwork migrate JOBID --rank R`` finds the
  coordinator of a job.

The agent exits with 0 when the job finished, 1 when it failed, 128 + N on signal N. This module imports no
torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from clockwork.contracts.coordinator_wire import FailureKind, JobState
from clockwork.contracts.job_options import FtMode, JobOptions, JobOptionsError, SpareMode
from clockwork.contracts.versions import check_daemon
from torchpass.auth import job_key
from torchpass.config import ENV_CONFIG, TorchPassConfig
from torchpass.coordinator.placement import slot_moves
from torchpass.coordinator.records import worker_id
from torchpass.coordinator.service import Coordinator
from torchpass.events import DaemonEventSink, EventSink, JsonlEventSink, emit, tee
from torchpass.fabric_env import daemon_status_reader
from torchpass.failure_domains import node_domains
from torchpass.launch.borrow import BorrowDaemon, Borrower, guest_environment, spawn_guest
from torchpass.launch.container import container_from_environ, node_mounts
from torchpass.launch.mesh import AgentMesh
from torchpass.launch.node_fabric import NodeFabric
from torchpass.launch.node_ranks import rank_environment
from torchpass.launch.node_steps import AGENT_EXIT_DONE, AGENT_EXIT_FAILED, AGENT_EXIT_LEFT
from torchpass.launch.node_verdicts import VerdictFollower, node_heard
from torchpass.launch.proxy import CoordinatorProxy
from torchpass.launch.requeue import decide, requeue
from torchpass.launch.slurm_layout import (
    ENV_AGENT_INDEX,
    ENV_LOST_NODES_FILE,
    ENV_NODES,
    SlurmLayout,
    SlurmLayoutError,
)
from torchpass.launch.zygote import ForkedProcess, Zygote, start_process, start_zygote
from torchpass.rank_env import ENV_DAEMON_SOCKET, ENV_GLOO_HOST, LaunchEnv, rank_argv, thread_default

__all__ = ["SlurmAgent", "daemon_control_socket"]

#: How many moved slots the job's end tells the node daemon (``torchpass.placement``): about 100 bytes each with
#: the part's name, within the 16 KB a daemon event may carry.
PLACEMENT_SLOTS = 120

log = logging.getLogger("clockwork.torchpass.agent")

CONFIG_ENV = "CLOCKWORK_CONFIG"
FINISH_WAIT_S = 10.0  # the leader waits this long for the other agents to see the end before it exits


@dataclasses.dataclass
class _Child:
    """One of the node's processes: local index ``local`` (its GPU), its worker id and role at start."""

    local: int
    wid: str
    role: str
    proc: subprocess.Popen[bytes] | ForkedProcess
    pidfd: int | None  # None: a forked process (the zygote reports its exit), or no pidfds here
    code: int | None = None

    @property
    def alive(self) -> bool:
        return self.code is None


def daemon_control_socket(config_path: str) -> str:
    """This node's daemon control socket per Clockwork's configuration ('' when it cannot be found).

    Resolved once by the agent and handed to its ranks, so that no rank reads Clockwork's configuration."""
    try:
        from clockwork.contracts.daemon_client import DaemonClient  # lazy: torchpass -> clockworkd client only

        client = DaemonClient.for_this_node(config_path or None)
    except Exception as exc:  # clockworkd missing or a bad configuration: events stay in the log only
        log.warning("no events to the node daemon: %s: %s", type(exc).__name__, exc)
        return ""
    endpoint = client.endpoint
    path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else ""
    try:
        if path and Path(path).exists():  # a daemon serves here: it must be ours (VersionSkewError: the agent stops)
            client.timeout_s = 5.0
            check_daemon(client, "this TorchPass node agent", f"the node daemon ({path})")
        elif path:
            log.warning("no node daemon socket at %s (in a container: is its folder mounted?)", path)
    finally:
        client.close()
    return path


class SlurmAgent:
    """One node's TorchPass agent; :meth:`run` blocks until the job ends and returns the exit status."""

    def __init__(
        self,
        script: str,
        script_args: list[str],
        layout: SlurmLayout,
        config: TorchPassConfig,
        *,
        events_file: str | None = None,
        python: str = sys.executable,
        exit_grace_s: float = 30.0,
        environ: dict[str, str] | None = None,
        transparent: bool = False,
    ) -> None:
        self.script = script
        self.script_args = script_args
        self.layout = layout
        self.python = python
        self.exit_grace_s = exit_grace_s
        self.environ = dict(os.environ if environ is None else environ)
        rank_environment(self.environ, 0, layout.ranks_per_node)  # a node with too few GPUs stops here
        try:
            self.options = JobOptions.from_environ(self.environ)
        except JobOptionsError as exc:
            raise SlurmLayoutError(str(exc)) from None
        # Model-transparent mode: `torchpass run --transparent`, or the job's --clockwork-ft=transparent.
        self.transparent = transparent or self.options.ft is FtMode.TRANSPARENT
        # A survivor's broken collective must not trigger a same-members rebuild before a crashed node's
        # silence has been noticed: wait at least as long as the agents take to count a node lost.
        grace = config.agent_timeout_s + 2 * config.agent_heartbeat_interval_s
        if config.broken_grace_s < grace:
            config = dataclasses.replace(config, broken_grace_s=grace)
        self.config = config
        self.daemon_socket = ""
        daemon_sink: EventSink | None = None
        if self.environ.get(CONFIG_ENV) or self.options.enabled:  # else not a Clockwork job
            self.daemon_socket = daemon_control_socket(self.environ.get(CONFIG_ENV, ""))
            if self.daemon_socket:
                daemon_sink = DaemonEventSink(layout.job_id, self.daemon_socket)
        self._daemon_sink = daemon_sink
        self._jsonl_sink = JsonlEventSink(events_file.replace("{agent}", str(layout.index))) if events_file else None
        self.event_sink = tee(self._jsonl_sink, daemon_sink)
        self.key = job_key()  # every socket of the job needs it; without one the agent stops here
        domains = node_domains(config.failure_domains)  # node -> rack (leaf, block): spares avoid one that lost a node
        self.coordinator = Coordinator(
            layout.world_size,
            config,
            event_sink=self.event_sink,
            bind_host=layout.address,
            port=layout.port + 1,
            active=layout.index == 0,
            node_names=dict(enumerate(layout.nodes)),
            domains={k: domains[node] for k, node in enumerate(layout.nodes) if node in domains},
        )
        self.mesh = AgentMesh(layout, config, self.coordinator, event_sink=self.event_sink)
        if self.daemon_socket:  # a silent agent whose node the fabric still hears gets agent_stall_timeout_s
            socket = self.daemon_socket
            self.mesh.fabric_alive = lambda agent: node_heard(socket, layout.nodes[agent])
        self.coordinator.replicate = self.mesh.publish
        self.coordinator.leader_hint = self.mesh.leader_endpoint()
        self.proxy = CoordinatorProxy(layout.address, self.mesh.leader_endpoint)
        self.mesh.listeners.append(lambda _leader, _term: self.proxy.leader_changed())
        self.mesh.listeners.append(lambda _leader, _term: self._announce())
        # The fabric part of each new process's environment: NCCL_IB_HCA without the HCAs the daemon avoids,
        # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME on the node address's device.
        self.fabric = NodeFabric(
            layout.node,
            layout.address,
            self.environ,
            daemon_status_reader(self.daemon_socket) if self.daemon_socket else None,
            self.event_sink,
        )
        self.verdicts: VerdictFollower | None = None
        if self.daemon_socket and config.fabric_verdicts:
            self.verdicts = VerdictFollower(layout.job_id, self.daemon_socket, self._on_node_verdict)
        self.borrower: Borrower | None = None
        if self.options.spares is SpareMode.BORROW:  # a spare, when needed, is borrowed from other work
            self.borrower = Borrower(
                layout.job_id,
                connect=self._daemon_client,
                launch=self._launch_guest,
                fail=lambda reason: self.coordinator.fail_now(reason, FailureKind.CAPACITY),
                lost_node=self._lost_node,
                filled=lambda: not self.coordinator.vacant,
                fallback=config.borrow_fallback,
                timeout_s=config.borrow_timeout_s,
                event_sink=self.event_sink,
            )
            self.coordinator.on_spare_needed = self.borrower.need
        self._children: dict[int, _Child] = {}  # local index -> its newest process
        self._started = 0
        self.zygote: Zygote | None = None
        self._signal: int | None = None
        self._told_lost: frozenset[int] = frozenset()  # the lost agents the launcher was last told of
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _on_node_verdict(self, node: str, why: str, last_heard: float, silent_ms: float) -> None:
        """The node daemon judged ``node`` dead: every agent of the job on it is silent now."""
        for agent, name in enumerate(self.layout.nodes):
            if name == node:
                self.mesh.node_verdict(agent, why, last_heard, silent_ms / 1000)

    # ----- borrowed spares (--clockwork-spares=borrow) ------------------------------------------

    def _daemon_client(self) -> BorrowDaemon:
        """A client of this node's daemon, which borrows on the job owner's behalf (it checks who asks)."""
        if not self.daemon_socket:
            raise RuntimeError("this node's Clockwork daemon is not reachable (is clockworkd running here?)")
        from pathlib import Path

        from clockwork.contracts.daemon_client import DaemonClient  # lazy: torchpass -> clockworkd client only

        return DaemonClient(Path(self.daemon_socket), timeout_s=10.0)

    def _lost_node(self) -> str:
        """The node whose agent was counted lost last (what the borrowed node stands in for)."""
        dead = sorted(self.mesh.dead)
        return self.layout.nodes[dead[-1]] if dead else ""

    def _launch_guest(self, holder: int, node: str, gres: str = "") -> subprocess.Popen[bytes] | None:
        """Start the replacement on the borrowed node, in the holder allocation, as a spare of this job."""
        leader = self.mesh.leader_endpoint()
        endpoints = [leader, *(e for e in self.layout.coordinator_endpoints() if e != leader)]
        env = guest_environment(
            self.environ,
            job_id=self.layout.job_id,
            endpoints=endpoints,
            world_size=self.layout.world_size,
            key_hex=self.key.hex,
            ranks_per_node=self.layout.ranks_per_node,  # the borrowed node offers G spare slots
        )
        env[ENV_CONFIG] = self.config.to_json()
        container = container_from_environ(self.environ)  # the launcher's decision: the guest runs in the image too
        return spawn_guest(
            self.environ.get("TORCHPASS_SRUN", "srun"),
            self.python,
            self.script,
            self.script_args,
            container.step_environment(env),
            lambda borrowed: container.srun_args(node_mounts(self.environ, borrowed)),
        )(holder, node, gres)

    # ----- start -----------------------------------------------------------------------------

    def _announce(self) -> None:
        """Tell the node daemon (and the event file) where this job's coordinator is now.

        Only the daemon's copy carries the job key (for ``clockwork migrate``): the daemon shows a job's events
        to its owner and root alone, while the log and the events file may be readable by others."""
        fields = {
            "agent": self.layout.index,
            "node": self.layout.node,
            "leader": self.mesh.leader_endpoint(),
            "leader_agent": self.mesh.leader,
            "term": self.mesh.term,
            "endpoints": self.layout.coordinator_endpoints(),
            "nodes": list(self.layout.nodes),  # agent K runs on nodes[K] (clockwork migrate --ranks-on)
            "world_size": self.layout.world_size,
            "spares": self.layout.spares,
            "ranks_per_node": self.layout.ranks_per_node,
        }
        emit(self._jsonl_sink, log, "torchpass.coordinator", **fields)
        if self._daemon_sink is not None:  # not through emit(): that would log the key
            try:
                self._daemon_sink("torchpass.coordinator", {**fields, "key": self.key.hex})
            except Exception as exc:
                log.warning("the node daemon did not take the coordinator record: %s: %s", type(exc).__name__, exc)

    def _environment(self, wid: str, role: str, local: int) -> dict[str, str]:
        env = dict(self.environ)
        env.update(rank_environment(self.environ, local, self.layout.ranks_per_node))
        launch = LaunchEnv(
            self.proxy.endpoint,
            wid,
            role,
            self.layout.world_size,
            self.layout.address,
            str(self.layout.job_id),
            False,
            agent=self.layout.index,
        )
        env.update(launch.to_environ())
        env[ENV_CONFIG] = self.config.to_json()
        env[ENV_GLOO_HOST] = self.layout.address
        env[ENV_DAEMON_SOCKET] = self.daemon_socket
        env.update(self.fabric.current().env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _spawn(self, local: int, role: str) -> None:
        wid = worker_id(self.layout.index, self._started, local, self.layout.ranks_per_node)
        self._started += 1
        argv = rank_argv(self.python, self.script, self.script_args, transparent=self.transparent)
        proc, pidfd = start_process(self.zygote, argv, self._environment(wid, role, local))
        self._children[local] = _Child(local, wid, role, proc, pidfd)
        self.mesh.child_update(wid, role, None)
        how = "forked by the zygote" if isinstance(proc, ForkedProcess) else "own interpreter"
        log.info("started %s (%s) local index %d on %s, pid %d (%s)", wid, role, local, self.layout.node, proc.pid, how)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signal = signum
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            pass

    def run(self) -> int:
        """Start the replica, the mesh, the proxy and this node's process; supervise until the job ends."""
        try:
            self.coordinator.start()
            self.mesh.start()
        except Exception as exc:
            self.coordinator.stop()
            raise SlurmLayoutError(
                f"agent {self.layout.index} cannot listen on {self.layout.address} ports {self.layout.port} and "
                f"{self.layout.port + 1} ({exc}): another job or program holds them; choose others with --port"
            ) from None
        self.proxy.start()
        if self.verdicts is not None:
            self.verdicts.start()
        print(
            f"torchpass: agent {self.layout.index}/{self.layout.agents} on {self.layout.node} ({self.layout.address}), "
            f"job {self.layout.job_id}: {self.layout.world_size} rank(s), {self.layout.spares} spare node(s), "
            f"{self.layout.ranks_per_node} rank(s) per node; "
            f"coordinator replicas on port {self.layout.port + 1}; clockwork-ft {self.options.ft.value}",
            file=sys.stderr,
        )
        self._announce()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.config.zygote:
                # The node's ranks (and the spares that replace them) fork from a process that imported torch,
                # with the environment every process of the node shares (the thread default: torch sizes its
                # pools at import).
                env = {**self.environ, **thread_default(self.environ, self.layout.ranks_per_node)}
                env.setdefault("PYTHONUNBUFFERED", "1")
                self.zygote = start_zygote(self.python, env, self.script, preload_frameworks=self.config.spare_warmup)
            for local, role in enumerate(self.layout.initial_roles()):
                self._spawn(local, role)
            return self._supervise()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._terminate_children(grace_s=5.0)
            if self.zygote is not None:
                self.zygote.close()
            if self.borrower is not None:
                self.borrower.stop()
            if self.verdicts is not None:
                self.verdicts.stop()
            self.proxy.stop()
            self.mesh.stop()
            self.coordinator.stop()
            if self._daemon_sink is not None and isinstance(self._daemon_sink, DaemonEventSink):
                self._daemon_sink.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    # ----- supervision -----------------------------------------------------------------------

    def _live(self) -> list[_Child]:
        return [child for child in self._children.values() if child.alive]

    def _supervise(self) -> int:
        ended_at: float | None = None
        while True:
            live = self._live()
            fds = [self._wake_r] + [c.pidfd for c in live if c.pidfd is not None]
            if self.zygote is not None and self.zygote.alive:
                fds.append(self.zygote.fileno())  # it reports its children's exits
            unwatched = any(c.pidfd is None and not isinstance(c.proc, ForkedProcess) for c in live)
            select.select(fds, [], [], 0.05 if unwatched else 0.2)
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
            for child in self._live():
                self._poll_child(child)
            if self.mesh.lost_agents() != self._told_lost:
                self._tell_launcher_the_lost_nodes()
            if self._signal is not None:
                print(f"torchpass: signal {self._signal}: agent {self.layout.index} stops", file=sys.stderr)
                return 128 + self._signal
            if self.mesh.evicted.is_set():
                self._terminate_children(grace_s=2.0)
                print(
                    f"torchpass: agent {self.layout.index} was counted lost by the job's coordinator (silent too "
                    "long); its slot went to a spare: leaving the job",
                    file=sys.stderr,
                )
                # In its own step the launcher must not take this for the job's end; in a shared srun step a
                # non-zero status would fail the whole step although the job goes on.
                return AGENT_EXIT_LEFT if self.environ.get(ENV_AGENT_INDEX) else AGENT_EXIT_DONE
            state = self.mesh.job_state()
            if state.ended:
                ended_at = ended_at or time.monotonic()
                live = self._live()
                if live and time.monotonic() - ended_at > self.exit_grace_s:
                    running = ", ".join(c.wid for c in live)
                    log.warning("%s still running %.0f s after the job ended", running, self.exit_grace_s)
                    self._terminate_children(grace_s=5.0)
                if not self._live():
                    return self._finish(state)
                continue
            for child in self._live():
                if self.mesh.worker_alive(child.wid) is False:
                    log.warning("the coordinator counts %s as dead (evicted): killing it", child.wid)
                    child.proc.kill()

    def _poll_child(self, child: _Child, respawn: bool = True) -> None:
        if not child.alive:
            return
        code = child.proc.poll()
        if code is None:
            return
        child.code = code
        if child.pidfd is not None:
            os.close(child.pidfd)
            child.pidfd = None
        log.info("%s (%s) local index %d exited with %d", child.wid, child.role, child.local, code)
        self.proxy.forget(child.wid)
        self.mesh.child_update(child.wid, child.role, code)
        if not respawn or code == 0 or self.mesh.job_state().ended or self.mesh.evicted.is_set():
            return
        respawned = self._started - self.layout.ranks_per_node
        if respawned >= self.config.max_failures:
            log.warning("not starting another spare on this node: %d processes started already", self._started)
            return
        # The node is fine, only this process died: its GPU stays useful as a spare slot.
        self._spawn(child.local, "spare")

    def _finish(self, state: JobState) -> int:
        self.mesh.finished = True
        deadline = time.monotonic() + FINISH_WAIT_S
        # The leader stays until every agent saw the end, so the ranks get their answers and nobody holds an
        # election over a leader that simply left; a follower stays for a couple of heartbeats.
        if self.mesh.is_leader():
            while time.monotonic() < deadline and not self.mesh.live_peers_finished():
                time.sleep(self.config.agent_heartbeat_interval_s)
        else:
            time.sleep(3 * self.config.agent_heartbeat_interval_s)
        self._tell_launcher_the_lost_nodes()
        self._post_slot_moves()
        if state == JobState.DONE:
            return AGENT_EXIT_DONE
        print(f"torchpass: job failed: {self.mesh.failure_reason() or 'see the leader agent log'}", file=sys.stderr)
        if self.mesh.is_leader():
            self._last_line_of_defence()
        return AGENT_EXIT_FAILED

    def _last_line_of_defence(self) -> None:
        """The job failed: requeue it when new nodes and its newest snapshot can undo that (:mod:`requeue`)."""
        decision = decide(self.mesh.failure_kind(), self.config, self.environ)
        error = requeue(str(self.layout.job_id)) if decision.requeue else ""
        if decision.requeue and not error:
            emit(self.event_sink, log, "torchpass.requeued", **decision.fields())
            print(f"torchpass: job {self.layout.job_id}: {decision.why} ({decision.snapshot})", file=sys.stderr)
            return
        why = f"{decision.why}, but {error}" if error else decision.why
        emit(self.event_sink, log, "torchpass.not_requeued", **{**decision.fields(), "why": why})
        print(f"torchpass: job {self.layout.job_id} not requeued: {why}", file=sys.stderr)

    def _post_slot_moves(self) -> None:
        """Tell this node's daemon where the job's replaced ranks went (``torchpass.placement``: per slot, the
        node/local index it started on and the one it ended on, and the part of the state its rank received
        where the layout names one: ``stage 0 of the 2x2 pipeline``).

        Every agent holds the replicated state, so every agent can say it; the coordinator's own events reach
        only the leader's node daemon, while the Epilog that writes the job's AdminComment runs on the batch
        host, which seldom leads. This event is what lets that AdminComment name the slots."""
        initial, members = self.mesh.slot_holders()
        moved = slot_moves(initial, members, self.layout.nodes)
        parts = self.mesh.slot_parts()
        # The first PLACEMENT_SLOTS slots (what fits in one daemon event), and how many moved in all.
        slots = {
            str(slot): {"from": start, "to": now, **({"part": parts[slot]} if slot in parts else {})}
            for slot, (start, now) in list(moved.items())[:PLACEMENT_SLOTS]
        }
        fields = {"slots": slots, "moved": len(moved), "ranks_per_node": self.layout.ranks_per_node}
        emit(self.event_sink, log, "torchpass.placement", **fields)

    def _tell_launcher_the_lost_nodes(self) -> None:
        """On the batch launcher's node: which nodes the job counted lost, kept current while it runs and written
        once more when it ended. While it runs, the end of a lost node's step (Slurm declares the node down
        SlurmdTimeout after the crash, and its srun then exits 0) is no verdict on the job; once it ended, the
        launcher cancels those steps at once (they would hold the job until Slurm declares the node down)."""
        target = self.environ.get(ENV_LOST_NODES_FILE)
        self._told_lost = self.mesh.lost_agents()
        if not target:
            return
        nodes = self.environ.get(ENV_NODES, "").split(",")
        lost = [nodes[k] for k in sorted(self._told_lost) if k < len(nodes)]
        try:  # whole or not at all: the launcher may read it at any moment
            staged = Path(f"{target}.new")
            staged.write_text("".join(f"{node}\n" for node in lost))
            staged.replace(target)
        except OSError as error:
            log.warning("cannot tell the launcher the lost nodes (%s): it waits for their steps instead", error)

    def _terminate_children(self, grace_s: float) -> None:
        live = self._live()
        for child in live:
            child.proc.terminate()
        deadline = time.monotonic() + grace_s
        for child in live:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            self._poll_child(child, respawn=False)
        for child in self._children.values():
            if child.pidfd is not None:
                os.close(child.pidfd)
                child.pidfd = None
