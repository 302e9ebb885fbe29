"""What transparent mode and a framework adapter ask of each other (see :mod:`torchpass.frameworks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.data import DataLoader

    from torchpass.rank.context import Context
    from torchpass.transparent.data import DataPosition

__all__ = ["FrameworkAdapter", "PassView", "SessionView"]


class PassView(Protocol):
    """One pass over the tracked loader, as an adapter sees it (:class:`torchpass.transparent.data.TrackedPass`)."""

    pass_no: int
    epoch: int

    def __len__(self) -> int: ...

    def __next__(self) -> Any: ...

    def retarget(self, pass_no: int, epoch: int) -> None:
        """Become pass ``pass_no`` with the sampler's order of ``epoch`` (a jump to another pass)."""
        ...


class SessionView(Protocol):
    """What an adapter needs from the transparent-mode session."""

    ctx: Context
    step_open: bool
    position: DataPosition  # where the replicas are (received with the state, rolled back with a step)
    loader: DataLoader[Any] | None  # the tracked loader

    def warn(self, message: str) -> None: ...

    def start_pass(self, loader: DataLoader[Any]) -> PassView:
        """A new pass over the tracked loader (what ``iter(loader)`` returns)."""
        ...

    def roll_back_open_step(self) -> bool:
        """Close the step in progress now if it committed cleanly; if it was abandoned, undo it but leave the
        recovery to the next batch request (True: the step must be redone)."""
        ...


class FrameworkAdapter(Protocol):
    """The points where a framework's training differs from a plain DDP script's (see the module docstring)."""

    name: str

    def group_visible(self) -> bool:
        """Whether ``torch.distributed.is_initialized()`` should report a group before the first step (False:
        the framework then skips its set-up collectives, as it does when it runs without one)."""
        ...

    def tracks(self, loader: Any) -> bool:
        """Whether ``loader``, which has no ``DistributedSampler``, is sharded by the framework itself (each
        rank's batches its own) and may be the tracked one."""
        ...

    def accepts_loader(self) -> bool:
        """Whether a ``DistributedSampler`` loader built now is the one training iterates (not validation's)."""
        ...

    def adopt_model(self, module: nn.Module) -> None:
        """The script's DDP was built over ``module``."""
        ...

    def adopt_sharded(self, module: nn.Module) -> None:
        """``module`` is the outermost ``fully_shard``-ed module so far (called again as FSDP2 shards bottom-up and
        the model comes last): the framework's state must be registered, once, before the first step; raise
        TorchPassError where the framework's sharded training is not protected."""
        ...

    def pass_number(self, counted: int) -> int:
        """The pass a new ``iter(loader)`` starts (``counted``: how many iterations came before it)."""
        ...

    def align(self, it: PassView) -> int:
        """The batch of ``it`` to serve now, after any jump (raise StopIteration to end the pass)."""
        ...

    def served(self, index: int) -> None:
        """Batch ``index`` of the current pass is being handed to the framework."""
        ...

    def check_first_step(self, has_model: bool) -> None:
        """At the end of the first step: refuse what this framework's mode cannot protect."""
        ...
