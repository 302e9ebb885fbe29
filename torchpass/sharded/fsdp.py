"""Sharded training (FSDP2 and HSDP) under TorchPass: the model-aware wrapper and how its shards move.

``ctx.wrap_fsdp(model, mesh_shape=(R, S), shard=...)`` runs ``fully_shard`` as the user would, on the
submodules named by ``shard`` (deepest first) and then on the root, over the
:class:`~torch.distributed.device_mesh.DeviceMesh` TorchPass owns (:mod:`torchpass.sharded.shard_mesh`): R replicas
of a model cut into S shards, slot ``r * S + s`` holding shard ``s`` of replica ``r``; ``R = 1`` is pure FSDP.
``fully_shard``'s own options (``mp_policy``, ``reshard_after_forward``, ``offload_policy``, ...) pass
through. Optimizers over the sharded (DTensor) parameters, LR schedulers, ``clip_grad_norm_`` over DTensors and
mixed precision then work as under plain FSDP2.

The plan is replayed, not rebuilt: a newcomer runs the script, which calls ``wrap_fsdp`` with the same
arguments, so its modules are sharded exactly as the dead rank's were (the shard is a function of the slot,
which it takes over). Survivors keep their FSDP modules across a recovery; only the mesh's groups are formed
again (:meth:`torchpass.sharded.shard_mesh.MeshGroups.bind`, from :meth:`ShardTransport.form`).

What moves (:class:`ShardTransport`): the state of slot (r, s) is *part* ``s``: its local shards of every
parameter and of every piece of optimizer state, plus what is not sharded (the step, LR schedulers, grad
scalers, registered objects, buffers). A newcomer in (r, s) receives part ``s`` from a live holder (r', s) of
the most advanced step. Pure FSDP keeps a copy of every shard in its ring neighbours' host memory
(:mod:`torchpass.sharded.peer_copy`; ``peer_copies``, ``peer_copy_every_steps``): a newcomer gets its shard from one,
and when that copy is older than the committed step every rank rolls back to it in memory. HSDP keeps such copies
too with ``peer_copies_in_hsdp`` (each replica's row is its ring): the plan still takes a shard from a live replica
while one is left, and from a copy, rolling back the same way, once every holder of it died at once. When no
member holds part ``s`` at any step every other part is held at (every holder lost without copies, or a shard and
its copies), nothing is invented: the job stops with that reason (:class:`torchpass.rank.transfer_plan.StateLost`),
which names the newest snapshot to restart from (or says that snapshots are off). Snapshots hold every shard, each
written by one of its holders, and a restore gives slot (r, s) shard s (:mod:`torchpass.snapshot`).

Tensor parallelism (``tp=T, tp_plan=...``): ``parallelize_module`` over the mesh's ``tp`` dimension, then
``fully_shard`` over (replicate, shard). Slot ``r * S * T + s * T + t``'s state is part ``s * T + t`` (its local
shards of TP- and FSDP-sharded parameters and their optimizer state), held by the same coordinate in every other
replica: the layout is :class:`ShardedReplicas` with ``S * T`` parts, so transfers, plans and snapshots are
unchanged (:func:`mesh_layout`).

Buffers are not synchronised by FSDP2: a buffer a forward pass updates (BatchNorm's running statistics) then
differs per rank, and a replica's copy is not the dead rank's. ``wrap_fsdp`` warns about such modules.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from torchpass.config import TorchPassConfig
from torchpass.errors import TorchPassError
from torchpass.events import EventSink, emit
from torchpass.failure_domains import Place, rank_domain
from torchpass.rank.backends import CommBackend
from torchpass.rank.rejoin import ProcessGroupTransport
from torchpass.rank.replica_check import ReplicaNet
from torchpass.rank.state import StateError, StateParts
from torchpass.rank.step import StepLifecycle
from torchpass.rank.torch_compat import check_fsdp_internals
from torchpass.rank.transfer_plan import Holdings, ShardedReplicas
from torchpass.rank_env import LaunchEnv
from torchpass.sharded import peer_ring
from torchpass.sharded.expert_parallel import check_expert_layout, shard_experts
from torchpass.sharded.peer_copy import PeerCopies
from torchpass.sharded.shard_mesh import DIM_NAMES, TP_DIM, MeshGroups

__all__ = [
    "LifecycleGuard",
    "ShardHost",
    "ShardPlan",
    "ShardSpec",
    "ShardTransport",
    "ShardedState",
    "mesh_layout",
    "sharded_modules",
]

log = logging.getLogger("clockwork.torchpass.fsdp")

# What ``shard=`` may be: module classes, a predicate on (qualified name, module), or the modules themselves.
ShardSpec = type | tuple[type, ...] | Callable[[str, nn.Module], bool] | Iterable[nn.Module]


class LifecycleGuard:
    """The mesh proxies' guard (:class:`torchpass.sharded.shard_mesh.StepGuard`) over the rank's step lifecycle: the
    same rules as the DDP hook and ``ctx.all_reduce`` (before the update a failure abandons the step; after it the
    step commits and the rank recovers right after)."""

    def __init__(self, lifecycle: StepLifecycle) -> None:
        self.lifecycle = lifecycle

    def protecting(self) -> bool:
        """Inside ``ctx.steps`` (the step counter is -1 before the first step and after the last)."""
        return self.lifecycle.step >= 0

    def admit(self) -> bool:
        """Whether a collective may start (see :meth:`torchpass.rank.step.StepLifecycle.collective_allowed`)."""
        lifecycle = self.lifecycle
        if lifecycle.updated:
            if lifecycle.failed_after_update or lifecycle.stale():
                lifecycle.fail_after_update("a newer generation was announced after the step's update")
                return False
            return True
        return lifecycle.collective_allowed()

    def cut_off(self) -> bool:
        """Whether the control thread aborted this generation's groups for a newer one."""
        return self.lifecycle.cut_off()

    def failed(self, error: BaseException | str) -> None:
        """Abandon the step, or after its update commit it and recover right after."""
        lifecycle = self.lifecycle
        if lifecycle.updated:
            lifecycle.fail_after_update(error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        else:
            lifecycle.abandon(error)


class ShardPlan:
    """How one job shards its model: the mesh's shape, which submodules get their own ``fully_shard``, and
    ``fully_shard``'s options; with tensor parallelism, the TP plan (``{fqn: ParallelStyle}``, as
    ``parallelize_module`` takes it). Applied once per process (:meth:`apply`), identically on every slot."""

    def __init__(
        self,
        shape: ShardedReplicas,
        shard: ShardSpec | None,
        options: dict[str, Any],
        tp_plan: Mapping[str, ParallelStyle] | None = None,
        ep: int = 1,
    ) -> None:
        reserved = sorted({"mesh"} & set(options))
        if reserved:
            raise TypeError("ctx.wrap_fsdp builds the mesh itself (mesh_shape=...); do not pass mesh=")
        if shape.tp > 1 and not tp_plan:
            raise TypeError(f"tp={shape.tp} needs a tp_plan ({{module name: ParallelStyle}}) to shard the model by")
        for name, style in (tp_plan or {}).items():
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"tp_plan[{name!r}] is a {type(style).__name__}, not a ParallelStyle")
        self.shape = shape
        self.shard = shard
        self.options = options
        self.tp_plan = dict(tp_plan) if tp_plan is not None else None
        self.ep = ep

    def apply(self, model: nn.Module, groups: MeshGroups) -> list[str]:
        """With a TP plan, ``parallelize_module`` over the mesh's tp dimension first (as torchtitan's
        ``parallelize_llama`` does); then ``fully_shard`` the chosen submodules (deepest first) and the root over
        the (replicate, shard) dimensions; the names sharded.

        Each TP rank cuts its own copy of the initial weights (``src_data_rank=None``): no collective runs before
        the first generation forms, so every rank must build the model identically (the same seed), as the
        replicas of any TorchPass job do."""
        if isinstance(model, FSDPModule):
            raise TypeError("the model is already sharded: give ctx.wrap_fsdp the plain module")
        chosen = sharded_modules(model, self.shard)
        options = self.options
        with groups.before_first_generation():
            mesh = groups.mesh
            if self.ep > 1:  # experts cut to this rank's ep coordinate, left out of FSDP (expert_parallel.py)
                shape = groups.shape
                ep_rank = shape.coordinate(groups.slot)[1] // shape.tp % self.ep
                data_ranks = shape.world_size // shape.tp  # a TP group's ranks share a batch
                ep_group, holders = groups.expert_groups()
                experts = shard_experts(model, ep_group, ep_rank, self.ep, holders, data_ranks)
                options = {**options, "ignored_params": set(options.get("ignored_params") or ()) | experts}
            if self.tp_plan is not None:
                parallelize_module(model, groups.submesh(TP_DIM), self.tp_plan, src_data_rank=None)
                mesh = groups.submesh(DIM_NAMES)
            for _, module in chosen:
                fully_shard(module, mesh=mesh, **options)
            fully_shard(model, mesh=mesh, **options)
        warn_unsynchronised_buffers(model, self.shape.replicas)
        return [name for name, _ in chosen] + [""]


def mesh_layout(
    mesh_shape: tuple[int, int], tp: int = 1, tp_plan: Mapping[str, ParallelStyle] | None = None, ep: int = 1
) -> ShardedReplicas:
    """The layout of ``ctx.wrap_fsdp(mesh_shape=(R, S), tp=T, tp_plan=..., ep=E)``: R replicas of S * T parts (a
    rank's (shard, tp) coordinate; under ep, S is a multiple of E and part s * T + t holds the experts of ep
    coordinate s % E), refusing at start what is not protected."""
    replicas, shards = mesh_shape
    check_expert_layout(mesh_shape, ep, tp)
    if (tp != 1 or tp_plan is not None) and (tp < 1 or not tp_plan):
        raise TorchPassError(f"tensor parallelism needs tp >= 1 and a non-empty tp_plan (got tp={tp})")
    return ShardedReplicas(replicas, shards * tp, tp=tp, ep=ep)


class ShardHost(Protocol):
    """What sharding a model needs from the rank (:class:`torchpass.rank.context.Context` provides it)."""

    @property
    def slot(self) -> int:
        """This rank's slot: its coordinates in the mesh."""
        ...

    @property
    def world_size(self) -> int:
        """The job's slots."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the collectives run (the mesh's device type)."""
        ...

    @property
    def lifecycle(self) -> StepLifecycle:
        """The step in progress: what the mesh's collectives consult and report failures to."""
        ...

    @property
    def config(self) -> TorchPassConfig:
        """The job's settings (snapshots, buffer copies, peer copies)."""
        ...

    @property
    def env(self) -> LaunchEnv:
        """How the launcher started this rank (its address: where peer copies are sent to it)."""
        ...

    @property
    def log(self) -> logging.LoggerAdapter:  # type: ignore[type-arg]
        """The rank's logger."""
        ...

    @property
    def event_sink(self) -> EventSink | None:
        """Where the rank's events go."""
        ...

    def on_committed_state(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(step)`` after each committed step, once the step's state is final (after the script's
        own ``on_commit`` callbacks, whose changes to registered state belong to the step)."""
        ...


class ShardedState:
    """The mesh TorchPass owns for a job's sharded model, on one rank, and how this rank's shard moves: made once
    per job (``ctx.wrap_fsdp``, or transparent mode's ``init_device_mesh``). Its mesh groups are guarded by the
    rank's step lifecycle; ``parts`` (the rank's state) gets the mesh, which received optimizer state is rebuilt
    over, and the name of this rank's shard; :meth:`adopt` makes a ``fully_shard``-ed module the state's model."""

    def __init__(
        self,
        shape: ShardedReplicas,
        host: ShardHost,
        parts: StateParts,
        names: tuple[str, ...] | None = None,
        tensor_parallel: bool = False,
    ) -> None:
        if shape.world_size != host.world_size:
            raise TorchPassError(f"a {shape} mesh needs {shape.world_size} ranks; the job has {host.world_size}")
        self.host = host
        tensor_parallel = tensor_parallel or shape.tp > 1
        # One replica is pure FSDP: a mesh without the replicate dimension ((S,), or (S, T) with tensor
        # parallelism), unless the script named one more ((1, S), as configurable scripts write it), which it then
        # indexes by either name: a size-1 replicate dimension is ordinary. ctx.wrap_fsdp names none: the mesh
        # keeps it, so that its (replicate, shard) slice exists.
        flat = shape.replicas == 1 and (len(names) == 1 + tensor_parallel if names else not tensor_parallel)
        self.groups = MeshGroups(
            shape, host.slot, host.device.type, flat=flat, names=names, tensor_parallel=tensor_parallel
        )
        self.groups.guard = LifecycleGuard(host.lifecycle)
        self.layout = shape
        self.parts = parts
        parts.mesh = self.groups.mesh
        parts.label = shape.part_name(shape.coordinate(host.slot)[1])
        self.peers: PeerCopies | None = None
        # Pure FSDP keeps peer copies unless peer_copies = 0; HSDP only on request (its replicas hold every shard)
        wanted = shape.replicas == 1 or host.config.peer_copies_in_hsdp
        copies = host.config.peer_copies if wanted and shape.shards > 1 else 0
        self.part_layout = dataclasses.replace(shape, peer_copies=copies)  # what the generations' plan sees
        self.place = rank_domain(host.config.failure_domains) if copies else Place("")  # the ring's input
        if copies:
            self.peers = PeerCopies(host.config, host.slot, shape.shards, host.env.host, host.log, host.event_sink)
            host.lifecycle.before_update_hooks.append(self.peers.before_update)
            host.on_committed_state(self._after_commit)

    def _after_commit(self, step: int) -> None:
        """A round of peer copies after every K-th commit (a snapshot's rule: step + 1 divisible by K); with
        ``peer_copy_sync`` the round ran before the commit (:meth:`ShardTransport.copied_everywhere`)."""
        if self.peers is not None and self.peers.due(step) and not self.peers.sync:
            self.peers.capture(self.parts, step)

    def adopt(self, model: nn.Module) -> None:
        """``model`` (sharded over this mesh: the outermost ``fully_shard``-ed module) is the job's model: its
        state moves and its buffers roll back with an abandoned step."""
        check_fsdp_internals(model)
        self.parts.model = model
        self.host.lifecycle.watch_zero_grad(model)
        self.host.lifecycle.track_model(list(model.buffers()) if self.host.config.snapshot_buffers else [], None)
        log.info("model sharded over a %s mesh (slot %d: %s)", self.layout, self.host.slot, self.parts.label)

    def transport(self, backend: CommBackend, chunk_bytes: int, net: ReplicaNet | None = None) -> ShardTransport:
        """How this rank's shard moves (:class:`ShardTransport`), over ``backend``'s generations (``net``: checking
        every transfer)."""
        transport = ShardTransport(backend, self.groups, self.parts, chunk_bytes, self.peers, net)
        transport.place, transport.rings = self.place, self.part_layout.rings
        if self.peers is not None:
            self.host.lifecycle.commit_checks.append(transport.copied_everywhere)
        return transport


def sharded_modules(model: nn.Module, shard: ShardSpec | None) -> list[tuple[str, nn.Module]]:
    """The submodules ``shard`` names (not the root), deepest first, as ``fully_shard`` must see them."""
    if shard is None:
        return []
    named = [(name, module) for name, module in model.named_modules() if name]
    if isinstance(shard, type) or (isinstance(shard, tuple) and all(isinstance(t, type) for t in shard)):
        chosen = [(name, module) for name, module in named if isinstance(module, shard)]
    elif callable(shard) and not isinstance(shard, nn.Module):
        chosen = [(name, module) for name, module in named if shard(name, module)]
    else:
        wanted = {id(module) for module in shard}  # type: ignore[union-attr]
        chosen = [(name, module) for name, module in named if id(module) in wanted]
        if len(chosen) != len(wanted):
            raise ValueError("shard= names modules that are not submodules of the model")
    depth = {name: name.count(".") for name, _ in chosen}
    return sorted(reversed(chosen), key=lambda item: -depth[item[0]])


def unsynchronised_buffers(model: nn.Module, replicas: int) -> str:
    """Why the model's buffers are not protected ("" when they are). A buffer that a forward pass updates
    (BatchNorm's running statistics) differs per rank under FSDP2, which does not synchronise buffers. Pure FSDP
    rebuilds a rank from its own state (a peer copy, or the shard a migrating rank hands over), so its statistics
    come back exactly; HSDP rebuilds it from another replica's rank, whose statistics are that rank's own."""
    tracking = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
    ]
    if not tracking or replicas == 1:
        return ""
    return (
        f"{len(tracking)} module(s) with running statistics ({', '.join(tracking[:3])}): FSDP2 does not "
        "synchronise buffers, so each rank's statistics are its own, and a rank rebuilt from another replica gets "
        "that replica's statistics, not its own (its weights and optimizer state are exact)"
    )


def warn_unsynchronised_buffers(model: nn.Module, replicas: int) -> None:
    """Warn when :func:`unsynchronised_buffers` finds buffers a replica cannot stand in for."""
    why = unsynchronised_buffers(model, replicas)
    if why:
        warnings.warn(why, stacklevel=3)


class ShardTransport(ProcessGroupTransport):
    """The state transport of a sharded model (:class:`torchpass.rank.rejoin.StateTransport`): DDP's, over the
    generation's default group, with the mesh's groups formed beside it and the rank's own shard as its only
    part (part ``s`` for slot (r, s)). Same wire as DDP's (:func:`torchpass.rank.state.send_state`): each DTensor
    travels as its local shard and lands straight in the live parameters."""

    def __init__(
        self,
        backend: CommBackend,
        groups: MeshGroups,
        parts: StateParts,
        chunk_bytes: int,
        peers: PeerCopies | None = None,
        net: ReplicaNet | None = None,
    ) -> None:
        self.shard = groups.shape.coordinate(groups.slot)[1]
        super().__init__(backend, {self.shard: parts}, chunk_bytes, net)
        self.groups = groups
        self.peers = peers
        self.live: int | None = None  # the step of this rank's live shard, as last reported
        self.depth = peers.depth if peers is not None else 0
        self.place = Place("")  # where this rank runs (its node and failure domain): the ring's input
        # Each replica row's peer-copy ring, once decided (torchpass.sharded.peer_ring).
        self.rings: list[tuple[int, ...]] = []

    def form(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        generation: int,
        skip_ports: set[int],
        handoff: bool = False,
    ) -> None:
        """The generation's default group, then its mesh groups, which the proxies forward to from now on. A
        migration's two-member group has none: its ranks are not the slots the mesh's groups are made of."""
        if self.peers is not None and not handoff:
            peer_ring.publish(store, self.rings)  # before the group forms: its newcomers read it after
        super().form(store, rank, world_size, generation, skip_ports, handoff)
        if not handoff:
            self.groups.bind(generation, self.backend.new_subgroup)
            if self.peers is not None:  # where each slot's peer copies go in this generation
                listeners, places = peer_ring.exchange(store, rank, world_size, self.peers.address, self.place)
                shape = self.groups.shape
                rings, fresh = peer_ring.decide(store, self.rings, places, shape.replicas, shape.shards)
                self.rings[:] = rings  # kept for the job (and the plan's message when a shard is lost)
                self.peers.set_peers(listeners, rings[self.peers.replica])
                if fresh and rank == 0:
                    row = [[places[r * shape.shards + s] for s in range(shape.shards)] for r in range(len(rings))]
                    emit(
                        self.peers.event_sink,
                        self.peers.log,
                        "torchpass.peer_ring",
                        rings=[[r * shape.shards + s for s in ring] for r, ring in enumerate(rings)],
                        places={str(slot): place.wire() for slot, place in sorted(places.items())},
                        separated=all(
                            peer_ring.separated(ring, row[r], self.peers.copies) for r, ring in enumerate(rings)
                        ),
                    )

    def held(self, has_state: bool, committed: int) -> Holdings:
        """This rank's shard at ``committed`` (or nothing); no other part."""
        self.live = committed if has_state else None
        if self.peers is not None:  # and the peer copies it keeps (frozen until the transfers are done)
            self.peers.freeze()
            return self.peers.holdings(has_state, committed)
        steps: list[int | None] = [None] * self.groups.shape.shards
        steps[self.shard] = committed if has_state else None
        return Holdings(tuple(steps))

    def send_part(self, part: int, committed: int, peer: int) -> int:
        """This rank's shard (at ``committed``) to ``peer``; the bytes sent."""
        copy = self.peers.copy_of(part, committed) if self.peers is not None else None
        if part == self.shard and (self.live == committed or copy is None):  # live (a fresh start's too)
            return super().send_part(part, committed, peer)
        if self.peers is not None and copy is not None:
            return self.peers.send_copy(part, committed, peer, self.backend.device, self.chunk_bytes)
        raise StateError(f"asked to send shard {part} at step {committed}; this rank holds no such copy")

    def recv_part(self, part: int, peer: int) -> tuple[int, int]:
        """This rank's shard from ``peer``, into the live parameters; (committed step, bytes)."""
        if part != self.shard:
            raise StateError(f"asked to receive shard {part}; this rank holds shard {self.shard}")
        received = super().recv_part(part, peer)
        self.live = received[0]
        return received

    def restore_part(self, part: int, step: int) -> int:
        """Roll this rank's shard back to its own peer copy of ``step`` (in place)."""
        if self.peers is None or part != self.shard:
            raise StateError(f"no copy of shard {part} at step {step} is kept here")
        parts = self.parts[part]
        check = self.net.checker(parts, "this rank's own copy") if self.net is not None else None
        with torch.no_grad():
            loaded = self.peers.restore(parts, step, self.backend.device, check)
        self.live = step
        return loaded

    def copied_everywhere(self, step: int, failed_after_update: str) -> str:
        """``peer_copy_sync``'s condition of a commit: every rank's copy of ``step`` acknowledged by its neighbours,
        which a vote of all ranks (the minimum of one integer each) establishes. Otherwise (a rank died, a copy
        was refused, a collective failed after the update) this rank's update is undone from its own copy of
        the step before, and the reason returned: the step is redone, and no committed step ever is. The vote
        runs on the generation's default group, which a newer generation's announcement aborts."""
        if self.peers is None or not self.peers.sync or self.peers.off:
            return ""  # the copies overlap the next step (the commit hook starts them), or there are none
        reason = failed_after_update or self._vote(step)
        if reason:
            with torch.no_grad():
                self.peers.restore(self.parts[self.shard], step - 1, self.backend.device)
            self.live = step - 1
        return reason

    def done(self, step: int) -> None:
        """Keep neighbours' copies again (dropping any of steps after ``step``: a future computed again), and
        capture this rank's shard at once when it has no copy of it yet (a fresh start, a newcomer) or when a
        newcomer is now among its neighbours. Without that round the newcomer held no copy of this shard until
        the next commit's round, and losing this rank before it (a second kill right after a recovery) left no
        member holding the shard: the job stopped where it could have recovered (fuzzer seed 500076)."""
        if self.peers is None:
            return
        self.peers.thaw(step)
        if self.peers.gated or self.peers.off:
            return  # the job's budgets first (torchpass.rank.budget_gate calls this again once they are judged)
        if not self.peers.has_own_copy() or self.peers.ring_changed():
            self.peers.wait_sent(self.peers.timeout_s)  # a round to the old neighbours (a dead one fails at once)
            self.peers.capture(self.parts[self.shard], step)

    def held_everywhere(self, step: int) -> str:
        """After ``step`` committed: every rank's copy of it acknowledged by this generation's neighbours, which
        a vote of all ranks (the minimum of one integer each) establishes; the reason when not. Transparent mode
        asks this where a pass over the data ends: a survivor that left the pass cannot redo its last step, so
        no later recovery may roll back before it (:meth:`torchpass.transparent.session.Session.next_batch`)."""
        if self.peers is None or self.peers.off:
            return ""
        return self._vote(step)

    def _vote(self, step: int) -> str:
        acknowledged = self.peers is not None and self.peers.copy_now(self.parts[self.shard], step)
        flag = torch.tensor([int(acknowledged)], dtype=torch.int32, device=self.backend.device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        except Exception as exc:
            return f"the vote on the peer copies of step {step} failed: {type(exc).__name__}: {exc}"
        return "" if int(flag.item()) else f"a peer copy of step {step} was not acknowledged by the neighbours"

    def leave(self) -> None:
        """Destroy the generation's groups (the mesh's with them)."""
        self.groups.unbind()
        if self.peers is not None:
            self.peers.thaw()
        super().leave()
