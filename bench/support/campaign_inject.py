"""Replaying the fault campaign's trace against a running job (``bench/fault_campaign.py``).

Each fault of :mod:`fault_trace` is applied where the real failure would act: on the sandbox through
:class:`SandboxFaults` (``Sandbox.crash_node``, the switch port, nftables loss, the GPU fault file, SIGSTOP of every
process in the node's namespace), or to a local job (checkpoint-restart, TorchFT outside Slurm) through
:class:`LocalFaults`, where only the faults a process can feel exist: a kill and a stop. Which process holds a
slot is read at the moment the fault fires from the ``pid-<slot>`` file the workload writes (a spare that took
the slot rewrote it). :func:`replay` times the trace from the job's first training step. No torch here.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from clockwork.sandbox import processes
from clockwork.sandbox.cluster import Sandbox
from support.fault_trace import Fault, FaultKind

log = logging.getLogger("bench.fault_campaign")

FLAP_CYCLES = 4
FLAP_HALF_S = 0.3
LOSS_PERCENT = "2"
GPU_HOT_C = "95"  # the emulated GPU's slowdown threshold is 90 C: a migration


def holder(out: Path, slot: int) -> tuple[int, str] | None:
    """(pid, Slurm node) of the process that holds ``slot`` now, from its ``pid-<slot>`` file; None before any."""
    path = out / f"pid-{slot}"
    try:
        pid, *node = path.read_text().split()
    except FileNotFoundError:
        return None
    return int(pid), (node[0] if node else "")


def first_step_at(out: Path) -> float | None:
    """When the job's first training step began (the earliest entry of any step log), or None before one."""
    firsts = []
    for path in out.glob("steps-*.log"):
        with open(path) as handle:
            line = handle.readline().split()
        if len(line) == 2:
            firsts.append(float(line[1]))
    return min(firsts) if firsts else None


@dataclass
class Applied:
    """One fault as it happened: the wall time it was applied (the step logs' clock), where, and a note."""

    fault: Fault
    at: float
    target: str
    note: str = ""


class Injector(Protocol):
    def apply(self, fault: Fault) -> Applied | None: ...


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class SandboxFaults:
    """Faults on the sandbox's real nodes. ``protected`` is the batch host: Slurm ends a job whose batch host
    dies, so a node crash aimed at it goes to the next slot's node instead (said in the note). Lasting faults are
    lifted from a thread of their own after their hold time; :meth:`crashed` lists the nodes to restore after
    the job."""

    box: Sandbox
    out: Path
    slots: int
    protected: str
    crashed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, fault: Fault) -> Applied | None:
        slot = fault.slot
        held = holder(self.out, slot)
        note = ""
        if fault.kind is FaultKind.NODE_CRASH:
            for k in range(self.slots):
                candidate = holder(self.out, (fault.slot + k) % self.slots)
                if candidate and candidate[1] != self.protected and candidate[1] not in self.crashed:
                    if k:
                        note = f"slot {fault.slot} is on the batch host: slot {(fault.slot + k) % self.slots}'s node"
                    held, slot = candidate, (fault.slot + k) % self.slots
                    break
            else:
                return None
        if held is None:
            return None
        pid, node = held
        at = time.time()
        kind = fault.kind
        if kind is FaultKind.NODE_CRASH:
            with self.lock:
                self.box.crash_node(node)
            self.crashed.append(node)
        elif kind is FaultKind.RANK_KILL:
            _signal_all({pid}, signal.SIGKILL)
        elif kind is FaultKind.NODE_STOP:
            pids = processes.netns_pids([self.box.layout().node(node).netns])
            at = time.time()  # finding the node's processes can take a while on a loaded machine
            _signal_all(pids, signal.SIGSTOP)
            self._later(fault.hold_s, lambda: _signal_all(pids, signal.SIGCONT))
        elif kind is FaultKind.NIC_DOWN:
            self._box_fault("port", node, "down")
            self._later(fault.hold_s, lambda: self._box_fault("port", node, "up"))
        elif kind is FaultKind.LINK_FLAP:
            threading.Thread(target=self._flap, args=(node,), daemon=True).start()
        elif kind is FaultKind.LOSS:
            self._box_fault("loss", node, LOSS_PERCENT)
            self._later(fault.hold_s, lambda: self._box_fault("loss", node, "0"))
        elif kind is FaultKind.GPU_WARNING:
            with self.lock:
                self.box.gpu_fault(node, "0", "temp", GPU_HOT_C)
            self._later(fault.hold_s, lambda: self._gpu_clear(node))
        else:
            return Applied(fault, at, node, "not applied: needs a borrow-mode job")
        return Applied(fault, at, f"slot {slot} on {node}", note)

    def _box_fault(self, kind: str, node: str, value: str) -> None:
        with self.lock:
            self.box.fault(kind, node, "nic0", value)

    def _gpu_clear(self, node: str) -> None:
        with self.lock:
            self.box.gpu_fault(node, "0", "clear", None)

    def _flap(self, node: str) -> None:
        for _ in range(FLAP_CYCLES):
            self._box_fault("port", node, "down")
            time.sleep(FLAP_HALF_S)
            self._box_fault("port", node, "up")
            time.sleep(FLAP_HALF_S)

    def _later(self, delay_s: float, action: Callable[[], None]) -> None:
        def run() -> None:
            time.sleep(delay_s)
            try:
                action()
            except Exception:  # a node crashed meanwhile: nothing left to lift
                log.exception("lifting a fault failed")

        threading.Thread(target=run, daemon=True).start()


@dataclass
class LocalFaults:
    """Faults on local processes (no Slurm, no NIC, no GPU): a node crash or a rank kill is a SIGKILL of the slot's
    process (one rank per node), a node stop a SIGSTOP of it for the hold time; the network and GPU faults have
    nothing to act on here and are recorded as not applied. ``pid_of`` gives the slot's current process as its
    launcher knows it (a rank still starting after a restart has written no pid file yet, but a crash kills it)."""

    pid_of: Callable[[int], int | None]

    def apply(self, fault: Fault) -> Applied | None:
        pid = self.pid_of(fault.slot)
        at = time.time()
        if pid is None:
            return Applied(fault, at, f"slot {fault.slot}", "not applied: no live process (the job is restarting)")
        if fault.kind in (FaultKind.NODE_CRASH, FaultKind.RANK_KILL):
            _signal_all({pid}, signal.SIGKILL)
        elif fault.kind is FaultKind.NODE_STOP:
            _signal_all({pid}, signal.SIGSTOP)
            threading.Timer(fault.hold_s, _signal_all, args=({pid}, signal.SIGCONT)).start()
        else:
            return Applied(fault, at, f"slot {fault.slot}", "not applied: no NIC or GPU outside the sandbox")
        return Applied(fault, at, f"slot {fault.slot} pid {pid}")


class Replay:
    """The trace replayed from a thread: it waits for the job's first step (``first_step_at``), then applies
    each fault at its offset from it, until the trace is done or ``stop`` is set (the job ended)."""

    def __init__(self, trace: list[Fault], out: Path, injector: Injector) -> None:
        self.trace = trace
        self.out = out
        self.injector = injector
        self.applied: list[Applied] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Replay:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        t0 = None
        while t0 is None:
            if self.stop.wait(0.05):
                return
            t0 = first_step_at(self.out)
        for fault in self.trace:
            if self.stop.wait(max(0.0, t0 + fault.at_s - time.time())):
                return
            try:
                applied = self.injector.apply(fault)
            except Exception:
                log.exception("applying %s failed", fault)
                continue
            if applied is not None:
                self.applied.append(applied)
