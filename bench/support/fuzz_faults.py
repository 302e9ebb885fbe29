"""A case's faults, acted while its job trains: SIGKILLs of the process holding a slot, and planned migrations.

Why from outside and at drawn times: a kill that a script's own hook makes lands only where someone put a hook
(issue 40's defect hid between two of them). Here a thread of the fuzzer watches the job's folder: the marker a
slot writes when it starts a micro-batch or step (``mark-slotN-K``), and the file every process writes when it
takes a slot (``pid-slotN-PID``). A ``mark`` fault waits for its marker and then a drawn fraction of a step, so it
lands anywhere in the step (a forward, a backward inside a collective, the optimizer step, the commit, a peer
copy); ``during`` and ``rejoin`` faults land inside the previous fault's recovery. Only processes of the job's own
session (the launcher's, started by the fuzzer) are ever signalled.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .fuzz_grammar import Case, Fault

PID_FILE = re.compile(r"pid-slot(\d+)-(\d+)$")
SPARE_READY = "spare ready, waiting for a slot"  # a spare's log line (torchpass.rank.context) once it can take a slot
POLL_S = 0.005
MIGRATE_TIMEOUT_S = 30.0  # the migrate command asks again for up to 20 s while no spare is ready


@dataclass
class Acted:
    """What became of one planned fault."""

    fault: Fault
    done: bool = False
    pid: int = 0
    at_s: float = 0.0  # seconds after the job started
    note: str = ""


@dataclass
class FaultRun:
    """The faults of one job, acted by a thread (:meth:`start`) until the job ends (:meth:`stop`)."""

    case: Case
    folder: Path
    job: subprocess.Popen[bytes]
    step_s: float  # a marker's duration in the fault-free run
    env: dict[str, str]
    acted: list[Acted] = field(default_factory=list)
    _killed: set[int] = field(default_factory=set)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _started: float = 0.0

    def start(self) -> None:
        self._started = time.monotonic()
        self.acted = [Acted(fault) for fault in self.case.faults]
        self._thread = threading.Thread(target=self._run, name="fuzz-faults", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The job ended (or is being ended): no fault acts from now on. A kill the script makes itself (``hook``)
        happens whether or not this thread got to wait for it (it may still be waiting for an earlier fault): its
        marker file says whether it did."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=MIGRATE_TIMEOUT_S + 5)
        for acted in self.acted:
            fault = acted.fault
            killed = self.folder / f"killed-{fault.slot}-{fault.mark}-{fault.phase}"
            if fault.timing == "hook" and not acted.done and killed.exists():
                acted.done, acted.note = True, "made by the script while the fuzzer waited for an earlier fault"

    def missing(self) -> list[str]:
        """The planned faults that were not acted, each with why."""
        return [f"{a.fault.describe()}: {a.note or 'not reached'}" for a in self.acted if not a.done]

    # ----- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        previous: Acted | None = None
        holders_before: set[int] = set()
        for acted in self.acted:
            fault = acted.fault
            if fault.timing == "mark":
                if not self._wait(lambda f=fault: (self.folder / f"mark-slot{f.slot}-{f.mark}").exists()):
                    acted.note = f"marker {fault.mark} of slot {fault.slot} never appeared"
                    return
                if not self._sleep(fault.delay * self.step_s):
                    return
            elif fault.timing == "hook":  # the script kills itself; its marker file says when
                killed = self.folder / f"killed-{fault.slot}-{fault.mark}-{fault.phase}"
                if not self._wait(lambda k=killed: k.exists() and k.read_text().endswith("\n")):
                    acted.note = f"slot {fault.slot} never reached {fault.phase} of marker {fault.mark}"
                    return
                acted.pid = int(killed.read_text())
                self._killed.add(acted.pid)
                holders_before = set(self._holders(fault.slot)) | self._killed
                acted.done, acted.at_s = True, self._now()
                previous = acted
                continue
            elif fault.timing == "during":
                assert previous is not None
                if not self._sleep(max(0.0, previous.at_s + fault.delay - self._now())):
                    return
            else:  # rejoin: the process that took the previous victim's slot shows up
                assert previous is not None
                victim = previous.fault.slot
                if not self._wait(lambda v=victim, seen=holders_before: bool(set(self._holders(v)) - seen)):
                    acted.note = f"no process took slot {victim} again"
                    return
                if not self._sleep(fault.delay):
                    return
            holders_before = set(self._holders(fault.slot)) | self._killed
            if fault.kind == "kill":
                self._kill(acted)
            else:
                self._migrate(acted)
                # The next fault is drawn after the migration, not inside it: wait until the rank has handed its
                # state over (a crash meanwhile may take the migrated generation's place: the handoff still counts).
                if acted.done and not self._wait(self._handed_over):
                    acted.done, acted.note = False, f"accepted, but the job ended before it was done ({acted.note})"
            if not acted.done:
                return
            previous = acted

    def _now(self) -> float:
        return time.monotonic() - self._started

    def _sleep(self, seconds: float) -> bool:
        """Sleep; False when the job ended meanwhile."""
        return not self._stopping.wait(max(0.0, seconds))

    def _wait(self, condition: object) -> bool:
        """Poll ``condition`` until true; False when the job ended first."""
        assert callable(condition)
        while not condition():
            if self._stopping.wait(POLL_S) or self.job.poll() is not None:
                return False
        return True

    def _logged(self, kind: str) -> bool:
        """Whether the job's coordinator logged an event of ``kind`` (its events file, one JSON line each)."""
        events = self.folder / "events.jsonl"
        return events.exists() and f'"kind": "{kind}"' in events.read_text()

    def _handed_over(self) -> bool:
        """Whether a migration's rank handed its state over (``torchpass.departed``) or the migration is done."""
        return self._logged("torchpass.migrated") or self._logged("torchpass.departed")

    def _holders(self, slot: int) -> list[int]:
        """Live processes of this job that took ``slot`` (newest last), not yet killed by us nor by themselves (a
        hook kill's marker file holds the pid: a timed kill that waited for an earlier fault could otherwise
        signal a process that had just killed itself, and count a kill that took nothing, seed 700005)."""
        found: list[tuple[int, int]] = []
        gone = self._killed | self._self_killed()
        for entry in os.scandir(self.folder):
            match = PID_FILE.match(entry.name)
            if match and int(match.group(1)) == slot:
                pid = int(match.group(2))
                if pid not in gone and _ours(pid, self.job.pid):
                    found.append((entry.stat().st_mtime_ns, pid))
        return [pid for _, pid in sorted(found)]

    def _self_killed(self) -> set[int]:
        """The pids the script's own kills took (each ``killed-SLOT-MARK-PHASE`` file holds its pid)."""
        pids: set[int] = set()
        for marker in self.folder.glob("killed-*"):
            text = marker.read_text().strip()
            if text.isdigit():
                pids.add(int(text))
        return pids

    def _kill(self, acted: Acted) -> None:
        slot = acted.fault.slot
        if not self._wait(lambda: bool(self._holders(slot))):
            acted.note = f"no live process holds slot {slot}"
            return
        pid = self._holders(slot)[-1]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            acted.note = f"pid {pid} of slot {slot} exited before the kill"
            return
        self._killed.add(pid)
        acted.done, acted.pid, acted.at_s = True, pid, self._now()

    def _migrate(self, acted: Acted) -> None:
        """``clockwork migrate --coordinator FILE --rank N``, run in this process (the same CLI code, without an
        interpreter's start-up, which would outlast a short job's training)."""
        from clockwork.cli.main import run as clockwork

        slot, coordinator = acted.fault.slot, self.folder / "coordinator"
        if not self._wait(coordinator.exists):
            acted.note = "no coordinator file"
            return
        # A migration needs a ready spare; a fast job may reach the drawn marker before its spare is up, and end
        # before the coordinator stops refusing ("no spare is ready"): ask once one is (the rank's log says so).
        log = self.folder / "launcher.log"
        if not self._wait(lambda: SPARE_READY in log.read_text(errors="replace")):
            acted.note = "no spare was ever ready"
            return
        acted.at_s = self._now()
        said = io.StringIO()
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            code = clockwork(["migrate", "--coordinator", str(coordinator), "--rank", str(slot), "--wait", "20"])
        acted.note = " ".join(said.getvalue().split())[-300:]
        acted.done = code == 0


def _ours(pid: int, session: int) -> bool:
    """Whether ``pid`` is alive (not a zombie) and in the job's session (the launcher's, which we started)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] not in ("Z", "X") and int(fields[3]) == session
