"""Per-part watchdog of the node daemon: which part (the loop, a hosted component's tick, the GPU reader thread,
LinkPass's heartbeat thread) is stuck, and for how long.

The daemon's loop is one thread; a part that blocks it (a hung NVML call, a slow disk) would blind every other
part hosted there. So what can block runs on its own thread (the GPU reader, :mod:`clockworkd.gpuhealth.guarded`;
LinkPass's heartbeats, :mod:`linkpass.hbio`), and every part says here when it starts and ends a call
(:meth:`Watchdog.working`) or when it last made progress (:meth:`Watchdog.watch`). The ``status`` op shows
:meth:`Watchdog.report` (answered from the loop, so it names stuck *threads* while the loop runs), and the
watchdog's own thread (``daemon-watchdog``) logs a stuck part, with its thread's Python stack, once per episode,
which is what still says something when the loop itself is the stuck part.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["STUCK_AFTER_S", "Watchdog"]

log = logging.getLogger("clockwork.daemon.watchdog")

#: A part busy in one call (or without progress) this long is reported stuck. The loop wakes at least once a
#: second, a GPU read takes well under a second and LinkPass's heartbeat thread runs every interval.
STUCK_AFTER_S = 5.0
CHECK_EVERY_S = 1.0


class Watchdog:
    """Heartbeats of the daemon's parts (see the module docstring). Thread-safe: parts run on several threads."""

    def __init__(self, node: str, clock: Callable[[], float] = time.monotonic, stuck_after_s: float = STUCK_AFTER_S):
        self.node = node
        self.clock = clock
        self.stuck_after_s = stuck_after_s
        self._lock = threading.Lock()
        self._busy: dict[str, tuple[float, int, str]] = {}  # part -> (since, thread ident, thread name)
        self._progress: dict[str, Callable[[], float]] = {}  # part -> seconds since its last progress
        self._told: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def working(self, part: str) -> Iterator[None]:
        """Mark ``part`` busy in one call for the duration of the ``with`` block."""
        me = threading.current_thread()
        with self._lock:
            self._busy[part] = (self.clock(), me.ident or 0, me.name)
        try:
            yield
        finally:
            with self._lock:
                self._busy.pop(part, None)

    def watch(self, part: str, age_s: Callable[[], float]) -> None:
        """Watch a part that keeps its own progress stamp: ``age_s()`` is the seconds since it last progressed."""
        with self._lock:
            self._progress[part] = age_s

    def stuck(self) -> list[dict[str, Any]]:
        """The parts stuck now: ``{"part", "for_s", "how", "thread"}``, longest first."""
        now = self.clock()
        with self._lock:
            busy = dict(self._busy)
            progress = dict(self._progress)
        out = []
        for part, (since, _ident, name) in busy.items():
            if now - since >= self.stuck_after_s:
                out.append({"part": part, "for_s": round(now - since, 1), "how": "busy in one call", "thread": name})
        for part, age_s in progress.items():
            try:
                age = float(age_s())
            except Exception as exc:  # a part that cannot say: report it, never fail the status
                out.append({"part": part, "for_s": 0.0, "how": f"unreadable: {exc}", "thread": ""})
                continue
            if age >= self.stuck_after_s:
                out.append({"part": part, "for_s": round(age, 1), "how": "no progress", "thread": ""})
        return sorted(out, key=lambda s: -s["for_s"])

    def report(self) -> dict[str, Any]:
        """What ``status`` shows: the parts watched, those busy now, and the stuck ones."""
        now = self.clock()
        with self._lock:
            busy = {part: round(now - since, 3) for part, (since, _i, _n) in self._busy.items()}
            parts = sorted({*self._busy, *self._progress})
        return {"stuck_after_s": self.stuck_after_s, "parts": parts, "busy_s": busy, "stuck": self.stuck()}

    # ----- the watchdog's own thread ---------------------------------------------------------------

    def start(self) -> None:
        """Start the thread that logs stuck parts (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="daemon-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def check(self) -> list[dict[str, Any]]:
        """Log each part that became stuck (once per episode) and each that recovered; the stuck parts."""
        stuck = self.stuck()
        names = {s["part"] for s in stuck}
        with self._lock:
            idents = {part: ident for part, (_s, ident, _n) in self._busy.items()}
        for s in stuck:
            if s["part"] in self._told:
                continue
            self._told.add(s["part"])
            frame = sys._current_frames().get(idents.get(s["part"], -1))
            where = "".join(traceback.format_stack(frame, limit=8)) if frame is not None else ""
            log.warning(
                "node %s: %s stuck for %.1f s (%s%s)%s",
                self.node,
                s["part"],
                s["for_s"],
                s["how"],
                f", thread {s['thread']}" if s["thread"] else "",
                f"; it is at:\n{where}" if where else "",
            )
        for part in sorted(self._told - names):
            self._told.discard(part)
            log.warning("node %s: %s is moving again", self.node, part)
        return stuck

    def _run(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            try:
                self.check()
            except Exception:  # the watchdog must never take the daemon down
                log.exception("node %s: watchdog check failed", self.node)
