"""Peer copies: every shard also kept in its ring neighbours' host memory (pure FSDP, and HSDP on request).

Without a replicate dimension a rank's shard exists nowhere else, so a sudden crash would stop the job. Here,
after every K-th committed step (``peer_copy_every_steps``), each rank in slot s captures its state (what
moves: its shard of the parameters and optimizer state, the step, schedulers, registered objects) into host
memory and streams it to slots s+1 .. s+r of the ring (``peer_copies`` = r), on a side thread, while the next
step's forward and backward pass run (:mod:`torchpass.sharded.peer_wire`). A spare taking slot s after a crash gets the
shard from a neighbour's copy, through the plan every generation makes (:mod:`torchpass.rank.transfer_plan`).

Under HSDP (R x S, ``peer_copies_in_hsdp``) the ring is the rank's own replica: slot (r, s) sends to (r, s+1)
.. (r, s+r), so every replica keeps copies of every shard, and the copies are what is left when all R holders
of a shard die at once. The plan prefers a live holder, so with one of them left the copies change nothing.
Copies are keyed by shard, not slot: a rank receives from predecessors of its own replica only, so the shard
names the sender, and it is the part the agreement reports them as.

Why it is correct, and what the buffers are for:

* **The copy is of the committed state.** Parameters and optimizer state change only in the optimizer step,
  so they are copied while the next forward and backward pass run, and that step's update waits for the copy
  (:meth:`PeerCopies.before_update`, the snapshot machinery's rule); the rest (buffers, small state) is copied
  at the boundary. The update also waits until the round's copies are acknowledged: at most one round is ever
  in flight, and a rank that took part in step n's collectives has finished its round before n - 1.
* **Rolling back.** The copy of a lost shard may be of an older step c than the survivors committed (K > 1,
  or a crash while its round was still streaming). Then the whole job resumes after c: every survivor restores
  its own shard of step c from the copies it keeps of its own state. A neighbour is at most one round behind
  another, so three own copies (the two last rounds and the one before) always include c; the receiving side
  keeps two copies per neighbour (written alternately: the last complete one is never overwritten).
* **Synchronous commits** (``peer_copy_sync``, K = 1): the round of step n runs before n commits
  (:meth:`PeerCopies.copy_now`) and all ranks vote on its acknowledgements (:mod:`torchpass.sharded.fsdp`); a failed
  vote undoes the update from the copy of n - 1, so the copy of a lost shard is never older than the committed step.
  Ranks are then never a round apart, and two own copies (n - 1 and n) are enough.
* **Losing more adjacent ranks than r covers** (slots s and s+1 with r = 1): no member holds shard s. The job
  stops with that reason, naming the newest disk snapshot to restart from
  (:func:`torchpass.snapshot.restore.restart_advice`).

This is the rank's side only; which copies serve whom is the plan's, and the agreement is the generation's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchpass.auth import job_key
from torchpass.config import TorchPassConfig
from torchpass.events import EventSink, emit
from torchpass.failure_domains import ring_successors
from torchpass.rank.replica_check import payload_checksums
from torchpass.rank.state import (
    StateError,
    StateParts,
    as_bytes,
    describe,
    load_payload,
    payload_offsets,
    send_payload,
    update_only_tensors,
)
from torchpass.rank.state_codec import MetaCodecError, decode_meta, encode_meta
from torchpass.rank.transfer_plan import Holdings
from torchpass.sharded.peer_wire import CopyBuffer, CopyLink, CopyListener, ReceivedCopies, WireError

__all__ = ["OWN_COPIES", "SYNC_OWN_COPIES", "PeerCopies", "ring_holders"]

OWN_COPIES = 3  # copies a rank keeps of its own shard (see the module docstring)
SYNC_OWN_COPIES = 2  # with peer_copy_sync: the committed step's and the one voted on
RECEIVED_COPIES = 2  # copies a rank keeps of each neighbour's shard
_LogAdapter = logging.LoggerAdapter  # type: ignore[type-arg]


def ring_holders(shard: int, shards: int, copies: int, order: Sequence[int] = ()) -> list[int]:
    """The shards whose ranks keep copies of ``shard``: the next ``copies`` of the ring (never itself), the ring
    being ``order`` (:func:`torchpass.failure_domains.ring_order`: neighbours in different failure domains), or
    the shard order without one. Under pure FSDP these are slots; under HSDP, shards of the same replica (a copy
    stays in its replica's row)."""
    return ring_successors(order or range(shards), shard, copies)


@dataclass
class Round:
    """One refresh of this rank's copies: the captured state of ``step``, still to copy and to send."""

    step: int
    buffer: CopyBuffer
    deferred: list[tuple[torch.Tensor, torch.Tensor]]  # (buffer view, live CPU tensor) copied by the thread
    gpu_done: Any = None  # a CUDA event: the side stream's copies are in the buffer
    copied: threading.Event = field(default_factory=threading.Event)  # the buffer holds the state
    sent: threading.Event = field(default_factory=threading.Event)  # every neighbour acknowledged or failed
    started: float = field(default_factory=time.perf_counter)


class PeerCopies:
    """One rank's peer copies: its own (to send and to roll back to) and its neighbours' (to serve a spare)."""

    def __init__(
        self,
        config: TorchPassConfig,
        slot: int,
        shards: int,
        host: str,
        log: _LogAdapter,
        event_sink: EventSink | None,
    ) -> None:
        self.copies = config.peer_copies
        self.every = config.peer_copy_every_steps
        self.sync = config.peer_copy_sync  # a commit waits for the copies (fsdp.ShardTransport.copied_everywhere)
        self.checksums = config.replica_check_every_steps > 0  # each copy carries its checksums (replica_check)
        self.timeout_s = config.collective_timeout_s
        self.slot = slot  # the global slot (r * shards + s, as :class:`ShardedReplicas` numbers them)
        self.shards = shards
        self.replica, self.shard = divmod(slot, shards)  # the part this rank holds is its shard
        self.log = log
        self.event_sink = event_sink
        self._secret = job_key().secret
        self.received = ReceivedCopies()
        self.listener = CopyListener(host, self.received, self._secret, self.timeout_s)
        self.own = [CopyBuffer() for _ in range(SYNC_OWN_COPIES if self.sync else OWN_COPIES)]
        self._targets: dict[int, tuple[str, int]] = {}  # neighbour slot -> its listener, this generation
        self._links: dict[int, CopyLink] = {}  # the side thread's connections
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Round | None] = queue.Queue()
        self._round: Round | None = None
        self._thread = threading.Thread(target=self._run, name="torchpass-peer-copy", daemon=True)
        self._thread.start()
        self.rounds = 0  # rounds whose every copy was acknowledged
        self.acknowledged = -2  # the step of the newest such round (-2: none yet; -1: the initial state)
        self.acknowledged_by: dict[int, tuple[str, int]] = {}  # the neighbours that acknowledged it
        self.failed = 0  # copies that did not reach a neighbour
        self.skipped = 0  # rounds not started (the previous one was still in flight)
        self.bytes_sent = 0
        self.last_round_ms = 0.0  # capture to the last acknowledgement
        self.waited_s = 0.0  # what steps waited for rounds, in all (optimizer steps; commits with peer_copy_sync)
        self.gated = True  # no round before the job's budgets are judged (torchpass.rank.budget_gate opens it)
        self.off = False  # switched off for the job: its budgets do not fit them (budget_policy = degrade)

    @property
    def depth(self) -> int:
        """Older copies per part a member reports at the agreement (the same on every member: one config)."""
        return len(self.own)

    @property
    def address(self) -> tuple[str, int]:
        """Where neighbours send their copies to this rank."""
        return self.listener.address

    @property
    def held_copies(self) -> int:
        """Copies of a shard this rank holds at most: its own, and 2 of each neighbour's (what the budget counts)."""
        return len(self.own) + RECEIVED_COPIES * self.copies

    def switch_off(self) -> None:
        """No copy from now on (taken at start, before any round: nothing is held yet)."""
        self.off, self.gated, self.copies = True, False, 0
        with self._lock:
            self._targets = {}

    def host_bytes(self) -> int:
        """Host memory held for copies now: own and received."""
        return sum(int(b.payload.numel()) for b in self.own) + self.received.nbytes()

    # ----- the generation ---------------------------------------------------------------------

    def set_peers(self, addresses: dict[int, tuple[str, int]], order: Sequence[int] = ()) -> None:
        """The listeners of every slot in the generation just formed; this rank sends to its ring successors
        (in its own replica: the slots of the shards after its own in ``order``, its row's ring)."""
        row = self.replica * self.shards
        wanted = {row + n: addresses[row + n] for n in ring_holders(self.shard, self.shards, self.copies, order)}
        with self._lock:
            self._targets = wanted

    def freeze(self) -> None:
        """While the generation agrees and transfers: wait for the local copy in progress, keep what is held."""
        current = self._round
        if current is not None and not current.copied.wait(self.timeout_s):
            self._discard(current.buffer)
        self.received.freeze()

    def thaw(self, resume_after: int | None = None) -> None:
        """The generation's transfers are over: keep incoming copies again. ``resume_after``: the step the
        generation resumes after; copies of later steps are of a future that is computed again, and dropped."""
        if resume_after is not None:
            for buffer in self.own:
                if buffer.complete and buffer.step > resume_after:
                    self._discard(buffer)
            self.received.drop_after(resume_after)
            if self.acknowledged > resume_after:  # the neighbours dropped it too
                self.acknowledged, self.acknowledged_by = -2, {}
        self.received.thaw()

    def ring_changed(self) -> bool:
        """Whether this generation's neighbours are not the ones that acknowledged the newest round (a newcomer
        took a neighbour's slot): they hold no copy of this rank's shard yet."""
        with self._lock:
            return self.acknowledged_by != self._targets

    def has_own_copy(self) -> bool:
        """Whether a complete copy of this rank's shard exists here (or a round is capturing one)."""
        current = self._round
        return any(b.complete for b in self.own) or (current is not None and not current.copied.is_set())

    # ----- rounds -----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether a round starts after ``step`` commits (every K-th step, as snapshots count)."""
        return (step + 1) % self.every == 0 and not self.off

    def capture(self, parts: StateParts, step: int) -> None:
        """At the boundary after ``step`` committed: start a round (skipped while the last one is in flight)."""
        previous = self._round
        if previous is not None and not previous.sent.is_set():
            self.skipped += 1
            emit(self.event_sink, self.log, "torchpass.peer_copy_skipped", step=step, pending=previous.step)
            return
        buffer = min(self.own, key=lambda b: (b.complete, b.step))  # the oldest (or an unused) own copy
        buffer.complete = False
        meta, tensors = describe(parts, step)
        try:
            blob = encode_meta(meta)  # msgpack: what crosses the peer-copy wire is never unpickled
        except MetaCodecError as exc:
            raise StateError(str(exc)) from None
        offsets, total = payload_offsets(meta["layout"])
        cuda = any(t.is_cuda for t in tensors)
        payload = buffer.ensure(total, pinned=cuda)
        side = update_only_tensors(parts)
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        gpu_side: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for offset, tensor in zip(offsets, tensors, strict=True):
                source = as_bytes(tensor.contiguous())
                into = payload[offset : offset + source.numel()]
                if tensor.data_ptr() not in side:
                    into.copy_(source)  # may change in the next forward pass: copied now
                elif tensor.is_cuda:
                    gpu_side.append((into, source))
                else:
                    deferred.append((into, source))
        buffer.meta, buffer.blob = meta, blob
        round_ = Round(step, buffer, deferred, self._copy_on_side_stream(gpu_side))
        self._round = round_
        self._jobs.put(round_)

    @staticmethod
    def _copy_on_side_stream(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Start the GPU tensors' copies into pinned memory on a side stream; the event they are done at."""
        if not pairs:
            return None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the committed update first
        with torch.cuda.stream(stream):
            for into, source in pairs:
                into.copy_(source, non_blocking=True)
                source.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def held_by_neighbours(self, step: int) -> bool:
        """Whether this generation's neighbours acknowledged a copy of ``step`` (a round to the ranks of an older
        generation, a newcomer's predecessor among them, does not count)."""
        return self.acknowledged == step and not self.ring_changed()

    def copy_now(self, parts: StateParts, step: int) -> bool:
        """Copy ``step`` now, unless this generation's neighbours hold it already (after any round still in
        flight: a newcomer's first, or the round of ``step`` itself), and wait for it; whether every neighbour
        acknowledged it. Bounded as :meth:`before_update` is. ``peer_copy_sync`` does this before each commit;
        transparent mode after the commit that ends a pass over the data (:meth:`ShardTransport.held_everywhere`)."""
        started = time.perf_counter()
        self.wait_sent(self.timeout_s)
        if not self.held_by_neighbours(step):
            self.capture(parts, step)
            self.wait_sent(self.timeout_s)
        self.waited_s += time.perf_counter() - started
        return self.held_by_neighbours(step)

    def before_update(self) -> None:
        """Before an optimizer step changes the parameters: the round in flight must have copied them, and its
        copies must be acknowledged (so no rank is ever more than one round ahead). Bounded: a neighbour that
        died fails its copy at once, a silent one at ``collective_timeout_s``."""
        current = self._round
        if current is None or current.sent.is_set():
            return
        started = time.perf_counter()
        if not current.sent.wait(self.timeout_s):
            self.log.warning("peer copy of step %d still unacknowledged after %.0f s", current.step, self.timeout_s)
        self.waited_s += time.perf_counter() - started

    def wait_sent(self, timeout_s: float) -> int:
        """Wait until the round in flight (if any) is over; the step of the newest acknowledged round."""
        current = self._round
        if current is not None:
            current.sent.wait(timeout_s)
        return self.acknowledged

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                with torch.no_grad():
                    for into, source in job.deferred:
                        into.copy_(source)  # releases the GIL: the forward pass runs meanwhile
                if job.gpu_done is not None:
                    job.gpu_done.synchronize()
                if self.checksums and job.buffer.meta is not None:  # taken from the copy as it was made
                    meta = job.buffer.meta
                    meta["checksums"] = payload_checksums(job.buffer.data, meta)
                    job.buffer.blob = encode_meta(meta)  # msgpack, as at capture
                job.buffer.step, job.buffer.complete = job.step, True
            except Exception as exc:
                self._discard(job.buffer)
                self.log.warning("capturing the peer copy of step %d failed: %s", job.step, exc)
            finally:
                job.copied.set()
            try:
                if job.buffer.complete:
                    self._send(job)
            finally:
                job.sent.set()

    def _send(self, job: Round) -> None:
        with self._lock:
            targets = dict(self._targets)
        ok = True
        for neighbour, address in targets.items():
            link = self._links.get(neighbour)
            try:
                if link is None or link.address != address:
                    if link is not None:
                        link.close()
                    self._links.pop(neighbour, None)
                    link = self._links[neighbour] = CopyLink(address, self._secret, self.timeout_s)
                link.send(self.shard, job.step, job.buffer.blob, job.buffer.data)
                self.bytes_sent += job.buffer.size
            except (OSError, WireError) as exc:
                ok = False
                self.failed += 1
                dead = self._links.pop(neighbour, None)
                if dead is not None:
                    dead.close()
                self.log.info("peer copy of step %d to slot %d not kept: %s", job.step, neighbour, exc)
        if ok:
            self.rounds += 1
            self.acknowledged, self.acknowledged_by = job.step, targets
            self.last_round_ms = 1000 * (time.perf_counter() - job.started)

    @staticmethod
    def _discard(buffer: CopyBuffer) -> None:
        buffer.complete, buffer.step = False, -1

    # ----- serving the agreement --------------------------------------------------------------

    def holdings(self, has_state: bool, committed: int) -> Holdings:
        """What this rank can serve: its own shard live (at ``committed``) and from its own copies, and the
        copies it keeps of its ring predecessors' shards."""
        steps: list[int | None] = [None] * self.shards
        older: list[tuple[int, ...]] = [()] * self.shards
        steps[self.shard] = committed if has_state else None
        own = sorted({b.step for b in self.own if b.complete}, reverse=True)
        older[self.shard] = tuple(own[: self.depth])
        for source in range(self.shards):
            if source != self.shard:
                kept = self.received.steps(source)
                if kept:
                    steps[source], older[source] = kept[0], tuple(kept[1 : 1 + self.depth])
        return Holdings(tuple(steps), tuple(older))

    def copy_of(self, part: int, step: int) -> CopyBuffer | None:
        """The complete copy of ``part`` at ``step`` this rank keeps (its own, or a neighbour's)."""
        if part == self.shard:
            return next((b for b in self.own if b.complete and b.step == step), None)
        return self.received.get(part, step)

    def send_copy(self, part: int, step: int, peer: int, device: torch.device, chunk_bytes: int) -> int:
        """Send the copy of ``part`` at ``step`` to ``peer`` of the generation's group (the state wire)."""
        copy = self.copy_of(part, step)
        if copy is None:
            raise WireError(f"no copy of shard {part} at step {step} here")
        return send_payload(copy.blob, copy.data, peer, device, chunk_bytes)  # its description: msgpack

    def restore(
        self, parts: StateParts, step: int, device: torch.device, check: Callable[[dict[str, Any]], None] | None = None
    ) -> int:
        """Roll this rank's live state back to its own copy of ``step``; the bytes loaded. ``check(meta)`` runs once
        it is loaded (the net's comparison with the copy's checksums)."""
        copy = self.copy_of(self.shard, step)
        if copy is None:
            raise WireError(f"no copy of this rank's shard at step {step}")
        return load_payload(parts, self._meta(copy), copy.data, device, check)

    @staticmethod
    def _meta(copy: CopyBuffer) -> dict[str, Any]:
        """A copy's state description: as captured (own copies), or decoded from what a neighbour sent."""
        if copy.meta is not None:
            return copy.meta
        try:
            return decode_meta(copy.blob)
        except MetaCodecError as exc:
            raise WireError(f"the copy of step {copy.step} is unreadable: {exc}") from None

    def close(self) -> None:
        """Stop the side thread and the listener (the copies are dropped with the process)."""
        self._jobs.put(None)
        self._thread.join(timeout=self.timeout_s)
        self.listener.close()
        for link in self._links.values():
            link.close()
