"""How many ranks each node of a Slurm job runs (G), and what each of them is told about its place on the node.

A GPU node runs one rank per GPU, as ``torchrun --nproc-per-node`` or ``srun --ntasks-per-node`` would. G is
the same on every node (the job's world size is training nodes x G) and is decided once, in this order:

1. ``--nproc-per-node G`` on the command line (torchrun's spelling): what the user asked for wins;
2. ``TORCHPASS_RANKS_PER_NODE``: what the batch-script launcher (:mod:`torchpass.launch.node_steps`) decided for every
   agent, so that all agents agree even where their own environments differ;
3. ``SLURM_GPUS_PER_NODE`` (``sbatch --gpus-per-node=[TYPE:]G``): the same on every node by construction;
4. ``SLURM_GPUS_ON_NODE`` (``--gres=gpu:G``, ``--gpus=...``): the GPUs Slurm gave this node;
5. in the batch script only, ``SLURM_NTASKS_PER_NODE`` (``sbatch --ntasks-per-node=G``): the user asked for G
   tasks per node. Inside a step started with ``srun --ntasks-per-node=1`` that variable describes the agents
   themselves, so it is not read there;
6. otherwise 1.

CPUs per node are never a default: a CPU node has dozens of CPUs, and a rank per CPU is rarely what a training
job wants (a node with no GPU runs one rank unless ``--nproc-per-node`` says more).

Each rank of a node gets ``LOCAL_RANK`` (its local index J, 0..G-1, which is also the CUDA device index it
uses: TorchPass binds rank J to ``cuda:J``), ``LOCAL_WORLD_SIZE`` (G) and ``CUDA_VISIBLE_DEVICES`` exactly as
Slurm set it for the node's step, so device J is the J-th GPU Slurm gave the node (with ConstrainDevices the
cgroup shows only those, numbered from 0). A node whose step sees fewer GPUs than G is an error at start, not a
rank that finds no device later. The ranks inherit the CPU binding Slurm gave the agent's step (every CPU of
the node: :mod:`torchpass.launch.node_steps` asks for them). This module imports no torch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from torchpass.launch.slurm_layout import ENV_RANKS_PER_NODE, SlurmLayoutError
from torchpass.rank_env import thread_default

__all__ = [
    "RanksPerNode",
    "gpu_count",
    "rank_environment",
    "ranks_per_node",
]

log = logging.getLogger("clockwork.torchpass.node_ranks")

_COUNT = re.compile(r"(?:[^:,()]+:)*(\d+)(?:\([^)]*\))?")  # "8", "h100:8", "gpu:h100:8", "8(S:0-1)"


@dataclass(frozen=True)
class RanksPerNode:
    """G, and where it came from (for the agent's first line and the docs' "why G ranks?")."""

    count: int
    source: str

    def __str__(self) -> str:
        return f"{self.count} rank(s) per node ({self.source})"


def gpu_count(name: str, expr: str) -> int:
    """The GPU count in a Slurm GPU variable: ``8``, ``h100:8``, ``gpu:h100:8``, several types summed
    (``a100:2,v100:1`` is 3)."""
    total = 0
    for item in filter(None, (part.strip() for part in expr.split(","))):
        match = _COUNT.fullmatch(item)
        if match is None:
            raise SlurmLayoutError(f"{name}={expr!r}: cannot read a GPU count in {item!r}")
        total += int(match.group(1))
    return total


def ranks_per_node(env: Mapping[str, str], nproc_per_node: int | None = None, *, batch: bool = False) -> RanksPerNode:
    """G for this job, by the order in the module docstring (``batch``: this is the batch script's environment)."""
    if nproc_per_node is not None:
        if nproc_per_node < 1:
            raise SlurmLayoutError(f"--nproc-per-node {nproc_per_node}: a node runs at least one rank")
        return RanksPerNode(nproc_per_node, "--nproc-per-node")
    decided = env.get(ENV_RANKS_PER_NODE, "").strip()
    if decided:
        if not decided.isdigit() or int(decided) < 1:
            raise SlurmLayoutError(f"{ENV_RANKS_PER_NODE}={decided!r} is not a positive integer")
        return RanksPerNode(int(decided), "decided by the batch script")
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        raw = env.get(name, "").strip()
        if raw:
            count = gpu_count(name, raw)
            if count >= 1:
                return RanksPerNode(count, f"one per GPU: {name}={raw}")
    if batch:
        raw = env.get("SLURM_NTASKS_PER_NODE", "").strip()
        if raw:
            if not raw.isdigit() or int(raw) < 1:
                raise SlurmLayoutError(f"SLURM_NTASKS_PER_NODE={raw!r} is not a positive integer")
            return RanksPerNode(int(raw), f"one per task: SLURM_NTASKS_PER_NODE={raw}")
    return RanksPerNode(1, "no GPUs in the allocation; --nproc-per-node G runs more")


def rank_environment(env: Mapping[str, str], local: int, per_node: int) -> dict[str, str]:
    """What rank ``local`` of a node with ``per_node`` ranks is told about its place (see the module docstring),
    and ``OMP_NUM_THREADS=1`` when ``per_node`` > 1 and the job set none (:func:`torchpass.rank_env.thread_default`).

    ``CUDA_VISIBLE_DEVICES`` stays as Slurm set it; when it lists fewer devices than ``per_node`` the node
    cannot give rank ``local`` a GPU of its own, and that is an error."""
    if not 0 <= local < per_node:
        raise ValueError(f"local index {local} is not one of 0..{per_node - 1}")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in ("", "NoDevFiles"):
        devices = [d for d in visible.split(",") if d.strip()]
        if len(devices) < per_node:
            raise SlurmLayoutError(
                f"{per_node} ranks per node, but this node's step sees {len(devices)} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={visible}): ask Slurm for one GPU per rank (--gpus-per-node={per_node}) "
                "or run fewer ranks per node (--nproc-per-node)"
            )
    return {"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(per_node), **thread_default(env, per_node)}
