"""The job's budgets judged at start, on every rank at once, before the first step and the first copy.

Why here, in the ranks: only a rank knows its share of the state (its shard, the part of the replicated state it
stages for a snapshot), and only once the model and optimizers exist. Each rank of the first generation measures
its share and reads its node (:func:`torchpass.rank.budgets.read_node`), one ``all_gather`` gives every rank every
rank's numbers, and each computes the same verdict from them (:func:`torchpass.rank.budgets.judge`): the G ranks of a
node are summed against that node's memory and /dev/shm, the job's snapshots against the snapshot filesystem and
the quota. Nothing is copied before the verdict: peer copies wait for it (:attr:`PeerCopies.gated`), and the
staging arena is made at the first snapshot.

* Refused (``budget_policy = "refuse"``): every rank tells the coordinator, which fails the job with the message;
  no step has run, nothing is lost.
* Degraded: the features that do not fit are switched off on every rank, with one warning (slot 0's). A rank that
  joins later takes the verdict from the members of its first generation (:class:`torchpass.rank.budgets.JobVerdict`,
  through the rendezvous store) instead of judging again: the job keeps one set of features for its life.

An optimizer whose state is made at its first step (Adam's moments) is counted as it will be: ``moments`` bytes
per parameter byte, by the optimizer's class (:data:`MOMENTS`; 2 when unknown).
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist

from clockwork.contracts.config.snapshots import parse_size
from torchpass.config import TorchPassConfig
from torchpass.events import EventSink, emit, emit_at
from torchpass.failure_domains import this_node
from torchpass.rank.budgets import PEER_COPIES, SNAPSHOTS, RankUse, judge, read_node, size_text
from torchpass.rank.output import RankLog
from torchpass.rank.rejoin import CoordinatorLink, Rejoiner
from torchpass.rank.state import StateParts, describe, local_tensor, payload_offsets
from torchpass.sharded.fsdp import ShardedState
from torchpass.snapshot.arena import ALIGN
from torchpass.snapshot.snapshotter import Snapshotter
from torchpass.snapshot.staging import plan_entries, rank_state
from torchpass.snapshot_location import snapshot_directory

__all__ = ["MOMENTS", "check_budgets", "unmade_optimizer_bytes"]

#: Bytes of state per parameter byte an optimizer makes at its first step (its ``state`` is empty before).
MOMENTS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2, "ASGD": 2}


class BudgetHost(Protocol):
    """What the check needs from the rank (:class:`torchpass.rank.context.Context` provides it)."""

    @property
    def config(self) -> TorchPassConfig: ...

    @property
    def rejoiner(self) -> Rejoiner: ...

    @property
    def link(self) -> CoordinatorLink: ...

    @property
    def log(self) -> RankLog: ...

    @property
    def event_sink(self) -> EventSink | None: ...

    @property
    def parts(self) -> StateParts: ...

    @property
    def slot(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def committed_step(self) -> int: ...

    def recover(self, reason: str, *, error: bool) -> None: ...


def _moments(optimizer: torch.optim.Optimizer) -> int:
    name = type(optimizer).__name__
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    if name == "Adagrad":
        return 0  # made in its constructor: already in its state
    return MOMENTS.get(name, 2) + bool(group.get("amsgrad", False))


def unmade_optimizer_bytes(parts: StateParts) -> int:
    """Bytes the optimizers will add at their first step: those with no state yet, by :func:`_moments`."""
    total = 0
    for optimizer in parts.optimizers:
        if optimizer.state:
            continue
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total += _moments(optimizer) * sum(local_tensor(p).numel() * p.element_size() for p in params)
    return total


def _align(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def measure(host: BudgetHost, snapshotter: Snapshotter, sharded: ShardedState | None) -> RankUse:
    """This rank's shares (at the committed state, plus the optimizer state still to be made) and its node: its
    staging is its share of the snapshot, at most the arena's cap (``snapshot_arena_max``), its shard file the
    whole share."""
    cfg, parts = host.config, host.parts
    meta, tensors = describe(parts, host.committed_step)
    unmade = unmade_optimizer_bytes(parts)
    arena = state = copies = 0
    if snapshotter.periodic:
        mesh = sharded.layout if sharded is not None else None
        sizes = [t.numel() * t.element_size() for t in tensors]
        plan = plan_entries(sizes, host.slot, host.world_size, mesh)
        own = rank_state(host.slot, host.committed_step, cfg.seed).values()  # its RNG states and position
        arena = sum(_align(sizes[i]) for i in plan.tensors) + sum(_align(t.numel() * t.element_size()) for t in own)
        arena += _align(len(pickle.dumps(meta))) if plan.meta else 0
        arena += unmade // (mesh.replicas if mesh is not None else host.world_size)
    peers = sharded.peers if sharded is not None else None
    if peers is not None:
        state, copies = payload_offsets(meta["layout"])[1] + unmade, peers.held_copies
    readings = read_node(snapshot_directory(cfg), count_snapshots=host.slot == 0 and snapshotter.periodic)
    staging = min(arena, snapshotter.arena_cap) if snapshotter.arena_cap else arena  # a share past the cap: windowed
    return RankUse(this_node(os.environ), readings, staging, arena, state, copies)


def check_budgets(host: BudgetHost, snapshotter: Snapshotter, sharded: ShardedState | None) -> None:
    """Judge the job's budgets unless the job did already, then apply the verdict (see the module docstring), and
    start the snapshot writer when snapshots stay on."""
    cfg, verdict = host.config, host.rejoiner.budget
    while not verdict.decided:
        mine = measure(host, snapshotter, sharded)
        uses: list[Any] = [None] * host.world_size
        try:
            dist.all_gather_object(uses, mine)
        except Exception as exc:  # a member died: the next generation judges again (or takes its verdict)
            host.recover(f"the budget check could not gather every rank's numbers: {exc}", error=True)
            continue
        quota = parse_size(cfg.snapshot_quota, "snapshot_quota")
        result = judge(uses, keep=cfg.snapshot_keep, quota=quota, policy=cfg.budget_policy)
        if host.slot == 0:
            level = logging.ERROR if result.refuse else logging.WARNING if result.shortfalls else logging.INFO
            emit_at(level, host.event_sink, host.log, "torchpass.budget", **_summary(uses, result, cfg, quota))
        if result.refuse:
            # Every rank judged the same numbers, and each stops the job. The first to stop would exit while
            # others may still be reading its part of the gather (a closed socket drops what is in flight): they
            # would leave with "could not gather", slot 0 before it posted the verdict. So all wait here first.
            try:
                dist.barrier()
            except Exception as exc:  # stopping anyway: what the job is told is the same verdict
                host.log.debug("the budget check's barrier before stopping failed: %s", exc)
            host.link.fatal(result.message())
        if result.shortfalls and host.slot == 0:
            host.log.warning("%s", result.message())
        verdict.decide(result.off)
    if SNAPSHOTS in verdict.off:
        snapshotter.switch_off("the job's budgets do not fit snapshots (budget_policy = degrade)")
    snapshotter.prepare()
    peers = sharded.peers if sharded is not None else None
    if peers is not None and PEER_COPIES in verdict.off:
        peers.switch_off()
    elif peers is not None:
        peers.gated = False
        host.rejoiner.transport.done(host.committed_step)  # the first round, held back until now
    if verdict.off:
        emit(host.event_sink, host.log, "torchpass.degraded", off=sorted(verdict.off))


def _summary(uses: list[RankUse], result: Any, cfg: TorchPassConfig, quota: int) -> dict[str, Any]:
    """The event's fields: per node what is needed against what it has, and the job's snapshot disk use."""
    nodes: dict[str, dict[str, Any]] = {}
    for use in uses:
        node = nodes.setdefault(use.node, {"ranks": 0, "staging": 0, "peer_copies": 0})
        node["ranks"] += 1
        node["staging"] += use.arena
        node["peer_copies"] += use.state * use.copies
        node["mem_available"], node["shm_free"] = use.readings.mem_available, use.readings.shm_free
    per_snapshot = sum(use.shard_file for use in uses)
    return {
        "verdict": "refused" if result.refuse else "degraded" if result.shortfalls else "fits",
        "policy": cfg.budget_policy,
        "off": sorted(result.off),
        "shortfalls": [s.line() for s in result.shortfalls],
        "nodes": nodes,
        "snapshots": {
            "per_snapshot": per_snapshot,
            "kept": cfg.snapshot_keep + 1 if per_snapshot else 0,
            "quota": quota,
            "per_snapshot_text": size_text(per_snapshot),
        },
    }
