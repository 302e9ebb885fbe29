"""``torchpass run train.py`` in a batch script: one Slurm job step per node, so a node crash ends only its own.

Why not one ``srun`` with a task per node? When a node of a job step dies, Slurm ends the *whole step* as soon
as it declares the node down (``srun: error: Node failure``, then ``Force Terminated``): the survivors would be
killed SlurmdTimeout seconds after the crash, however well TorchPass had recovered. With ``--no-kill`` on the
job, Slurm keeps the job and its other steps, so this launcher starts one single-task step per node
(``srun --nodes=1 --ntasks=1 --nodelist=NODE``): the crashed node's step ends, the others train on. Each step
asks for the job's container, if it has one (:mod:`torchpass.launch.container`): the agents and their ranks run
in the user's image.

Each step runs ``torchpass run`` again, with the job's node list and its own index in the environment
(``TORCHPASS_NODES``, ``TORCHPASS_AGENT_INDEX``) and G, the ranks per node decided once here
(``TORCHPASS_RANKS_PER_NODE``, :mod:`torchpass.launch.node_ranks`); it becomes that node's agent
(:mod:`torchpass.launch.agent`), which runs the node's G ranks. The step asks for one task whatever
``--ntasks-per-node`` the job has (``--ntasks-per-node=G`` is one way to ask for G ranks per node).

The batch host (the node running this script) goes last in that list, so it starts as a standby spare and
the coordinator leads from another node. Slurm ends a job whose batch host fails, even with ``--no-kill``,
once it declares that node down (SlurmdTimeout); every other node's loss is TorchPass's to repair. Keeping
the batch host out of the training slots at the start keeps that one Slurm-imposed risk off the busy nodes.

The job is over when an agent ends with its verdict (0: training finished, 1: the job failed), unless the job
counted that agent's node lost or Slurm holds the node down: when Slurm declares a crashed node down (SlurmdTimeout
after the crash), it ends the node's step and its srun exits 0, which says nothing of the job. The steps that are
still running then get ``finish_grace_s`` to end by themselves; a step whose node died can only end when
Slurm declares the node down, so it is cancelled instead of holding the job for SlurmdTimeout. The agent on
the launcher's own node keeps current which nodes the job counted lost (``TORCHPASS_LOST_NODES_FILE``,
a file on this node); their steps are cancelled after ``lost_grace_s`` instead: a job that lost a node ends a
moment after its last live step. The launcher exits with the verdict; SIGINT/SIGTERM (``scancel``) are passed to
every step.
This module imports no torch.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from torchpass.auth import ENV_JOB_KEY, JobKey
from torchpass.launch.container import ContainerKind, ContainerSpec, bundle_warnings, node_mounts
from torchpass.launch.slurm_layout import (
    ENV_AGENT_INDEX,
    ENV_LOST_NODES_FILE,
    ENV_NODES,
    ENV_RANKS_PER_NODE,
    SlurmLayoutError,
    expand_hostlist,
)

__all__ = [
    "AGENT_EXIT_DONE",
    "AGENT_EXIT_FAILED",
    "AGENT_EXIT_LEFT",
    "NodeSteps",
    "cpus_per_node",
    "in_batch_script",
]

log = logging.getLogger("clockwork.torchpass.steps")

AGENT_EXIT_DONE = 0  # an agent's exit status: the job finished
AGENT_EXIT_FAILED = 1  # the job failed (no spare left, too many failures, ...)
AGENT_EXIT_LEFT = 3  # this agent was counted lost and left; the job goes on without it
VERDICTS = (AGENT_EXIT_DONE, AGENT_EXIT_FAILED)


#: The batch step's id as a batch script sees it: Slurm 26.05 exports ``SLURM_STEP_ID=-5`` there (its
#: ``SLURM_BATCH_SCRIPT``, 0xfffffffb, printed signed); 22.05 and 24.11 export no step id at all.
BATCH_STEP_IDS = frozenset({"-5", str(0xFFFFFFFB), "batch"})


def in_batch_script(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs in a job's batch script (an allocation, but not inside a job step)."""
    env = os.environ if environ is None else environ
    steps = [env.get(name, "") for name in ("SLURM_STEP_ID", "SLURM_STEPID")]
    return bool(env.get("SLURM_JOB_ID")) and all(not step or step in BATCH_STEP_IDS for step in steps)


def cpus_per_node(expr: str, count: int) -> list[int]:
    """Expand ``SLURM_JOB_CPUS_PER_NODE`` (``4(x2),2``) to one CPU count per node."""
    out: list[int] = []
    for item in filter(None, (part.strip() for part in expr.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if match is None:
            raise SlurmLayoutError(f"SLURM_JOB_CPUS_PER_NODE={expr!r}: cannot read {item!r}")
        out += [int(match.group(1))] * int(match.group(2) or 1)
    if len(out) != count:
        raise SlurmLayoutError(f"SLURM_JOB_CPUS_PER_NODE={expr!r} lists {len(out)} node(s), the job has {count}")
    return out


@dataclass
class _Step:
    node: str
    proc: subprocess.Popen[bytes]
    code: int | None = None
    cancelled: bool = False


@dataclass
class NodeSteps:
    """Start one agent step per node of the job and wait for the job's verdict."""

    argv: Sequence[str]  # the arguments of ``torchpass`` itself (``run ... train.py args``), passed on unchanged
    srun: str = "srun"
    scontrol: str = "scontrol"
    python: str = sys.executable
    finish_grace_s: float = 15.0
    lost_grace_s: float = 1.0  # for the steps on nodes the job counted lost
    ranks_per_node: int = 0  # G, decided once here for every agent (0: each agent decides)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    container: ContainerSpec = field(default_factory=ContainerSpec)  # the job's, on every agent step
    _signal: int | None = None

    def commands(self) -> list[tuple[str, list[str], dict[str, str]]]:
        """(node, srun command line, environment) of each agent step, in agent order."""
        nodes = expand_hostlist(self.environ.get("SLURM_JOB_NODELIST") or self.environ.get("SLURM_NODELIST", ""))
        if len(nodes) < 2:
            raise SlurmLayoutError(
                f"the job has {len(nodes)} node(s): TorchPass needs at least two (a rank and a spare, or two ranks)"
            )
        cpus_expr = self.environ.get("SLURM_JOB_CPUS_PER_NODE", "")
        cpus = dict(zip(nodes, cpus_per_node(cpus_expr, len(nodes)) if cpus_expr else [0] * len(nodes), strict=True))
        batch_host = self.environ.get("SLURMD_NODENAME", "")
        if batch_host in nodes:
            nodes = [n for n in nodes if n != batch_host] + [batch_host]
        key = JobKey.from_environ(self.environ) or JobKey.new()  # one per job: every agent and rank gets it
        out = []
        for index, node in enumerate(nodes):
            env = dict(self.environ, **{ENV_NODES: ",".join(nodes), ENV_AGENT_INDEX: str(index), ENV_JOB_KEY: key.hex})
            if self.ranks_per_node:
                env[ENV_RANKS_PER_NODE] = str(self.ranks_per_node)
            if node == batch_host:
                env[ENV_LOST_NODES_FILE] = str(self._lost_nodes_file)
            cmd = [self.srun, "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--kill-on-bad-exit=0"]
            cmd += ["--ntasks-per-node=1"]  # one agent, whatever --ntasks-per-node the job has (its G ranks)
            cmd += [f"--cpus-per-task={cpus[node]}"] if cpus[node] else []
            cmd += self.container.srun_args(node_mounts(env, node))  # the agent and its ranks run in the image
            cmd += ["--job-name=torchpass-agent", self.python, "-m", "torchpass", *self.argv]
            out.append((node, cmd, self.container.step_environment(env)))
        return out

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signal = signum

    def run(self) -> int:
        """Run the steps; the job's verdict as exit status (128 + N after signal N)."""
        plan = self.commands()
        print(
            f"torchpass: job {self.environ.get('SLURM_JOB_ID')}: one agent step per node on {len(plan)} node(s): "
            + " ".join(node for node, _, _ in plan),
            file=sys.stderr,
            flush=True,
        )
        if self.container.srun_args():
            print(f"torchpass: every agent step in the job's {self.container.describe()}", file=sys.stderr, flush=True)
        if self.container.kind is ContainerKind.OCI:  # the bundle carries its mounts: say what it lacks, once
            for warning in bundle_warnings(self.container.bundle, node_mounts(self.environ, plan[0][0])):
                print(f"torchpass: warning: {warning}", file=sys.stderr, flush=True)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        steps = [_Step(node, subprocess.Popen(cmd, env=env)) for node, cmd, env in plan]
        try:
            return self._wait(steps)
        finally:
            self._lost_nodes_file.unlink(missing_ok=True)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._cancel([s for s in steps if s.code is None], why="the launcher is stopping")

    @property
    def _lost_nodes_file(self) -> Path:
        return Path(tempfile.gettempdir()) / f"torchpass-{self.environ.get('SLURM_JOB_ID', '0')}-{os.getpid()}.lost"

    def _lost_nodes(self) -> set[str]:
        try:
            return set(self._lost_nodes_file.read_text().split())
        except OSError:
            return set()

    def _slurm_says_down(self, node: str) -> bool:
        """Whether slurmctld holds ``node`` down or not responding: the second witness that a step's end is its
        node's loss, for when the lost-nodes file cannot reach this launcher (an agent in a container whose /tmp
        is its own). A failed query says no: the step's end is then taken as the agent's word, as before."""
        try:
            shown = subprocess.run(
                [self.scontrol, "-o", "show", "node", node], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("cannot ask Slurm about %s (%s): taking its step's end as its agent's word", node, exc)
            return False
        state = re.search(r"\bState=(\S+)", shown.stdout)
        flags = set(re.split(r"[+*]", state.group(1).upper())) if state else set()
        return bool(flags & {"DOWN", "NOT_RESPONDING", "FAIL"}) or (state is not None and "*" in state.group(1))

    def _wait(self, steps: list[_Step]) -> int:
        verdict: int | None = None
        verdict_at = 0.0
        while True:
            for step in steps:
                if step.code is None and (code := step.proc.poll()) is not None:
                    step.code = code
                    if not step.cancelled:
                        log.info("agent step on %s ended with %d", step.node, code)
                    if verdict is None and code in VERDICTS:
                        if step.node in self._lost_nodes():
                            # Slurm declared the crashed node down and its srun exited: no word from its agent.
                            log.info("the job counted %s lost before its step ended: not the job's verdict", step.node)
                        elif self._slurm_says_down(step.node):
                            log.info("Slurm declared %s down before its step ended: not the job's verdict", step.node)
                        else:
                            verdict, verdict_at = code, time.monotonic()
            running = [s for s in steps if s.code is None]
            if self._signal is not None:
                self._cancel(running, why=f"signal {self._signal}")
                return 128 + self._signal
            if verdict is not None and (not running or time.monotonic() - verdict_at > self.finish_grace_s):
                self._cancel(running, why=f"the job ended {self.finish_grace_s:.0f} s ago (their node is lost)")
                return verdict
            if verdict is not None and time.monotonic() - verdict_at > self.lost_grace_s:
                lost = self._lost_nodes()
                on_lost = [s for s in running if s.node in lost]
                self._cancel(on_lost, why="the job ended and counted their node lost", at_once=True)
            if verdict is None and not running:
                codes = {s.node: s.code for s in steps}
                print(f"torchpass: every agent step ended without the job's verdict: {codes}", file=sys.stderr)
                return AGENT_EXIT_FAILED
            time.sleep(0.1)

    def _cancel(self, steps: list[_Step], *, why: str, at_once: bool = False) -> None:
        """End these steps: SIGTERM to srun (passed to the task), SIGKILL if it does not end within 5 s; SIGKILL
        ``at_once`` for steps on a lost node (nobody there to pass SIGTERM to: srun would only wait)."""
        if not steps:
            return
        print(f"torchpass: cancelling the agent steps on {', '.join(s.node for s in steps)}: {why}", file=sys.stderr)
        for step in steps:
            step.cancelled = True
            if at_once:
                step.proc.kill()
            else:
                step.proc.terminate()
        deadline = time.monotonic() + 5.0
        for step in steps:
            try:
                step.code = step.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                step.proc.kill()  # srun gives up on a step whose node cannot answer; Slurm cleans it up
                step.code = step.proc.wait()
