"""Waits on gloo work that the abort of its group does not free: given up once the group was aborted.

Why: a gloo send can outlive the abort of its group. When the receiving rank closes its connection (its own
abort, or its death) between the two writes a send makes, the second write fails with ``EPIPE`` and gloo queues
the operation; gloo's ``Pair::signalException`` then fails every pending operation of the pair except a queued
send to an unbound buffer (it checks ``op.buf``, not ``op.ubuf``). That send's ``wait`` runs out the group's whole
timeout (``collective_timeout_s``) although the group is gone, and the survivor holds up the recovery that long.
Pipelines' sends hit it (about 1 in 12 to 50 middle-stage kills of a 4-stage pipeline), and so do the sends
inside gloo's collectives (FSDP's, about 1 in 20 faulted runs of FSDP inside pipeline stages).

What cannot free it from Python: ``ProcessGroupGloo.abort()`` does not reach the buffer and ``Work.abort`` is not
exposed. So the waiter stops waiting instead, once ``cut_off()`` says this rank's control thread has aborted the
step's groups for a newer generation (nothing of the old group can succeed any more), and raises
:class:`WaitAbandoned`. The work stays pending in the dead group until gloo's own timeout fails it, holding its
tensors (their memory is not reused before that); nothing of an abandoned step is used again (a pipeline's
stage and schedule are rebuilt, FSDP's outputs are fresh per collective, the step's gradients are discarded).

How, by kind of work (measured on torch 2.13's gloo):

* A collective's wait takes a timeout without side effects (``Operation timed out!``, the collective goes on):
  :func:`wait_polling` waits in the caller's thread in slices of :data:`POLL_S`, at no cost while it completes.
* A send's or receive's timed wait fails every pair of the group's context on timeout ("Application timeout
  caused pair closure"), and gloo's reduce-scatter ignores the timeout (it blocks); neither completes without a
  ``wait``. :class:`HelperWaiter` waits for them on a helper thread and the caller polls that thread.

A pipeline's schedule waits on its sends and receives through :meth:`HelperWaiter.guarding`. Not covered: the
blocking metadata exchange ``PipelineStage`` runs once per build (shapes, the inference vote), which calls
``dist.send``/``dist.recv`` directly.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch.distributed as dist

from torchpass.rank.torch_compat import route_pipeline_waits

__all__ = ["POLL_S", "HelperWaiter", "WaitAbandoned", "wait_polling"]

log = logging.getLogger("clockwork.torchpass.gloo_wait")

POLL_S = 0.05  # how often a blocked wait asks whether its group was aborted (a recovery waits at most this long)
_SLICE = datetime.timedelta(seconds=POLL_S)

CutOff = Callable[[], bool]


class WaitAbandoned(RuntimeError):
    """A wait given up: the group was aborted for a newer generation while the work was pending (it may still
    be pending in the dead group)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} given up: its group was aborted for a newer generation while it was pending")


def wait_polling(work: dist.Work, cut_off: CutOff, what: str = "a collective") -> None:
    """Wait for a gloo collective whose ``wait`` takes a timeout harmlessly; raise its error, or
    :class:`WaitAbandoned` once ``cut_off()`` is true while it is pending."""
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # it failed, or completed as the slice ran out: its plain wait says which
                work.wait()
                return
            if cut_off():
                log.warning("%s of the abandoned step is left pending in the aborted group", what)
                raise WaitAbandoned(what) from None


class _Job:
    """One batch of works to wait for, and how that wait ended."""

    def __init__(self, works: Sequence[dist.Work]) -> None:
        self.works = works
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            self.error = exc
        finally:
            self.done.set()


class _Helper(threading.Thread):
    """The thread that blocks in ``Work.wait`` (which releases the GIL) for the caller."""

    def __init__(self) -> None:
        super().__init__(name="torchpass-gloo-wait", daemon=True)
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job.run()


class HelperWaiter:
    """Waits on works that complete only through a blocking ``wait`` (a rank's one; used from one thread at a
    time, the training loop's)."""

    def __init__(self) -> None:
        self._helper: _Helper | None = None
        self.given_up = 0  # waits given up so far (a stuck helper left behind for each)

    def wait(self, works: Sequence[dist.Work], cut_off: CutOff, what: str = "a send/recv") -> None:
        """Return once every work in ``works`` finished; raise its error if one failed, or :class:`WaitAbandoned`
        once ``cut_off()`` is true while one is still pending."""
        if not works:
            return
        if self._helper is None:
            self._helper = _Helper()
        job = _Job(works)
        self._helper.jobs.put(job)
        while not job.done.wait(POLL_S):
            if cut_off():
                self._helper.jobs.put(None)  # it exits when the pending work does (the dead group's timeout)
                self._helper = None
                self.given_up += 1
                log.warning("%s of the abandoned step is left pending in the aborted group", what)
                raise WaitAbandoned(what)
        if job.error is not None:
            raise job.error

    @contextmanager
    def guarding(self, cut_off: CutOff) -> Iterator[None]:
        """Within it, torch's pipeline schedules wait on their sends and receives here, given up once
        ``cut_off()`` is true (elsewhere, and in other threads, they wait as torch does). The first use routes
        the schedules' waits here (not at import: ``torch.distributed.pipelining`` costs a few tenths of a second to
        import, which a job without a pipeline does not pay)."""
        if not _torch_wait:
            _torch_wait.append(route_pipeline_waits(_wait_batch_p2p))
        token = _current.set((self, cut_off))
        try:
            yield
        finally:
            _current.reset(token)


_current: ContextVar[tuple[HelperWaiter, CutOff] | None] = ContextVar("torchpass_gloo_waiter", default=None)


_torch_wait: list[Callable[[list[dist.Work]], None]] = []  # torch's own, for schedules outside a guarded step


def _wait_batch_p2p(works: list[dist.Work]) -> None:
    current = _current.get()
    if current is None:
        _torch_wait[0](works)
    else:
        current[0].wait(works, current[1], "a pipeline send/recv")
