"""Where this agent sits in a Slurm job: which node, which slot or spare, and every peer's address.

Under the batch-script launcher (:mod:`torchpass.launch.node_steps`, one job step per node) the launcher says who is
where: ``TORCHPASS_NODES`` (the job's nodes in agent order) and ``TORCHPASS_AGENT_INDEX``. In one srun step
with a task per node (``srun --ntasks-per-node=1 torchpass run train.py``), everything an agent needs to find
the others comes from the environment srun gives every task. Either way no rendezvous service is needed
before the agents can talk:

* ``SLURM_JOB_ID``: the job (daemon events, the default port);
* ``SLURM_PROCID`` / ``SLURM_NTASKS``: this agent's index and how many agents there are. The first N
  agents hold the rank slots 0..N-1 at the start, the other S wait as spares;
* ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) and ``SLURM_NODEID``: the step's nodes. With one
  task per node, task K runs on the K-th node of the list, so agent K's address is what that node's name
  resolves to;
* ``SLURMD_NODENAME`` (else the short hostname): this node's name.

The node's stable address is what its name resolves to (not a NIC address: LinkPass moves the routes of that
address between NICs), so the agent's sockets, the ranks' store servers and gloo all bind to it.

Each agent runs G ranks (:mod:`torchpass.launch.node_ranks` says how G is chosen: one per GPU by default). Rank slots
are numbered as torchrun numbers them, contiguous per node: training agent K holds slots K*G .. K*G+G-1 at the
start, its local index J being slot K*G+J; a spare agent runs G spare processes, local indices 0..G-1. A slot is
a (node, local index) pair only at the start: a replacement keeps the slot number and runs where its spare was.

How many of the tasks are spares: ``--spares S`` (nodes) or ``--nproc N`` (ranks: N/G nodes) on the command
line; else the
``--clockwork-spares`` mode the SPANK plugin exported to the job (``CLOCKWORK_SPARES``, or
``SLURM_SPANK_CLOCKWORK_SPARES`` under ``--export=NONE``): ``standby`` means one spare node, ``none`` none.
``borrow`` means no standby spare: when one is needed the agents borrow a node from preemptible work
(:mod:`torchpass.launch.borrow`).

The agents' two ports (the agent mesh, and the coordinator replica one above it) are the same on every node,
derived from the job id unless ``--port`` says otherwise, so each agent knows every peer's endpoints from the
node list alone. The hostlist syntax (``node[01-04,07],gpu3``) is expanded in-process
(:mod:`clockwork.contracts.hostlist`) because TorchPass must not depend on Slurm's libraries or commands. This module
imports no torch.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from clockwork.contracts.hostlist import expand_hostlist as _expand_hostlist
from clockwork.contracts.job_options import JobOptions, JobOptionsError, SpareMode

__all__ = [
    "ENV_AGENT_INDEX",
    "ENV_LOST_NODES_FILE",
    "ENV_NODES",
    "ENV_RANKS_PER_NODE",
    "PORT_BASE",
    "PORT_SPAN",
    "SlurmLayout",
    "SlurmLayoutError",
    "default_port",
    "expand_hostlist",
    "in_slurm_step",
    "resolve_address",
    "training_nodes",
]

log = logging.getLogger("clockwork.torchpass.slurm")

# Agent ports: PORT_BASE + 2 * (job id % PORT_SPAN) for the mesh, one above it for the coordinator replica.
# The range stays below Linux's ephemeral ports (32768+), so no outgoing connection can be holding it.
PORT_BASE = 21000
PORT_SPAN = 5000
STANDBY_SPARES_DEFAULT = 1
# Set by the batch-script launcher (:mod:`torchpass.launch.node_steps`) for its one-task-per-node steps:
ENV_NODES = "TORCHPASS_NODES"  # the job's nodes, comma separated: agent K runs on the K-th
ENV_AGENT_INDEX = "TORCHPASS_AGENT_INDEX"  # this step's agent index
ENV_RANKS_PER_NODE = "TORCHPASS_RANKS_PER_NODE"  # G, decided once by the launcher (torchpass.launch.node_ranks)
#: Given by the batch launcher to the agent on its own node only: where that agent writes, once the job ended, the
#: nodes whose agents the job counted lost (one per line), so that the launcher need not wait for their steps.
ENV_LOST_NODES_FILE = "TORCHPASS_LOST_NODES_FILE"


class SlurmLayoutError(ValueError):
    """The job step does not have the shape TorchPass needs (the message says what and how to fix it)."""


def in_slurm_step(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a task of a Slurm job step (what ``srun`` sets)."""
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_JOB_ID") and env.get("SLURM_PROCID"))


def expand_hostlist(expr: str) -> list[str]:
    """Expand Slurm's hostlist syntax: ``a[1-3,07],b`` -> ``a1 a2 a3 a07 b`` (zero padding kept), by the one
    implementation the daemon uses too (:mod:`clockwork.contracts.hostlist`, python-hostlist with Slurm's rules)."""
    try:
        return _expand_hostlist(expr)
    except ValueError as exc:
        raise SlurmLayoutError(str(exc)) from None


def resolve_address(name: str) -> str:
    """The IPv4 address ``name`` resolves to: a node's stable address (what gloo and the stores bind to)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SlurmLayoutError(f"node name {name!r} does not resolve to an address: {exc}") from None
    return str(infos[0][4][0])


def default_port(job_id: int) -> int:
    """The agents' mesh port for ``job_id`` (the coordinator replica listens one above it)."""
    return PORT_BASE + 2 * (job_id % PORT_SPAN)


@dataclass(frozen=True)
class SlurmLayout:
    """This agent's place in the job step and the addresses of every agent."""

    job_id: int
    index: int  # SLURM_PROCID: agent index; agent K < world_size / G starts rank slots K*G .. K*G+G-1
    world_size: int  # N: training slots (ranks), training nodes x G
    spares: int  # S: standby agents, each with G spare processes (agents = N / G + S)
    nodes: tuple[str, ...]  # node name of agent K
    addresses: tuple[str, ...]  # stable address of agent K's node
    port: int  # mesh port on every node; the coordinator replica uses port + 1
    ranks_per_node: int = 1  # G: processes per agent, one per GPU

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise SlurmLayoutError(
                f"{self.world_size} rank(s) do not fill whole nodes of {self.ranks_per_node} rank(s) each"
            )

    @property
    def training_agents(self) -> int:
        """How many agents hold rank slots at the start (the others are spare nodes)."""
        return self.world_size // self.ranks_per_node

    @property
    def agents(self) -> int:
        """How many agents (srun tasks) the job step has."""
        return len(self.nodes)

    @property
    def node(self) -> str:
        """This agent's node name."""
        return self.nodes[self.index]

    @property
    def address(self) -> str:
        """This node's stable address."""
        return self.addresses[self.index]

    @property
    def initial_role(self) -> str:
        """The role of this agent's first process (local index 0): see :meth:`role_of`."""
        return self.role_of(self.index, 0)

    def role_of(self, agent: int, local: int) -> str:
        """The starting role of ``agent``'s process with local index ``local``: ``slot:K*G+J`` on a training
        node (contiguous per node, as torchrun numbers ranks), ``spare`` on a spare node."""
        if not 0 <= local < self.ranks_per_node:
            raise ValueError(f"local index {local} is not one of 0..{self.ranks_per_node - 1}")
        return f"slot:{agent * self.ranks_per_node + local}" if agent < self.training_agents else "spare"

    def initial_roles(self) -> list[str]:
        """The starting roles of this agent's G processes, by local index."""
        return [self.role_of(self.index, local) for local in range(self.ranks_per_node)]

    def mesh_endpoint(self, agent: int) -> str:
        """Where agent ``agent`` listens for its peers' heartbeats."""
        return f"tcp://{self.addresses[agent]}:{self.port}"

    def coordinator_endpoint(self, agent: int) -> str:
        """Where agent ``agent``'s coordinator replica listens."""
        return f"tcp://{self.addresses[agent]}:{self.port + 1}"

    def coordinator_endpoints(self) -> list[str]:
        """Every replica's endpoint, in agent order."""
        return [self.coordinator_endpoint(k) for k in range(self.agents)]

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        spares: int | None = None,
        nproc: int | None = None,
        port: int | None = None,
        ranks_per_node: int = 1,
    ) -> SlurmLayout:
        """Read the layout srun gave this task; ``spares`` (nodes), ``nproc`` (ranks) and ``port`` are the command
        line's, ``ranks_per_node`` G (:func:`torchpass.launch.node_ranks.ranks_per_node`)."""
        env = os.environ if environ is None else environ
        if not in_slurm_step(env):
            raise SlurmLayoutError(
                "not a task of a Slurm job step (SLURM_JOB_ID/SLURM_PROCID unset): run it with srun inside the "
                "job, or use --local"
            )
        job_id = _int(env, "SLURM_JOB_ID")
        if env.get(ENV_AGENT_INDEX):  # one step per node (the batch-script launcher): it says who is where
            nodes = [n for n in env.get(ENV_NODES, "").split(",") if n]
            index, ntasks = _int(env, ENV_AGENT_INDEX), len(nodes)
            if not 0 <= index < ntasks:
                raise SlurmLayoutError(f"{ENV_AGENT_INDEX}={index} is not an index of {ENV_NODES}={nodes}")
        else:
            index, ntasks, nodes = _step_tasks(env)
        try:
            mode = JobOptions.from_environ(env).spares
        except JobOptionsError as exc:
            raise SlurmLayoutError(str(exc)) from None
        nodes_asked = None if nproc is None else training_nodes(nproc, ranks_per_node)
        count = _spare_count(ntasks, spares, nodes_asked, mode)
        own = env.get("SLURMD_NODENAME") or socket.gethostname().split(".", 1)[0]
        if own != nodes[index] and own.split(".", 1)[0] != nodes[index]:
            raise SlurmLayoutError(
                f"task {index} runs on {own} but the node list puts {nodes[index]} there: TorchPass needs task K "
                "on the K-th node (srun --ntasks-per-node=1)"
            )
        addresses = tuple(resolve_address(name) for name in nodes)
        if len(set(addresses)) != len(addresses):
            raise SlurmLayoutError(f"two nodes resolve to the same address: {dict(zip(nodes, addresses, strict=True))}")
        if env.get("TORCHPASS_PORT") and port is None:
            port = _int(env, "TORCHPASS_PORT")
        chosen = port if port is not None else default_port(job_id)
        if not 1024 <= chosen < 65535:
            raise SlurmLayoutError(f"port {chosen} out of range (1024..65534)")
        world = (ntasks - count) * ranks_per_node
        return cls(job_id, index, world, count, tuple(nodes), addresses, chosen, ranks_per_node)


def training_nodes(nproc: int, per_node: int) -> int:
    """How many nodes ``--nproc`` ranks fill (under Slurm they fill whole nodes)."""
    if per_node < 1 or nproc % per_node:
        raise SlurmLayoutError(
            f"--nproc {nproc} is not a multiple of {per_node} rank(s) per node: under Slurm the training ranks fill "
            "whole nodes (give --nproc as nodes x ranks per node, or leave it out)"
        )
    return nproc // per_node


def _step_tasks(env: Mapping[str, str]) -> tuple[int, int, list[str]]:
    """(this task's index, tasks, nodes) of a step with one task per node (``srun --ntasks-per-node=1``)."""
    index = _int(env, "SLURM_PROCID")
    ntasks = _int(env, "SLURM_NTASKS", env.get("SLURM_NPROCS", ""))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    nodes = expand_hostlist(nodelist)
    if len(nodes) != ntasks:
        raise SlurmLayoutError(
            f"the step has {ntasks} task(s) on {len(nodes)} node(s) ({nodelist}): TorchPass needs exactly one "
            "agent per node (srun --ntasks-per-node=1)"
        )
    node_id = env.get("SLURM_NODEID")
    if node_id is not None and node_id.isdigit() and int(node_id) != index:
        raise SlurmLayoutError(
            f"task {index} runs on node index {node_id}: TorchPass needs task K on the K-th node "
            "(srun --ntasks-per-node=1 with the default block distribution)"
        )
    return index, ntasks, nodes


def _int(env: Mapping[str, str], name: str, fallback: str = "") -> int:
    raw = env.get(name, fallback)
    try:
        return int(raw)
    except ValueError:
        raise SlurmLayoutError(f"{name}={raw!r} is not an integer") from None


def _spare_count(ntasks: int, spares: int | None, nproc: int | None, mode: SpareMode | None) -> int:
    """How many of ``ntasks`` agents are spares (see the module docstring for the rules; ``nproc`` in nodes)."""
    if spares is not None and nproc is not None and spares + nproc != ntasks:
        raise SlurmLayoutError(
            f"{nproc} training node(s) (--nproc) + --spares {spares} != {ntasks} tasks in the step (one per node)"
        )
    if spares is None and nproc is not None:
        spares = ntasks - nproc
    if spares is None:
        if mode is SpareMode.STANDBY:
            spares = STANDBY_SPARES_DEFAULT
        else:
            spares = 0  # none, borrow (a spare is borrowed when needed), or not a Clockwork job
    if spares < 0 or spares >= ntasks:
        raise SlurmLayoutError(
            f"{spares} spare(s) out of {ntasks} task(s): at least one task must train (give --spares or --nproc)"
        )
    if mode is SpareMode.NONE and spares:
        log.warning("the job was submitted with --clockwork-spares=none but %d task(s) wait as spares", spares)
    return spares
