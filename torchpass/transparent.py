"""Model-transparent mode: TorchPass's guarantees for an unmodified DDP script (``torchpass run --transparent``).

``python -m torchpass.transparent SCRIPT ARGS...`` is what each rank and spare runs in this mode (the launcher
and the Slurm agents start it; ``--clockwork-ft=transparent`` selects it). It joins the job as
:func:`torchpass.init` does (a spare waits there for a slot), installs the interposers below, and runs the
script with :mod:`runpy` as ``__main__``, with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT`` set as ``torchrun`` would (rank = the TorchPass slot, which never changes).

What is interposed, and why:

* ``torch.distributed.init_process_group`` / ``destroy_process_group``: TorchPass owns the process group (it
  forms it at the first step boundary and rebuilds it after every membership change); the script's calls only
  check that its rank and world size agree. Until the group exists, ``is_initialized``, ``get_rank`` and
  ``get_world_size`` answer for it (a ``DistributedSampler`` built before the first step needs them).
* ``DistributedDataParallel(model, ...)`` builds TorchPass's DDP (:class:`torchpass.ddp.TorchPassDDP`): its
  gradient averaging survives a dead peer by abandoning the step instead of raising into ``backward()``.
* ``torch.optim.Optimizer`` construction registers every optimizer (its state moves, its ``step`` skips an
  abandoned step); PyTorch's global optimizer step hooks count the optimizer steps of each step.
  LR schedulers and grad scalers are registered when they are built (their state moves and rolls back).
* The first ``DataLoader`` built over a ``DistributedSampler`` is *tracked*: iterating it is where the step
  boundaries are. Each ``next()`` on it closes the step in progress (commit, or roll back and recover),
  checks for a new generation, reseeds the RNGs from (seed, slot, step) and serves the batch at the data
  position. The data position (pass over the loader, batch index within the pass) is part of the state that
  moves, so a spare resumes at the same batch and a step abandoned by a failure is re-run with the same
  batch: the loader simply serves it again.
* The common collectives (``all_reduce``, ``broadcast``, ``all_gather``, ``barrier``, ...), when called inside
  a step, abandon the step instead of raising when a peer dies (as ``ctx.all_reduce`` does); called between
  steps (e.g. after an epoch), a failure makes the rank recover and run the collective again.

How a survivor unwinds: nothing is unwound by exception (an exception raised inside the script's loop body
would leave the loop, and a Python ``for`` loop cannot be resumed). As in model-aware mode, a failed
collective *abandons* the step: the rest of the body runs with the gradient hook, the optimizer, the grad
scaler and the interposed collectives doing nothing, and at the next ``next()`` on the tracked loader the
step is rolled back, the rank recovers, and the same batch is served again. The script's loop over the
loader does not advance, so its epochs still contain every batch exactly once.

How a newcomer jumps into the middle: it runs the script from the top. At its first ``next()`` on the tracked
loader it joins the generation and receives the state, data position included (pass P, batch I). It then
*fast-forwards*: iterations of passes before P end at once (``StopIteration``), with optimizer steps,
LR-scheduler steps and grad-scaler updates suppressed in between (the received state already contains
them), and pass P is served from batch I. The script's epoch counter lines up because it counts passes
over the loader exactly as the survivors' did.

Gradient accumulation: a step spans the batches up to its optimizer step, so an accumulation window is one
step, committed after its update and redone from its first batch when it fails.

Frameworks (:mod:`torchpass.frameworks`): the framework whose code calls ``init_process_group`` picks an
adapter (Lightning), which the session asks where the framework's loop differs from a plain script's: its
counters and callbacks are registered state, its replacement jumps to the replicas' epoch instead of
fast-forwarding, its set-up collectives run before any group exists. Frameworks it cannot protect are refused
at start (the Hugging Face Trainer), and a script error before training fails the job at once rather than
every spare in turn.

What it cannot capture is documented in docs/user-guide.md ("Model-transparent mode"): arbitrary Python
state of the script (locals, lists of losses, counters), iterators it cannot see (a hand-written generator,
a loader without a DistributedSampler), loops bounded by their own step counters, collectives before the
first batch or after the training loop. The interposers warn while the script builds
its objects, and :meth:`Session.check_first_step` when the first step ends, when a script is outside what
it protects (``transparent_strict`` makes every warning an error).
"""

from __future__ import annotations

import builtins
import functools
import inspect
import os
import runpy
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, DistributedSampler

from torchpass.backends import BOUND_GLOO
from torchpass.config import TorchPassConfig
from torchpass.context import Context, TorchPassError, init
from torchpass.ddp import TorchPassDDP
from torchpass.frameworks import FrameworkAdapter, detect, framework_imported
from torchpass.frameworks.environment import torchrun_environment
from torchpass.frameworks.warmup import preimport, rebind_in_loaded_modules
from torchpass.protocol import LaunchEnv
from torchpass.rng import step_seed

__all__ = ["Session", "TransparentWarning", "main"]

DATA_STATE = "torchpass.data_position"
_WRAPPED_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter_tensor",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)
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
        self.sampler = sampler
        self.epoch = int(getattr(sampler, "epoch", 0))
        self.batches: list[Any] = list(iter(loader.batch_sampler))  # type: ignore[arg-type]
        self.inner: Iterator[Any] | None = None
        self.inner_next = -1

    def retarget(self, pass_no: int, epoch: int) -> None:
        """Become pass ``pass_no``, in the sampler's order of ``epoch`` (a framework adapter's jump)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self.pass_no, self.epoch = pass_no, epoch
        self.batches = list(iter(self.loader.batch_sampler))  # type: ignore[arg-type]
        self.inner, self.inner_next = None, -1
        self.session.passes = pass_no + 1

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
        self.model: TorchPassDDP | None = None
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
        self.framework: FrameworkAdapter | None = None  # Lightning's adapter, once it called init_process_group
        self.rolled_back = False  # the open step was abandoned and undone already; only the recovery is left
        self.n_schedulers = 0
        self.n_scalers = 0
        self._undo: list[Callable[[], None]] = []

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
                "the first step ran without a DistributedDataParallel model: gradients are not averaged through "
                "TorchPass and no model state moves to a replacement"
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

    # ----- the interposers -----------------------------------------------------------------

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> None:
        """Install every interposer (before the script runs)."""
        self._install_distributed()
        self._install_ddp()
        self._install_optim()
        self._install_data()
        handle = register_optimizer_step_post_hook(self._on_optimizer_step)
        self._undo.append(handle.remove)

    def uninstall(self) -> None:
        """Remove the interposers (the rank's process ends right after, but tests run several sessions)."""
        while self._undo:
            self._undo.pop()()

    def _install_distributed(self) -> None:
        real_is_initialized = dist.is_initialized
        real_get_rank, real_get_world_size = dist.get_rank, dist.get_world_size
        real_init, real_destroy = dist.init_process_group, dist.destroy_process_group
        real_get_backend = dist.get_backend
        session = self

        def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None, **kw: Any) -> None:
            if _internal():
                return real_init(backend, init_method, timeout, **kw)
            world, rank = kw.get("world_size", -1), kw.get("rank", -1)
            if world not in (-1, None) and int(world) != session.ctx.world_size:
                raise TorchPassError(
                    f"transparent mode: the script asks for world_size={world}, the job has {session.ctx.world_size}"
                )
            if rank not in (-1, None) and int(rank) != session.ctx.slot:
                raise TorchPassError(
                    f"transparent mode: the script asks for rank={rank}, this rank is slot {session.ctx.slot}"
                )
            session.group_requested = True
            session.ctx.log.info("init_process_group(%s): TorchPass owns the process group", backend or "default")
            if session.framework is None:
                caller = sys._getframe(1)
                session.framework = detect(str(caller.f_globals.get("__name__", "")), session, lambda: caller)

        def destroy_process_group(group: Any = None) -> None:
            if _internal() or (group is not None and group is not dist.GroupMember.WORLD):
                real_destroy(group)

        def is_initialized() -> bool:
            if _internal():
                return real_is_initialized()
            if session.framework is not None and not session.framework.group_visible():
                return real_is_initialized()
            return bool(real_is_initialized() or session.group_requested)

        def get_rank(group: Any = None) -> int:
            if real_is_initialized() or group is not None or not session.group_requested:
                return real_get_rank(group)
            return session.ctx.slot

        def get_backend(group: Any = None) -> Any:
            # TorchPass's gloo bound to the node's address (torchpass.backends) is gloo: a framework that asks
            # picks gloo's ways (Lightning averages by a sum and a division, gloo having no AVG).
            name = real_get_backend(group)
            return "gloo" if not _internal() and name == BOUND_GLOO else name

        def get_world_size(group: Any = None) -> int:
            if real_is_initialized() or group is not None or not session.group_requested:
                return real_get_world_size(group)
            return session.ctx.world_size

        self._patch(dist, "init_process_group", init_process_group)
        self._patch(dist, "destroy_process_group", destroy_process_group)
        self._patch(dist, "is_initialized", is_initialized)
        self._patch(dist, "get_rank", get_rank)
        self._patch(dist, "get_world_size", get_world_size)
        self._patch(dist, "get_backend", get_backend)
        for name in _WRAPPED_COLLECTIVES:
            self._patch(dist, name, self._guarded(getattr(dist, name)))

    def _guarded(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        """Inside a step, a failing collective abandons the step (and returns None) instead of raising.

        Once the step's update is done (every optimizer stepped), the step can no longer be abandoned: its
        result is in the parameters. A collective failing after that (e.g. the script averaging its loss for a
        log line) is skipped and remembered; the step commits and the rank recovers right after.

        A call on the default group runs on the generation's group for the script's collectives instead
        (:meth:`Context.guarded_collective`), which no gradient bucket ever uses."""
        session = self
        name = f"dist.{collective.__name__}"
        params = list(inspect.signature(collective).parameters)
        group_at = params.index("group") if "group" in params else -1

        def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            group = session.ctx.user_group
            if group is None or group_at < 0:
                return collective(*args, **kwargs)
            if len(args) > group_at:
                if args[group_at] is None or args[group_at] is dist.GroupMember.WORLD:
                    args = (*args[:group_at], group, *args[group_at + 1 :])
            elif kwargs.get("group") is None or kwargs.get("group") is dist.GroupMember.WORLD:
                kwargs = {**kwargs, "group": group}
            return collective(*args, **kwargs)

        @functools.wraps(collective)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if _internal():
                return collective(*args, **kwargs)
            if kwargs.get("async_op"):
                return call(args, kwargs)
            if not session.step_open:
                return session.between_steps(lambda *a, **k: call(a, k), args, kwargs)
            return session.ctx.guarded_collective(name, lambda: call(args, kwargs), None)

        return guarded

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

    def _install_ddp(self) -> None:
        session = self

        class DistributedDataParallel(TorchPassDDP):
            """What the script's ``DistributedDataParallel(model, ...)`` builds in transparent mode."""

            def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
                session.adopt_ddp(self, module, args, kwargs)

            def forward(self, *inputs: Any, **kwargs: Any) -> Any:
                # A training forward (grad enabled); an evaluation forward, such as Lightning's sanity check
                # of its validation loop before training, may come before the training loader exists.
                if session.loader is None and torch.is_grad_enabled():
                    raise TorchPassError(
                        "transparent mode: the model trains on batches from a loader TorchPass cannot see (no "
                        "DataLoader over a DistributedSampler was built before the first forward pass), so it "
                        "cannot find the step boundaries nor restore the data position; use a DistributedSampler "
                        "or the model-aware API (see 'Model-transparent mode' in docs/user-guide.md)"
                    )
                return super().forward(*inputs, **kwargs)

        for owner in (torch.nn.parallel, torch.nn.parallel.distributed, torch.nn):
            if getattr(owner, "DistributedDataParallel", None) is _TorchDDP:
                self._patch(owner, "DistributedDataParallel", DistributedDataParallel)
        # Modules imported before the script ran (a spare's warm-up, a zygote's preload) bound torch's class.
        rebind_in_loaded_modules(_TorchDDP, DistributedDataParallel, self._patch)

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

    def _install_optim(self) -> None:
        session = self
        real_optimizer_init = torch.optim.Optimizer.__init__

        @functools.wraps(real_optimizer_init)  # inspect.signature shows the real one (frameworks read it)
        def optimizer_init(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            real_optimizer_init(optimizer, *args, **kwargs)
            session.adopt_optimizer(optimizer)

        self._patch(torch.optim.Optimizer, "__init__", optimizer_init)

        # Every scheduler class of torch.optim.lr_scheduler: LRScheduler's __init__ (most chain to it) and the
        # ones that do not chain to it register their object; every own ``step`` is silenced while a newcomer
        # fast-forwards (the received scheduler state already includes those steps).
        schedulers = [
            cls
            for cls in vars(torch.optim.lr_scheduler).values()
            if isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)
        ]
        for cls in schedulers:
            if cls.__name__ in ("LRScheduler", "ReduceLROnPlateau", "SequentialLR", "ChainedScheduler"):
                self._patch(cls, "__init__", self._registering_init(cls.__init__, "lr_scheduler"))
            if "step" in cls.__dict__:
                self._patch(cls, "step", self._silenced_when_fast_forwarding(cls.__dict__["step"]))

        real_scaler_init = torch.amp.GradScaler.__init__

        @functools.wraps(real_scaler_init)
        def scaler_init(scaler: Any, *args: Any, **kwargs: Any) -> None:
            real_scaler_init(scaler, *args, **kwargs)
            session.adopt("grad_scaler", scaler)

        self._patch(torch.amp.GradScaler, "__init__", scaler_init)

    def _registering_init(self, real_init: Callable[..., None], kind: str) -> Callable[..., None]:
        session = self

        @functools.wraps(real_init)
        def init(obj: Any, *args: Any, **kwargs: Any) -> None:
            real_init(obj, *args, **kwargs)
            session.adopt(kind, obj)

        return init

    def _silenced_when_fast_forwarding(self, real_step: Callable[..., Any]) -> Callable[..., Any]:
        session = self

        @functools.wraps(real_step)
        def step(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if session.fast_forward:
                return None
            return real_step(obj, *args, **kwargs)

        return step

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

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step post-hook: an optimizer no constructor hook saw is adopted here. Its step ran
        outside ctx.wrap_optimizer's gate, which counts the step's updates (torchpass.step), so count it."""
        if not any(optimizer is o for o in self.ctx.parts.optimizers):
            self.adopt_optimizer(optimizer)
            if self.step_open:
                self.ctx.lifecycle.optimizer_steps += 1

    def _install_data(self) -> None:
        session = self
        real_init, real_iter = DataLoader.__init__, DataLoader.__iter__

        # Wrapped, so that inspect.signature shows DataLoader's own parameters: Lightning reads them to rebuild
        # the script's loader with its DistributedSampler.
        @functools.wraps(real_init)
        def loader_init(loader: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
            real_init(loader, *args, **kwargs)
            session.adopt_loader(loader)

        def loader_iter(loader: DataLoader[Any]) -> Any:
            if loader is session.loader:
                counted = session.passes
                pass_no = counted if session.framework is None else session.framework.pass_number(counted)
                session.passes = pass_no + 1
                return _Pass(session, loader, pass_no)
            return real_iter(loader)

        self._patch(DataLoader, "__init__", loader_init)
        self._patch(DataLoader, "__iter__", loader_iter)

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
                    "are not part of the state, so a failure before the next optimizer step is not protected"
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

    def _window_goes_on(self, it: _Pass) -> bool:
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

    def next_batch(self, it: _Pass) -> Any:
        """``next()`` on the tracked loader: the step boundary (see the module docstring).

        A step spans the batches up to its optimizer step: with gradient accumulation, the whole window is one
        step, committed after its update and redone from its first batch when it fails."""
        ctx = self.ctx
        if self._window_goes_on(it):
            index = self.step_index + 1 if self.framework is None else self.framework.align(it)
            return self._serve(it, index, ctx.step)
        self._close_step()
        self._boundary()
        if self.framework is not None:
            index = self.framework.align(it)
            return self._serve(it, index, self._begin_step())
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
        return self._serve(it, index, self._begin_step())

    def _begin_step(self) -> int:
        ctx = self.ctx
        if self.moved_between:  # an abandoned step rolls back to here, keeping what the epilogue did
            self.moved_between = False
            ctx.lifecycle.remember()
        step = ctx.committed_step + 1
        ctx.begin(step)
        return step

    def _serve(self, it: _Pass, index: int, step: int) -> Any:
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


def _internal() -> bool:
    """Whether the interposer was called by TorchPass itself (which needs the real function), not the script.

    TorchPass's modules call ``dist.init_process_group`` and friends through the same module attributes the
    interposers replace; the caller's module name tells them apart (two frames up: interposer, caller)."""
    return str(sys._getframe(2).f_globals.get("__name__", "")).startswith("torchpass.")


def main(argv: list[str] | None = None) -> int:
    """Join the job, install the interposers and run the script as ``__main__``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m torchpass.transparent SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    try:
        _run(args[0], args[1:])
    except TorchPassError as exc:  # its message says it all; a traceback per rank would bury it
        print(f"torchpass: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def _run(script: str, script_args: list[str]) -> None:
    launch = LaunchEnv.from_environ()
    warmed: tuple[list[str], float] | None = None
    if launch is not None and launch.role == "spare" and TorchPassConfig.from_env().spare_warmup:
        warmed = preimport(script)  # off the recovery's critical path (torchpass.frameworks.warmup)
    ctx = init()  # a spare waits here for a slot (and exits 0 if the job ends first)
    if warmed is not None and warmed[0]:
        ctx.log.info("spare warm-up imported %d modules of the script in %.2f s", len(warmed[0]), warmed[1])
    session = Session(ctx)
    session.install()
    # What torchrun would set, so that scripts and frameworks written for it find their rank (the slot).
    torchrun_environment(os.environ, slot=ctx.slot, world_size=ctx.world_size, host=ctx.env.host, job_id=ctx.env.job_id)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        try:
            runpy.run_path(script, init_globals={"enumerate": session.enumerate}, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        session.finish()
    except TorchPassError as exc:
        # The script is outside what the mode protects: every rank finds it at the same point, and so would
        # every spare put in its place, so the job fails now instead of burning its spares one by one.
        ctx.report_fatal(str(exc))
        raise
    except Exception as exc:
        if ctx.generation < 0 and not ctx.is_replacement:
            # An original rank whose script fails before training ever started: a spare would run the same
            # script into the same error (a crash loop of spares), so the job fails now, with it.
            ctx.report_fatal(
                f"slot {ctx.slot}: the script failed before training started: {type(exc).__name__}: "
                f"{str(exc)[:500]} (see the rank's traceback)"
            )
        raise


if __name__ == "__main__":
    sys.exit(main())
