"""One rank's transparent-mode session: what the script built, where it is in its data, and the step boundary.

:mod:`torchpass.transparent.bootstrap` explains the mode; :mod:`torchpass.transparent.interposers` hands this session
what the script builds and calls its step boundary (:meth:`Session.next_batch`) at every ``next()`` on the tracked
loader, and its :meth:`Session.between_steps` for the script's collectives outside a step.
"""

from __future__ import annotations

import builtins
import inspect
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP
from torch.utils.data import DataLoader, DistributedSampler

from torchpass.errors import TorchPassError
from torchpass.frameworks import FrameworkAdapter, framework_imported
from torchpass.rank.context import Context
from torchpass.rank.ddp import TorchPassDDP
from torchpass.snapshot.restore import restart_advice
from torchpass.transparent.data import DATA_STATE, DataPosition, Enumerated, TrackedPass

__all__ = ["Session", "TransparentWarning"]

# DDP arguments TorchPass decides itself (torchpass.rank.ddp), dropped from the script's call.
_DDP_DROPPED = (
    "process_group",
    "init_sync",
    "static_graph",
    "device_mesh",
    "check_reduction",
    "forward_sync_buffers",
    "bucket_cap_mb_list",
)


class TransparentWarning(UserWarning):
    """The script does something transparent mode cannot protect (the message says what and what happens)."""


class _ReplayOnce:
    """A closure already evaluated once: its first call returns that result, later calls evaluate it again
    (an optimizer such as LBFGS calls its closure several times)."""

    def __init__(self, first: Any, closure: Callable[[], Any]) -> None:
        self.first: Any = first
        self.closure = closure
        self.used = False

    def __call__(self) -> Any:
        if self.used:
            return self.closure()
        self.used = True
        return self.first


class Session:
    """One rank's transparent-mode state: the context, what the script built, and the step in progress."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.position = DataPosition()
        ctx.register(DATA_STATE, self.position)
        self.group_requested = False
        self.model: nn.Module | None = None  # the script's DDP, or the outermost module it fully_shard-ed
        self.loader: DataLoader[Any] | None = None
        self.untracked: list[tuple[Any, bool]] = []  # (dataset, over a DistributedSampler) of untracked loaders
        self.evaluation_datasets: list[Any] = []  # of the loaders a framework rebuilt for validation
        self.passes = 0
        self.step_open = False
        self.step_pass = -1
        self.step_index = -1
        self.step_epoch = -1
        self.steps_without_optimizer = 0
        self.fast_forward = False
        self.between_seen = 0  # the script's collectives between steps this process reached (once the job started)
        self.moved_between = False  # the script ran on between two steps: the rollback point moves to the next
        self.first_step_checked = False
        self.framework: FrameworkAdapter | None = None  # a framework's adapter, once it called init_process_group
        self.rolled_back = False  # the open step was abandoned and undone already; only the recovery is left
        self.n_schedulers = 0
        self.n_scalers = 0
        self.n_averaged = 0

    # ----- warnings ------------------------------------------------------------------------

    def warn(self, message: str) -> None:
        """A loud start-up warning: on the rank's log and as a Python warning; an error when
        ``transparent_strict`` is set (a site or user that wants no unprotected job to run)."""
        if self.ctx.config.transparent_strict:
            raise TorchPassError(f"transparent mode (transparent_strict): {message}")
        self.ctx.log.warning("transparent mode: %s", message)
        warnings.warn(f"torchpass transparent mode: {message}", TransparentWarning, stacklevel=3)

    def check_first_step(self) -> None:
        """At the end of the first step: is this script inside what transparent mode protects?"""
        if self.first_step_checked:
            return
        self.first_step_checked = True
        if self.framework is not None:
            self.framework.check_first_step(self.model is not None)
        if self.model is None:
            self.warn(
                "the first step ran without a DistributedDataParallel model or a fully_shard-ed one: gradients "
                "are not averaged through TorchPass and no model state moves to a replacement"
            )
        if not self.ctx.parts.optimizers:
            raise TorchPassError(
                "transparent mode: no torch.optim optimizer was built before the first step; there is no "
                "training state to protect (use the model-aware API for custom update rules)"
            )
        if self.ctx.lifecycle.optimizer_steps == 0:
            raise TorchPassError(
                "transparent mode: a whole pass over the DistributedSampler loader ran no optimizer step; there "
                "is no training update to protect"
            )
        if len(self.ctx.parts.optimizers) > 1:
            self.warn(
                f"{len(self.ctx.parts.optimizers)} optimizers were built; all of them move with the state, "
                "matched by construction order, which must be the same on every rank"
            )
        if self.other_loaders:
            self.warn(
                f"{self.other_loaders} further DataLoader(s) are not tracked: only the first one over a "
                "DistributedSampler sets the data position; iterating the others is not protected"
            )

    def between_steps(self, collective: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A collective of the script's outside a step (e.g. between epochs). A newcomer skips the ones the
        replicas completed before it joined (it counts them as it replays the script); the first one they did
        not complete is where it catches up with them, and from there on it runs the script for real. When it
        fails, the rank recovers and runs it again in the new generation, with its input tensors as they were
        (a failed collective may have written into them). Every member meets it there: survivors by retrying,
        a newcomer by reaching it."""
        ctx = self.ctx
        if ctx.generation < 0:
            return collective(*args, **kwargs)  # before the first step there is no group: it raises as usual
        self.between_seen += 1
        if self.between_seen <= self.position.collectives:
            return None  # the replicas ran it before this process joined
        self.fast_forward = False
        tensors = _tensors_in(args, kwargs)
        saved = [t.detach().clone() for t in tensors]
        while True:
            ctx.follow_generation()
            try:
                result = collective(*args, **kwargs)
            except Exception as exc:
                ctx.lifecycle.first_error_at = time.time()
                ctx.log.warning("collective between steps failed (%s): recovering, then running it again", exc)
                with torch.no_grad():
                    for live, old in zip(tensors, saved, strict=True):
                        live.copy_(old)
                ctx.recover(f"{type(exc).__name__}: {exc}", error=True)
                continue
            self.position.collectives += 1
            self.moved_between = True
            return result

    def adopt_ddp(self, ddp: TorchPassDDP, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Build TorchPass's DDP in place of the script's, dropping the arguments TorchPass decides itself."""
        if self.model is not None:
            raise TorchPassError(
                "transparent mode protects one DistributedDataParallel model; this script wraps a second one "
                "(use the model-aware API, or one DDP over a module holding both)"
            )
        try:  # the script's arguments by name, as torch's own DDP would read them
            given = dict(inspect.signature(_TorchDDP.__init__).bind(ddp, module, *args, **kwargs).arguments)
        except TypeError as exc:
            raise TypeError(f"DistributedDataParallel: {exc}") from None
        given.pop("self", None)
        given.pop("module", None)
        group = given.get("process_group")
        if group is not None and group is not dist.GroupMember.WORLD:
            raise TorchPassError("transparent mode: DDP over a process group other than the default one")
        dropped = sorted(name for name in _DDP_DROPPED if given.pop(name, None) is not None)
        if dropped:
            self.ctx.log.info("DistributedDataParallel: TorchPass decides %s itself", ", ".join(dropped))
        broadcast_buffers = given.pop("broadcast_buffers", None)
        TorchPassDDP.__init__(
            ddp,
            module,
            self.ctx,
            broadcast_buffers=True if broadcast_buffers is None else bool(broadcast_buffers),
            **given,
        )
        self.ctx.adopt_model(ddp)
        self.model = ddp
        if self.framework is not None:
            self.framework.adopt_model(module)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every optimizer built by the script: its state moves; its step skips abandoned and skipped steps."""
        if self.ctx.generation >= 0:
            self.warn(
                f"{type(optimizer).__name__} built after training started: a newcomer builds it before its first "
                "step, so the optimizers no longer match by construction order; it is tracked from now on"
            )
        self.ctx.wrap_optimizer(optimizer)
        gated = optimizer.step
        session = self

        def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if session.fast_forward:
                return None
            closure = kwargs.pop("closure", None) if "closure" in kwargs else (args[0] if args else None)
            if closure is None:
                return gated(*args, **kwargs)
            # Forward and backward run inside the closure (Lightning's automatic optimization): run it before
            # the gate decides, so that a gradient all-reduce failing in it keeps the update from happening.
            with torch.enable_grad():
                loss = closure()
            return gated(closure=_ReplayOnce(loss, closure))

        # A bound method, as ctx.wrap_optimizer's: an LR scheduler re-wraps it through its __func__.
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def adopt(self, kind: str, obj: Any) -> None:
        """An LR scheduler, grad scaler or averaged model (an EMA or SWA copy of the weights): registered by kind
        and construction order."""
        if any(obj is registered for registered in self.ctx.parts.extra.values()):
            return  # e.g. a SequentialLR's __init__ and LRScheduler's both saw it
        if kind == "lr_scheduler":
            name, self.n_schedulers = f"lr_scheduler{self.n_schedulers}", self.n_schedulers + 1
        elif kind == "averaged_model":
            name, self.n_averaged = f"averaged_model{self.n_averaged}", self.n_averaged + 1
        else:
            name, self.n_scalers = f"grad_scaler{self.n_scalers}", self.n_scalers + 1
        if self.ctx.generation >= 0:
            self.warn(f"{type(obj).__name__} built after training started: its state is not protected")
            return
        self.ctx.register(name, obj)
        if kind == "grad_scaler":
            gated_update = obj.update
            session = self

            def update(*args: Any, **kwargs: Any) -> Any:
                if session.fast_forward:
                    return None
                return gated_update(*args, **kwargs)

            obj.update = update

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step post-hook: an optimizer no constructor hook saw is adopted here. Its step ran
        outside ctx.wrap_optimizer's gate, which counts the step's updates (torchpass.rank.step), so count it."""
        if not any(optimizer is o for o in self.ctx.parts.optimizers):
            self.adopt_optimizer(optimizer)
            if self.step_open:
                self.ctx.lifecycle.optimizer_steps += 1

    def start_pass(self, loader: DataLoader[Any]) -> TrackedPass:
        """``iter()`` on the tracked loader: a new pass over it, whose ``next()`` is the step boundary."""
        counted = self.passes
        pass_no = counted if self.framework is None else self.framework.pass_number(counted)
        self.passes = pass_no + 1
        return TrackedPass(self, loader, pass_no)

    def adopt_loader(self, loader: DataLoader[Any]) -> None:
        """The first loader over a DistributedSampler is tracked; say why when one cannot be."""
        sampler = loader.sampler
        batch_sampler = loader.batch_sampler
        distributed = isinstance(sampler, DistributedSampler) or isinstance(
            getattr(batch_sampler, "sampler", None), DistributedSampler
        )
        if not distributed and self.framework is not None:
            distributed = self.framework.tracks(loader)  # e.g. accelerate's loader over its BatchSamplerShard
        if isinstance(loader.batch_sampler, list):
            return  # one of ours (the inner loader of a pass)
        if not distributed:
            self.untracked.append((loader.dataset, False))
            if self.loader is None and not framework_imported():  # a framework may add the sampler itself
                self.warn(
                    "a DataLoader without a DistributedSampler: transparent mode cannot see or restore its "
                    "position, so it is not tracked (a replacement would start it from the beginning)"
                )
            return
        # A framework's validation loader (Lightning rebuilds it with a DistributedSampler too) is not the one
        # training iterates; neither is any loader after the tracked one.
        if self.framework is not None and not self.framework.accepts_loader():
            self.evaluation_datasets.append(loader.dataset)  # validation: need not be tracked, not "another"
            return
        if self.loader is not None:
            self.untracked.append((loader.dataset, True))
            return
        if batch_sampler is None:
            self.warn("the DistributedSampler loader has batch_size=None: its position is not tracked")
            return
        self.loader = loader

    @property
    def other_loaders(self) -> int:
        """Loaders not tracked, counted by dataset. A framework that adds the sampler rebuilds the script's
        loaders: the script's own loader of the training data is not "another" loader, and a validation
        loader it rebuilt counts once with the script's."""
        tracked = None if self.loader is None else self.loader.dataset
        evaluation = {id(d) for d in self.evaluation_datasets}
        return len(
            {
                id(d)
                for d, distributed in self.untracked
                if (distributed or d is not tracked) and id(d) not in evaluation
            }
        )

    def enumerate(self, iterable: Any, start: int = 0) -> Any:
        """The script's ``enumerate`` (its module's global): over the tracked loader, each batch comes with its
        place in the pass, which is the right count on a redone step (the batch is served again with the same
        index) and on a replacement that resumes inside a pass. The builtin's count would have counted the
        redone step twice and started a replacement at 0, and a collective gated on it would not line up
        across ranks. Anything else is the builtin's ``enumerate``."""
        if self.loader is not None and iterable is self.loader:
            iterable = iter(iterable)
        if isinstance(iterable, TrackedPass):
            return Enumerated(iterable, start)
        return builtins.enumerate(iterable, start)

    # ----- the step boundary ---------------------------------------------------------------

    def _close_step(self) -> None:
        """The step in progress ends here: commit it, or roll it back and recover (a new generation)."""
        if not self.step_open:
            return
        self.step_open = False
        ctx, step = self.ctx, self.ctx.step
        if ctx.lifecycle.abandoned:
            if self.rolled_back:  # undone already (roll_back_open_step): what is left is the recovery
                self.rolled_back = False
                ctx.recover(ctx.lifecycle.reason, error=True)
                return
            ctx.end_step()  # rolls back and recovers
            return
        if ctx.lifecycle.optimizer_steps == 0:
            self.steps_without_optimizer += 1
            if self.first_step_checked and self.steps_without_optimizer == 1:
                self.warn(
                    f"step {step} ended with its pass and ran no optimizer step: the gradients accumulated in it "
                    "are not part of the state, so a failure before the next optimizer step stops the job (make "
                    "every pass a whole number of windows)"
                )
        self.check_first_step()
        self.position.pass_no, self.position.index, self.position.epoch = (
            self.step_pass,
            self.step_index + 1,
            self.step_epoch,
        )
        ctx.end_step()  # commits; recovers after when a collective failed after the update

    def roll_back_open_step(self) -> bool:
        """For a framework whose loop asks for no batch after the last one (Lightning): close the last step
        of training right after it. A committed step commits now. An abandoned one is undone now (the
        framework's counters go back with it, so its loop fetches the same batch again) and the recovery
        waits for that request. True when the step must be redone."""
        if not self.step_open:
            return False
        lifecycle = self.ctx.lifecycle
        if lifecycle.abandoned:
            if not self.rolled_back:
                lifecycle.roll_back()
                self.rolled_back = True
            return True
        if lifecycle.optimizer_steps == 0:
            return False  # inside an accumulation window: it closes with its optimizer step
        self._close_step()
        return False

    def _window_goes_on(self, it: TrackedPass) -> bool:
        """Whether the open step is a gradient-accumulation window still waiting for its optimizer step."""
        lifecycle = self.ctx.lifecycle
        return (
            self.step_open
            and not lifecycle.abandoned
            and lifecycle.optimizer_steps == 0
            and it.pass_no == self.step_pass
            and self.step_index + 1 < len(it.batches)
        )

    def _boundary(self) -> None:
        """Between two steps: join the first generation, or follow a newer one (as ``ctx.steps`` does)."""
        self.ctx.start()
        self.ctx.follow_generation()

    def next_batch(self, it: TrackedPass) -> Any:
        """``next()`` on the tracked loader: the step boundary (see :mod:`torchpass.transparent.bootstrap`).

        A step spans the batches up to its optimizer step: with gradient accumulation, the whole window is one
        step, committed after its update and redone from its first batch when it fails."""
        if self._window_goes_on(it):
            index = self.step_index + 1 if self.framework is None else self.framework.align(it)
            return self._serve(it, index, self.ctx.step)
        generation, ends_pass = self.ctx.generation, self._step_ends_pass(it)
        self._close_step()
        if ends_pass and self.ctx.generation == generation:
            self.ctx.hold_committed()  # before the loop leaves the pass: see _step_ends_pass
        self._boundary()
        if self.framework is not None:
            index = self.framework.align(it)
            return self._serve(it, index, self._begin_step())
        pos = self.position
        if it.pass_no > pos.pass_no and not (it.pass_no == pos.pass_no + 1 and pos.index >= len(it.batches)):
            self.ctx.link.fatal(
                f"transparent mode: the recovery rolled back to step {self.ctx.committed_step}, inside pass "
                f"{pos.pass_no} over the data, but this rank's script is in pass {it.pass_no} already and cannot "
                f"run that pass's batches again: {restart_advice(self.ctx.config)}"
            )
        if it.pass_no < pos.pass_no:
            self.fast_forward = True  # a newcomer behind the received position: this pass is done
            raise StopIteration
        if it.pass_no == pos.pass_no:
            index = pos.index
            if self.fast_forward and pos.epoch >= 0 and it.epoch != pos.epoch:
                self.warn(
                    f"resumed pass {it.pass_no} with sampler epoch {it.epoch}, but the replicas were at epoch "
                    f"{pos.epoch}: the script's set_epoch does not follow its passes over the loader"
                )
        else:
            index = 0
        self.fast_forward = False
        if index >= len(it.batches):  # the pass ends here and the script goes on to its epilogue
            pos.pass_no, pos.index, pos.epoch = it.pass_no + 1, 0, -1
            self.moved_between = True
            raise StopIteration
        return self._serve(it, index, self._begin_step())

    def _step_ends_pass(self, it: TrackedPass) -> bool:
        """Whether the open step is the last of its pass and will commit. Its commit is made held everywhere
        (:meth:`Context.hold_committed`) before the script's loop leaves the pass: a Python ``for`` loop cannot
        go back, so a recovery that rolled back before that step (a pure-FSDP shard whose peer copy of it was
        not kept yet) would leave a survivor that cannot redo it. Before this, such a survivor served the next
        pass's first batch as the redone step while the newcomer served the old pass's: their collectives no
        longer matched and the job failed after ``max_resets`` rebuilds (fuzzer seed 500047)."""
        return (
            self.framework is None
            and self.step_open
            and not self.ctx.lifecycle.abandoned
            and it.pass_no == self.step_pass
            and self.step_index + 1 >= len(it.batches)
        )

    def _begin_step(self) -> int:
        ctx = self.ctx
        step = ctx.committed_step + 1
        if self.moved_between:  # an abandoned step rolls back to here, keeping what the epilogue did
            self.moved_between = False
            ctx.lifecycle.remember_moved_on(step)
        ctx.begin(step)
        return step

    def _serve(self, it: TrackedPass, index: int, step: int) -> Any:
        if self.framework is not None:
            self.framework.served(index)
        batch = it.fetch(index, step, self.ctx.config.seed, self.ctx.slot)
        self.step_open, self.step_pass, self.step_index, self.step_epoch = True, it.pass_no, index, it.epoch
        return batch

    def finish(self) -> None:
        """After the script returned: close the last step and wait until every member finished."""
        ctx = self.ctx
        if ctx.closed:
            return
        self._close_step()
        if ctx.generation < 0:
            raise TorchPassError(
                "transparent mode: the script ended without iterating a DataLoader over a DistributedSampler; "
                "nothing was protected (see 'Model-transparent mode' in docs/user-guide.md)"
            )
        while not ctx.finish():
            pass
        ctx.close()


def _tensors_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a collective was given (directly or in a list), which it may write into."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found
