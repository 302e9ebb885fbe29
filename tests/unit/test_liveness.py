"""The supervisor tells a busy daemon from a dead one before it SIGKILLs: real processes that spin, are stopped
(SIGSTOP), are gone, or are busy for a while and then answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_hooks.liveness import Liveness, judge, proc_sample

SPIN = "while True: pass"
# Spins for two seconds of CPU time, then "answers" (creates the file named by argv[1]) and sleeps.
BUSY_THEN_ANSWER = (
    "import pathlib, sys, time\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 2.0: pass\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()


def _start(procs: list[subprocess.Popen[bytes]], code: str, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args])
    procs.append(proc)
    return proc


def test_a_spinning_process_is_busy_until_the_bound_not_stalled(procs: list[subprocess.Popen[bytes]]) -> None:
    proc = _start(procs, SPIN)
    verdict, why = judge(proc.pid, lambda: False, busy_wait_s=1.0, stall_s=30.0)
    assert verdict is Liveness.BUSY, why
    assert proc.poll() is None  # judging never signals


def test_a_stopped_process_is_stalled(procs: list[subprocess.Popen[bytes]]) -> None:
    proc = _start(procs, SPIN)
    os.kill(proc.pid, signal.SIGSTOP)
    verdict, why = judge(proc.pid, lambda: False, busy_wait_s=60.0, stall_s=0.5)
    assert verdict is Liveness.STALLED and "process state T" in why, why


def test_a_gone_process_is_gone(procs: list[subprocess.Popen[bytes]]) -> None:
    proc = _start(procs, "pass")
    proc.wait()
    assert proc_sample(proc.pid) is None
    assert judge(proc.pid, lambda: False, busy_wait_s=60.0, stall_s=60.0)[0] is Liveness.GONE


def test_a_busy_process_that_answers_in_time_is_kept(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    flag = tmp_path / "answered"
    proc = _start(procs, BUSY_THEN_ANSWER, str(flag))
    # stall_s is short: only its CPU time advancing keeps it from being judged stalled before it answers.
    verdict, why = judge(proc.pid, flag.exists, busy_wait_s=60.0, stall_s=0.7)
    assert verdict is Liveness.ANSWERS, why
    assert proc.poll() is None


def test_proc_sample_reads_a_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    fields = ["S", *["0"] * 10, "120", "30", *["0"] * 30]
    (tmp_path / "7" / "stat").write_text(f"7 (a (b) c) {' '.join(fields)}\n")
    sample = proc_sample(7, tmp_path)
    assert sample is not None and sample.state == "S" and sample.cpu_ticks == 150
