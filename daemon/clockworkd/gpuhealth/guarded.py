"""A GPU source read on its own thread, so a hung NVML call cannot stop the daemon's loop.

NVML calls can block for seconds to forever (a GPU falling off the bus, a wedged driver). The watch reads from the
daemon's one loop, which also serves node watch, LinkPass's loop side and every request, so
:class:`GuardedSource` hands each read to one worker thread (``gpu-health-read``) and waits at most ``wait_s``.
A read that does not return in time raises :class:`~clockworkd.gpuhealth.readings.SourceBusyError` (the watch
skips that round); while it is still running, every next read raises at once without starting another (a hung
call cannot be cancelled, so at most one thread is ever stuck in NVML). When the call finally returns, the next
read starts afresh. The worker marks itself busy in the daemon's :class:`~clockworkd.watchdog.Watchdog`, so
``status`` names it and says for how long.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from clockworkd.gpuhealth.readings import GpuReading, GpuSource, SourceBusyError
from clockworkd.watchdog import Watchdog

__all__ = ["READ_WAIT_S", "GuardedSource"]

log = logging.getLogger("clockwork.daemon.health")

#: The longest the loop waits for one read (once per hang: the reads after it do not wait).
READ_WAIT_S = 1.0
PART = "health.read"


class GuardedSource:
    """``inner`` read on its own thread (see the module docstring); a :class:`GpuSource` itself."""

    def __init__(self, inner: GpuSource, watchdog: Watchdog | None = None, wait_s: float = READ_WAIT_S) -> None:
        self.inner = inner
        self.name = inner.name
        self.watchdog = watchdog
        self.wait_s = wait_s
        self.hung_reads = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-health-read")
        self._pending: Future[list[GpuReading]] | None = None
        self._since = 0.0

    def busy_for(self) -> float | None:
        """Seconds the current read has been running past its wait (None: no read hangs)."""
        pending = self._pending
        if pending is None or pending.done():
            return None
        return time.monotonic() - self._since

    def read(self) -> list[GpuReading]:
        busy = self.busy_for()
        if busy is not None:
            raise SourceBusyError(f"{self.name} read still running after {busy:.1f} s")
        self._pending = None
        self._since = time.monotonic()
        future = self._pool.submit(self._read)
        try:
            return future.result(timeout=self.wait_s)
        except concurrent.futures.TimeoutError:
            self._pending = future
            self.hung_reads += 1
            raise SourceBusyError(f"{self.name} read did not return within {self.wait_s:g} s") from None

    def _read(self) -> list[GpuReading]:
        if self.watchdog is None:
            return self.inner.read()
        with self.watchdog.working(PART):
            return self.inner.read()

    def describe(self) -> str:
        busy = self.busy_for()
        base = self.inner.describe()
        return base if busy is None else f"{base}; a read has hung for {busy:.1f} s"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.busy_for() is not None:  # closing NVML under a hung call could hang too: leave it to exit
            log.warning("GPU source %s not closed: a read is still hung", self.name)
            return
        self.inner.close()
