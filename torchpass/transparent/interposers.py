"""What transparent mode replaces in torch, and with what (:mod:`torchpass.transparent.bootstrap` says why).

Every replacement is undone by :meth:`Interposers.uninstall`. What the replacements find the script building
(its DDP model, optimizers, LR schedulers, grad scalers, averaged models, the loader over a DistributedSampler)
they hand to the :class:`torchpass.transparent.session.Session`, and iterating the tracked loader goes through the
session's step boundary. TorchPass's own calls reach the real functions (:func:`internal`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader

from torchpass.errors import TorchPassError
from torchpass.frameworks import detect
from torchpass.launch.warmup import rebind_in_loaded_modules
from torchpass.rank.backends import BOUND_GLOO
from torchpass.rank.ddp import TorchPassDDP
from torchpass.transparent.fsdp import FsdpInterposers
from torchpass.transparent.pipelining import refuse_pipelining
from torchpass.transparent.session import Session

__all__ = ["Interposers", "internal"]

WRAPPED_COLLECTIVES = (
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


class Interposers:
    """The replacements of one session, installed before the script runs."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._undo: list[Callable[[], None]] = []

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
        FsdpInterposers(self.session, internal).install(self._patch)  # an FSDP2 script's mesh and fully_shard
        refuse_pipelining(self._patch, self._undo)  # when the script builds a pipeline stage
        handle = register_optimizer_step_post_hook(self.session.on_optimizer_step)
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
        session = self.session

        def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None, **kw: Any) -> None:
            if internal():
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
            if session.framework is None:  # the framework whose code asks for the group, if any (its adapter)
                caller = sys._getframe(1)
                session.framework = detect(str(caller.f_globals.get("__name__", "")), session, lambda: caller)

        def destroy_process_group(group: Any = None) -> None:
            if internal() or (group is not None and group is not dist.GroupMember.WORLD):
                real_destroy(group)

        def is_initialized() -> bool:
            if internal():
                return real_is_initialized()
            if session.framework is not None and not session.framework.group_visible():
                return real_is_initialized()
            return bool(real_is_initialized() or session.group_requested)

        def get_rank(group: Any = None) -> int:
            if real_is_initialized() or group is not None or not session.group_requested:
                return real_get_rank(group)
            return session.ctx.slot

        def get_backend(group: Any = None) -> Any:
            # TorchPass's gloo bound to the node's address (torchpass.rank.backends) is gloo: a framework that asks
            # picks gloo's ways (Lightning averages by a sum and a division, gloo having no AVG).
            name = real_get_backend(group)
            return "gloo" if not internal() and name == BOUND_GLOO else name

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
        for name in WRAPPED_COLLECTIVES:
            self._patch(dist, name, self._guarded(getattr(dist, name)))

    def _guarded(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        """Inside a step, a failing collective abandons the step (and returns None) instead of raising.

        Once the step's update is done (every optimizer stepped), the step can no longer be abandoned: its
        result is in the parameters. A collective failing after that (e.g. the script averaging its loss for a
        log line) is skipped and remembered; the step commits and the rank recovers right after.

        A call on the default group runs on the generation's group for the script's collectives instead
        (:meth:`Context.guarded_collective`), which no gradient bucket ever uses."""
        session = self.session
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
            if internal():
                return collective(*args, **kwargs)
            if kwargs.get("async_op"):
                return call(args, kwargs)
            if not session.step_open:
                return session.between_steps(lambda *a, **k: call(a, k), args, kwargs)
            return session.ctx.guarded_collective(name, lambda: call(args, kwargs), None)

        return guarded

    def _install_ddp(self) -> None:
        session = self.session

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

    def _install_optim(self) -> None:
        session = self.session
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
            if cls is torch.optim.lr_scheduler.ReduceLROnPlateau:
                self._patch(cls, "step", self._metric_step(cls.__dict__["step"]))
            elif "step" in cls.__dict__:
                self._patch(cls, "step", self._silenced_when_fast_forwarding(cls.__dict__["step"]))

        real_scaler_init = torch.amp.GradScaler.__init__

        @functools.wraps(real_scaler_init)
        def scaler_init(scaler: Any, *args: Any, **kwargs: Any) -> None:
            real_scaler_init(scaler, *args, **kwargs)
            session.adopt("grad_scaler", scaler)

        self._patch(torch.amp.GradScaler, "__init__", scaler_init)

        # An EMA or SWA copy of the weights (torch.optim.swa_utils.AveragedModel) is training state the script keeps
        # beside the model: registered like a scheduler (it moves, and rolls back with an abandoned step), its
        # update silenced while a newcomer fast-forwards. Unregistered, a replacement's copy restarted from the
        # initial weights and a redone step averaged twice: the job ended silently different from the fault-free run.
        averaged = torch.optim.swa_utils.AveragedModel
        self._patch(averaged, "__init__", self._registering_init(averaged.__init__, "averaged_model"))
        self._patch(averaged, "update_parameters", self._silenced_when_fast_forwarding(averaged.update_parameters))

    def _registering_init(self, real_init: Callable[..., None], kind: str) -> Callable[..., None]:
        session = self.session

        @functools.wraps(real_init)
        def init(obj: Any, *args: Any, **kwargs: Any) -> None:
            real_init(obj, *args, **kwargs)
            session.adopt(kind, obj)

        return init

    def _silenced_when_fast_forwarding(self, real_step: Callable[..., Any]) -> Callable[..., Any]:
        session = self.session

        @functools.wraps(real_step)
        def step(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if session.fast_forward:
                return None
            return real_step(obj, *args, **kwargs)

        return step

    def _metric_step(self, real_step: Callable[..., Any]) -> Callable[..., Any]:
        """``ReduceLROnPlateau.step(metric)``: silenced while a newcomer fast-forwards, and refused inside a step
        one of whose collectives failed after the update. That collective cannot abandon the step (a redo would
        apply the update twice), so the step commits with what the script did after it; a metric it produced (a
        loss all-reduced after ``optimizer.step()``) lacks a lost peer's share, and the scheduler's state and
        learning rate would follow that wrong value on every rank, silently. The job stops with the reason."""
        session = self.session

        @functools.wraps(real_step)
        def step(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if session.fast_forward:
                return None
            failed = session.ctx.lifecycle.failed_after_update
            if failed and session.step_open:
                why = failed.splitlines()[0][:200]
                session.ctx.link.fatal(
                    f"step {session.ctx.step}: a collective failed after the step's update ({why}), and the script"
                    " then stepped ReduceLROnPlateau with a metric: if that collective produced it, "
                    "it lacks a lost peer's share, and the learning rate would follow a wrong value. The job stops "
                    "rather than train on it. Step ReduceLROnPlateau before the optimizer step (a failure there "
                    "redoes the step) or between passes over the loader (its collectives are run again after a "
                    "recovery)."
                )
            return real_step(obj, *args, **kwargs)

        return step

    def _install_data(self) -> None:
        session = self.session
        real_init, real_iter = DataLoader.__init__, DataLoader.__iter__

        # Wrapped, so that inspect.signature shows DataLoader's own parameters: Lightning reads them to rebuild
        # the script's loader with its DistributedSampler.
        @functools.wraps(real_init)
        def loader_init(loader: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
            real_init(loader, *args, **kwargs)
            session.adopt_loader(loader)

        def loader_iter(loader: DataLoader[Any]) -> Any:
            if loader is session.loader:
                return session.start_pass(loader)
            return real_iter(loader)

        self._patch(DataLoader, "__init__", loader_init)
        self._patch(DataLoader, "__iter__", loader_iter)


def internal() -> bool:
    """Whether the interposer was called by TorchPass itself (which needs the real function), not the script.

    TorchPass's modules call ``dist.init_process_group`` and friends through the same module attributes the
    interposers replace; the caller's module name tells them apart (two frames up: interposer, caller)."""
    return str(sys._getframe(2).f_globals.get("__name__", "")).startswith("torchpass.")
