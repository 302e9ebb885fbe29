"""One case from seed to verdict: the script written into the case's folder, its fault-free run, its faulted run.

Why the reference runs first, every time: the reference is the same script with no fault, so its markers also
time a step on this machine right now (the faults' moments are fractions of it) and its wall time sizes the
faulted run's limit. The limit leaves room for what the product may legitimately take (a recovery late by one
collective timeout, 20 s here, per fault) and no more: past it the case is a hang.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .fuzz_grammar import Case
from .fuzz_jobs import Job, run_job
from .fuzz_render import render
from .fuzz_verdict import Verdict, judge_faulted, judge_reference

REFERENCE_TIMEOUT_S = 240.0
# Per fault: room for the product to give up by itself where it must (max_resets = 3 rebuilds after a collective
# timeout of 20 s each, ~90 s), so that a crash loop ends as a crash with its reason rather than as a hang.
FAULT_ALLOWANCE_S = 100.0


@dataclass
class CaseResult:
    """A case and its verdict, with the time it took and where its files are (when kept)."""

    case: Case
    verdict: Verdict
    seconds: float
    folder: Path
    reference_s: float = 0.0
    faulted_s: float = 0.0

    def line(self) -> str:
        verdict = self.verdict.verdict + (f" ({self.verdict.kind})" if self.verdict.kind else "")
        detail = f": {self.verdict.detail[:400]}" if self.verdict.detail and self.verdict.verdict != "bitwise" else ""
        return f"case seed={self.case.seed} verdict={verdict} in {self.seconds:.0f}s{detail}"


def faulted_timeout(case: Case, reference: Job) -> float:
    """How long the faulted run may take before it counts as a hang."""
    return 2.0 * reference.wall_s + 30.0 + FAULT_ALLOWANCE_S * len(case.faults)


def run_case(case: Case, folder: Path, *, keep: bool = True) -> CaseResult:
    """Run ``case`` in ``folder`` (made here; removed at the end unless ``keep`` or the case failed)."""
    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=False)
    script = folder / f"case_{case.seed}.py"
    script.write_text(render(case))
    reference = run_job(case, folder / "reference", script, timeout_s=REFERENCE_TIMEOUT_S, faults=False, step_s=0.0)
    verdict = judge_reference(case, reference)
    result = CaseResult(case, Verdict("bitwise"), 0.0, folder, reference_s=reference.wall_s)
    if verdict is None:
        timeout = faulted_timeout(case, reference)
        step_s = reference.step_s()
        faulted = run_job(case, folder / "faulted", script, timeout_s=timeout, faults=True, step_s=step_s)
        verdict = judge_faulted(case, reference, faulted)
        if verdict.kind == "fault-not-injected":
            # The run tested nothing (on a loaded machine a timed fault can land after training ended): run it
            # once more, and judge that run; a second miss stays a failure.
            missed = verdict.detail
            faulted = run_job(case, folder / "faulted-again", script, timeout_s=timeout, faults=True, step_s=step_s)
            verdict = judge_faulted(case, reference, faulted)
            again = f"{verdict.detail} (run again: the first run missed its faults: {missed})"
            verdict = replace(verdict, detail=again)
        result.faulted_s = faulted.wall_s
        (folder / "faults.txt").write_text(
            "\n".join(
                f"{a.fault.describe()} done={a.done} pid={a.pid} at={a.at_s:.3f}s {a.note}" for a in faulted.acted
            )
            + "\n"
        )
    result.verdict = verdict
    result.seconds = time.monotonic() - started
    (folder / "verdict.txt").write_text(result.line() + "\n" + verdict.detail + "\n")
    if not keep and not verdict.failed:
        shutil.rmtree(folder, ignore_errors=True)
    return result
