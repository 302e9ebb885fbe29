"""LinkPass on the sandbox: a clockwork training job rides through NIC faults with the fault-free result.

Each test runs the demo's gloo data-parallel job (examples/train_ddp.py, one rank on each of the 4 nodes,
traffic on the node addresses routed over rail 0) and injects a fault on nic0 of one node while it
trains: node-side link down, switch-side port down, a silent blackhole, a flapping link. With LinkPass
the job must complete with final weights bitwise equal to the same job run without any fault (no step
lost or repeated), and the faulted node's daemon must have told the job (``link.failover`` then
``link.failback`` in ``clockwork node events`` and in the job's report). Without LinkPass the same fault
must kill the job: the baseline LinkPass exists to beat.

These tests check correctness only; bench/linkpass_failover.py measures the stalls.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.instance_lock import running_pid
from clockwork.sandbox.cluster import REPO_ROOT, Sandbox
from clockwork.sandbox.processes import alive
from tests.conftest import until
from tests.integration.conftest import CLOCKWORK, daemon_paths, daemon_pid, slurm_env, wait_job

TRAIN = REPO_ROOT / "examples" / "train_ddp.py"
CLOCKWORKD = str(Path(sys.executable).parent / "clockworkd")

#: Steps of the first fault-free run, which also measures the step time (about 10-20 ms on 2 cores).
CALIBRATION_STEPS = 600
#: Training seconds a fault test needs: ~20 steps before the fault, 1.5 s of fault, ~1 s fail-back
#: hold-down (longer after recent flaps), and a margin so the job still runs when LinkPass fails back. A
#: blackhole's Lens suspect (a gray failure to LinkPass) can take 5 s to clear on a loaded machine, while the
#: healed path's delay and jitter statistics settle: 10 s keeps the job running past that.
FAULT_TRAINING_S = 10.0
HOLD_S = 1.5
FLAP_S = 10.0  # the issue asks 30 s; the benchmark does that, CI keeps it short
FLAP_PERIOD_S = 2.0
STEPS_BEFORE_FAULT = 20
COLLECTIVE_TIMEOUT_S = 20  # train_ddp --timeout with LinkPass: far longer than any failover
BASELINE_TIMEOUT_S = 10  # train_ddp --timeout without LinkPass
BASELINE_STEPS = 3000  # long enough that the baseline job cannot finish before its timeout fires

FAULTS = [
    pytest.param("link", "down", "up", id="link-down"),
    pytest.param("port", "down", "up", id="port-down"),
    pytest.param("blackhole", "on", "off", id="blackhole"),
]

_ports = itertools.count(29700)  # a fresh rendezvous port per job: no TIME_WAIT surprises


# ----------------------------------------------------------------------------------------------------------
# Node daemons with LinkPass on or off
# ----------------------------------------------------------------------------------------------------------


def node_names(box: Sandbox) -> list[str]:
    return [n.name for n in box.layout().nodes]


def daemon_status(box: Sandbox, node: str) -> dict[str, Any] | None:
    try:
        with DaemonClient(daemon_paths(box, node), timeout_s=2) as client:
            return client.status()
    except ClockworkError:
        return None


def linkpass_status(box: Sandbox, node: str) -> dict[str, Any]:
    """The ``linkpass`` section of the daemon's status ({} when it has none or does not answer)."""
    lp = (daemon_status(box, node) or {}).get("linkpass")
    return lp if isinstance(lp, dict) else {}


def stop_daemon(box: Sandbox, node: str) -> None:
    """SIGTERM the node's daemon (whoever started it) and wait until it is gone and its lock released."""
    paths = daemon_paths(box, node)
    pid = daemon_pid(box, node) or running_pid(paths.pid_file)
    if pid is None or pid <= 0:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (alive(pid) or running_pid(paths.pid_file) is not None):
        _reap()
        time.sleep(0.05)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        until(f"clockworkd on {node} to die", lambda: not alive(pid) and running_pid(paths.pid_file) is None, 10)


_daemons: list[subprocess.Popen[bytes]] = []


def _reap() -> None:
    for proc in _daemons:
        proc.poll()
    _daemons[:] = [p for p in _daemons if p.returncode is None]


def start_daemon(box: Sandbox, node: str, linkpass: bool) -> None:
    """Start one daemon on ``node`` (stopping any running one first) and wait until it answers."""
    stop_daemon(box, node)
    env = {**os.environ, "CLOCKWORK_LINKPASS_ENABLED": "true" if linkpass else "false"}
    argv = box.exec_argv(node, [CLOCKWORKD, "--config", str(box.paths.clockwork_toml)])
    log_file = box.paths.logs / f"clockworkd-{node}-linkpass-tests.log"
    with open(log_file, "ab") as sink:
        _daemons.append(
            subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        )
    until(f"clockworkd on {node} to answer (see {log_file})", lambda: daemon_pid(box, node) is not None, 20)


def start_daemons(box: Sandbox, linkpass: bool) -> None:
    for node in node_names(box):
        stop_daemon(box, node)
    for node in node_names(box):
        start_daemon(box, node, linkpass)


def linkpass_clean(lp: dict[str, Any], home: str = "nic0") -> bool:
    """LinkPass at its start state: enabled, NICs up, every path alive (no hold-down), every peer routed home."""
    if lp.get("enabled") is not True:
        return False
    nics = lp.get("nics", {})
    paths = lp.get("paths", {})
    routes = lp.get("routes", {})
    return (
        all(n.get("up") is True for n in nics.values())
        and all(state == "alive" for rails in paths.values() for state in rails.values())
        and all(list(rails) == [home] for rails in routes.values())
    )


def all_clean(box: Sandbox) -> bool:
    return all(linkpass_clean(linkpass_status(box, node)) for node in node_names(box))


@pytest.fixture(autouse=True)
def linkpass_daemons(sandbox: Sandbox) -> Sandbox:
    """Before each test: a daemon with LinkPass enabled on every node, with nothing failed over.

    The sandbox fixture has put every route back on nic0. A previous test's fault may still be in its
    hold-down (LinkPass would fail back later and post that into this test's job): wait a little for
    it, else restart the daemons, which then start clean.
    """
    for node in node_names(sandbox):
        if daemon_pid(sandbox, node) is None or linkpass_status(sandbox, node).get("enabled") is not True:
            start_daemon(sandbox, node, linkpass=True)
    for node in node_names(sandbox):
        lp = linkpass_status(sandbox, node)
        assert lp.get("enabled") is True, f"clockworkd on {node}: status()['linkpass'] = {lp!r}, LinkPass not enabled"
    deadline = time.monotonic() + 5
    while not all_clean(sandbox):
        if time.monotonic() > deadline:
            start_daemons(sandbox, linkpass=True)
            states = {n: linkpass_status(sandbox, n) for n in node_names(sandbox)}
            until(f"LinkPass to start clean on every node: {states}", lambda: all_clean(sandbox), 15, 0.1)
            break
        time.sleep(0.1)
    return sandbox


# ----------------------------------------------------------------------------------------------------------
# Training jobs
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TrainingJob:
    box: Sandbox
    job_id: int
    out: Path

    def text(self) -> str:
        try:
            return self.out.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def last_step(self) -> int:
        steps = re.findall(r"^step (\d+) loss", self.text(), re.MULTILINE)
        return int(steps[-1]) if steps else 0

    def sha(self) -> str | None:
        found = re.search(r"^final weights sha256 ([0-9a-f]{64})$", self.text(), re.MULTILINE)
        return found.group(1) if found else None

    def finished(self) -> bool:
        info = self.box.slurm().job(self.job_id)
        return info is None or info.finished

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def cancel(self) -> None:
        if not self.finished():
            self.box.slurm().cancel(self.job_id)
            try:
                wait_job(self.box, self.job_id, timeout_s=60)
            except AssertionError:
                pass


def submit_training(box: Sandbox, out: Path, steps: int, timeout_s: float) -> TrainingJob:
    """sbatch -N4 --ntasks-per-node=1 --clockwork-ft: the demo's training job, one rank per node."""
    cmd = f"srun {sys.executable} {TRAIN} --steps {steps} --timeout {timeout_s:g} --port {next(_ports)}"
    env = {k: v for k, v in slurm_env(box).items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    argv = ["sbatch", "--parsable", "-N4", "--ntasks-per-node=1", "--clockwork-ft", "-t", "3", "-o", str(out)]
    sub = subprocess.run(
        [*argv, "--wrap", cmd],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    return TrainingJob(box, int(sub.stdout.strip().split(";")[0]), out)


def wait_steps(job: TrainingJob, steps: int, timeout_s: float = 120) -> None:
    """Wait until rank 0 printed ``steps`` steps (the job is training across all nodes)."""
    deadline = time.monotonic() + timeout_s
    checked = 0.0
    while job.last_step() < steps:
        now = time.monotonic()
        assert now < deadline, f"job {job.job_id} printed no step {steps} within {timeout_s:g} s:\n{job.tail()}"
        if now - checked > 0.5:
            checked = now
            assert not job.finished(), f"job {job.job_id} ended before step {steps}:\n{job.tail()}"
        time.sleep(0.05)


@dataclass
class References:
    """Fault-free results, per step count, shared by the whole session (the job is deterministic)."""

    step_s: float | None = None
    shas: dict[int, str] = field(default_factory=dict)


@pytest.fixture(scope="session")
def references() -> Iterator[References]:
    yield References()


def reference_sha(box: Sandbox, refs: References, tmp: Path, steps: int) -> str:
    """The final weights hash of the job run without faults (run once per step count and session)."""
    if steps in refs.shas:
        return refs.shas[steps]
    job = submit_training(box, tmp / f"reference-{steps}.out", steps, COLLECTIVE_TIMEOUT_S)
    samples: list[tuple[float, int]] = []  # (when seen, last step) to measure the step time
    deadline = time.monotonic() + 240
    checked = 0.0
    while time.monotonic() < deadline:
        step = job.last_step()
        if step and (not samples or step != samples[-1][1]):
            samples.append((time.monotonic(), step))
        now = time.monotonic()
        if now - checked > 0.5:
            checked = now
            if job.finished():
                break
        time.sleep(0.05)
    state = wait_job(box, job.job_id, timeout_s=60)
    assert state == "COMPLETED", f"fault-free reference job {job.job_id} ended {state}:\n{job.tail()}"
    sha = job.sha()
    assert sha is not None, f"fault-free reference job printed no final hash:\n{job.tail()}"
    warm = [(t, s) for t, s in samples if s >= 10 and s < steps]
    if refs.step_s is None and len(warm) >= 2 and warm[-1][1] > warm[0][1]:
        refs.step_s = (warm[-1][0] - warm[0][0]) / (warm[-1][1] - warm[0][1])
    refs.shas[steps] = sha
    return sha


def steps_for(box: Sandbox, refs: References, tmp: Path, seconds: float) -> int:
    """Steps that keep the job training for about ``seconds`` (measured on the first fault-free run)."""
    if refs.step_s is None:
        reference_sha(box, refs, tmp, CALIBRATION_STEPS)
    step_s = refs.step_s or 0.02  # no usable samples (output arrived at once): assume a slow step
    if CALIBRATION_STEPS * step_s >= seconds:
        return CALIBRATION_STEPS
    return math.ceil(seconds / step_s / 100.0) * 100


# ----------------------------------------------------------------------------------------------------------
# Events
# ----------------------------------------------------------------------------------------------------------


def daemon_events(box: Sandbox, job_id: int, node: str) -> list[dict[str, Any]]:
    with DaemonClient(daemon_paths(box, node), timeout_s=5) as client:
        return client.job_events(job_id)


def cli_events(box: Sandbox, job_id: int, node: str) -> list[dict[str, Any]]:
    """`clockwork node events JOBID --node NODE --json`, as an admin reads them."""
    out = subprocess.run(
        [CLOCKWORK, "--config", str(box.paths.clockwork_toml), "node", "events", str(job_id), "--node", node, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    events = json.loads(out.stdout)
    assert isinstance(events, list)
    return events


def failovers_from(events: list[dict[str, Any]], nic: str) -> list[dict[str, Any]]:
    """``link.failover`` events that moved traffic off ``nic`` (field ``nic``: the NIC(s) left)."""
    return [
        e
        for e in events
        if e.get("kind") == "link.failover" and nic in str((e.get("fields") or {}).get("nic", "")).split(",")
    ]


def failbacks_to(events: list[dict[str, Any]], nic: str) -> list[dict[str, Any]]:
    """``link.failback`` events that moved traffic back onto ``nic`` (field ``via``: the NIC(s) used now)."""
    return [e for e in events if e.get("kind") == "link.failback" and (e.get("fields") or {}).get("via") == nic]


def wait_link_events(box: Sandbox, job_id: int, node: str, kinds: tuple[str, ...], timeout_s: float = 10) -> None:
    """Give the daemon a moment to record late events; the caller asserts on what is there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = {e.get("kind") for e in daemon_events(box, job_id, node)}
        if set(kinds) <= seen:
            return
        time.sleep(0.2)


def node_report(box: Sandbox, job_id: int, node: str, timeout_s: float = 30) -> dict[str, Any]:
    """The job's report written by ``node``'s Epilog."""
    path = daemon_paths(box, node).reports_dir / f"{job_id}.json"
    until(f"the Epilog of {node} to write {path}", path.exists, timeout_s, 0.2)
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def describe(events: list[dict[str, Any]]) -> str:
    return "; ".join(f"{e.get('kind')} {json.dumps(e.get('fields', {}), sort_keys=True)}" for e in events)


# ----------------------------------------------------------------------------------------------------------
# Faults
# ----------------------------------------------------------------------------------------------------------


def hold_fault(box: Sandbox, kind: str, node: str, on: str, off: str, seconds: float) -> None:
    box.fault(kind, node, "nic0", on)
    try:
        time.sleep(seconds)
    finally:
        box.fault(kind, node, "nic0", off)


def flap_link(box: Sandbox, node: str, seconds: float, period_s: float, stop: Callable[[], bool]) -> int:
    """nic0 of ``node`` down, up, down ... every ``period_s`` for ``seconds``; ends up; returns the downs."""
    t0 = time.monotonic()
    downs = 0
    try:
        for k in itertools.count():
            due = t0 + k * period_s
            if due >= t0 + seconds or stop():
                break
            time.sleep(max(0.0, due - time.monotonic()))
            box.fault("link", node, "nic0", "down" if k % 2 == 0 else "up")
            downs += k % 2 == 0
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
    finally:
        box.fault("link", node, "nic0", "up")
    return downs


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "on", "off"), FAULTS)
def test_training_job_survives_a_nic0_fault_with_the_fault_free_weights(
    sandbox: Sandbox, references: References, tmp_path: Path, kind: str, on: str, off: str
) -> None:
    steps = steps_for(sandbox, references, tmp_path, FAULT_TRAINING_S)
    expected = reference_sha(sandbox, references, tmp_path, steps)
    node = random.Random(f"linkpass-{kind}").choice(node_names(sandbox))

    job = submit_training(sandbox, tmp_path / f"train-{kind}.out", steps, COLLECTIVE_TIMEOUT_S)
    try:
        wait_steps(job, STEPS_BEFORE_FAULT)
        step_at_fault = job.last_step()
        hold_fault(sandbox, kind, node, on, off, HOLD_S)
        step_at_lift = job.last_step()
        state = wait_job(sandbox, job.job_id, timeout_s=180)
    finally:
        job.cancel()
    where = (
        f"{kind} {on} on {node}/nic0 from step {step_at_fault} for {HOLD_S:g} s (step {step_at_lift} at the "
        f"lift, {steps} steps in all)"
    )
    assert state == "COMPLETED", f"job {job.job_id} ended {state} after {where}:\n{job.tail()}"
    assert job.sha() == expected, f"weights differ from the fault-free run after {where}:\n{job.tail()}"

    wait_link_events(sandbox, job.job_id, node, ("link.failover", "link.failback"))
    events = cli_events(sandbox, job.job_id, node)
    failovers = failovers_from(events, "nic0")
    assert failovers, f"no link.failover off nic0 on {node} ({where}): {describe(events)}"
    assert failbacks_to(events, "nic0"), (
        f"no link.failback onto nic0 on {node} ({where}; did the job end before the hold-down?): " + describe(events)
    )
    fields = failovers[0]["fields"]
    assert {"nic", "reason", "via"} <= set(fields), f"link.failover lacks fields: {fields}"

    report = node_report(sandbox, job.job_id, node)
    kinds = [e.get("kind") for e in report.get("events", [])]
    assert "link.failover" in kinds and "link.failback" in kinds, f"report of {node}: {kinds}"
    assert report["counts"]["link failovers"] >= 1, report["counts"]


def test_training_job_survives_a_flapping_link(sandbox: Sandbox, references: References, tmp_path: Path) -> None:
    steps = steps_for(sandbox, references, tmp_path, FLAP_S + 4.0)
    expected = reference_sha(sandbox, references, tmp_path, steps)
    node = random.Random("linkpass-flap").choice(node_names(sandbox))

    job = submit_training(sandbox, tmp_path / "train-flap.out", steps, COLLECTIVE_TIMEOUT_S)
    try:
        wait_steps(job, STEPS_BEFORE_FAULT)
        downs = flap_link(sandbox, node, FLAP_S, FLAP_PERIOD_S, stop=job.finished)
        state = wait_job(sandbox, job.job_id, timeout_s=180)
    finally:
        job.cancel()
    where = f"nic0 of {node} flapping every {FLAP_PERIOD_S:g} s ({downs} downs)"
    assert state == "COMPLETED", f"job {job.job_id} ended {state} with {where}:\n{job.tail()}"
    assert job.sha() == expected, f"weights differ from the fault-free run with {where}:\n{job.tail()}"
    wait_link_events(sandbox, job.job_id, node, ("link.failover",))
    events = cli_events(sandbox, job.job_id, node)
    assert failovers_from(events, "nic0"), f"no link.failover off nic0 on {node} with {where}: " + describe(events)


def test_without_linkpass_the_same_fault_kills_the_job(sandbox: Sandbox, tmp_path: Path) -> None:
    """The baseline: LinkPass disabled, nic0 of node2 down for good; gloo times out and the job fails."""
    node = "node2"
    start_daemons(sandbox, linkpass=False)
    job: TrainingJob | None = None
    try:
        for name in node_names(sandbox):
            enabled = linkpass_status(sandbox, name).get("enabled")
            assert enabled in (False, None), f"clockworkd on {name} still runs LinkPass (enabled={enabled!r})"
        sandbox.clear_faults()  # routes back on rail 0, whatever the stopped LinkPass left
        job = submit_training(sandbox, tmp_path / "train-baseline.out", BASELINE_STEPS, BASELINE_TIMEOUT_S)
        wait_steps(job, STEPS_BEFORE_FAULT)
        step_at_fault = job.last_step()
        sandbox.fault("link", node, "nic0", "down")
        # The job is dead once it ended or a rank reported its collective's failure (train_ddp prints one
        # "error:" line per failed rank; srun may then wait for the other ranks' own timeouts): whichever
        # comes first. Still training long past its collective timeout is as dead as a failed job.
        try:
            until(
                "the job to end or a rank to report the collective's failure",
                lambda: "error:" in job.text() or job.finished(),
                BASELINE_TIMEOUT_S * 9,
                0.5,
            )
            info = sandbox.slurm().job(job.job_id)
            state = info.state if info is not None and info.finished else "FAILING"
        except AssertionError:
            state = "HUNG"
        text = job.text()
        detail = f"job {job.job_id}: {state}, step {step_at_fault} at the fault, {job.last_step()} last:\n{job.tail()}"
        assert state != "COMPLETED" and job.sha() is None, f"the job survived without LinkPass: {detail}"
        assert state in ("FAILED", "TIMEOUT", "HUNG", "CANCELLED", "NODE_FAIL") or "error:" in text, detail
    finally:
        if job is not None:
            job.cancel()
        sandbox.clear_faults()
        start_daemons(sandbox, linkpass=True)
