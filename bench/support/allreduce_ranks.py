"""``examples/allreduce_loop.py`` on every sandbox node (one rank each) and the step logs it writes.

For ``bench/linkpass_failover.py``: the ranks run through ``Sandbox.exec_argv`` with a plain Popen (no Slurm, so
a trial is cheap); each logs ``STEP MONOTONIC_TIME`` per 1 MiB all-reduce, read here incrementally.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.processes import wait_until
from support.owned_processes import Procs, kill_groups
from support.step_stalls import parse_step_lines

LOOP = Path(__file__).resolve().parents[2] / "examples" / "allreduce_loop.py"
LOOP_PORT_BASE = 29600


def load_loop_module() -> ModuleType:
    """examples/allreduce_loop.py as a module (for expected_checksum; it imports torch only when run)."""
    spec = importlib.util.spec_from_file_location("allreduce_loop", LOOP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class RankLog:
    path: Path
    offset: int = 0
    tail: bytes = b""
    steps: list[tuple[int, float]] = field(default_factory=list)

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        data = self.tail + chunk
        cut = data.rfind(b"\n") + 1
        self.tail = data[cut:]
        self.steps += parse_step_lines(data[:cut].decode(errors="replace"))


class Loop:
    """One generation of examples/allreduce_loop.py, one rank per node."""

    generation = 0

    def __init__(self, box: Sandbox, procs: Procs, work: Path, tag: str, timeout_s: float) -> None:
        Loop.generation += 1
        self.box = box
        self.nodes = [n.name for n in box.layout().nodes]
        self.dir = work / f"loop-{Loop.generation:02d}-{tag}"
        self.dir.mkdir(parents=True)
        self.stop_file = self.dir / "stop"
        self.port = LOOP_PORT_BASE + Loop.generation
        self.logs = [RankLog(self.dir / f"steps.log.rank{r}") for r in range(len(self.nodes))]
        self.outs = [self.dir / f"out.rank{r}" for r in range(len(self.nodes))]
        self.exits: dict[int, tuple[int, float]] = {}  # rank -> (return code, when noticed)
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
        self.procs = []
        for rank, node in enumerate(self.nodes):
            argv = [
                sys.executable,
                str(LOOP),
                f"--rank={rank}",
                f"--world={len(self.nodes)}",
                f"--master={self.nodes[0]}",
                f"--port={self.port}",
                f"--log={self.dir / 'steps.log'}",
                f"--stop-file={self.stop_file}",
                f"--timeout={timeout_s:g}",
            ]
            self.procs.append(procs.start(box.exec_argv(node, argv), self.outs[rank], env))

    def poll(self) -> dict[int, tuple[int, float]]:
        """Ranks that exited so far (return code, time first seen)."""
        now = time.monotonic()
        for rank, proc in enumerate(self.procs):
            if rank not in self.exits and proc.poll() is not None:
                self.exits[rank] = (proc.returncode, now)
        return self.exits

    def read(self) -> list[list[float]]:
        for log in self.logs:
            log.read()
        return [[t for _, t in log.steps] for log in self.logs]

    def last_step(self) -> int:
        self.read()
        return min((log.steps[-1][0] if log.steps else 0) for log in self.logs)

    def wait_flowing(self, min_steps: int = 20, timeout_s: float = 120) -> None:
        def flowing() -> bool:
            if self.poll():
                raise RuntimeError(f"all-reduce loop exited while starting: {self.describe_exits()}")
            return self.last_step() >= min_steps

        wait_until(
            f"{min_steps} all-reduce steps on every rank (see {self.dir})", flowing, timeout_s=timeout_s, interval_s=0.1
        )

    def wait_steps_after(self, when: float, timeout_s: float) -> bool:
        """Wait until every rank logged a step after ``when``; False if that did not happen in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            times = self.read()
            if all(ts and ts[-1] > when for ts in times):
                return True
            if self.poll():
                return False
            time.sleep(0.05)
        return False

    def describe_exits(self) -> str:
        parts = []
        for rank, (rc, _) in sorted(self.exits.items()):
            text = self.outs[rank].read_text(errors="replace").strip().splitlines()
            parts.append(f"rank {rank} exit {rc}: {text[-1] if text else '(no output)'}")
        return "; ".join(parts)

    def stop(self, timeout_s: float = 60) -> list[str]:
        """Ask every rank to stop after the same step; return their final stdout lines."""
        self.stop_file.touch()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.poll()
        self.kill()
        lines = []
        for out in self.outs:
            text = out.read_text(errors="replace").strip().splitlines()
            lines.append(text[-1] if text else "")
        return lines

    def kill(self) -> None:
        kill_groups(self.procs)
