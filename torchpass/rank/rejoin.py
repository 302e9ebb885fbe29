"""Joining a generation: rendezvous, arrival, group formation, agreement and state transfer.

A rank joins a generation when the job starts, after every membership change, and after a broken collective
(:meth:`torchpass.rank.context.Context.recover`). :class:`Rejoiner` does it, the same way every time:

1. **Rendezvous.** Meet the generation's members in the store server of one live member, under a fresh
   prefix per generation (``PREFIX/gN``), so no single process is the rendezvous for the job's life.
2. **Arrival.** A store barrier that gives up as soon as a newer generation is announced or the job stops
   (a blocking ``store.wait`` would not), or after ``join_timeout_s``.
3. **Group formation.** :meth:`StateTransport.form` (the process group of the generation, for DDP).
4. **Agreement.** Every member says what it holds (:class:`torchpass.rank.transfer_plan.Holdings`), and
   :func:`torchpass.rank.transfer_plan.plan_transfers`, a pure function, decides who sends which part to whom.
5. **State transfer.** Every member carries out the transfers it takes part in, in the plan's order,
   through :meth:`StateTransport.send_part` / :meth:`StateTransport.recv_part`.

A planned migration is the same machinery on a two-member group: the departing rank (group rank 0) sends its
parts straight to the spare taking its slot (group rank 1), both confirm with one agreement, and the
departing process exits cleanly; when the handoff fails the spare gets the state from a replica instead.

A failure anywhere (a member that never arrives, a group that does not form, a transfer that breaks) makes
:class:`GenerationBroken`: the rank reports it and waits for the next generation. A state that cannot be
loaded, or a part no member holds any more, is fatal: retrying cannot help.

What plugs in: :class:`StateTransport` is how a member moves state parts and forms the group, and
:class:`torchpass.rank.transfer_plan.PartLayout` which parts each slot needs. :class:`ProcessGroupTransport`
(DDP: one part, the whole state, over the generation's gloo or NCCL group) is today's; an FSDP transport
(per-shard parts, peer copies kept in a neighbour's host memory) or one with its own NCCL communicator
implements the same five methods and leaves rendezvous, agreement and the plan as they are.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist

from clockwork.contracts.coordinator_wire import FailureKind, GenerationInfo
from torchpass.config import TorchPassConfig
from torchpass.errors import TorchPassError
from torchpass.events import EventSink, emit
from torchpass.rank.backends import CommBackend
from torchpass.rank.budgets import JobVerdict
from torchpass.rank.control import ControlChannel, CoordinatorLost, CoordinatorRefused, JobStopped
from torchpass.rank.replica_check import ReplicaMismatch, ReplicaNet
from torchpass.rank.state import StateError, StateParts, recv_state, send_state
from torchpass.rank.step import StepLifecycle
from torchpass.rank.transfer_plan import Holdings, PartLayout, StateLost, plan_transfers
from torchpass.snapshot.restore import restart_advice

__all__ = [
    "CoordinatorLink",
    "GenerationBroken",
    "ProcessGroupTransport",
    "RankPosition",
    "Rejoiner",
    "StateTransport",
]

_FOREVER_S = 10 * 365 * 24 * 3600.0
_CONNECT_TRY_S = 1.0  # one try to connect to a generation's store (torchpass.rank.rejoin.Rejoiner._rendezvous)
_LogAdapter = logging.LoggerAdapter  # type: ignore[type-arg]


class GenerationBroken(Exception):
    """The generation being joined cannot complete; the rank asks for the next one."""


@dataclass
class RankPosition:
    """This rank's slot and generation, and the committed state it holds (the job's membership, every rank's slot
    by generation, is the coordinator's: :class:`torchpass.coordinator.membership.Membership`).

    Written by joining (:class:`Rejoiner`), committing and restoring (the context); read by everything that
    reports where the rank is."""

    slot: int
    generation: int = -1
    committed: int = -1  # the last step whose update this rank's state contains
    has_state: bool = False  # False for a fresh spare, and after a receive that did not complete


class StateTransport(Protocol):
    """How the members of one group form it and move state parts between them.

    Ranks passed here are the group's (a slot in a generation's group; 0 and 1 in a handoff's two-member group).
    Every method may raise on a transport failure (a peer died): the caller turns that into
    :class:`GenerationBroken`; :class:`torchpass.rank.state.StateError` means the state itself does not fit."""

    def form(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        generation: int,
        skip_ports: set[int],
        handoff: bool = False,
    ) -> None:
        """Form the group over ``store`` (every member calls this; ``skip_ports``: the stores' own ports;
        ``handoff``: a migration's two-member group, which carries one rank's state and nothing else)."""
        ...

    def held(self, has_state: bool, committed: int) -> Holdings:
        """What this member can serve, per part (its own state at ``committed``, and any copies it keeps)."""
        ...

    def exchange(self, mine: Holdings) -> list[Holdings]:
        """Every member's holdings, by rank (a collective: every member calls it)."""
        ...

    def send_part(self, part: int, committed: int, peer: int) -> int:
        """Send this member's copy of ``part`` (at step ``committed``) to ``peer``; the bytes sent."""
        ...

    def recv_part(self, part: int, peer: int) -> tuple[int, int]:
        """Receive ``part`` from ``peer`` into this member's state; (its committed step, bytes received)."""
        ...

    def restore_part(self, part: int, step: int) -> int:
        """Roll this member's ``part`` back to the copy of ``step`` it keeps itself; the bytes loaded."""
        ...

    def done(self, step: int) -> None:
        """The generation's transfers are over: every member holds its parts at ``step`` and resumes after it."""
        ...

    def held_everywhere(self, step: int) -> str:
        """After ``step`` committed (a collective): whether no later recovery can roll back before it; the
        reason when one could (a copy not yet kept)."""
        ...

    def leave(self) -> None:
        """Tear the group down (safe on a broken one, and when none is formed)."""
        ...


class ProcessGroupTransport:
    """DDP's transport: the generation's default process group (gloo or NCCL, :mod:`torchpass.rank.backends`), the
    agreement as one ``all_gather``, and each part as :func:`torchpass.rank.state.send_state`'s point-to-point
    stream (``parts``: part -> the objects whose state it is; DDP has one, the whole state)."""

    def __init__(
        self, backend: CommBackend, parts: Mapping[int, StateParts], chunk_bytes: int, net: ReplicaNet | None = None
    ) -> None:
        self.backend = backend
        self.parts = parts
        self.chunk_bytes = chunk_bytes
        self.net = net  # checks every transfer (the sender's checksums travel with the state) unless None
        self.depth = 0  # older copies per part in the agreement's rows (a transport that keeps copies sets it)

    def form(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        generation: int,
        skip_ports: set[int],
        handoff: bool = False,
    ) -> None:
        """The generation's default process group (and the script's group beside it)."""
        if self.net is not None:
            self.net.forget()
        self.backend.form_group(dist.PrefixStore("pg", store), rank, world_size, generation, skip_ports)

    def held(self, has_state: bool, committed: int) -> Holdings:
        """Every part at ``committed``, or nothing."""
        return Holdings.whole(has_state, committed, len(self.parts))

    def exchange(self, mine: Holdings) -> list[Holdings]:
        """``all_gather`` of each member's holdings (two int64 per part)."""
        device = self.backend.device
        row = torch.tensor(mine.encode(self.depth), dtype=torch.int64, device=device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        return [Holdings.decode([int(v) for v in r.tolist()], self.depth) for r in rows]

    def send_part(self, part: int, committed: int, peer: int) -> int:
        """The part's state as one stream to ``peer`` (with its checksums when the net is on)."""
        annex = self.net.annex if self.net is not None else None
        return send_state(self.parts[part], committed, peer, self.backend.device, self.chunk_bytes, annex)

    def recv_part(self, part: int, peer: int) -> tuple[int, int]:
        """Receive straight into the live parameters (and fresh tensors for the rest); with the net on, the loaded
        state is compared with the sender's checksums (:class:`torchpass.rank.replica_check.ReplicaMismatch`)."""
        parts = self.parts[part]
        check = self.net.checker(parts, f"rank {peer} of the group") if self.net is not None else None
        with torch.no_grad():
            return recv_state(parts, peer, self.backend.device, self.chunk_bytes, check)

    def restore_part(self, part: int, step: int) -> int:
        """DDP keeps no copies: the plan never asks for this."""
        raise StateError(f"no copy of {part} at step {step} is kept by this transport")

    def done(self, step: int) -> None:
        """Nothing to settle."""

    def held_everywhere(self, step: int) -> str:
        """A survivor holds its own committed step: a recovery never rolls back here (no collective)."""
        return ""

    def leave(self) -> None:
        """Destroy the generation's groups."""
        self.backend.destroy()


class CoordinatorLink:
    """The rank's membership requests to the coordinator, with the job's end made this process's end: a
    finished job exits the process cleanly (``on_exit`` first), a failed one raises :class:`TorchPassError`."""

    def __init__(self, channel: ControlChannel, log: _LogAdapter, on_exit: Callable[[], None]) -> None:
        self.channel = channel
        self.log = log
        self.on_exit = on_exit

    @property
    def latest_gen(self) -> int:
        """The newest generation the coordinator announced."""
        return self.channel.latest_gen

    @property
    def stopped(self) -> JobStopped | None:
        """How the job ended, once the coordinator said so."""
        return self.channel.stopped

    def await_generation(self, after: int, position: RankPosition) -> GenerationInfo:
        """Long-poll for a generation newer than ``after`` that includes this process."""
        try:
            reply = self.channel.wait(
                "await_generation",
                _FOREVER_S,
                after=after,
                gen=position.generation,
                slot=position.slot,
                committed=position.committed,
            )
        except JobStopped as stop:
            self.exit_stopped(stop)
        except CoordinatorLost as exc:
            raise TorchPassError(str(exc)) from None
        return GenerationInfo.from_wire(reply["generation"])

    def exit_stopped(self, stop: JobStopped) -> NoReturn:
        """The job ended while this process waited: exit 0 when it finished, fail when it failed."""
        if stop.done:
            self.log.info("the job finished without needing this process")
            self.on_exit()
            raise SystemExit(0)
        raise TorchPassError(f"the job failed: {stop.reason}")

    def report(self, op: str, **fields: Any) -> None:
        """A short request whose loss must not stop recovery (the coordinator also sees deaths itself)."""
        try:
            self.channel.call(op, **fields)
        except JobStopped as stop:
            self.exit_stopped(stop)
        except (CoordinatorLost, CoordinatorRefused) as exc:
            self.log.warning("coordinator did not take %s: %s", op, exc)

    def fatal(self, message: str, **fields: Any) -> NoReturn:
        """Tell the coordinator the job cannot go on (it fails the job) and raise. ``fields``: what the request
        says besides (a replica mismatch's kind, step and tensor, which the coordinator records as an event)."""
        self.report("fatal", message=message, **fields)
        raise TorchPassError(message)


class Rejoiner:
    """Joins this rank to the next generation (see the module docstring)."""

    def __init__(
        self,
        *,
        worker_id: str,
        config: TorchPassConfig,
        link: CoordinatorLink,
        transport: StateTransport,
        layout: PartLayout,
        position: RankPosition,
        lifecycle: StepLifecycle,
        own_store_port: int,
        log: _LogAdapter,
        event_sink: EventSink | None,
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.link = link
        self.transport = transport
        self.layout = layout
        self.position = position
        self.lifecycle = lifecycle
        self.own_store_port = own_store_port
        self.log = log
        self.event_sink = event_sink
        self.rolled_back = 0  # committed steps the last generation joined made this member undo
        self.budget = JobVerdict()  # the job's budget verdict, decided once (torchpass.rank.budget_gate) or taken here

    def await_generation(self, after: int) -> GenerationInfo:
        """The next generation after ``after`` that includes this process (or its end)."""
        return self.link.await_generation(after, self.position)

    def join(self, after: int, first: GenerationInfo | None = None, left_at: float | None = None) -> None:
        """Join ``first`` (or the next generation after ``after``), and the next one whenever it breaks.

        A rank the generation migrates away hands its state over and exits here (``SystemExit(0)``)."""
        info = first
        while True:
            if info is None:
                info = self.await_generation(after)
            received_at = time.time()
            if info.handoff is not None and info.handoff.source == self.worker_id:
                self._depart(info)
            try:
                self._join(info, received_at, left_at)
                return
            except GenerationBroken as exc:
                self.log.warning("generation %d could not form: %s", info.gen, exc)
                self.transport.leave()
                m = self.position
                self.link.report(
                    "broken",
                    gen=info.gen,
                    slot=m.slot,
                    step=self.lifecycle.step,
                    committed=m.committed,
                    error=str(exc)[:500],
                    at=time.time(),
                )
                after, info = info.gen, None

    # ----- one generation -------------------------------------------------------------------

    def _join(self, info: GenerationInfo, received_at: float, left_at: float | None) -> None:
        m = self.position
        slot = info.slot_of(self.worker_id)
        if slot is None:
            raise TorchPassError(f"generation {info.gen} does not include this process")
        m.slot = slot
        self.transport.leave()
        emit(self.event_sink, self.log, "torchpass.joining", generation=info.gen, slot=slot, reason=info.reason)
        handed: list[dict[str, Any]] = []  # what the departing rank handed over, when this is its spare
        if info.handoff is not None and info.handoff.target == self.worker_id and not m.has_state:
            handed = self._receive_handoff(info)
        store = self._rendezvous(info.store_host, info.store_port, f"{self.config.store_prefix}/g{info.gen}", info.gen)
        self._arrive(store, slot, info.world_size, info.gen)
        arrived_at = time.time()
        try:
            self.transport.form(store, slot, info.world_size, info.gen, self._skip_ports(info.store_port))
        except Exception as exc:
            raise GenerationBroken(f"process group did not form: {exc}") from None
        formed_at = time.time()
        if self.link.latest_gen > info.gen:
            raise GenerationBroken(f"superseded by generation {self.link.latest_gen}")
        m.generation = info.gen
        self.lifecycle.drop_staged_buffers()  # staged in a generation that is gone
        source, received, nbytes, moves = self._agree_and_transfer(info)
        done_at = time.time()
        self.lifecycle.restart_at(m.committed + 1)
        timings: dict[str, Any] = {
            "rebuild_ms": round(1000 * (formed_at - received_at), 1),
            "transfer_ms": round(1000 * (done_at - formed_at), 1),
        }
        outcome: dict[str, Any] = {
            "slot": slot,
            "resume_step": m.committed + 1,
            "source": source,
            "received": received,
            "transfer_bytes": nbytes,
            "moves": handed + moves,
            "rolled_back": self.rolled_back,
        }
        emit(self.event_sink, self.log, "torchpass.joined", generation=info.gen, **outcome, **timings)
        self.link.report(
            "joined",
            gen=info.gen,
            **outcome,
            arrived_at=arrived_at,
            first_error_at=self.lifecycle.first_error_at,
            left_at=left_at,
            handoff_ok=bool(handed),
            **timings,
        )

    def _agree_and_transfer(self, info: GenerationInfo) -> tuple[int | None, bool, int, list[dict[str, Any]]]:
        """Agree on who holds what, and carry out this member's part of the plan; (source, received, bytes, and
        what it received: one record per part, with the part's name, its source, bytes and time)."""
        m = self.position
        try:
            table = self.transport.exchange(self.transport.held(m.has_state, m.committed))
        except Exception as exc:
            raise GenerationBroken(f"state agreement failed: {exc}") from None
        try:
            plan = plan_transfers(table, self.layout, expect_state=info.expect_state)
        except StateLost as exc:  # the reason says what to restart from: a snapshot, or turn them on
            self.link.fatal(f"generation {info.gen}: {exc}; {restart_advice(self.config)}", kind=FailureKind.STATE_LOST)
        me, nbytes, moves = m.slot, 0, []
        before = m.committed if m.has_state else plan.step
        for transfer in plan.involving(me):
            if transfer.source == transfer.target:  # a rollback: this member's own copy of the plan's step
                began = time.time()
                try:
                    m.has_state = False
                    got = self.transport.restore_part(transfer.part, plan.step)
                except Exception as exc:
                    self.link.fatal(
                        f"generation {info.gen}: rolling back to step {plan.step} failed: {exc}", **_mismatch(exc)
                    )
                nbytes += got
                moves.append(self._move(transfer.part, me, got, began))
                continue
            sending = transfer.source == me
            peer = transfer.target if sending else transfer.source
            emit(
                self.event_sink,
                self.log,
                "torchpass.transfer",
                generation=info.gen,
                role="send" if sending else "receive",
                peer=peer,
                step=plan.step,
            )
            try:
                if sending:
                    nbytes += self.transport.send_part(transfer.part, plan.step, peer)
                else:
                    m.has_state = False  # a partial receive leaves nothing trustworthy
                    began = time.time()
                    got = self.transport.recv_part(transfer.part, peer)[1]
                    nbytes += got
                    moves.append(self._move(transfer.part, peer, got, began))
            except StateError as exc:
                self.link.fatal(str(exc), **_mismatch(exc))
            except Exception as exc:
                raise GenerationBroken(f"state transfer {transfer.source}->{transfer.target} failed: {exc}") from None
        m.committed, m.has_state = plan.step, True  # every member now holds its parts at the plan's step
        self.rolled_back = max(0, before - plan.step)
        if self.rolled_back:
            self.log.warning(
                "rolled back %d step(s) to step %d (the newest every shard is held at)", before - plan.step, plan.step
            )
        self.transport.done(plan.step)
        source = plan.source_of(me)
        return source, source is not None, nbytes, moves

    def _move(self, part: int, source: int, nbytes: int, began: float) -> dict[str, Any]:
        """The record of one part received (or restored from this member's own copy: source = target)."""
        return {
            "part": part,
            "what": self.layout.part_name(part),
            "source": source,
            "target": self.position.slot,
            "bytes": nbytes,
            "ms": round(1000 * (time.time() - began), 1),
        }

    # ----- meeting --------------------------------------------------------------------------

    def _rendezvous(self, host: str, port: int, prefix: str, gen: int) -> dist.Store:
        """A client of generation ``gen``'s store, connected in tries of :data:`_CONNECT_TRY_S` until
        ``collective_timeout_s``, given up as soon as the generation is superseded. Why in tries: a store whose
        host died (a second failure during a recovery, the store's host being a member) refuses connections,
        and TCPStore retries a refused connect for its whole timeout, twice (about 50 s seen), while the
        coordinator had announced the generation that replaces this one within milliseconds."""
        deadline = time.monotonic() + self.config.collective_timeout_s
        try_timeout = datetime.timedelta(seconds=_CONNECT_TRY_S)
        while True:
            try:
                client = dist.TCPStore(host, port, None, False, timeout=try_timeout, wait_for_workers=False)
                break
            except Exception as exc:
                if self.link.latest_gen > gen:
                    raise GenerationBroken(f"superseded by generation {self.link.latest_gen}") from None
                if time.monotonic() > deadline:
                    raise GenerationBroken(f"store {host}:{port} unreachable: {exc}") from None
        client.set_timeout(datetime.timedelta(seconds=self.config.collective_timeout_s))
        return dist.PrefixStore(prefix, client)

    def _arrive(self, store: dist.Store, me: int, count: int, gen: int) -> None:
        """Store barrier that gives up as soon as the generation is superseded (a blocking wait would not). The
        job's budget verdict crosses it: published before, taken after by a member that has none (a newcomer)."""
        try:
            self.budget.publish(store)
            store.set(f"arrive/{me}", self.worker_id)
            keys = [f"arrive/{i}" for i in range(count)]
            deadline = time.monotonic() + self.config.join_timeout_s
            delay = 0.001
            while not store.check(keys):
                if self.link.latest_gen > gen:
                    raise GenerationBroken(f"superseded by generation {self.link.latest_gen}")
                stopped = self.link.stopped
                if stopped is not None and not stopped.done:
                    raise GenerationBroken(f"job stopped: {stopped.reason}")
                if time.monotonic() > deadline:
                    raise GenerationBroken(
                        f"not every member arrived within join_timeout_s={self.config.join_timeout_s:g}"
                    )
                time.sleep(delay)
                delay = min(0.02, delay * 1.5)
            self.budget.adopt(store)
        except GenerationBroken:
            raise
        except Exception as exc:
            raise GenerationBroken(f"rendezvous store failed: {exc}") from None

    def _skip_ports(self, *ports: int) -> set[int]:
        return {self.own_store_port, *ports}

    # ----- planned migration ----------------------------------------------------------------

    def _handoff_group(self, info: GenerationInfo, rank: int) -> None:
        """Meet the other side of the handoff in the departing rank's store and form the two-member group."""
        assert info.handoff is not None
        prefix = f"{self.config.store_prefix}/g{info.gen}/handoff"
        store = self._rendezvous(info.handoff.host, info.handoff.port, prefix, info.gen)
        self._arrive(store, rank, 2, info.gen)
        self.transport.form(store, rank, 2, info.gen, self._skip_ports(info.handoff.port), handoff=True)

    def _depart(self, info: GenerationInfo) -> NoReturn:
        """This rank is migrating away: hand the live state to the spare, then exit cleanly."""
        assert info.handoff is not None
        m = self.position
        started, ok, nbytes = time.time(), False, 0
        try:
            self._handoff_group(info, 0)
            for part in self.layout.parts_of(info.handoff.slot):
                nbytes += self.transport.send_part(part, m.committed, 1)
            self.transport.exchange(self.transport.held(m.has_state, m.committed))  # the spare has it all
            ok = True
            self.log.info("handed %d bytes of state (step %d) to %s", nbytes, m.committed, info.handoff.target)
        except Exception as exc:
            self.log.warning("handoff to %s failed (%s); it gets the state from a replica", info.handoff.target, exc)
        finally:
            self.transport.leave()
        handoff_ms = round(1000 * (time.time() - started), 1)
        sent = nbytes if ok else 0
        emit(
            self.event_sink,
            self.log,
            "torchpass.departed",
            generation=info.gen,
            handoff_ok=ok,
            handoff_ms=handoff_ms,
            handoff_bytes=sent,
        )
        self.link.report("departed", gen=info.gen, handoff_ok=ok, handoff_ms=handoff_ms, handoff_bytes=sent)
        self.link.on_exit()
        raise SystemExit(0)

    def _receive_handoff(self, info: GenerationInfo) -> list[dict[str, Any]]:
        """The spare side of a migration: what it received, per part (as the agreement's moves, from the slot it
        takes over); nothing on any failure, and the state then comes from a replica instead."""
        assert info.handoff is not None
        m = self.position
        try:
            self._handoff_group(info, 1)
            committed, nbytes, handed = -1, 0, []
            for part in self.layout.parts_of(info.handoff.slot):
                began = time.time()
                committed, got = self.transport.recv_part(part, 0)
                nbytes += got
                handed.append(
                    {
                        "part": part,
                        "what": self.layout.part_name(part),
                        "source": info.handoff.slot,
                        "target": info.handoff.slot,
                        "bytes": got,
                        "ms": round(1000 * (time.time() - began), 1),
                        "handoff": True,
                    }
                )
            self.transport.exchange(self.transport.held(True, committed))  # tells the departing rank: received
            m.committed, m.has_state = committed, True
            self.log.info("received %d bytes of state (step %d) from %s", nbytes, committed, info.handoff.source)
            return handed
        except StateError as exc:
            self.link.fatal(str(exc), **_mismatch(exc))
        except Exception as exc:
            m.has_state, m.committed = False, -1
            self.log.warning("handoff from %s failed (%s); taking the state from a replica", info.handoff.source, exc)
            emit(
                self.event_sink,
                self.log,
                "torchpass.handoff_failed",
                generation=info.gen,
                source=info.handoff.source,
                error=f"{type(exc).__name__}: {exc}"[:300],
            )
            return []
        finally:
            self.transport.leave()


def _mismatch(exc: BaseException) -> dict[str, Any]:
    """The fields a fatal request adds for a state that failed the net's transfer check (none otherwise)."""
    return exc.fields if isinstance(exc, ReplicaMismatch) else {}
