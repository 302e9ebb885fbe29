#!/usr/bin/env python3
"""Benchmark: how long a NIC fault stalls a 4-node all-reduce loop with LinkPass, and without it (baseline).

On a fresh 4-node sandbox of its own (root; it refuses to start while another sandbox owns the node
namespaces), it starts one node daemon per node with LinkPass enabled and ``examples/allreduce_loop.py`` on
every node (one rank each, plain Popen through ``Sandbox.exec_argv``: no Slurm, so a trial is cheap).
Each rank logs ``STEP MONOTONIC_TIME`` per 1 MiB all-reduce; a stall is the longest gap between two
consecutive steps.

Scenarios, each over ``--trials`` trials on a random node (seeded):
- link down / port down / blackhole on nic0 (the rail carrying the traffic): fault held ``--hold`` s
  (1.5), lifted, then at least ``--failback-wait`` s (2) and until traffic is home again. Reported: the
  longest stall while the fault was on (p50/p99/max), the longest stall that began after the lift
  (fail-back), and how long after the lift traffic was home again (the hold-down included).
- the same faults on nic1 (the idle rail), reported separately;
- flap: link down/up every 2 s for 30 s (``--quick``: 4 s) on nic0 of one node; the longest stall.
Before each trial it waits until every node routes its peers through nic0 again and every daemon's
LinkPass reports all NICs up, all paths alive and every peer routed home, so no trial starts half
failed over. Single-fault trials come every few seconds, far more often than LinkPass's flap window,
so they run with the hold-down fixed at its base value (``--damping`` keeps the doubling); the flap
scenario runs with the configured damping.
Then the baseline: daemons restarted with LinkPass disabled, the loop restarted with a 15 s collective
timeout, nic0 of one node down for 20 s; the outcome is a stall until the fault was lifted, or the
collective error that kills a real job.

Prints a table, the goals (link/port down p50 < 300 ms, p99 < 1 s; blackhole p99 < 1 s; fail-back p99
< 300 ms; zero collective errors), the baseline, the ratio baseline stall / LinkPass p99 stall, and as
its very last line one JSON object with every figure. The sandbox is always torn down.

    sudo .venv/bin/python bench/linkpass_failover.py [--trials 10] [--quick] [--seed 1] [--keep]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from clockworkd.client import DaemonClient
from clockworkd.config import load_config
from clockworkd.config.schema import SandboxConfig
from clockworkd.daemon_paths import DaemonPaths
from clockworkd.errors import ClockworkError
from clockworkd.instance_lock import running_pid
from clockworkd.sandbox.cluster import Sandbox
from clockworkd.sandbox.processes import alive

HERE = Path(__file__).resolve().parent
LOOP = HERE.parent / "examples" / "allreduce_loop.py"
NODES = 4
WORLD = NODES
FAULTS = {"link": ("down", "up"), "port": ("down", "up"), "blackhole": ("on", "off")}
SCENARIO_NAMES = {"link": "link down", "port": "port down", "blackhole": "blackhole"}
GOALS_MS = {"down_p50": 300.0, "down_p99": 1000.0, "blackhole_p99": 1000.0, "failback_p99": 300.0}
LOOP_PORT_BASE = 29600
SETTLE_MARGIN_S = 0.3  # the fail-back window ends this long after routes were seen back home


def load_loop_module() -> ModuleType:
    """examples/allreduce_loop.py as a module (for expected_checksum; it imports torch only when run)."""
    spec = importlib.util.spec_from_file_location("allreduce_loop", LOOP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def say(text: str = "") -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------------------------------------
# Figures from step logs (pure functions)
# --------------------------------------------------------------------------------------------------------


def parse_step_lines(text: str) -> list[tuple[int, float]]:
    """``STEP TIME`` lines -> [(step, time)]; a torn last line (no newline yet) is left for the next read."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out.append((int(parts[0]), float(parts[1])))
            except ValueError:
                continue
    return out


def window_stall(times: Sequence[float], start: float, end: float, now: float, *, overlap: bool = True) -> float:
    """The longest gap between consecutive step times that belongs to the window [start, end).

    ``overlap``: a gap belongs when it overlaps the window (the stall a fault caused, including the
    step interval it began in); otherwise only gaps that begin inside the window count (what happened
    after a fault was lifted). A stall still open at ``now`` (no step since the last one) counts up to
    ``now``.
    """
    best = 0.0
    for prev, nxt in itertools.pairwise(times):
        inside = (nxt > start and prev < end) if overlap else (start <= prev < end)
        if inside:
            best = max(best, nxt - prev)
    if times:
        last = times[-1]
        open_inside = last < end and (last > start or overlap)
        if open_inside and now > last:
            best = max(best, now - last)
    elif now > start:
        best = max(best, min(now, end) - start)
    return best


def typical_gap(times: Sequence[float], start: float, end: float) -> float | None:
    """Median gap between steps that completed in [start, end): the normal step time."""
    inside = [t for t in times if start <= t < end]
    gaps = [b - a for a, b in itertools.pairwise(inside)]
    return statistics.median(gaps) if gaps else None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isnan(seconds) else round(seconds * 1000.0, 1)


def fmt_ms(seconds: float | None) -> str:
    value = ms(seconds)
    return "-" if value is None else f"{value:.0f}"


# --------------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------------


class Procs:
    """Every Popen this run makes, so each one is killed at exit whatever happens."""

    def __init__(self) -> None:
        self.items: list[subprocess.Popen[bytes]] = []

    def start(self, argv: Sequence[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "ab") as sink:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        self.items.append(proc)
        return proc

    def reap(self) -> None:
        for proc in self.items:
            proc.poll()
        self.items = [p for p in self.items if p.returncode is None]

    def kill_all(self) -> None:
        for proc in self.items:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.items:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.items = []


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


# --------------------------------------------------------------------------------------------------------
# Node daemons
# --------------------------------------------------------------------------------------------------------


class Daemons:
    """One clockworkd per sandbox node, started and stopped by this harness."""

    def __init__(self, box: Sandbox, procs: Procs, log_dir: Path) -> None:
        self.box = box
        self.procs = procs
        self.log_dir = log_dir
        self.cfg = load_config(box.paths.clockwork_toml, env={}).config.daemon
        self.nodes = [n.name for n in box.layout().nodes]
        self.exe = str(Path(sys.executable).parent / "clockworkd")

    def paths(self, node: str) -> DaemonPaths:
        return DaemonPaths.from_config(self.cfg, node)

    def ping(self, node: str) -> int | None:
        try:
            with DaemonClient(self.paths(node), timeout_s=1) as client:
                return int(client.ping()["pid"])
        except ClockworkError:
            return None

    def status(self, node: str) -> dict[str, Any] | None:
        try:
            with DaemonClient(self.paths(node), timeout_s=2) as client:
                return client.status()
        except ClockworkError:
            return None

    def linkpass(self, node: str) -> dict[str, Any]:
        info = self.status(node) or {}
        lp = info.get("linkpass")
        return lp if isinstance(lp, dict) else {}

    def failovers(self, node: str) -> int | None:
        value = self.linkpass(node).get("failovers")
        return value if isinstance(value, int) else None

    def clean(self, node: str) -> bool:
        """LinkPass on ``node`` is back at its start: every NIC up, every path alive, every peer routed home."""
        return linkpass_clean(self.linkpass(node))

    def stop(self, node: str) -> None:
        paths = self.paths(node)
        pid = self.ping(node) or running_pid(paths.pid_file)
        if pid is None or pid <= 0:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (alive(pid) or running_pid(paths.pid_file) is not None):
            self.procs.reap()
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            wait_for(f"clockworkd on {node} to die", lambda: not alive(pid) and running_pid(paths.pid_file) is None, 10)

    def start_all(self, linkpass: bool, settings: dict[str, str] | None = None) -> None:
        """Stop whatever runs, start one daemon per node with LinkPass on or off, wait until all answer.

        ``settings``: extra ``[linkpass]`` settings (key -> value), given as CLOCKWORK_LINKPASS_KEY.
        """
        for node in self.nodes:
            self.stop(node)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCKWORK_LINKPASS_")}
        env["CLOCKWORK_LINKPASS_ENABLED"] = "true" if linkpass else "false"
        env.update({f"CLOCKWORK_LINKPASS_{k.upper()}": v for k, v in (settings or {}).items()})
        for node in self.nodes:
            argv = self.box.exec_argv(node, [self.exe, "--config", str(self.box.paths.clockwork_toml)])
            self.procs.start(argv, self.log_dir / f"clockworkd-{node}.log", env)
        for node in self.nodes:

            def answers(n: str = node) -> bool:
                return self.ping(n) is not None

            wait_for(f"clockworkd on {node} to answer (see {self.log_dir})", answers, 20)
        for node in self.nodes:
            lp = self.linkpass(node)
            wanted = (True,) if linkpass else (False, None)  # a disabled LinkPass may leave its section out
            if lp.get("enabled") not in wanted:
                raise RuntimeError(f"clockworkd on {node}: status()['linkpass'] = {lp!r}, wanted enabled={linkpass}")

    def stop_all(self) -> None:
        for node in self.nodes:
            self.stop(node)


# --------------------------------------------------------------------------------------------------------
# The all-reduce loop on every node
# --------------------------------------------------------------------------------------------------------


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

        wait_for(f"{min_steps} all-reduce steps on every rank (see {self.dir})", flowing, timeout_s, 0.1)

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
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass


# --------------------------------------------------------------------------------------------------------
# Fabric state
# --------------------------------------------------------------------------------------------------------


def routes_on_rail0(box: Sandbox) -> bool:
    """True when every node reaches every peer's node address through nic0 only (the state at start)."""
    layout = box.layout()
    addrs = {n.node_addr for n in layout.nodes}
    for node in layout.nodes:
        try:
            out = subprocess.run(
                ["ip", "-n", node.netns, "-j", "route", "show"], capture_output=True, text=True, timeout=5
            ).stdout
            routes = json.loads(out or "[]")
        except (subprocess.TimeoutExpired, ValueError):
            return False
        seen = set()
        for route in routes:
            dst = str(route.get("dst", "")).removesuffix("/32")
            if dst not in addrs or dst == node.node_addr:
                continue
            devs = [route.get("dev")] if route.get("dev") else [h.get("dev") for h in route.get("nexthops", [])]
            if not devs or any(d != "nic0" for d in devs):
                return False
            seen.add(dst)
        if seen != addrs - {node.node_addr}:
            return False
    return True


def linkpass_clean(lp: dict[str, Any], home: str = "nic0") -> bool:
    """A LinkPass status section at its start state: NICs up, paths alive (no hold-down), routes home.

    Fields a daemon does not report are not checked (an older daemon reports fewer).
    """
    if lp.get("enabled") is not True:
        return False
    nics = lp.get("nics")
    if isinstance(nics, dict) and not all(isinstance(v, dict) and v.get("up") is True for v in nics.values()):
        return False
    paths = lp.get("paths")
    if isinstance(paths, dict) and not all(
        isinstance(rails, dict) and all(state == "alive" for state in rails.values()) for rails in paths.values()
    ):
        return False
    routes = lp.get("routes")
    return not (isinstance(routes, dict) and not all(list(rails) == [home] for rails in routes.values()))


# --------------------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------------------


@dataclass
class Trial:
    kind: str
    node: str
    nic: str
    stall_s: float
    failback_stall_s: float
    step_s: float | None
    failovers: int | None  # LinkPass's failover counter on the faulted node went up by this much
    home_s: float | None  # seconds from the lift until routes and LinkPass were back at their start state
    open_stall: bool  # the loop had not stepped again when the trial was measured


@dataclass
class Bench:
    box: Sandbox
    procs: Procs
    work: Path
    rng: random.Random
    hold_s: float
    failback_s: float
    settle_timeout_s: float
    daemons: Daemons = field(init=False)
    loop: Loop | None = None
    collective_errors: int = 0
    error_lines: list[str] = field(default_factory=list)
    unsettled: int = 0
    checksums_ok: bool = True

    def __post_init__(self) -> None:
        self.daemons = Daemons(self.box, self.procs, self.work)

    @property
    def nodes(self) -> list[str]:
        return self.daemons.nodes

    def start_loop(self, tag: str, timeout_s: float) -> Loop:
        self.loop = Loop(self.box, self.procs, self.work, tag, timeout_s)
        self.loop.wait_flowing()
        return self.loop

    def healthy(self) -> bool:
        return routes_on_rail0(self.box) and all(self.daemons.clean(n) for n in self.nodes)

    def settle(self, timeout_s: float) -> float | None:
        """Wait until the fabric is back to its start state; seconds waited, None on timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.1)
        self.unsettled += 1
        say(f"  warning: routes/NICs not back on nic0 within {timeout_s:g} s; continuing")
        return None

    def check_loop(self) -> None:
        """Count a dead loop as collective errors and start a new one, so the next trials still run."""
        assert self.loop is not None
        exits = self.loop.poll()
        if not exits:
            return
        failed = [rank for rank, (rc, _) in exits.items() if rc != 0]
        self.collective_errors += len(failed)
        self.error_lines.append(self.loop.describe_exits())
        say(f"  COLLECTIVE ERROR: {self.loop.describe_exits()}")
        self.loop.kill()
        self.settle(self.settle_timeout_s)
        self.start_loop("restart", 30)

    def fault(self, kind: str, node: str, nic: str, value: str) -> None:
        self.box.fault(kind, node, nic, value)

    def trial(self, kind: str, node: str, nic: str) -> Trial:
        assert self.loop is not None
        on, off = FAULTS[kind]
        before = self.daemons.failovers(node)
        t_inject = time.monotonic()
        try:
            self.fault(kind, node, nic, on)
            time.sleep(max(0.0, self.hold_s - (time.monotonic() - t_inject)))
        finally:
            t_lift = time.monotonic()
            self.fault(kind, node, nic, off)
        time.sleep(self.failback_s)
        settled = self.settle(self.settle_timeout_s) is not None
        t_home = time.monotonic()  # traffic is back on nic0 (or we gave up waiting)
        t_end = t_home + SETTLE_MARGIN_S  # the fail-back window ends a little after it
        stepped = self.loop.wait_steps_after(t_end, 5.0)
        now = time.monotonic()
        times = self.loop.read()
        after = self.daemons.failovers(node)
        stall = max(window_stall(ts, t_inject, t_lift, now) for ts in times)
        failback = max(window_stall(ts, t_lift, t_end, now, overlap=False) for ts in times)
        step = typical_gap(times[0], t_inject - 1.0, t_inject)
        self.check_loop()
        return Trial(
            kind,
            node,
            nic,
            stall,
            failback,
            step,
            None if before is None or after is None else after - before,
            t_home - t_lift if settled else None,
            not stepped,
        )

    def flap(self, node: str, duration_s: float, period_s: float = 2.0) -> dict[str, Any]:
        assert self.loop is not None
        before = self.daemons.failovers(node)
        t0 = time.monotonic()
        toggles = 0
        try:
            while True:
                due = t0 + toggles * period_s
                if due >= t0 + duration_s:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                self.fault("link", node, "nic0", "down" if toggles % 2 == 0 else "up")
                toggles += 1
            time.sleep(max(0.0, t0 + duration_s - time.monotonic()))
        finally:
            t_lift = time.monotonic()
            self.fault("link", node, "nic0", "up")
        time.sleep(self.failback_s)
        settled = self.settle(self.settle_timeout_s) is not None
        t_home = time.monotonic()
        t_end = t_home + SETTLE_MARGIN_S
        stepped = self.loop.wait_steps_after(t_end, 5.0)
        now = time.monotonic()
        times = self.loop.read()
        after = self.daemons.failovers(node)
        result = {
            "node": node,
            "duration_s": duration_s,
            "downs": (toggles + 1) // 2,
            "stall_s": max(window_stall(ts, t0, t_lift, now) for ts in times),
            "failback_stall_s": max(window_stall(ts, t_lift, t_end, now, overlap=False) for ts in times),
            "failovers": None if before is None or after is None else after - before,
            "home_s": t_home - t_lift if settled else None,
            "open_stall": not stepped,
        }
        self.check_loop()
        return result

    def finish_loop(self, loop_module: ModuleType) -> None:
        """Stop the loop and check that every rank ended with the same, correct result."""
        assert self.loop is not None
        lines = self.loop.stop()
        results = set()
        for line in lines:
            parts = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p) if line.startswith("done ") else {}
            results.add((parts.get("steps"), parts.get("checksum")))
        steps, checksum = next(iter(results)) if len(results) == 1 else (None, None)
        ok = steps is not None and steps.isdigit() and checksum == loop_module.expected_checksum(int(steps), WORLD)
        if not ok:
            self.checksums_ok = False
            say(f"  WRONG OR MISSING RESULT at the end of the loop: {lines}")
        self.loop = None

    def baseline(self, hold_s: float, timeout_s: float) -> dict[str, Any]:
        """LinkPass off: the same link-down fault on nic0, held ``hold_s``, gloo timeout ``timeout_s``."""
        self.daemons.start_all(linkpass=False)
        self.box.clear_faults()  # routes back on rail 0 whatever the stopped daemons left
        loop = self.start_loop("baseline", timeout_s)
        node = self.rng.choice(self.nodes)
        t_inject = time.monotonic()
        error_at: float | None = None
        try:
            self.fault("link", node, "nic0", "down")
            while time.monotonic() - t_inject < hold_s:
                exits = loop.poll()
                if exits and error_at is None:
                    error_at = min(when for _, when in exits.values())
                time.sleep(0.05)
        finally:
            t_lift = time.monotonic()
            self.fault("link", node, "nic0", "up")
        self.box.clear_faults()  # admin-down deleted the routes through nic0, and nothing restores them now
        deadline = time.monotonic() + timeout_s + 15
        resumed = False
        while time.monotonic() < deadline:
            exits = loop.poll()
            if exits and error_at is None:
                error_at = min(when for _, when in exits.values())
            if len(exits) == len(loop.procs):
                break
            times = loop.read()
            if not exits and all(ts and ts[-1] > t_lift for ts in times):
                resumed = True
                break
            time.sleep(0.05)
        now = time.monotonic()
        times = loop.read()
        last_before = max((max((t for t in ts if t <= t_inject), default=t_inject) for ts in times), default=t_inject)
        failed = {r: rc for r, (rc, _) in loop.exits.items() if rc != 0}
        if error_at is not None:
            outcome = "collective error" if failed else "loop exited"
            stall = error_at - last_before
        elif resumed:
            outcome = "stalled until the fault was lifted"
            stall = max(window_stall(ts, t_inject, t_lift, now) for ts in times)
        else:
            outcome = "hung"
            stall = now - last_before
        result = {
            "node": node,
            "hold_s": hold_s,
            "collective_timeout_s": timeout_s,
            "outcome": outcome,
            "stall_s": stall,
            "error_after_s": None if error_at is None else error_at - t_inject,
            "failed_ranks": len(failed),
            "detail": loop.describe_exits() if loop.exits else "",
        }
        loop.kill()
        self.loop = None
        return result


def summarize(trials: list[Trial]) -> dict[str, Any]:
    stalls = [t.stall_s for t in trials]
    backs = [t.failback_stall_s for t in trials]
    steps = [t.step_s for t in trials if t.step_s is not None]
    failovers = [t.failovers for t in trials if t.failovers is not None]
    homes = [t.home_s for t in trials if t.home_s is not None]
    return {
        "trials": len(trials),
        "stall_p50_ms": ms(percentile(stalls, 50)),
        "stall_p99_ms": ms(percentile(stalls, 99)),
        "stall_max_ms": ms(max(stalls) if stalls else None),
        "failback_p50_ms": ms(percentile(backs, 50)),
        "failback_p99_ms": ms(percentile(backs, 99)),
        "home_again_p50_ms": ms(percentile(homes, 50)),
        "home_again_p99_ms": ms(percentile(homes, 99)),
        "step_ms": ms(statistics.median(steps) if steps else None),
        "failovers_counted": sum(failovers) if failovers else None,
        "open_stalls": sum(t.open_stall for t in trials),
        "nodes": [t.node for t in trials],
    }


def run_bench(args: argparse.Namespace, work: Path, procs: Procs) -> dict[str, Any]:
    loop_module = load_loop_module()
    rng = random.Random(args.seed)
    cfg = replace(SandboxConfig(), state_dir=str(work / "state"), nodes=NODES, accounting=False)
    box = Sandbox(cfg)
    say(f"building a {NODES}-node sandbox at {cfg.state_dir} ...")
    up_s = box.up()
    try:
        say(f"  up in {up_s:.1f} s")
        bench = Bench(box, procs, work, rng, args.hold, args.failback_wait, args.settle_timeout)
        # Trials come every few seconds, far more often than LinkPass's 60 s flap window: with its damping
        # on, the trials themselves would look like a flapping fabric and stretch every later fail-back.
        # So single-fault trials run with the hold-down fixed at its base value (unless --damping); the
        # flap scenario runs with the configured damping, as a site would.
        base_holddown = load_config(box.paths.clockwork_toml, env={}).config.linkpass.holddown_s
        single = {} if args.damping else {"holddown_max_s": f"{base_holddown:g}"}
        say(
            "starting one clockworkd per node (LinkPass enabled"
            + ("" if args.damping else f", hold-down fixed at {base_holddown:g} s for single-fault trials")
            + ")"
        )
        bench.daemons.start_all(linkpass=True, settings=single)
        bench.settle(args.settle_timeout)
        say("starting the all-reduce loop (1 MiB, gloo, one rank per node)")
        bench.start_loop("linkpass", args.timeout)

        scenarios: dict[str, list[Trial]] = {}
        for kind in FAULTS:
            for nic, count in (("nic0", args.trials), ("nic1", args.nic1_trials)):
                key = f"{kind}_{nic}"
                scenarios[key] = []
                for i in range(count):
                    node = rng.choice(bench.nodes)
                    t = bench.trial(kind, node, nic)
                    scenarios[key].append(t)
                    say(
                        f"  {SCENARIO_NAMES[kind]:<9} {nic} {node}  trial {i + 1:>2}/{count}: stall "
                        f"{fmt_ms(t.stall_s):>5} ms, fail-back stall {fmt_ms(t.failback_stall_s):>5} ms, "
                        f"failovers {t.failovers if t.failovers is not None else '?'}"
                        + (" (STALL STILL OPEN)" if t.open_stall else "")
                    )
        if single:
            say("restarting the daemons with the configured flap damping for the flap scenario")
            bench.settle(args.settle_timeout)  # routes home first: a starting LinkPass takes them as home
            bench.daemons.start_all(linkpass=True)
            bench.settle(args.settle_timeout)
        flap_node = rng.choice(bench.nodes)
        say(f"  flap: nic0 of {flap_node} down/up every 2 s for {args.flap:g} s ...")
        flap = bench.flap(flap_node, args.flap)
        say(
            f"  flap: longest stall {fmt_ms(flap['stall_s'])} ms, after it {fmt_ms(flap['failback_stall_s'])} ms, "
            f"failovers {flap['failovers'] if flap['failovers'] is not None else '?'}"
        )
        bench.finish_loop(loop_module)

        say(
            f"baseline: LinkPass disabled, nic0 down for {args.baseline_hold:g} s, "
            f"gloo timeout {args.baseline_timeout:g} s"
        )
        base = bench.baseline(args.baseline_hold, args.baseline_timeout)
        return report(args, scenarios, flap, base, bench)
    finally:
        procs.kill_all()
        say("tearing the sandbox down")
        box.down()


def report(
    args: argparse.Namespace,
    scenarios: dict[str, list[Trial]],
    flap: dict[str, Any],
    base: dict[str, Any],
    bench: Bench,
) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "nodes": NODES,
        "trials": args.trials,
        "seed": args.seed,
        "hold_s": args.hold,
        "single_fault_damping": bool(args.damping),
    }
    say()
    say(f"LinkPass failover, {NODES} nodes x 2 NICs, 1 MiB gloo all-reduce per step; stalls in ms")
    say(
        f"{'scenario':<22} {'n':>3} {'p50':>6} {'p99':>6} {'max':>6} {'fb p50':>7} {'fb p99':>7} "
        f"{'home p50':>9} {'step':>5} {'failovers':>9}"
    )
    summaries = {}
    for key, trials in scenarios.items():
        kind, nic = key.split("_")
        s = summarize(trials)
        summaries[key] = s
        label = f"{SCENARIO_NAMES[kind]} {nic}" + (" (idle)" if nic == "nic1" else "")
        say(
            f"{label:<22} {s['trials']:>3} {_f(s['stall_p50_ms']):>6} {_f(s['stall_p99_ms']):>6} "
            f"{_f(s['stall_max_ms']):>6} {_f(s['failback_p50_ms']):>7} {_f(s['failback_p99_ms']):>7} "
            f"{_f(s['home_again_p50_ms']):>9} {_f(s['step_ms']):>5} {_f(s['failovers_counted']):>9}"
        )
        for name, value in s.items():
            figures[f"{key}_{name}"] = value
    say(
        f"{'flap nic0 ' + str(int(args.flap)) + ' s':<22} {flap['downs']:>3} {'':>6} {'':>6} "
        f"{fmt_ms(flap['stall_s']):>6} {'':>7} {fmt_ms(flap['failback_stall_s']):>7} "
        f"{fmt_ms(flap['home_s']):>9} {'':>5} {_f(flap['failovers']):>9}   (n = downs; max = longest stall)"
    )
    figures.update(
        {
            "flap_duration_s": flap["duration_s"],
            "flap_downs": flap["downs"],
            "flap_stall_max_ms": ms(flap["stall_s"]),
            "flap_failback_stall_ms": ms(flap["failback_stall_s"]),
            "flap_failovers": flap["failovers"],
            "flap_home_again_ms": ms(flap["home_s"]),
            "collective_errors": bench.collective_errors,
            "checksums_ok": bench.checksums_ok,
            "unsettled_trials": bench.unsettled,
        }
    )
    say(
        f"collective errors with LinkPass: {bench.collective_errors} (must be 0); results correct: {bench.checksums_ok}"
    )
    if bench.error_lines:
        for line in bench.error_lines:
            say(f"  {line}")

    say(
        f"baseline without LinkPass (nic0 of {base['node']} down {base['hold_s']:g} s, gloo timeout "
        f"{base['collective_timeout_s']:g} s): {base['outcome']}, stall {base['stall_s']:.1f} s"
        + (f", error after {base['error_after_s']:.1f} s" if base["error_after_s"] is not None else "")
    )
    figures.update(
        {
            "baseline_outcome": base["outcome"],
            "baseline_stall_s": round(base["stall_s"], 2),
            "baseline_error_after_s": None if base["error_after_s"] is None else round(base["error_after_s"], 2),
            "baseline_failed_ranks": base["failed_ranks"],
            "baseline_hold_s": base["hold_s"],
            "baseline_timeout_s": base["collective_timeout_s"],
        }
    )
    lp99 = summaries["link_nic0"]["stall_p99_ms"]
    ratio = None if not lp99 else round(base["stall_s"] * 1000.0 / lp99, 1)
    figures["baseline_vs_linkpass_p99_ratio"] = ratio
    say(
        f"baseline stall / LinkPass p99 stall (link down nic0): {ratio}x"
        + (" (the baseline job died: its stall is a lower bound)" if base["error_after_s"] is not None else "")
    )

    goals = {
        "link_down_p50": _le(summaries["link_nic0"]["stall_p50_ms"], GOALS_MS["down_p50"]),
        "link_down_p99": _le(summaries["link_nic0"]["stall_p99_ms"], GOALS_MS["down_p99"]),
        "port_down_p50": _le(summaries["port_nic0"]["stall_p50_ms"], GOALS_MS["down_p50"]),
        "port_down_p99": _le(summaries["port_nic0"]["stall_p99_ms"], GOALS_MS["down_p99"]),
        "blackhole_p99": _le(summaries["blackhole_nic0"]["stall_p99_ms"], GOALS_MS["blackhole_p99"]),
        "failback_p99": all(_le(summaries[f"{k}_nic0"]["failback_p99_ms"], GOALS_MS["failback_p99"]) for k in FAULTS),
        "zero_collective_errors": bench.collective_errors == 0,
        "results_correct": bench.checksums_ok,
    }
    say("goals: " + ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in goals.items()))
    figures["goals"] = goals
    figures["goals_met"] = all(goals.values())
    return figures


def _le(value: float | None, limit: float) -> bool:
    return value is not None and value < limit


def _f(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10, help="trials per nic0 scenario (default 10)")
    parser.add_argument("--nic1-trials", type=int, default=None, help="trials per nic1 scenario (default trials/3)")
    parser.add_argument(
        "--quick", action="store_true", help="under a minute: 2 trials, none on nic1, a 4 s flap, an 8 s baseline"
    )
    parser.add_argument("--seed", type=int, default=1, help="random node choice (default 1)")
    parser.add_argument("--hold", type=float, default=1.5, help="seconds each fault is held (1.5)")
    parser.add_argument("--failback-wait", type=float, default=2.0, help="seconds after lifting it (2)")
    parser.add_argument(
        "--settle-timeout", type=float, default=40.0, help="max wait for traffic back home between trials (40)"
    )
    parser.add_argument(
        "--damping", action="store_true", help="keep LinkPass's flap damping on during single-fault trials too"
    )
    parser.add_argument("--flap", type=float, default=30.0, help="flap duration, s (30; --quick: 4)")
    parser.add_argument("--timeout", type=float, default=30.0, help="collective timeout with LinkPass, s (30)")
    parser.add_argument("--baseline-hold", type=float, default=20.0, help="baseline fault duration, s (20)")
    parser.add_argument("--baseline-timeout", type=float, default=15.0, help="baseline collective timeout (15)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs) even on success")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)
    if args.quick:
        args.trials = 2
        args.flap = min(args.flap, 4.0)
        args.baseline_hold = min(args.baseline_hold, 8.0)
        args.baseline_timeout = min(args.baseline_timeout, 5.0)
    if args.nic1_trials is None:
        args.nic1_trials = 0 if args.quick else max(1, args.trials // 3)
    if args.trials < 1 or args.nic1_trials < 0:
        parser.error("--trials must be >= 1 and --nic1-trials >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        say("linkpass_failover.py needs root: it builds a sandbox cluster (network namespaces, Slurm daemons)")
        return 77

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="cwlp-", dir="/tmp"))
    os.chmod(work, 0o755)
    procs = Procs()
    ok = False
    figures: dict[str, Any] = {}
    try:
        figures = run_bench(args, work, procs)
        ok = True
    finally:
        procs.kill_all()
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"logs kept in {work}")
    print(json.dumps(figures), flush=True)
    return 1 if args.strict and not figures["goals_met"] else 0


if __name__ == "__main__":
    sys.exit(main())
