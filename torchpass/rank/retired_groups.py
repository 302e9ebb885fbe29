"""Process groups of past generations, held until every collective they may still run has timed out.

Why: destroying a gloo group joins its worker threads, and a worker stuck in a send that gloo never fails after its
peer closed the connection (:mod:`torchpass.sharded.gloo_wait`) holds that join for the group's whole timeout
(``collective_timeout_s``). A soak saw it: a survivor gave up a DDP bucket's all-reduce within a millisecond of the
abort (:meth:`torchpass.rank.step.StepLifecycle.when_cut_off`), then waited 30 s in ``destroy_process_group`` before
it could join the next generation. Held here, a group leaves torch.distributed's registry at once and its C++
object (threads, buffers, the sockets the abort shut down) lives on until its timeout has passed; it is released
when a later generation is retired, on that thread, with nothing left to wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["RetiredGroups"]

#: Held this much longer than the groups' own timeout: a work started right before the destroy has timed out by then.
MARGIN_S = 5.0


class RetiredGroups:
    """The groups of the generations left, each set released once ``hold_s`` has passed since it was retired."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: list[tuple[float, list[Any]]] = []

    def retire(self, groups: Iterable[Any], hold_s: float) -> None:
        """Hold ``groups`` (a generation's, about to be destroyed) for ``hold_s`` + :data:`MARGIN_S` seconds, and
        release the sets held long enough (their destructors find every work ended)."""
        now = self._clock()
        self._held = [(until, held) for until, held in self._held if until > now]
        kept = [g for g in groups if g is not None]
        if kept:
            self._held.append((now + hold_s + MARGIN_S, kept))

    def __len__(self) -> int:
        """Groups held now."""
        return sum(len(held) for _, held in self._held)
