"""Who holds which part of the training state, and who sends what to whom when a generation forms.

This is the decision half of joining a generation (:mod:`torchpass.rank.rejoin` does the I/O), kept apart as a
pure function so that every case is a line of a table test and another layout is a new :class:`PartLayout`,
not a new protocol.

Words used here:

* A **part** is a piece of the training state that moves as a whole. Under DDP the whole state is one part
  (part 0) and every slot holds it (:class:`Replicated`). Under HSDP with R replicas of S shards, part ``s``
  is shard ``s`` and slot ``r * S + s`` holds it (:class:`ShardedReplicas`): a newcomer in slot (r, s)
  needs shard s and only a holder of shard s can give it. Under pure FSDP (R = 1) a shard's only other
  holder is a peer copy, e.g. in a neighbour's host memory: a member reports the parts it *holds* (its own,
  and any copies it keeps), and the layout says which parts each slot *needs* to train.
* At the agreement every member says what it holds (:class:`Holdings`: per part, the committed step of its
  copy, or nothing). :func:`plan_transfers` turns the table of holdings into a :class:`TransferPlan`.

The rules (for one part they are exactly DDP's: the most advanced replicas send to everyone behind):

1. The generation resumes after the newest committed step at which every part some slot needs is held by a
   member (``step``); a survivor that committed it keeps it, one that had not finished it receives its result
   instead of recomputing it. Without copies that is the newest step held anywhere, as it always was.
2. For each part, the sources are the members holding it at that step. Every slot that needs the part and is
   not a source receives it, the sources taking the receivers in turn (so several receivers are fed in
   parallel); across parts, the least busy *domain* (:meth:`PartLayout.domain_of`: an HSDP replica) serves
   next, so several shards rebuilt at once are sent by different replicas where each has a holder. A live
   holder (a slot that needs the part and holds it as its own state: an HSDP replica) is preferred to a peer
   copy of the same step. An HSDP job's copies are a second line of defence: while a holder of the shard is
   left, the job recovers exactly as it would without copies (same sources, same transfers), and the live
   state is already where the transfer starts (on the GPU), where a copy is in host memory.
3. **Rolling back.** Peer copies are refreshed every K steps, so the copy of a lost shard may be older than
   the step the survivors committed. The generation then resumes after the copy's step: a slot whose live
   state is newer restores its own part from the copy it keeps of that step (:attr:`Holdings.older`; a
   *local* transfer, source = target), and the steps after it are computed again.
4. Nobody holds anything and training has not progressed: a fresh start. Each part's lowest slot needing it
   sends its initial values to the others, as DDP broadcasts rank 0's weights at construction.
5. No step at which every needed part is held (training has progressed, or another part was already past the
   start): :class:`StateLost`, naming a part missing at the newest step. Retrying cannot help; the job fails
   with the reason (and the layout's :meth:`PartLayout.lost_hint`, e.g. which peer copies were lost too; the
   joining rank adds the snapshot to restart from, :func:`torchpass.snapshot.restart_advice`: no I/O here).

Transfers are listed by part, then receiver. Every member walks the plan in that order, sending or receiving
the transfers it takes part in, so the point-to-point sends pair up on every member alike.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from clockwork.contracts.coordinator_requests import WHOLE_STATE
from torchpass.failure_domains import ring_successors

__all__ = [
    "Holdings",
    "PartLayout",
    "Replicated",
    "ShardedReplicas",
    "StateLost",
    "Transfer",
    "TransferPlan",
    "plan_transfers",
]


class PartLayout(Protocol):
    """How the training state is cut into parts, and which parts each slot needs to train."""

    @property
    def parts(self) -> int:
        """How many parts there are (numbered from 0)."""
        ...

    def parts_of(self, slot: int) -> tuple[int, ...]:
        """The parts ``slot`` must hold once the generation formed."""
        ...

    def domain_of(self, slot: int) -> int:
        """The group of slots whose sends share a bottleneck (a replica of an HSDP job, typically its own nodes):
        the plan spreads sources over these before it spreads them over slots."""
        ...

    def part_name(self, part: int) -> str:
        """How a message names ``part``."""
        ...

    def lost_hint(self, part: int) -> str:
        """Why no member holds ``part`` any more, beyond its holders being gone ("" when that says it all)."""
        ...


@dataclass(frozen=True)
class Replicated:
    """DDP: the whole state is part 0, and every slot holds it."""

    @property
    def parts(self) -> int:
        """One part."""
        return 1

    def parts_of(self, slot: int) -> tuple[int, ...]:
        """Part 0, whatever the slot."""
        return (0,)

    def domain_of(self, slot: int) -> int:
        """Every slot is its own."""
        return slot

    def part_name(self, part: int) -> str:
        """The state is one part."""
        return WHOLE_STATE

    def lost_hint(self, part: int) -> str:
        """Every replica is gone: nothing to add."""
        return ""


@dataclass(frozen=True)
class ShardedReplicas:
    """HSDP: ``replicas`` copies of a model cut into ``shards`` shards; slot ``r * shards + s`` holds shard s.

    ``replicas=1`` is pure FSDP: each shard lives in one slot only, plus whatever peer copies members report.
    ``peer_copies``: how many ring successors in each replica keep one (0: none), for the message when a shard
    is lost anyway.

    ``tp``: with tensor parallelism, each replica's ``shards`` slots are ``shards // tp`` FSDP shards times ``tp``
    tensor-parallel ranks, tp innermost (slot ``r * shards + s * tp + t``, so a TP group is adjacent slots: one
    node). A rank's state is still named by its coordinate outside the replicate dimension, ``slot % shards``
    (its (shard, tp) pair): everything here (parts, holders, the plan) is the same as for ``shards`` plain
    shards, and only the names and the mesh's groups (:mod:`torchpass.sharded.shard_mesh`) see ``tp``."""

    replicas: int
    shards: int
    peer_copies: int = 0
    tp: int = field(default=1, kw_only=True)
    # ``ep``: expert parallelism inside the shard dimension (FSDP shards per replica a multiple of ep): FSDP shard s
    # holds the experts of ep coordinate s % ep (shards == ep: part e is FSDP shard e and experts e)
    ep: int = field(default=1, kw_only=True)
    # Each replica row's peer-copy ring, once the first generation decided it (filled in place by the transport,
    # :class:`torchpass.sharded.fsdp.ShardTransport`; empty: the shard order). Not part of the mesh's identity.
    rings: list[tuple[int, ...]] = field(default_factory=list, compare=False, hash=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.shards < 1:
            raise ValueError(f"replicas and shards must be >= 1, got {self.replicas} x {self.shards}")
        if self.tp < 1 or self.shards % self.tp:
            raise ValueError(f"a replica's {self.shards} slots do not split into tensor-parallel groups of {self.tp}")
        if self.ep < 1 or (self.shards // self.tp) % self.ep:
            fsdp_shards = self.shards // self.tp
            raise ValueError(f"{fsdp_shards} FSDP shards per replica do not split into ep groups of {self.ep}")

    @property
    def parts(self) -> int:
        """One part per shard."""
        return self.shards

    def parts_of(self, slot: int) -> tuple[int, ...]:
        """The shard of ``slot``."""
        return (slot % self.shards,)

    def slot(self, replica: int, shard: int) -> int:
        """The slot of shard ``shard`` in replica ``replica``."""
        return replica * self.shards + shard

    @property
    def world_size(self) -> int:
        """Slots in the job."""
        return self.replicas * self.shards

    def coordinate(self, slot: int) -> tuple[int, int]:
        """(replica, shard) of ``slot``."""
        return divmod(slot, self.shards)

    def row(self, replica: int) -> list[int]:
        """The slots of one replica: a shard group of the mesh."""
        return [self.slot(replica, s) for s in range(self.shards)]

    def column(self, shard: int) -> list[int]:
        """The slots holding one shard: a replicate group of the mesh."""
        return [self.slot(r, shard) for r in range(self.replicas)]

    def __str__(self) -> str:
        if self.tp > 1:
            return f"{self.replicas}x{self.shards // self.tp}x{self.tp}"
        return f"{self.replicas}x{self.shards}"

    def domain_of(self, slot: int) -> int:
        """The replica of ``slot``: several shards to rebuild are served by different replicas when they can."""
        return slot // self.shards

    def part_name(self, part: int) -> str:
        """``shard S of the RxS mesh``; with tensor parallelism ``part P (shard S, tp T) of the RxSxT mesh``; under
        expert parallelism the experts it holds are named too."""
        if self.tp > 1:
            shard, tp = divmod(part, self.tp)
            if self.ep > 1:
                return f"part {part} (ep {shard}: its experts and FSDP shard, tp {tp}) of the {self} mesh"
            return f"part {part} (shard {shard}, tp {tp}) of the {self} mesh"
        if self.ep > 1 and self.ep != self.shards:
            mesh = f"{self.replicas}x{self.shards} (replicate x shard, ep {self.ep})"
            return f"shard {part} (with the experts of ep {part % self.ep}) of the {mesh} mesh"
        if self.ep > 1:
            mesh = f"{self.replicas}x{self.shards} (replicate x ep)"
            return f"ep {part} (experts and FSDP shard {part}) of the {mesh} mesh"
        return f"shard {part} of the {self.replicas}x{self.shards} mesh"

    def copy_holders(self, part: int) -> list[int]:
        """The slots keeping peer copies of shard ``part``: in each replica, the next ``peer_copies`` slots of
        its row (:func:`torchpass.sharded.peer_copy.ring_holders`; a copy stays in its replica)."""
        rings = self.rings if len(self.rings) == self.replicas else [tuple(range(self.shards))] * self.replicas
        return [self.slot(r, s) for r, ring in enumerate(rings) for s in ring_successors(ring, part, self.peer_copies)]

    def lost_hint(self, part: int) -> str:
        """Why no member holds shard ``part``: which slots held it and its copies, and why that was not enough."""
        copies = self.copy_holders(part)
        if not copies:
            if self.replicas == 1:
                return ""
            return (
                f"its holders ({_slots(self.column(part))}) were all lost, and this HSDP job keeps no peer copies "
                "(peer_copies_in_hsdp, a second line of defence for that case, is off)"
            )
        kept = f"its peer copies (peer_copies={self.peer_copies}: {_slots(copies)})"
        if self.replicas == 1:
            lost = f"{kept} were lost with it"
        else:
            lost = f"its holders ({_slots(self.column(part))}) and {kept} were all lost"
        return (
            f"{lost}, or hold no step every other shard is still held at; losing more adjacent ranks than "
            "peer_copies covers needs a snapshot"
        )


def _slots(slots: list[int]) -> str:
    """``slot 2`` or ``slots 0, 2``."""
    return f"slot{'s' if len(slots) > 1 else ''} {', '.join(map(str, slots))}"


@dataclass(frozen=True)
class Holdings:
    """What one member holds at the agreement: per part, the committed step of its copy (None: no copy).

    For a part the member's slot needs, ``steps`` is its live state; for any other part, the newest copy it
    keeps. ``older`` (per part, or empty) lists further copies: the steps of the copies a rank keeps of its
    own part to roll back to, and of older copies of a neighbour's.

    On the wire (:meth:`encode`) two integers per part, (1, step) or (0, -1): for one part that is the
    (has state, committed step) pair every rank has always sent; then, with ``depth``, that many pairs of
    older copies per part."""

    steps: tuple[int | None, ...]
    older: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def whole(cls, has_state: bool, committed: int, parts: int = 1) -> Holdings:
        """A member holding all ``parts`` at ``committed`` (or nothing)."""
        return cls(tuple(committed if has_state else None for _ in range(parts)))

    def older_of(self, part: int) -> tuple[int, ...]:
        """The steps of the further copies of ``part`` this member keeps."""
        return self.older[part] if self.older else ()

    def holds(self, part: int, step: int) -> bool:
        """Whether this member can serve ``part`` at ``step`` (live or from a copy)."""
        return self.steps[part] == step or step in self.older_of(part)

    def encode(self, depth: int = 0) -> list[int]:
        """Two integers per part, then ``depth`` pairs per part of older copies, for a fixed-size collective."""
        out: list[int] = []
        for step in self.steps:
            out += [0, -1] if step is None else [1, step]
        for part in range(len(self.steps) if depth else 0):
            extra = self.older_of(part)
            if len(extra) > depth:
                raise ValueError(f"{len(extra)} older copies of part {part}; the wire carries {depth}")
            for step in extra:
                out += [1, step]
            out += [0, -1] * (depth - len(extra))
        return out

    @classmethod
    def decode(cls, values: Sequence[int], depth: int = 0) -> Holdings:
        """Inverse of :meth:`encode`."""
        width = 2 * (1 + depth)
        if len(values) % width:
            raise ValueError(f"holdings are pairs of integers ({depth} older per part), got {len(values)} values")
        parts = len(values) // width
        pairs = [(int(values[i]), int(values[i + 1])) for i in range(0, len(values), 2)]
        steps = tuple(step if has else None for has, step in pairs[:parts])
        if not depth:
            return cls(steps)
        rest = pairs[parts:]
        older = tuple(tuple(step for has, step in rest[p * depth : (p + 1) * depth] if has) for p in range(parts))
        return cls(steps, older)


@dataclass(frozen=True)
class Transfer:
    """Slot ``source`` sends its copy of ``part`` to slot ``target``."""

    part: int
    source: int
    target: int


class StateLost(Exception):
    """A part some slot needs is held by no member at the step the generation resumes from."""

    def __init__(self, part: int, step: int, name: str, hint: str = "") -> None:
        where = f" (at step {step})" if step >= 0 else ""
        super().__init__(f"no member holds {name} any more{where}" + (f": {hint}" if hint else ""))
        self.part = part
        self.step = step


@dataclass(frozen=True)
class TransferPlan:
    """Who sends what to whom, and the committed step every member holds once it is carried out."""

    step: int
    transfers: tuple[Transfer, ...]
    fresh: bool = False  # nothing was held: each part's initial values come from its lowest slot

    def involving(self, slot: int) -> tuple[Transfer, ...]:
        """The transfers ``slot`` sends or receives, in the plan's order."""
        return tuple(t for t in self.transfers if slot in (t.source, t.target))

    def source_of(self, slot: int) -> int | None:
        """The slot that sends ``slot`` its (first) part, or None when it receives nothing."""
        return next((t.source for t in self.transfers if t.target == slot), None)

    def sources(self) -> list[int]:
        """The slots that send something, ascending."""
        return sorted({t.source for t in self.transfers})


def plan_transfers(table: Sequence[Holdings], layout: PartLayout, *, expect_state: bool) -> TransferPlan:
    """The plan for members ``0..len(table)-1`` (``table[slot]``: what that slot holds); see the module docstring.

    ``expect_state``: training has progressed (a generation completed), so someone must hold the state; a
    fresh start is then :class:`StateLost` instead."""
    for slot, held in enumerate(table):
        if len(held.steps) != layout.parts:
            raise ValueError(f"slot {slot} reports {len(held.steps)} part(s), the layout has {layout.parts}")
    steps = {step for held in table for step in held.steps if step is not None}
    steps |= {step for held in table for part in range(layout.parts) for step in held.older_of(part)}
    fresh = not steps
    needed = [p for p in range(layout.parts) if any(p in layout.parts_of(slot) for slot in range(len(table)))]

    def missing_at(step: int) -> int | None:
        return next((p for p in needed if not any(held.holds(p, step) for held in table)), None)

    best = -1
    for candidate in sorted(steps, reverse=True):
        if missing_at(candidate) is None:
            best = candidate
            break
    else:
        if steps:
            newest = max(steps)
            part = missing_at(newest)
            assert part is not None
            raise StateLost(part, newest, layout.part_name(part), layout.lost_hint(part))
    transfers: list[Transfer] = []
    sends: dict[int, int] = {}  # transfers given so far, per source slot and per domain (negative keys)
    for part in range(layout.parts):
        needing = [slot for slot in range(len(table)) if part in layout.parts_of(slot)]
        sources = [slot for slot, held in enumerate(table) if not fresh and held.holds(part, best)]
        if not sources and fresh and not expect_state and needing:
            sources = [needing[0]]
        live = [slot for slot in sources if table[slot].steps[part] == best or fresh]
        receivers = [slot for slot in needing if slot not in live]
        senders = [slot for slot in live if part in layout.parts_of(slot)] or sources  # holders before copies
        if receivers and not sources:
            raise StateLost(part, best, layout.part_name(part), layout.lost_hint(part))
        for dst in receivers:
            if dst in sources:  # its own copy of the step: restored in place, nothing sent
                transfers.append(Transfer(part, dst, dst))
                continue
            # The least busy domain, then the least busy slot in it, then the lowest: for one part that is
            # round-robin over its sources; over several parts it spreads them over the replicas.
            src = min(senders, key=lambda s: (sends.get(-1 - layout.domain_of(s), 0), sends.get(s, 0), s))
            sends[src] = sends.get(src, 0) + 1
            sends[-1 - layout.domain_of(src)] = sends.get(-1 - layout.domain_of(src), 0) + 1
            transfers.append(Transfer(part, src, dst))
    return TransferPlan(best, tuple(transfers), fresh)
