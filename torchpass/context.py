"""The rank side of TorchPass: ``init``, the wrappers, and the step boundary where recovery happens.

A training script calls :func:`init`, wraps its model and optimizer, and iterates ``ctx.steps(...)``. Nothing
else changes, and nothing is sent anywhere per step: the boundary between two steps compares two integers
(the generation this rank trains in, the newest one the coordinator announced).

What a step is, and when it counts:

* Before step S is handed to the loop body, every RNG is reseeded from (seed, slot, S) and the batch of
  (S, slot) is fetched, so a step can be redone with the same batch and the same dropout masks.
* While the body runs, gradient averaging goes through TorchPass's DDP hook. If a collective fails (a peer
  died; its sockets closed) or a newer generation is announced, the step is *abandoned*: the hook stops
  launching collectives, the wrapped optimizer (and LR scheduler, grad scaler) skip their updates, and no
  exception reaches the user's code. Once every wrapped optimizer has stepped, the update is in the parameters
  and the step can no longer be abandoned (a redo would apply it twice): a ``ctx.all_reduce`` failing after
  that returns False, the step commits, and the rank recovers right after.
* When the body returns, a step that was not abandoned is *committed* (``ctx.committed_step`` = S); an
  abandoned one is rolled back (buffers, registered state, gradients) and the rank recovers.

Recovery (:meth:`Context.recover`): tear down the broken group (which unblocks peers still inside a
collective with us), tell the coordinator if the collective broke, wait for the new generation, meet its
members at a rendezvous in a live member's store (fresh prefix per generation), form the new default
process group, and agree on the state. Every member reports (has state, last committed step); the most
advanced replicas become sources and every other member (a newcomer, or a survivor that had not finished the
step) receives their state. A survivor that had already committed step S keeps it and does not redo it; one
that had not receives S's result instead of recomputing it. Training resumes at (most advanced step + 1).
A failure during any of this simply makes the next generation.

A planned migration is the same machinery: the departing rank sees the new generation at its next
boundary, sends its live state straight to the spare taking its slot over a two-rank group, and exits
cleanly (``SystemExit(0)`` out of ``ctx.steps``).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import logging
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from torchpass.auth import ENV_JOB_KEY, JobKey
from torchpass.backends import CommBackend, make_backend
from torchpass.buffers import StagedBuffers
from torchpass.config import TorchPassConfig
from torchpass.control import ControlChannel, CoordinatorLost, CoordinatorRefused, JobStopped
from torchpass.coordinator import Coordinator
from torchpass.data import batch_source
from torchpass.ddp import TorchPassDDP
from torchpass.events import DaemonEventSink, EventSink, emit, tee
from torchpass.protocol import ENV_DAEMON_SOCKET, ENV_GLOO_HOST, GenerationInfo, LaunchEnv, die_with_parent
from torchpass.snapshot import RestoreError, Snapshotter, restore, restore_target
from torchpass.state import StateError, StateParts, recv_state, send_state
from torchpass.step import StepLifecycle

__all__ = ["Context", "TorchPassError", "init"]

_T = TypeVar("_T")
LOGGER_NAME = "clockwork.torchpass"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
_FOREVER_S = 10 * 365 * 24 * 3600.0


class TorchPassError(RuntimeError):
    """TorchPass cannot keep this job going (the message says why); the rank exits with an error."""


class _Broken(Exception):
    """The generation being joined cannot complete; the rank asks for the next one."""


class _RankLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every message with the rank's slot, generation, step and worker id."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        ctx = cast(Context, self.extra["ctx"])  # type: ignore[index]
        return f"[slot {ctx.slot} g{ctx.generation} step {ctx.step} {ctx.worker_id}] {msg}", kwargs


def _configure_logging(level: str) -> None:
    """Show TorchPass's own log on stderr unless the script configured logging itself."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def _whole_lines_on_shared_output() -> None:
    """Keep each line a rank prints one ``write()``.

    The ranks of one launcher (or node agent) share its stdout and stderr, and are started with
    ``PYTHONUNBUFFERED`` so that nothing printed is lost when a rank is killed. Unbuffered, ``print`` writes
    its text and its newline in two calls, and two ranks' lines tear into each other. Line buffering flushes
    at every newline just as promptly, and a line then reaches the pipe in one write (atomic up to
    ``PIPE_BUF``). A stream the script replaced with something else is left alone.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is None:
            continue
        try:
            reconfigure(line_buffering=True, write_through=False)
        except (ValueError, OSError):  # closed, or not a text stream that can be reconfigured
            continue


class Context:
    """One rank's TorchPass state; create it with :func:`torchpass.init`."""

    def __init__(
        self,
        config: TorchPassConfig,
        env: LaunchEnv,
        channel: ControlChannel,
        backend: CommBackend,
        store_server: dist.TCPStore,
        event_sink: EventSink | None,
        coordinator: Coordinator | None = None,
    ) -> None:
        self.config = config
        self.env = env
        self.worker_id = env.worker_id
        self.world_size = env.world_size
        self.slot: int = env.initial_slot if env.initial_slot is not None else -1
        self.generation = -1
        self.is_replacement = env.initial_slot is None
        self.event_sink = event_sink
        self.log = _RankLog(logging.getLogger(LOGGER_NAME), {"ctx": self})
        self._channel = channel
        self._backend = backend
        self._store_server = store_server
        self._coordinator = coordinator  # standalone mode only: an in-process coordinator for one rank
        self._parts = StateParts()
        self._model: TorchPassDDP | None = None
        self._commit_hooks: list[Callable[[int], None]] = []
        self._pending: GenerationInfo | None = None
        self._committed = -1
        self._has_state = False
        # The step in progress and what an abandoned one is undone from (torchpass.step).
        self.lifecycle = StepLifecycle(channel, self._parts, lambda: self.generation, self.log, event_sink)
        self._closed = False
        self._snapshotter = Snapshotter(config, self.log, event_sink)
        self._restore_from = restore_target(config) if env.initial_slot is not None else (None, False)
        channel.on_generation = self._on_generation

    # ----- what the user reads --------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This rank's slot (its rank in every generation's process group)."""
        return self.slot

    @property
    def step(self) -> int:
        """The step being executed (-1 outside ``ctx.steps``)."""
        return self.lifecycle.step

    @property
    def committed_step(self) -> int:
        """The last step whose update this rank's state contains (-1 before the first)."""
        return self._committed

    @property
    def device(self) -> torch.device:
        """Where the backend's collectives run (cpu for gloo, this rank's GPU for NCCL)."""
        return self._backend.device

    # ----- wrapping -------------------------------------------------------------------------

    def wrap_model(self, model: nn.Module, *, broadcast_buffers: bool = True, **ddp_kwargs: Any) -> TorchPassDDP:
        """Wrap ``model`` in TorchPass's DDP (extra keyword arguments go to DDP, e.g. ``device_ids``).

        Its parameters and buffers are part of the state that moves. One model per job; further modules
        whose state matters can be registered with :meth:`register`.
        """
        if self._model is not None:
            raise TorchPassError("ctx.wrap_model was already called; register further modules with ctx.register")
        return self.adopt_model(TorchPassDDP(model, self, broadcast_buffers=broadcast_buffers, **ddp_kwargs))

    def adopt_model(self, ddp: TorchPassDDP) -> TorchPassDDP:
        """Make ``ddp`` (built over this context) the job's model: its state moves, its buffers roll back.

        Split from :meth:`wrap_model` for transparent mode, whose DDP stand-in constructs itself."""
        self._model = ddp
        self._parts.model = ddp.module
        self.lifecycle.track_model(
            list(ddp.module.buffers()) if self.config.snapshot_buffers else [],
            StagedBuffers(ddp.synced_buffers) if ddp.synced_buffers and self.world_size > 1 else None,
        )
        return ddp

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``optimizer.step()`` skip abandoned steps; its state becomes part of the state that moves.

        Returns the same object (so LR schedulers and grad scalers built on it keep working).
        """
        if any(optimizer is o for o in self._parts.optimizers):
            return optimizer
        inner = optimizer.step
        ctx, lifecycle = self, self.lifecycle

        def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            lifecycle.settle_staged_buffers()  # the update waits for slot 0's buffers: their loss abandons the step
            if lifecycle.abandoned:
                ctx.log.debug("optimizer step skipped (step abandoned: %s)", lifecycle.reason)
                return None
            ctx._snapshotter.before_update()  # snapshot copies still reading the parameters come first
            result = inner(*args, **kwargs)
            lifecycle.optimizer_steps += 1
            return result

        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        self._parts.optimizers.append(optimizer)
        return optimizer

    def register(self, name: str, obj: Any) -> Any:
        """Add ``obj`` (anything with ``state_dict``/``load_state_dict``) to the state that moves.

        A grad scaler is gated like the optimizer (its ``update()`` keeps the old scale in an abandoned step,
        without the GPU sync a copy of its state would cost). Any other object, an LR scheduler included, is
        copied at every committed step and restored when a step is abandoned, so keep it small (a scheduler's
        state is a few numbers), or update it only from an :meth:`on_commit` callback. Register before
        ``ctx.steps`` starts.
        """
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"ctx.register({name!r}): object needs state_dict() and load_state_dict()")
        if name in self._parts.extra:
            raise TorchPassError(f"ctx.register: {name!r} is already registered")
        if self.generation >= 0:
            raise TorchPassError("ctx.register must be called before ctx.steps starts")
        if isinstance(obj, torch.amp.GradScaler):
            self._gate_scaler(obj)
        else:
            self.lifecycle.track_state(name, obj)
        self._parts.extra[name] = obj
        return obj

    def _gate_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """``update()`` must still reset the scaler's per-step bookkeeping; only its scale is kept."""
        inner = scaler.update
        lifecycle = self.lifecycle

        def update(self: torch.amp.GradScaler, new_scale: Any = None) -> None:
            if not lifecycle.abandoned:
                inner(new_scale)
                return
            saved = [t.clone() if t is not None else None for t in (self._scale, self._growth_tracker)]
            inner(new_scale)
            for live, old in zip((self._scale, self._growth_tracker), saved, strict=True):
                if live is not None and old is not None:
                    live.copy_(old)

        scaler.update = types.MethodType(update, scaler)  # type: ignore[method-assign]

    def on_commit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(step)`` each time a step commits (e.g. an EMA update, a step journal)."""
        self._commit_hooks.append(callback)

    # ----- the loop -------------------------------------------------------------------------

    def steps(self, source: Any, total_steps: int) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` for every step from the current one to ``total_steps - 1``.

        ``source`` gives the batch of a step: a :class:`torchpass.StepLoader`, any object with
        ``batch(step, slot, world_size)``, a function ``step -> batch``, a sequence, or None. A step may be
        yielded again (same batch, same RNG) when it was abandoned by a failure; a committed step is never
        yielded twice. Returns when every member has committed the last step.
        """
        fetch = batch_source(source, lambda: self.slot, self.world_size)
        self.start()
        while True:
            if not self.follow_generation(stop_when_done=True):
                return
            step = self._committed + 1
            if step >= total_steps:
                if self.finish():
                    self.lifecycle.step = -1
                    return
                continue
            self.begin(step)
            batch = fetch(step)
            yield step, batch
            self.end_step()

    def start(self) -> None:
        """Join the job's first generation (a spare: the one that gave it its slot), restore a snapshot if one
        is due (every rank agrees), and start the snapshot writer; nothing once joined. ``steps`` calls it, and
        transparent mode at its first batch."""
        if self.generation >= 0:
            return
        self._join_loop(after=-1, first=self._pending)
        self._maybe_restore()
        self._snapshotter.prepare()

    def must_rejoin(self) -> bool:
        """Whether this rank must leave its generation at the next boundary: a newer one was announced, the
        coordinator is lost, or the job was stopped. The one test every step boundary makes."""
        channel = self._channel
        return channel.latest_gen > self.generation or channel.lost or channel.stopped is not None

    def follow_generation(self, *, stop_when_done: bool = False) -> bool:
        """At a step boundary: rejoin until this rank trains in the newest generation. False (only with
        ``stop_when_done``) when the job finished instead; otherwise a finished job ends the process."""
        while self.must_rejoin():
            stopped = self._channel.stopped
            if stop_when_done and stopped is not None and stopped.done:
                return False
            self.recover(f"generation {self._channel.latest_gen} announced", error=False)
        return True

    def begin(self, step: int) -> None:
        """Open ``step`` (the committed step + 1; a redo after an abandoned step gets the same RNG)."""
        cfg = self.config
        self.lifecycle.begin(step, seed=cfg.seed, slot=self.slot, python=cfg.reseed_python, numpy=cfg.reseed_numpy)

    def end_step(self) -> None:
        """Close the step in progress: commit it, or roll it back; then recover when it failed (a rank whose
        collective failed after the update commits first, then recovers)."""
        lifecycle = self.lifecycle
        if lifecycle.abandoned:
            lifecycle.roll_back()
            self.recover(lifecycle.reason, error=True)
            return
        self.commit(lifecycle.step)
        if lifecycle.failed_after_update:
            self.recover(lifecycle.failed_after_update, error=True)

    def commit(self, step: int) -> None:
        """``step`` is done on this rank: its state is the committed state (callbacks, snapshots)."""
        self.lifecycle.settle_for_commit()  # every rank now holds slot 0's buffers (torchpass.buffers)
        self._committed = step
        self._has_state = True
        self.lifecycle.remember()
        for callback in self._commit_hooks:
            callback(step)
        planned = step in self._channel.snapshot_steps
        if self._snapshotter.due(step, self._channel.snapshot_steps):
            if not self._snapshotter.capture(self._parts, step, self.slot, self.world_size) and planned:
                self._channel.skipped_snapshots.append(step)  # the coordinator may plan it again

    # ----- failure-tolerant collectives ----------------------------------------------------

    @property
    def parts(self) -> StateParts:
        """The state that moves (model, optimizers, registered objects); read it, do not replace it."""
        return self._parts

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    @property
    def user_group(self) -> dist.ProcessGroup | None:
        """This generation's process group for the script's own collectives (never the gradients')."""
        return self._backend.user_group

    def collective_allowed(self) -> bool:
        """Whether a collective may start now (False once the step is abandoned or the generation is stale)."""
        return self.lifecycle.collective_allowed()

    def abandon_step(self, error: BaseException | str) -> None:
        """Mark the current step abandoned (callable from any thread)."""
        self.lifecycle.abandon(error)

    def stage_buffers(self) -> None:
        """After a synchronising forward: start broadcasting slot 0's buffers (a failure abandons the step)."""
        self.lifecycle.stage_buffers()

    def take_staged_buffers(self) -> None:
        """Before a further forward of the same step: take the staged buffers, as DDP's broadcast would."""
        self.lifecycle.take_staged_buffers()

    def local_group(self) -> dist.ProcessGroup:
        """The private one-rank group DDP is constructed over when its gradients are not on the CPU."""
        return self._backend.local_group()

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> bool:
        """``dist.all_reduce`` that abandons the step instead of raising; returns whether it succeeded.

        Use it for collectives of your own inside the loop (e.g. averaging a loss for logging): a raw
        ``dist`` call would raise into your code when a peer dies. After the step's update a failure cannot
        abandon the step: the collective is skipped, the step commits and the rank recovers right after.
        """

        def run() -> bool:
            dist.all_reduce(tensor, op=op, group=self._backend.user_group)
            return True

        return self.guarded_collective("ctx.all_reduce", run, False)

    def guarded_collective(self, name: str, run: Callable[[], _T], failed: _T) -> _T:
        """Run one of the script's collectives inside the step in progress, never raising: before the update
        a failure abandons the step; after it, the step commits and the rank recovers (:meth:`end_step`).
        ``failed`` is returned when it did not run or failed; ``run()``'s result otherwise."""
        lifecycle = self.lifecycle
        if lifecycle.updated:
            if lifecycle.failed_after_update or lifecycle.stale():
                lifecycle.fail_after_update(f"generation {self._channel.latest_gen} announced")
                return failed
            try:
                return lifecycle.user_collective(name, run)
            except Exception as exc:
                lifecycle.fail_after_update(f"{type(exc).__name__}: {exc}")
                self.log.warning("collective failed after the step's update: %s", str(exc).splitlines()[0][:300])
                return failed
        if not lifecycle.collective_allowed():
            return failed
        try:
            return lifecycle.user_collective(name, run)
        except Exception as exc:
            lifecycle.abandon(exc)
            return failed

    def _on_generation(self, gen: int) -> None:
        """Control thread: a newer generation exists, so any collective of an older one is doomed: abort it."""
        if 0 <= self._backend.generation < gen:
            self._backend.abort()

    # ----- membership changes ---------------------------------------------------------------

    def recover(self, reason: str, *, error: bool) -> None:
        """Leave the current generation and join the next (see the module docstring)."""
        left_at = time.time()
        gen = self.generation
        self.log.warning("leaving generation %d: %s", gen, reason.splitlines()[0][:300])
        self._backend.destroy()  # closes our sockets: peers still inside a collective with us fail at once
        if error and self._channel.latest_gen <= gen:
            self._report(
                "broken",
                gen=gen,
                slot=self.slot,
                step=self.lifecycle.step,
                committed=self._committed,
                error=reason[:500],
                at=self.lifecycle.first_error_at or left_at,
            )
        self._join_loop(after=gen, first=None, left_at=left_at)

    def _join_loop(self, after: int, first: GenerationInfo | None, left_at: float | None = None) -> None:
        self._snapshotter.before_update()  # joining may overwrite the state a snapshot is still copying
        info = first
        while True:
            if info is None:
                info = self._await_generation(after)
            received_at = time.time()
            if info.handoff is not None and info.handoff.source == self.worker_id:
                self._depart(info)
            try:
                self._join(info, received_at, left_at)
                return
            except _Broken as exc:
                self.log.warning("generation %d could not form: %s", info.gen, exc)
                self._backend.destroy()
                self._report(
                    "broken",
                    gen=info.gen,
                    slot=self.slot,
                    step=self.lifecycle.step,
                    committed=self._committed,
                    error=str(exc)[:500],
                    at=time.time(),
                )
                after, info = info.gen, None

    def _await_generation(self, after: int) -> GenerationInfo:
        try:
            reply = self._channel.wait(
                "await_generation",
                _FOREVER_S,
                after=after,
                gen=self.generation,
                slot=self.slot,
                committed=self._committed,
            )
        except JobStopped as stop:
            self._stopped(stop)
        except CoordinatorLost as exc:
            raise TorchPassError(str(exc)) from None
        return GenerationInfo.from_wire(reply["generation"])

    def _stopped(self, stop: JobStopped) -> NoReturn:
        if stop.done:
            self.log.info("the job finished without needing this process")
            self.close()
            raise SystemExit(0)
        raise TorchPassError(f"the job failed: {stop.reason}")

    def _report(self, op: str, **fields: Any) -> None:
        """A short request whose loss must not stop recovery (the coordinator also sees deaths itself)."""
        try:
            self._channel.call(op, **fields)
        except JobStopped as stop:
            self._stopped(stop)
        except (CoordinatorLost, CoordinatorRefused) as exc:
            self.log.warning("coordinator did not take %s: %s", op, exc)

    def _rendezvous(self, host: str, port: int, prefix: str) -> dist.Store:
        try:
            client = dist.TCPStore(
                host,
                port,
                None,
                False,
                timeout=datetime.timedelta(seconds=self.config.collective_timeout_s),
                wait_for_workers=False,
            )
        except Exception as exc:
            raise _Broken(f"store {host}:{port} unreachable: {exc}") from None
        return dist.PrefixStore(prefix, client)

    def _arrive(self, store: dist.Store, me: int, count: int, gen: int) -> None:
        """Store barrier that gives up as soon as the generation is superseded (a blocking wait would not)."""
        try:
            store.set(f"arrive/{me}", self.worker_id)
            keys = [f"arrive/{i}" for i in range(count)]
            deadline = time.monotonic() + self.config.join_timeout_s
            delay = 0.001
            while not store.check(keys):
                if self._channel.latest_gen > gen:
                    raise _Broken(f"superseded by generation {self._channel.latest_gen}")
                if self._channel.stopped is not None and not self._channel.stopped.done:
                    raise _Broken(f"job stopped: {self._channel.stopped.reason}")
                if time.monotonic() > deadline:
                    raise _Broken(f"not every member arrived within join_timeout_s={self.config.join_timeout_s:g}")
                time.sleep(delay)
                delay = min(0.02, delay * 1.5)
        except _Broken:
            raise
        except Exception as exc:
            raise _Broken(f"rendezvous store failed: {exc}") from None

    def _skip_ports(self, *ports: int) -> set[int]:
        return {self._store_server.port, *ports}

    def _join(self, info: GenerationInfo, received_at: float, left_at: float | None) -> None:
        slot = info.slot_of(self.worker_id)
        if slot is None:
            raise TorchPassError(f"generation {info.gen} does not include this process")
        self.slot = slot
        self._backend.destroy()
        emit(self.event_sink, self.log, "torchpass.joining", generation=info.gen, slot=slot, reason=info.reason)
        handoff_ok = False
        if info.handoff is not None and info.handoff.target == self.worker_id and not self._has_state:
            handoff_ok = self._receive_handoff(info)
        prefix = f"{self.config.store_prefix}/g{info.gen}"
        store = self._rendezvous(info.store_host, info.store_port, prefix)
        self._arrive(store, slot, info.world_size, info.gen)
        arrived_at = time.time()
        try:
            self._backend.form_group(
                dist.PrefixStore("pg", store), slot, info.world_size, info.gen, self._skip_ports(info.store_port)
            )
        except Exception as exc:
            raise _Broken(f"process group did not form: {exc}") from None
        formed_at = time.time()
        if self._channel.latest_gen > info.gen:
            raise _Broken(f"superseded by generation {self._channel.latest_gen}")
        self.generation = info.gen
        self.lifecycle.drop_staged_buffers()  # staged in a generation that is gone
        source, received, nbytes = self._agree_and_transfer(info)
        done_at = time.time()
        self.lifecycle.restart_at(self._committed + 1)
        timings: dict[str, Any] = {
            "rebuild_ms": round(1000 * (formed_at - received_at), 1),
            "transfer_ms": round(1000 * (done_at - formed_at), 1),
        }
        emit(
            self.event_sink,
            self.log,
            "torchpass.joined",
            generation=info.gen,
            slot=slot,
            resume_step=self._committed + 1,
            source=source,
            received=received,
            transfer_bytes=nbytes,
            **timings,
        )
        self._report(
            "joined",
            gen=info.gen,
            slot=slot,
            resume_step=self._committed + 1,
            source=source,
            received=received,
            transfer_bytes=nbytes,
            arrived_at=arrived_at,
            first_error_at=self.lifecycle.first_error_at,
            left_at=left_at,
            handoff_ok=handoff_ok,
            **timings,
        )

    def _agree_and_transfer(self, info: GenerationInfo) -> tuple[int | None, bool, int]:
        """Find the most advanced replicas and send their state to everyone behind; (source, received, bytes)."""
        device = self._backend.device
        world, me = info.world_size, self.slot
        try:
            mine = torch.tensor([1 if self._has_state else 0, self._committed], dtype=torch.int64, device=device)
            rows = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(rows, mine)
            table = [(int(r[0]), int(r[1])) for r in (row.tolist() for row in rows)]
        except Exception as exc:
            raise _Broken(f"state agreement failed: {exc}") from None
        holders = [rank for rank, (has, _) in enumerate(table) if has]
        if not holders:
            if info.expect_state:
                self._fatal(f"generation {info.gen}: no member holds the training state any more")
            holders, best = [0], -1  # a fresh start: slot 0's initial weights go to everyone (as DDP does)
        else:
            best = max(table[rank][1] for rank in holders)
        sources = [rank for rank in holders if table[rank][1] == best]
        receivers = [rank for rank in range(world) if rank not in sources]
        plan = [(sources[i % len(sources)], dst) for i, dst in enumerate(receivers)]
        chunk = int(self.config.transfer_chunk_mb * (1 << 20))
        source_of_me, nbytes = None, 0
        for src, dst in plan:
            if me not in (src, dst):
                continue
            emit(
                self.event_sink,
                self.log,
                "torchpass.transfer",
                generation=info.gen,
                role="send" if me == src else "receive",
                peer=dst if me == src else src,
                step=best,
            )
            try:
                if me == src:
                    nbytes += send_state(self._parts, self._committed, dst, device, chunk)
                else:
                    self._has_state = False  # a partial receive leaves nothing trustworthy
                    with torch.no_grad():
                        self._committed, nbytes = recv_state(self._parts, src, device, chunk)
                    self._has_state = True
                    source_of_me = src
            except StateError as exc:
                self._fatal(str(exc))
            except Exception as exc:
                raise _Broken(f"state transfer {src}->{dst} failed: {exc}") from None
        if me in sources:
            self._committed = best
            self._has_state = True
        return source_of_me, source_of_me is not None, nbytes

    def _fatal(self, message: str) -> NoReturn:
        self.report_fatal(message)
        raise TorchPassError(message)

    def report_fatal(self, message: str) -> None:
        """Fail the whole job with ``message`` (a problem every rank, and every spare after it, would hit the
        same way: replacing this rank could only repeat it)."""
        self._report("fatal", message=message)

    def finish(self) -> bool:
        """Wait until every member committed the last step; False when a new generation needs this rank."""
        try:
            reply = self._channel.wait(
                "finished", _FOREVER_S, gen=self.generation, slot=self.slot, committed=self._committed
            )
        except JobStopped as stop:
            if stop.done:
                return True
            raise TorchPassError(f"the job failed: {stop.reason}") from None
        except CoordinatorLost as exc:
            raise TorchPassError(str(exc)) from None
        info = GenerationInfo.from_wire(reply["generation"])
        self.log.info("generation %d announced while finishing; rejoining", info.gen)
        self._backend.destroy()
        self._join_loop(after=self.generation, first=info, left_at=time.time())
        return False

    # ----- planned migration ----------------------------------------------------------------

    def request_migration(self, slot: int) -> dict[str, Any]:
        """Ask the coordinator to move ``slot`` to a spare at its next step boundary (as ``clockwork migrate``)."""
        try:
            return self._channel.call("migrate", slot=slot)
        except CoordinatorRefused as exc:
            raise TorchPassError(str(exc)) from None

    def _handoff_store(self, info: GenerationInfo) -> dist.Store:
        assert info.handoff is not None
        return self._rendezvous(info.handoff.host, info.handoff.port, f"{self.config.store_prefix}/g{info.gen}/handoff")

    def _depart(self, info: GenerationInfo) -> NoReturn:
        """This rank is migrating away: hand the live state to the spare, then exit cleanly."""
        assert info.handoff is not None
        started, ok, nbytes = time.time(), False, 0
        chunk = int(self.config.transfer_chunk_mb * (1 << 20))
        try:
            store = self._handoff_store(info)
            self._arrive(store, 0, 2, info.gen)
            self._backend.form_group(dist.PrefixStore("pg", store), 0, 2, info.gen, self._skip_ports(info.handoff.port))
            nbytes = send_state(self._parts, self._committed, 1, self._backend.device, chunk)
            ack = torch.zeros(1, dtype=torch.int64, device=self._backend.device)
            dist.recv(ack, 1)
            ok = True
            self.log.info("handed %d bytes of state (step %d) to %s", nbytes, self._committed, info.handoff.target)
        except Exception as exc:
            self.log.warning("handoff to %s failed (%s); it gets the state from a replica", info.handoff.target, exc)
        finally:
            self._backend.destroy()
        handoff_ms = round(1000 * (time.time() - started), 1)
        emit(
            self.event_sink,
            self.log,
            "torchpass.departed",
            generation=info.gen,
            handoff_ok=ok,
            handoff_ms=handoff_ms,
            handoff_bytes=nbytes if ok else 0,
        )
        self._report("departed", gen=info.gen, handoff_ok=ok, handoff_ms=handoff_ms, handoff_bytes=nbytes if ok else 0)
        self.close()
        raise SystemExit(0)

    def _receive_handoff(self, info: GenerationInfo) -> bool:
        """The spare side of a migration; on any failure the state comes from a replica instead."""
        chunk = int(self.config.transfer_chunk_mb * (1 << 20))
        assert info.handoff is not None
        try:
            store = self._handoff_store(info)
            self._arrive(store, 1, 2, info.gen)
            self._backend.form_group(dist.PrefixStore("pg", store), 1, 2, info.gen, self._skip_ports(info.handoff.port))
            with torch.no_grad():
                self._committed, nbytes = recv_state(self._parts, 0, self._backend.device, chunk)
            dist.send(torch.ones(1, dtype=torch.int64, device=self._backend.device), 0)
            self._has_state = True
            self.log.info("received %d bytes of state (step %d) from %s", nbytes, self._committed, info.handoff.source)
            return True
        except StateError as exc:
            self._fatal(str(exc))
        except Exception as exc:
            self._has_state, self._committed = False, -1
            self.log.warning("handoff from %s failed (%s); taking the state from a replica", info.handoff.source, exc)
            emit(
                self.event_sink,
                self.log,
                "torchpass.handoff_failed",
                generation=info.gen,
                source=info.handoff.source,
                error=f"{type(exc).__name__}: {exc}"[:300],
            )
            return False
        finally:
            self._backend.destroy()

    # ----- snapshots ------------------------------------------------------------------------

    def snapshot_now(self) -> bool:
        """Take a snapshot after the current step commits (every rank must call it at the same step, or use
        ``clockwork snapshot take``); False when one is still being written."""
        step = self.lifecycle.step if self.lifecycle.step >= 0 else self._committed
        self._channel.snapshot_steps.add(step)
        return not self._snapshotter.busy

    def _maybe_restore(self) -> None:
        """Right after the first generation formed: load the snapshot to restore, if any (every rank agrees)."""
        target, required = self._restore_from
        self._restore_from = (None, False)
        if target is None:
            return

        def agree(ok: bool) -> bool:
            flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self._backend.device)
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            except Exception as exc:
                raise TorchPassError(f"ranks could not agree on the snapshot to restore: {exc}") from None
            return bool(flag.item())

        try:
            committed = restore(
                self._parts,
                target,
                required=required,
                slot=self.slot,
                device=self._backend.device,
                agree=agree,
                log=self.log,
                event_sink=self.event_sink,
            )
        except RestoreError as exc:
            self._fatal(str(exc))
        if committed is None:
            return
        self._committed = committed
        self._has_state = True
        self.lifecycle.restart_at(committed + 1)

    # ----- end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process group and stop talking to the coordinator (also run at exit)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._snapshotter.close(timeout_s=min(self.config.snapshot_timeout_s, 120.0))
        except Exception as exc:  # the job's end must not hang on a snapshot
            self.log.warning("closing the snapshot writer failed: %s", exc)
        try:
            self._backend.destroy()
        finally:
            self._channel.close()
            if self._coordinator is not None:
                self._coordinator.stop()


def init(config: TorchPassConfig | None = None, *, event_sink: EventSink | None = None, **overrides: Any) -> Context:
    """Join the job the launcher started (``torchpass run``); returns this rank's :class:`Context`.

    The configuration is the launcher's (``TORCHPASS_CONFIG``) unless ``config`` is given; keyword arguments
    override single fields (unknown names are errors). A spare process blocks here until it is given a slot
    (and exits with status 0 if the job ends first). Run without a launcher, the script trains alone as slot
    0 of a one-rank job, with an in-process coordinator.
    """
    cfg = (config or TorchPassConfig.from_env()).with_overrides(**overrides)
    _configure_logging(cfg.log_level)
    env = LaunchEnv.from_environ()
    coordinator = None
    if env is None:
        if JobKey.from_environ() is None:  # alone, this process is the whole job: it makes the job's key
            os.environ[ENV_JOB_KEY] = JobKey.new().hex
        coordinator = Coordinator(1, cfg)
        env = LaunchEnv(coordinator.start(), "w0", "slot:0", 1, "127.0.0.1", "", False)
    else:
        _whole_lines_on_shared_output()
    if env.local or env.agent >= 0:
        die_with_parent()
    daemon_socket = os.environ.get(ENV_DAEMON_SOCKET, "")
    if daemon_socket and env.job_id.isdigit():
        event_sink = tee(event_sink, DaemonEventSink(int(env.job_id), daemon_socket))
    backend = make_backend(cfg, int(os.environ.get("LOCAL_RANK", "0")), os.environ.get(ENV_GLOO_HOST, ""))
    backend.prepare_env()
    store_server = dist.TCPStore(
        env.host, 0, None, True, timeout=datetime.timedelta(seconds=cfg.collective_timeout_s), wait_for_workers=False
    )
    channel = ControlChannel(
        env.coordinator,
        env.worker_id,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        coordinator_timeout_s=cfg.coordinator_timeout_s,
        rpc_timeout_s=cfg.rpc_timeout_s,
    )
    ctx = Context(cfg, env, channel, backend, store_server, event_sink, coordinator)
    # DDP's constructor imports torch._dynamo lazily (about 1 s here). Pay it before registering, so that a
    # spare is fully warm when the coordinator can first hand it a slot.
    importlib.import_module("torch._dynamo")
    if cfg.gc_freeze:
        gc.freeze()
    try:
        channel.call(
            "register", pid=os.getpid(), host=env.host, store_port=store_server.port, role=env.role, agent=env.agent
        )
    except JobStopped as stop:
        ctx._stopped(stop)
    except CoordinatorLost as exc:
        raise TorchPassError(f"cannot reach the coordinator: {exc}") from None
    channel.start()
    atexit.register(ctx.close)
    if env.role == "spare":
        ctx.log.info("spare ready, waiting for a slot")
        info = ctx._await_generation(-1)
        ctx._pending = info
        slot = info.slot_of(env.worker_id)
        ctx.slot = slot if slot is not None else -1
        ctx.log.info("assigned slot %d in generation %d (%s)", ctx.slot, info.gen, info.reason)
    return ctx
