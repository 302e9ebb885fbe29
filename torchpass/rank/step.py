"""One rank's step in progress: begin it, guard its collectives, abandon it, undo it or settle it for commit.

Why one object: the model-aware loop (``ctx.steps``), transparent mode and the DDP wrapper (and the
sharded wrappers to come) all drive the same lifecycle, and a failure must mean the same thing to each:

- :meth:`StepLifecycle.begin` opens step ``n`` (same RNG on a redo: :func:`torchpass.rank.rng.reseed`).
- :meth:`StepLifecycle.collective_allowed` is asked before every collective of the step;
  :meth:`StepLifecycle.abandon` marks the step failed (from any thread, the first reason wins). Nothing
  raises into the user's forward, backward or optimizer step.
- Once every optimizer stepped (:attr:`StepLifecycle.updated`), the step's result is in the parameters and
  it can no longer be abandoned: a collective failing after that is remembered
  (:meth:`StepLifecycle.fail_after_update`), the step commits, and the rank recovers right after.
- :meth:`StepLifecycle.roll_back` undoes what an abandoned step changed locally (buffers, optimizer
  hyper-parameters, registered state, gradients) from the copies :meth:`StepLifecycle.remember` took at the
  last commit; :meth:`StepLifecycle.settle_for_commit` lands slot 0's staged buffers before a commit.

What happens around a step (joining generations, recovering, snapshots, commit callbacks) is the
context's (:mod:`torchpass.rank.context`); this module holds no sockets and no process groups of its own.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from torchpass.events import EventSink, emit
from torchpass.rank.buffers import StagedBuffers
from torchpass.rank.rng import reseed
from torchpass.rank.state import StateParts
from torchpass.rank.torch_compat import drop_held_back_gradients, holds_back_gradients

__all__ = ["StepChannel", "StepLifecycle", "carried_gradients_reason"]

_T = TypeVar("_T")


class StepChannel(Protocol):
    """What the lifecycle reads from and tells the control channel (:class:`torchpass.rank.control.ControlChannel`)."""

    latest_gen: int
    urgent_gen: int
    cut_off_gen: int
    step: int
    collective: tuple[int, int, str] | None


@dataclass(frozen=True)
class _UndoCopies:
    """What a rollback puts back beside the parameters and the optimizer's moments."""

    buffers: list[torch.Tensor]
    groups: list[list[dict[str, Any]]]  # optimizer hyper-parameters (an LR scheduler edits them)
    registered: dict[str, Any]  # registered objects' state_dicts
    scalers: list[tuple[torch.amp.GradScaler, list[torch.Tensor | None]]]  # scale and growth tracker


class StepLifecycle:
    """The step in progress on one rank, and the local state an abandoned step is undone from."""

    def __init__(
        self,
        channel: StepChannel,
        parts: StateParts,
        generation: Callable[[], int],
        log: logging.LoggerAdapter,  # type: ignore[type-arg]
        event_sink: EventSink | None,
    ) -> None:
        self._channel = channel
        self._parts = parts
        self._generation = generation
        self._log = log
        self._event_sink = event_sink
        self.step = -1  # the step in progress (-1 between steps and before the first)
        self.abandoned = False
        self.reason = ""  # why the step was abandoned
        self.first_error_at: float | None = None  # when the first failure of this step was seen
        self.optimizer_steps = 0  # optimizer steps taken in the step in progress
        self.state_spoiled = False  # an abandoned step updated some of the parameters (roll_back)
        self.failed_after_update = ""  # a collective that failed once the update was applied
        self._user_collectives = 0  # the script's collectives started in the step in progress
        self._waits_lock = threading.Lock()
        self._waits: dict[int, tuple[int, Callable[[], None]]] = {}  # key -> (generation, callback): when_cut_off
        self._wait_keys = itertools.count()
        self._waits_cut_off = -1  # the newest generation cut_off_waits ran for
        self._buffers: list[torch.Tensor] = []
        self._buffer_shadow: list[torch.Tensor] = []
        self._group_shadow: list[list[dict[str, Any]]] = []  # optimizer hyper-parameters at the last commit
        self._registered: dict[str, Any] = {}  # generic registered state at the last commit
        # Grad scalers, with their scale and growth tracker at the last commit (None: not created yet).
        self._scalers: list[tuple[torch.amp.GradScaler, list[torch.Tensor | None]]] = []
        # What the script did between the last commit and the step it then began (a pass's epilogue: an LR
        # scheduler stepped once per epoch), as the undo copies at that step's start: (that step, the copies).
        self._moved_on: tuple[int, _UndoCopies] | None = None
        self._staged: StagedBuffers | None = None  # slot 0's buffers, broadcast after a forward (buffers.py)
        # Copies of the committed state still reading the parameters (snapshots, peer copies): an update waits.
        self.before_update_hooks: list[Callable[[], None]] = []
        # Conditions of a commit (peer_copy_sync's vote): ``check(step, failed_after_update)`` returns "" or, having
        # undone the step's update itself, why the step cannot commit.
        self.commit_checks: list[Callable[[int, str], str]] = []
        self._checked = False  # the step in progress passed its commit checks
        # Gradients a commit without an optimizer step left for the next update (a window crossing a pass's end):
        # the step they were committed at, whose optimizers hold them, whether FSDP2 held some back, and the step
        # whose failure found them still pending (see :meth:`note_commit`).
        self._carried_at = -1
        self._carried: set[int] = set()  # the optimizers (by id) whose parameters carry gradients
        self._carried_held_back = False
        self.carried_lost_at = -1

    # ----- what it protects ---------------------------------------------------------------------

    def track_model(self, buffers: list[torch.Tensor], staged: StagedBuffers | None) -> None:
        """The model's buffers roll back with an abandoned step; ``staged`` carries slot 0's (buffers.py)."""
        self._buffers = buffers
        self._buffer_shadow = [b.detach().clone() for b in buffers]
        self._staged = staged

    def track_state(self, name: str, obj: Any) -> None:
        """A registered object (not a grad scaler) is copied at every commit and restored on a roll back."""
        self._registered[name] = copy.deepcopy(obj.state_dict())

    def track_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """A grad scaler's scale and growth tracker roll back with an abandoned step. Its ``update()`` is gated
        as well (torchpass.rank.context), but a step that spans several of its updates (an accumulation window whose
        optimizer step the scaler skipped on inf/NaN gradients runs on into the next one) may have changed them
        before it failed: the redo must start from the committed scale. Copied as tensors (no device sync)."""
        self._scalers.append((scaler, self._scaler_copy(scaler)))

    @staticmethod
    def _scaler_copy(scaler: torch.amp.GradScaler) -> list[torch.Tensor | None]:
        return [t.detach().clone() if t is not None else None for t in (scaler._scale, scaler._growth_tracker)]

    # ----- the lifecycle ------------------------------------------------------------------------

    def begin(self, step: int, *, seed: int, slot: int, python: bool, numpy: bool) -> None:
        """Open ``step``: no failure yet, no update yet, the RNG of this step and slot."""
        self.abandoned = False
        self.reason = ""
        self.first_error_at = None
        self.optimizer_steps = 0
        self._user_collectives = 0
        self.failed_after_update = ""
        self._checked = False
        self.step = step
        self._channel.step = step
        reseed(seed, slot, step, python=python, numpy=numpy)

    def abandon(self, error: BaseException | str) -> None:
        """Mark the current step abandoned (safe from any thread; the first reason wins)."""
        if not self.abandoned:
            self.first_error_at = time.time()
            self.reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            self.abandoned = True
            self._log.warning("step abandoned: %s", self.reason.splitlines()[0][:300])

    def stale(self) -> bool:
        """Whether a newer generation than this rank's was announced that the step in progress must not outlive:
        a failure's or a rebuild's. A planned one (a migration: every member of this generation is alive) lets
        the step finish on every rank, and the ranks follow it at the boundary. Abandoning there instead left
        an HSDP job's shards at two steps (the ranks of one shard had passed their last collective and
        committed, the others abandoned), with no common step to resume at, and the job stopped (fuzzer seed
        3184: a migration and no failure)."""
        return self._channel.urgent_gen > self._generation()

    def cut_off(self) -> bool:
        """Whether this rank's groups of the current generation were aborted for a newer one (after :meth:`stale`,
        once the control thread acted on it): nothing pending in them can succeed any more."""
        return self._channel.cut_off_gen > self._generation()

    def when_cut_off(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once this rank's groups of the current generation are aborted for a newer one (on
        the control thread, right after the abort: :meth:`cut_off_waits`), or at once if they already were; the
        function returned cancels it (call it when the wait ended by itself).

        For a wait that the abort cannot free and nobody polls: a DDP bucket's gloo all-reduce, which DDP's
        reducer waits for in C++, can hold a send that gloo never fails (:mod:`torchpass.sharded.gloo_wait` says
        why), and backward then waits the whole ``collective_timeout_s`` (30 s, seen in a soak)."""
        gen = self._generation()
        with self._waits_lock:
            if gen >= self._waits_cut_off:
                key = next(self._wait_keys)
                self._waits[key] = (gen, callback)
                return lambda: self._forget_wait(key)
        callback()
        return lambda: None

    def _forget_wait(self, key: int) -> None:
        with self._waits_lock:
            self._waits.pop(key, None)

    def cut_off_waits(self, superseded_by: int) -> None:
        """Control thread, once this rank's groups older than ``superseded_by`` were aborted: run the callbacks
        :meth:`when_cut_off` registered under them."""
        with self._waits_lock:
            self._waits_cut_off = max(self._waits_cut_off, superseded_by)
            due = [key for key, (gen, _) in self._waits.items() if gen < superseded_by]
            callbacks = [self._waits.pop(key)[1] for key in due]
        for callback in callbacks:
            try:
                callback()
            except Exception:  # the control thread must survive it
                self._log.exception("a cut-off callback failed")

    def collective_allowed(self) -> bool:
        """Whether a collective may start now; abandons the step when the generation is stale."""
        if self.abandoned:
            return False
        if self.stale():
            self.abandon(f"generation {self._channel.urgent_gen} announced")
            return False
        return True

    @property
    def updated(self) -> bool:
        """Every wrapped optimizer stepped in this step: its result is in the parameters, so the step can no
        longer be abandoned (a redo would apply the update twice); it commits whatever fails after this."""
        return bool(self._parts.optimizers) and self.optimizer_steps >= len(self._parts.optimizers)

    def fail_after_update(self, reason: str) -> None:
        """A collective after the update failed (or may not run): the step commits, then the rank recovers."""
        self.first_error_at = self.first_error_at or time.time()
        self.failed_after_update = self.failed_after_update or reason

    def user_collective(self, name: str, run: Callable[[], _T]) -> _T:
        """Run one of the script's collectives; while it runs, the heartbeats say which one, so the coordinator
        can tell when peers went past it (a counter of the script's own that disagrees:
        torchpass.coordinator.lockstep)."""
        self._user_collectives += 1
        self._channel.collective = (self.step, self._user_collectives, name) if self.step >= 0 else None
        try:
            return run()
        finally:
            self._channel.collective = None

    # ----- slot 0's buffers (torchpass.rank.buffers) -------------------------------------------------

    def stage_buffers(self) -> None:
        """After a synchronising forward inside a step: start broadcasting slot 0's buffers."""
        staged = self._staged
        if staged is None or self.step < 0 or not self.collective_allowed():
            return
        try:
            staged.launch()
        except Exception as exc:
            staged.drop()
            self.abandon(exc)

    def before_update(self) -> None:
        """Right before an optimizer step changes the parameters: every copy still reading them finishes."""
        for hook in self.before_update_hooks:
            hook()

    def settle_staged_buffers(self) -> None:
        """Wait for a staged broadcast of slot 0's buffers; its failure abandons the step."""
        staged = self._staged
        if staged is None or not staged.pending:
            return
        if self.abandoned:
            staged.drop()
            return
        try:
            staged.wait()
        except Exception as exc:
            staged.drop()
            self.abandon(exc)

    def take_staged_buffers(self) -> None:
        """Before a further forward of the same step: slot 0's staged buffers replace this rank's own."""
        self.settle_staged_buffers()
        if self._staged is not None and self._staged.pending:
            self._staged.take()

    def drop_staged_buffers(self) -> None:
        """A staged broadcast of a generation that is gone is dropped."""
        if self._staged is not None:
            self._staged.drop()

    def check_commit(self) -> None:
        """Once per step, before it closes: run the commit checks. One that fails has undone the step's update,
        and the step is abandoned with its reason (rolled back and redone, as a failure before the update is)."""
        if self.abandoned or self._checked:
            return
        self._checked = True
        for check in self.commit_checks:
            reason = check(self.step, self.failed_after_update)
            if reason:
                # The check undid the update: this rank holds the committed state again, and serves it in the
                # recovery (not spoiled: fresh-clone CI, seed 28, a peer_copy_sync vote that failed left every
                # survivor receiving its own copy of the step before, whose scheduler predates the pass's end).
                self.failed_after_update, self.optimizer_steps = "", 0
                self.abandon(reason)
                return

    def settle_for_commit(self) -> None:
        """Before a commit: every rank takes slot 0's buffers; a failure here comes after the update, so the
        step commits and the rank recovers right after."""
        if self._staged is not None and self._staged.pending:
            try:
                self._staged.wait()
                self._staged.take()
            except Exception as exc:
                self._staged.drop()
                self.fail_after_update(f"{type(exc).__name__}: {exc}")

    # ----- gradients carried over a commit -----------------------------------------------------

    def note_commit(self, step: int) -> None:
        """At a commit: a step that ran no optimizer step but leaves gradients (the window that a pass's end cut
        short, or steps that skip the optimizer) hands them to the next update. They are no part of the state:
        a replacement cannot get a lost rank's (under ``no_sync`` each rank's are its own), and a rollback
        clears them, so a failure before that update could only end in a silent difference. They are
        remembered here until an update or a ``zero_grad`` (:meth:`watch_zero_grad`) uses them up, and
        :meth:`check_carried` finds whether a failure came while they were pending."""
        if self.optimizer_steps:
            self._carried_at, self._carried, self._carried_held_back = -1, set(), False
            return
        carried = {
            id(o)
            for o in self._parts.optimizers
            if any(p.grad is not None for g in o.param_groups for p in g["params"])
        }
        held_back = self._parts.model is not None and holds_back_gradients(self._parts.model)
        if carried or held_back:
            self._carried_at = self._carried_at if self._carried_at >= 0 else step
            self._carried |= carried
            self._carried_held_back = self._carried_held_back or held_back

    def watch_zero_grad(self, owner: Any, optimizer: Any = None) -> None:
        """``owner.zero_grad`` (an optimizer's, or the model's: ``optimizer`` None) drops carried gradients:
        the script that zeroes them at a pass's start carries nothing over. Not in an abandoned step (its
        update was skipped: the redo needs what was carried), and not FSDP2's held-back gradients, which are
        beyond its reach (FSDP2 sums them into the next reduce-scatter all the same)."""
        inner = owner.zero_grad
        lifecycle = self

        def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self is not owner:  # a deep copy of the owner (an EMA's AveragedModel) took this method along
                return type(self).zero_grad(self, *args, **kwargs)
            if lifecycle.abandoned:  # after a skipped update: what it drops was not used, the redo needs it
                return inner(*args, **kwargs)
            if optimizer is None:
                lifecycle._carried.clear()
            else:
                lifecycle._carried.discard(id(optimizer))
            if not lifecycle._carried and not lifecycle._carried_held_back:
                lifecycle._carried_at = -1
            return inner(*args, **kwargs)

        owner.zero_grad = types.MethodType(zero_grad, owner)

    def check_carried(self) -> None:
        """Before the gradients are cleared for a failure: remember when carried ones were still pending."""
        if self.carried_lost_at < 0 and self._carried_at >= 0:
            self.carried_lost_at = self._carried_at

    # ----- undo -------------------------------------------------------------------------------

    def remember(self) -> None:
        """Remember what a step may change outside the optimizer's update, as of the last commit: buffers,
        optimizer hyper-parameters (an LR scheduler edits ``param_groups`` directly) and generic registered
        state. An abandoned step is undone from these copies."""
        for live, shadow in zip(self._buffers, self._buffer_shadow, strict=True):
            shadow.copy_(live)
        self._group_shadow = [
            [
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
                for group in optimizer.param_groups
            ]
            for optimizer in self._parts.optimizers
        ]
        for name in self._registered:
            self._registered[name] = copy.deepcopy(self._parts.extra[name].state_dict())
        self._scalers = [(scaler, self._scaler_copy(scaler)) for scaler, _ in self._scalers]

    def remember_moved_on(self, step: int) -> None:
        """At the start of ``step``, after the script ran on past the last commit (a pass's epilogue): the
        rollback point moves here, and a state replaced with the committed one (a peer's copy, this rank's own
        copy, both taken at the commit) gets the epilogue's effects back in :meth:`restart_at`. Without it, a
        survivor rolled back to the last step of a pass lost its LR scheduler's end-of-epoch step, which its
        loop does not run again: every rank ended silently different (fresh-clone CI, seed 28)."""
        self.remember()
        buffers = [shadow.clone() for shadow in self._buffer_shadow]  # remember() copies into these in place
        self._moved_on = (step, _UndoCopies(buffers, self._group_shadow, dict(self._registered), self._scalers))

    def roll_back(self) -> None:
        """Undo what the abandoned step changed locally (a grad scaler's scale included: a step may span several of its
        updates); the optimizer, scheduler and scaler skipped theirs."""
        emit(self._event_sink, self._log, "torchpass.step_abandoned", step=self.step, reason=self.reason)
        if self.optimizer_steps:
            # Some optimizers stepped before the failure (it came between two of them: a grad scaler's step
            # of the second runs a collective, the found-inf reduction over a sharded model's DTensor
            # gradients). Their update is in the parameters, and nothing here can undo it: this rank's state is
            # no longer the committed step, so it must not serve it (fuzzer seed 500141: a survivor sent its
            # shard with half a step in it, and every rank ended one AdamW step ahead, exit 0).
            self.state_spoiled = True
            self._log.warning(
                "step %d failed after %d of its %d optimizer steps: this rank's state takes no part in the "
                "recovery, it is received from a holder",
                self.step,
                self.optimizer_steps,
                len(self._parts.optimizers),
            )
        self.drop_staged_buffers()
        self._restore(_UndoCopies(self._buffer_shadow, self._group_shadow, self._registered, self._scalers))
        self.check_carried()
        self._zero_grads()

    def _restore(self, undo: _UndoCopies) -> None:
        with torch.no_grad():
            for live, shadow in zip(self._buffers, undo.buffers, strict=True):
                live.copy_(shadow)
        for optimizer, groups in zip(self._parts.optimizers, undo.groups, strict=True):
            for group, saved in zip(optimizer.param_groups, groups, strict=True):
                group.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()})
        for name, saved_state in undo.registered.items():
            self._parts.extra[name].load_state_dict(copy.deepcopy(saved_state))
        with torch.no_grad():
            for scaler, (scale, tracker) in undo.scalers:
                if scale is None or tracker is None or scaler._scale is None or scaler._growth_tracker is None:
                    scaler._scale = None if scale is None else scale.clone()  # None: created again at init_scale
                    scaler._growth_tracker = None if tracker is None else tracker.clone()
                else:
                    scaler._scale.copy_(scale)
                    scaler._growth_tracker.copy_(tracker)

    def restart_at(self, step: int) -> None:
        """After the state was replaced (joined a generation, restored a snapshot): no gradients, the undo
        copies taken from the new state (with what this rank's script did after its commit and before ``step``
        put back: :meth:`remember_moved_on`), and ``step`` next."""
        self._zero_grads()
        if self._moved_on is not None and self._moved_on[0] == step:
            self._restore(self._moved_on[1])
        self.remember()
        self.step = step
        self.state_spoiled = False

    def _zero_grads(self) -> None:
        for optimizer in self._parts.optimizers:
            optimizer.zero_grad(set_to_none=True)
        model = self._parts.model
        if model is not None:
            model.zero_grad(set_to_none=True)
            dropped = drop_held_back_gradients(model)  # an abandoned accumulation window's, which zero_grad misses
            if dropped:
                self._log.info("dropped %d gradient(s) FSDP2 held back for the abandoned window", dropped)


def carried_gradients_reason(step: int, failure: str, advice: str) -> str:
    """Why a job stops when a failure finds gradients carried over the commit of ``step`` (see
    :meth:`StepLifecycle.note_commit`), what to change in the script, and what to restart from."""
    return (
        f"step {step} committed without an optimizer step and left its gradients to the next one (a gradient-"
        "accumulation window that a pass over the loader ended, or steps that skip the optimizer); a failure "
        f"came before that update ({failure.splitlines()[0][:200]}). Those gradients are not part of the state "
        "TorchPass moves (a lost rank's cannot be rebuilt), so the job stops rather than finish different from "
        "a fault-free run. Make every pass a whole number of windows (drop_last, or an optimizer step at a pass's "
        f"last batch, as Lightning and the Hugging Face Trainer do). {advice}"
    )
