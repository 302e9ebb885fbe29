"""One local TorchPass job of a generated script: launched, its faults acted, waited for with a limit, recorded.

Why its own module: the fuzzer's verdicts rest on what a job did (its exit status, its coordinator's events, its
log, the final state each slot wrote), and a hang must end as a verdict, not as a stuck fuzzer. The job runs in
a session of its own (``start_new_session``), so a job past its limit is killed whole, by its process group;
its ranks also die with the launcher (``PR_SET_PDEATHSIG``). The command is the one the oracle tests use
(``tests/unit/local_jobs.py``): the collective and rendezvous timeouts shortened to 20 s and 60 s, so a broken
generation costs seconds, not minutes.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fuzz_faults import Acted, FaultRun
from .fuzz_grammar import Case
from .fuzz_render import launch_flags

REPO = Path(__file__).resolve().parents[2]
SETTINGS = ("collective_timeout_s=20", "join_timeout_s=60")


@dataclass
class Job:
    """A finished (or killed) job: its folder, exit status, log, coordinator events and acted faults."""

    folder: Path
    returncode: int
    timed_out: bool
    wall_s: float
    output: str
    events: list[dict[str, Any]]
    acted: list[Acted] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e["fields"] for e in self.events if e.get("kind") == kind]

    def failure(self) -> str:
        """Why the job failed: the coordinator's ``torchpass.failed`` reason, else the launcher's last words."""
        failed = self.of_kind("torchpass.failed")
        if failed:
            return str(failed[-1].get("reason", ""))
        lines = [line for line in self.output.splitlines() if "job failed" in line or "Error" in line]
        return (lines[-1] if lines else self.output.strip().splitlines()[-1:][0] if self.output.strip() else "")[:2000]

    def reached(self, mark: int) -> bool:
        """Whether some slot began marker ``mark`` (a refusal at start never gets past the first step)."""
        return any(self.folder.glob(f"mark-slot*-{mark}"))

    def step_s(self) -> float:
        """The median time between two markers of slot 0 (a micro-batch or a step), for drawing fault moments."""
        times = sorted(p.stat().st_mtime for p in self.folder.glob("mark-slot0-*"))
        gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
        return statistics.median(gaps) if gaps else 0.2


def environment(folder: Path) -> dict[str, str]:
    """The job's environment: this one without the caller's CW_/TORCHPASS_ variables, the repository on the path
    (the worktree's torchpass and clockworkd), one thread per rank, the case folder for the script."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CW_", "TORCHPASS_", "SLURM_"))}
    path = [str(REPO), str(REPO / "daemon"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", CW_FUZZ_DIR=str(folder))
    return env


def command(case: Case, folder: Path, script: Path) -> list[str]:
    """``python -m torchpass run --local ...`` of the case's script, its events and coordinator file in
    ``folder``."""
    cmd = [sys.executable, "-m", "torchpass", "run", "--local", *launch_flags(case)]
    cmd += ["--events", str(folder / "events.jsonl"), "--coordinator-file", str(folder / "coordinator")]
    for setting in SETTINGS:
        cmd += ["--set", setting]
    return [*cmd, str(script)]


def run_job(case: Case, folder: Path, script: Path, *, timeout_s: float, faults: bool, step_s: float) -> Job:
    """Run the case's script in ``folder`` (new), with its faults when ``faults``, killed past ``timeout_s``."""
    folder.mkdir(parents=True)
    env = environment(folder)
    env["CW_FUZZ_KILLS"] = case.hook_kills() if faults else ""
    started = time.monotonic()
    with open(folder / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            command(case, folder, script),
            env=env,
            cwd=folder,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    injector = FaultRun(case, folder, proc, step_s, env) if faults else None
    if injector is not None:
        injector.start()
    timed_out = False
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_session(proc)
        returncode = proc.wait()
    finally:
        if injector is not None:
            injector.stop()
        if proc.poll() is None:
            _kill_session(proc)
            proc.wait()
    wall = time.monotonic() - started
    _kill_session(proc)  # stragglers of the session (none expected: children die with the launcher)
    events_file = folder / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    output = (folder / "launcher.log").read_text(errors="replace")
    acted = injector.acted if injector is not None else []
    missing = injector.missing() if injector is not None else []
    return Job(folder, returncode, timed_out, wall, output, events, acted, missing)


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the job's process group (the launcher's session, which the fuzzer started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
