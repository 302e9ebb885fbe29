"""DistributedDataParallel whose gradient traffic survives process-group rebuilds.

The model the user gets back from ``ctx.wrap_model`` is a real :class:`DistributedDataParallel` (``.module``,
``no_sync()``, ``state_dict()`` keys all as usual), with three changes that let TorchPass swap the process
group underneath it without rebuilding it:

* it is constructed without DDP's init-time broadcast and shape check (``init_sync=False``), over a group
  that is not the job's (below), so DDP itself never runs a collective that would need every rank at once,
  including a spare that is still building its model;
* each gradient bucket is averaged over the *current* generation's default group. When the collective
  fails (a peer died) or a newer generation was announced, this does not raise into ``loss.backward()``: it
  marks the step abandoned and returns the bucket as it is; the wrapped optimizer then skips its update and
  the step boundary recovers and re-runs the step. With CPU gradients (gloo) the reducer is built over
  :class:`_CurrentGroup`, a process group that forwards its all-reduce to the current generation: the
  reducer then runs DDP's own path, which scales each gradient by 1/world while copying it into its bucket,
  so the sums are bitwise plain DDP's and no extra pass over the gradients is made. Elsewhere (CUDA, NCCL)
  a communication hook does the same and scales each bucket once its sum is in;
* DDP never re-buckets: its reducer would otherwise rebuild the buckets in gradient-ready order after the
  first iteration, so a newcomer's first step (initial layout) would not line up with the survivors'
  (rebuilt layout) and the averages would stop being bitwise reproducible. DDP's Python side asks the
  reducer to rebuild before each forward; the reducer is wrapped so that this request is declined. Every
  rank, newcomer and generation keeps the construction-time layout. ``find_unused_parameters`` stays the
  user's choice (default False: no autograd-graph traversal per step, unlike TorchFT, which forces it on).
* That layout is cut by size from the start, as DDP's rebuilt one would be (``bucket_cap_mb``, default
  25 MiB, the bucket reduced last capped at DDP's 1 MiB first-bucket size). DDP itself puts every
  parameter into one bucket until its rebuild (unless ``find_unused_parameters``); kept for good, that
  one bucket could only be reduced after the whole backward pass, with no overlap of gradient traffic
  and backward compute (the likely cause of 14.6 % fewer steps/s than plain DDP measured on 16 cores).
  Needs DDP's ``bucket_cap_mb_list`` (torch 2.13); earlier releases keep the single bucket, with a warning.

Buffers (e.g. BatchNorm statistics) follow slot 0 as under DDP's ``broadcast_buffers``, but the broadcast
runs right after a forward pass instead of before the next one, so that every committed step holds slot 0's
buffers on every rank and recovery can copy them from any replica (:mod:`torchpass.rank.buffers`).

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations against the real
``dist.GradBucket`` and ``Future[Tensor]`` objects.)
"""

import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchpass.rank.torch_compat import FixedBuckets, default_group, work_from_future

__all__ = ["StepGuard", "TorchPassDDP"]


class StepGuard(Protocol):
    """What the DDP wrapper needs from the rank's context (:class:`torchpass.rank.context.Context` provides it)."""

    world_size: int

    def collective_allowed(self) -> bool:
        """Whether a collective may start now (False once the step is abandoned or the generation is stale)."""
        ...

    def abandon_step(self, error: BaseException | str) -> None:
        """Mark the current step abandoned (callable from any thread)."""
        ...

    def when_cut_off(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once this rank's groups are aborted for a newer generation; returns its cancel."""
        ...

    def stage_buffers(self) -> None:
        """After a synchronising forward: start broadcasting slot 0's buffers (a failure abandons the step)."""
        ...

    def take_staged_buffers(self) -> None:
        """Before a further forward of the same step: take the staged buffers, as DDP's broadcast would."""
        ...

    def local_group(self) -> dist.ProcessGroup:
        """The private one-rank group DDP is constructed over when its gradients are not on the CPU."""
        ...


# DDP arguments TorchPass decides itself (see the module docstring).
_RESERVED = (
    "process_group",
    "init_sync",
    "static_graph",
    "device_mesh",
    "forward_sync_buffers",
    "bucket_cap_mb_list",
)


_DDP_PARAMS = inspect.signature(DistributedDataParallel.__init__).parameters
_DEFAULT_CAP_MB = 25.0  # DDP's default bucket_cap_mb
_MIB = 1024 * 1024
_SUM = dist.AllreduceOptions()  # a sum with the group's own timeout, as dist.all_reduce asks for
_SUM.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)

log = logging.getLogger("clockwork.torchpass.ddp")
_T = TypeVar("_T")


def _bucket_caps(bucket_cap_mb: float | None) -> dict[str, Any]:
    """DDP arguments that cut the buckets by size at construction (see the module docstring).

    DDP assigns buckets in parameter order and reduces them in reverse, so the first cap applies to the
    bucket reduced last: DDP's small first bucket when ``bucket_cap_mb`` is its default, as DDP does."""
    if "bucket_cap_mb_list" not in _DDP_PARAMS:
        log.warning(
            "this torch's DDP has no bucket_cap_mb_list: TorchPass reduces all gradients as one bucket after "
            "the backward pass (no overlap with it); torch 2.13 or later cuts them by size"
        )
        return {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    if bucket_cap_mb is None:
        return {"bucket_cap_mb_list": [dist._DEFAULT_FIRST_BUCKET_BYTES / _MIB, _DEFAULT_CAP_MB]}
    return {"bucket_cap_mb_list": [bucket_cap_mb]}


def _completed(value: _T) -> torch.futures.Future[_T]:
    future: torch.futures.Future[_T] = torch.futures.Future()
    future.set_result(value)
    return future


def _sum_over_current(
    ctx: StepGuard, tensors: list[torch.Tensor], opts: Any, done: Callable[[], _T], fallback: _T
) -> torch.futures.Future[_T]:
    """Sum ``tensors`` in place over the current generation's default group; never raise.

    The future holds ``done()`` once the sum is in, or ``fallback`` when no collective may run now or the
    collective fails (a failure abandons the step instead of raising into ``loss.backward()``).
    """
    if not ctx.collective_allowed():
        return _completed(fallback)
    # The current generation's group, called directly: dist.all_reduce's checks cost ~10 µs a bucket. A
    # complex tensor goes as its real view, as dist.all_reduce would send it.
    flat = [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
    try:
        work = default_group().allreduce(flat, opts)
    except Exception as exc:
        ctx.abandon_step(exc)
        return _completed(fallback)

    def finish(future: torch.futures.Future[Any]) -> _T:
        try:
            future.value()
        except Exception as exc:  # runs on a backend thread: record, never raise into backward()
            ctx.abandon_step(exc)
            return fallback
        return done()

    if not all(t.device.type == "cpu" for t in flat):  # NCCL's abort fails its work; its future keeps streams
        return work.get_future().then(finish)
    return _given_up_when_cut_off(ctx, work.get_future(), finish, fallback)


def _given_up_when_cut_off(
    ctx: StepGuard, pending: torch.futures.Future[Any], finish: Callable[[torch.futures.Future[Any]], _T], fallback: _T
) -> torch.futures.Future[_T]:
    """``pending.then(finish)``, but holding ``fallback`` (the step abandoned) as soon as this rank's groups are
    aborted for a newer generation, whatever ``pending`` does: gloo may never fail a send queued to a peer that
    closed its connection until the group's timeout (:mod:`torchpass.sharded.gloo_wait`), and DDP's reducer waits
    for every bucket in C++ at the end of backward. Whichever comes first settles the result; the other is
    ignored (a late end of ``pending`` abandons nothing of the step then in progress). The work left pending
    only sends (the ring's next writes wait behind it) and dies with its group's timeout."""
    result: torch.futures.Future[_T] = torch.futures.Future()
    first = threading.Lock()

    def settle(value: Callable[[], _T]) -> None:
        if first.acquire(blocking=False):
            result.set_result(value())

    def given_up() -> _T:
        ctx.abandon_step("a gradient all-reduce given up: its group was aborted for a newer generation")
        return fallback

    cancel = ctx.when_cut_off(lambda: settle(given_up))

    def ended(future: torch.futures.Future[Any]) -> None:
        cancel()
        settle(lambda: finish(future))

    pending.add_done_callback(ended)
    return result


def _allreduce_hook(ctx: StepGuard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket over the current generation; never raise (a failure abandons the step)."""
    buffer = bucket.buffer()
    scale = 1.0 / ctx.world_size
    # Averaged on the backend's thread once the sum is in, not before the launch: DDP without a hook folds the
    # scaling into its gradient copy, a hook cannot, and a pass on the autograd thread would lengthen the
    # backward pass's critical path. A product with the reciprocal, as DDP scales, not a division: on a CPU a
    # division pass over a bucket takes twice as long.
    return _sum_over_current(ctx, [buffer], _SUM, lambda: buffer.mul_(scale), buffer)


class _CurrentGroup(dist.ProcessGroup):
    """The process group DDP's reducer is built over for CPU gradients: its all-reduce runs on the current
    generation's default group and never fails (a failure abandons the step and returns the tensors as they
    are).

    DDP itself then calls only :meth:`allreduce` (the buckets' sums, scaled by the reducer while it copies the
    gradients in, and the map of used parameters when ``find_unused_parameters``): the construction-time
    checks are skipped (``init_sync=False``) and the bucket rebuild, which would broadcast, is declined
    (:class:`~torchpass.rank.torch_compat.FixedBuckets`). Its rank and size are the slot-independent ones the reducer
    needs: the size is the job's world size, which no recovery changes (a spare takes the failed rank's slot)."""

    def __init__(self, ctx: StepGuard) -> None:
        super().__init__(0, ctx.world_size)  # type: ignore[call-arg]  # (rank, size): a group without a store
        self._ctx = ctx

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        done = _sum_over_current(self._ctx, tensors, _SUM if opts is None else opts, lambda: tensors, tensors)
        return work_from_future(done)


class TorchPassDDP(DistributedDataParallel):
    """DDP whose gradient averaging follows TorchPass's generations and abandons a step instead of raising."""

    def __init__(self, module: nn.Module, ctx: StepGuard, *, broadcast_buffers: bool = True, **ddp_kwargs: Any) -> None:
        reserved = sorted(set(ddp_kwargs) & set(_RESERVED))
        if reserved:
            raise TypeError(f"ctx.wrap_model sets {', '.join(reserved)} itself (see torchpass.rank.ddp)")
        # DDP's own buffer sync would run over the one-rank group (a no-op that costs time); TorchPass broadcasts
        # buffers itself. torch >= 2.13 spells it forward_sync_buffers, earlier releases broadcast_buffers.
        no_sync: dict[str, Any] = (
            {"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_PARAMS else {"broadcast_buffers": False}
        )
        caps = _bucket_caps(ddp_kwargs.pop("bucket_cap_mb", None))
        on_cpu = all(p.device.type == "cpu" for p in module.parameters())
        group = _CurrentGroup(ctx) if on_cpu else ctx.local_group()
        super().__init__(module, process_group=group, init_sync=False, **no_sync, **caps, **ddp_kwargs)
        self._tp_ctx = ctx
        self.synced_buffers = list(module.buffers()) if broadcast_buffers else []
        if not on_cpu:
            hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]] = _allreduce_hook
            self.register_comm_hook(ctx, hook)
        self.reducer = FixedBuckets(self.reducer)  # type: ignore[assignment]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """DDP's forward, between taking the buffers an earlier forward staged and staging slot 0's new ones.

        Staged only when DDP would broadcast before the next forward: grad enabled and outside ``no_sync()``."""
        if not self.synced_buffers:
            return super().forward(*inputs, **kwargs)
        self._tp_ctx.take_staged_buffers()
        output = super().forward(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._tp_ctx.stage_buffers()
        return output
