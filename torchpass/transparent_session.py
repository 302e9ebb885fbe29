"""One rank's transparent-mode session: what the script built, where it is in its data, and the step boundary.

:mod:`torchpass.transparent` explains the mode; :mod:`torchpass.interposers` hands this session what the
script builds and calls its step boundary (:meth:`Session.next_batch`) at every ``next()`` on the tracked
loader, and its :meth:`Session.between_steps` for the script's collectives outside a step.
"""

from __future__ import annotations

import builtins
import inspect
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP
from torch.utils.data import DataLoader, DistributedSampler

from torchpass.context import Context
from torchpass.ddp import TorchPassDDP
from torchpass.errors import TorchPassError
from torchpass.rng import step_seed

__all__ = ["DATA_STATE", "DataPosition", "Session", "TransparentWarning"]

DATA_STATE = "torchpass.data_position"
# DDP arguments TorchPass decides itself (torchpass.ddp), dropped from the script's call.
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


class DataPosition:
    """Where the replicas are in the script: ``index`` batches of pass ``pass_no`` over the tracked loader are
    done, and ``collectives`` of the script's collectives between steps have completed.

    Registered with the context like any user state, so it travels with the model and rolls back with an
    abandoned step. ``epoch`` is the sampler's epoch of that pass (a consistency check for newcomers; -1 when
    unknown). A pass whose end the replicas have passed is recorded as the next pass at index 0: from there on
    they ran the script's code after that pass (its epilogue), which a newcomer must then skip, while a pass
    ended but not yet left (``index`` = its length) means the epilogue is still to run, newcomer included.
    ``collectives`` tells a newcomer which of the epilogue's collectives the replicas already ran."""

    def __init__(self) -> None:
        self.pass_no = 0
        self.index = 0
        self.epoch = -1
        self.collectives = 0

    def state_dict(self) -> dict[str, int]:
        return {"pass": self.pass_no, "index": self.index, "epoch": self.epoch, "collectives": self.collectives}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pass_no, self.index, self.epoch = int(state["pass"]), int(state["index"]), int(state["epoch"])
        self.collectives = int(state.get("collectives", 0))  # snapshots written before the field existed


class _Pass:
    """One ``iter(loader)`` of the tracked loader: its batches (index lists) and a streaming inner loader."""

    def __init__(self, session: Session, loader: DataLoader[Any], pass_no: int) -> None:
        self.session = session
        self.loader = loader
        self.pass_no = pass_no
        sampler = loader.sampler
        if not isinstance(sampler, DistributedSampler):  # a batch sampler over the DistributedSampler
            sampler = getattr(loader.batch_sampler, "sampler", sampler)
        self.epoch = int(getattr(sampler, "epoch", 0))
        self.batches: list[Any] = list(iter(loader.batch_sampler))  # type: ignore[arg-type]
        self.inner: Iterator[Any] | None = None
        self.inner_next = -1

    def __iter__(self) -> _Pass:
        return self

    def __len__(self) -> int:
        return len(self.batches)

    def __next__(self) -> Any:
        return self.session.next_batch(self)

    def fetch(self, index: int, step: int, seed: int, slot: int) -> Any:
        """Batch ``index`` of this pass: streamed, or from a fresh inner loader after a jump (redo, resume).

        The inner loader's private generator keeps its construction from drawing on the global RNG, which
        was just reseeded for the step (in-process ``__getitem__`` randomness then depends on the step only)."""
        if self.inner is None or index != self.inner_next:
            src = self.loader
            workers = src.num_workers
            inner_loader: DataLoader[Any] = DataLoader(
                src.dataset,
                batch_sampler=self.batches[index:],  # type: ignore[arg-type]
                num_workers=workers,
                collate_fn=src.collate_fn,
                pin_memory=src.pin_memory,
                timeout=src.timeout,
                worker_init_fn=src.worker_init_fn,
                multiprocessing_context=src.multiprocessing_context if workers else None,
                generator=torch.Generator().manual_seed(step_seed(seed, slot, step)),
                prefetch_factor=src.prefetch_factor if workers else None,
                pin_memory_device=src.pin_memory_device,
            )
            self.inner = iter(inner_loader)
        batch = next(self.inner)
        self.inner_next = index + 1
        return batch


class _Enumerated:
    """``enumerate`` over the tracked loader: the index is the batch's place in its pass (see
    :meth:`Session.enumerate`)."""

    def __init__(self, it: _Pass, start: int) -> None:
        self.it = it
        self.start = start

    def __iter__(self) -> _Enumerated:
        return self

    def __next__(self) -> tuple[int, Any]:
        batch = next(self.it)
        return self.start + self.it.session.step_index, batch


class Session:
    """One rank's transparent-mode state: the context, what the script built, and the step in progress."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.position = DataPosition()
        ctx.register(DATA_STATE, self.position)
        self.group_requested = False
        self.model: nn.Module | None = None  # the script's DDP, or the outermost module it fully_shard-ed
        self.loader: DataLoader[Any] | None = None
        self.other_loaders = 0
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
        self.n_schedulers = 0
        self.n_scalers = 0

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
                "transparent mode: the first step (one batch of the DistributedSampler loader) ran no optimizer "
                "step; each batch must end with optimizer.step() (gradient accumulation over several batches "
                "cannot be protected: use the model-aware API)"
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
            return gated(*args, **kwargs)

        # A bound method, as ctx.wrap_optimizer's: an LR scheduler re-wraps it through its __func__.
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def adopt(self, kind: str, obj: Any) -> None:
        """An LR scheduler or grad scaler: registered by kind and construction order."""
        if any(obj is registered for registered in self.ctx.parts.extra.values()):
            return  # e.g. a SequentialLR's __init__ and LRScheduler's both saw it
        if kind == "lr_scheduler":
            name, self.n_schedulers = f"lr_scheduler{self.n_schedulers}", self.n_schedulers + 1
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
        outside ctx.wrap_optimizer's gate, which counts the step's updates (torchpass.step), so count it."""
        if not any(optimizer is o for o in self.ctx.parts.optimizers):
            self.adopt_optimizer(optimizer)
            if self.step_open:
                self.ctx.lifecycle.optimizer_steps += 1

    def start_pass(self, loader: DataLoader[Any]) -> _Pass:
        """``iter()`` on the tracked loader: a new pass over it, whose ``next()`` is the step boundary."""
        self.passes += 1
        return _Pass(self, loader, self.passes - 1)

    def adopt_loader(self, loader: DataLoader[Any]) -> None:
        """The first loader over a DistributedSampler is tracked; say why when one cannot be."""
        sampler = loader.sampler
        batch_sampler = loader.batch_sampler
        distributed = isinstance(sampler, DistributedSampler) or isinstance(
            getattr(batch_sampler, "sampler", None), DistributedSampler
        )
        if isinstance(loader.batch_sampler, list):
            return  # one of ours (the inner loader of a pass)
        if not distributed:
            self.other_loaders += 1
            if self.loader is None:
                self.warn(
                    "a DataLoader without a DistributedSampler: transparent mode cannot see or restore its "
                    "position, so it is not tracked (a replacement would start it from the beginning)"
                )
            return
        if self.loader is not None:
            self.other_loaders += 1
            return
        if batch_sampler is None:
            self.warn("the DistributedSampler loader has batch_size=None: its position is not tracked")
            return
        self.loader = loader

    def enumerate(self, iterable: Any, start: int = 0) -> Any:
        """The script's ``enumerate`` (its module's global): over the tracked loader, each batch comes with its
        place in the pass, which is the right count on a redone step (the batch is served again with the same
        index) and on a replacement that resumes inside a pass. The builtin's count would have counted the
        redone step twice and started a replacement at 0, and a collective gated on it would not line up
        across ranks. Anything else is the builtin's ``enumerate``."""
        if self.loader is not None and iterable is self.loader:
            iterable = iter(iterable)
        if isinstance(iterable, _Pass):
            return _Enumerated(iterable, start)
        return builtins.enumerate(iterable, start)

    # ----- the step boundary ---------------------------------------------------------------

    def _close_step(self) -> None:
        """The step in progress ends here: commit it, or roll it back and recover (a new generation)."""
        if not self.step_open:
            return
        self.step_open = False
        ctx, step = self.ctx, self.ctx.step
        if ctx.lifecycle.abandoned:
            ctx.end_step()  # rolls back and recovers
            return
        if ctx.lifecycle.optimizer_steps == 0:
            self.steps_without_optimizer += 1
            if self.first_step_checked and self.steps_without_optimizer == 1:
                self.warn(
                    f"step {step} ran no optimizer step (gradient accumulation?): a failure while gradients "
                    "accumulate over several batches is not protected"
                )
        self.check_first_step()
        self.position.pass_no, self.position.index, self.position.epoch = (
            self.step_pass,
            self.step_index + 1,
            self.step_epoch,
        )
        ctx.end_step()  # commits; recovers after when a collective failed after the update

    def _boundary(self) -> None:
        """Between two steps: join the first generation, or follow a newer one (as ``ctx.steps`` does)."""
        self.ctx.start()
        self.ctx.follow_generation()

    def next_batch(self, it: _Pass) -> Any:
        """``next()`` on the tracked loader: the step boundary (see the module docstring)."""
        self._close_step()
        self._boundary()
        pos = self.position
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
        ctx = self.ctx
        if self.moved_between:  # an abandoned step rolls back to here, keeping what the epilogue did
            self.moved_between = False
            ctx.lifecycle.remember()
        step = ctx.committed_step + 1
        ctx.begin(step)
        batch = it.fetch(index, step, ctx.config.seed, ctx.slot)
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
