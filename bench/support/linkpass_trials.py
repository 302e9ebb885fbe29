"""One fault trial, the flap and the LinkPass-off baseline of ``bench/linkpass_failover.py``, on a running sandbox.

:class:`Bench` holds the node daemons and the all-reduce loop; each trial injects a fault on one NIC of one
node, lifts it, waits until the fabric is home again and reads the stalls from the ranks' step logs. A loop
that dies is counted as collective errors and restarted, so the later trials still run.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from clockwork.sandbox.cluster import Sandbox
from support.allreduce_ranks import Loop
from support.linkpass_fabric import Daemons, routes_on_rail0
from support.owned_processes import Procs
from support.step_stalls import typical_gap, window_stall

NODES = 4
WORLD = NODES
FAULTS = {"link": ("down", "up"), "port": ("down", "up"), "blackhole": ("on", "off")}
SETTLE_MARGIN_S = 0.3  # the fail-back window ends this long after routes were seen back home


def say(text: str = "") -> None:
    print(text, flush=True)


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
