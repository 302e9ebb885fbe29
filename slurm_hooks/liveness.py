"""Tell a busy daemon from a dead one before the supervisor SIGKILLs it.

A daemon that does not answer ``ping`` is not necessarily dead: its loop may be busy (a long request, a big event
log being read) or waiting on a slow disk, and killing it then loses its in-memory state (LinkPass's verdicts, the
node watch's suspicions, migrations in flight) for nothing. So :func:`judge` keeps asking while it watches the
process in ``/proc/PID/stat``:

- the process is gone (or a zombie): ``GONE``, nothing to kill;
- it answers: ``ANSWERS``, keep it;
- its CPU time does not advance for ``stall_s`` and it is not in uninterruptible (disk) sleep, e.g. stopped
  (SIGSTOP) or blocked forever on a lock or a hung call in its loop: ``STALLED``, dead in effect;
- it stays busy (CPU time advancing, or waiting on the disk) without answering for ``busy_wait_s``:
  ``BUSY``, a bounded wait is over (a loop spinning that long without reading its socket is stuck too).

Linux only (``/proc``), like the rest of the node side.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUSY_WAIT_S", "STALL_S", "Liveness", "ProcSample", "judge", "proc_sample"]

#: The longest a hook waits for a daemon that does not answer but makes progress.
BUSY_WAIT_S = 10.0
#: A daemon that neither answers nor uses CPU time (nor waits on a disk) this long is dead.
STALL_S = 2.0
SAMPLE_S = 0.1


class Liveness(enum.StrEnum):
    """What :func:`judge` found."""

    ANSWERS = "answers"
    GONE = "gone"
    STALLED = "stalled"
    BUSY = "busy"


@dataclass(frozen=True)
class ProcSample:
    """One look at ``/proc/PID/stat``: the state letter and the CPU time used (user + system, clock ticks)."""

    state: str
    cpu_ticks: int


def proc_sample(pid: int, proc: Path = Path("/proc")) -> ProcSample | None:
    """The process's state and CPU time now; None when it does not exist."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return ProcSample(fields[0], int(fields[11]) + int(fields[12]))


def judge(
    pid: int,
    answers: Callable[[], bool],
    *,
    busy_wait_s: float = BUSY_WAIT_S,
    stall_s: float = STALL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[Liveness, str]:
    """Watch ``pid`` and ask ``answers()`` until it answers or is found gone, stalled or busy too long; and why."""
    start = progress_at = clock()
    last = proc_sample(pid)
    while True:
        if answers():
            return Liveness.ANSWERS, f"answered after {clock() - start:.1f} s"
        sample = proc_sample(pid)
        now = clock()
        if sample is None or sample.state in ("Z", "X"):
            return Liveness.GONE, "the process is gone"
        if last is None or sample.cpu_ticks != last.cpu_ticks or sample.state == "D":
            progress_at = now  # using CPU time, or waiting on a disk: busy, not dead
        last = sample
        if now - progress_at >= stall_s:
            return Liveness.STALLED, (
                f"no answer and no CPU time used for {now - progress_at:.1f} s (process state {sample.state})"
            )
        if now - start >= busy_wait_s:
            return Liveness.BUSY, f"busy (using CPU time or waiting on a disk) but no answer for {now - start:.1f} s"
        sleep(SAMPLE_S)
