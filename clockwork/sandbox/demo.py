"""The demo (`clockwork demo`): the product's three promises on the embedded cluster, told step by step.

Scene 1 (LinkPass): a 3-node gloo data-parallel training job submitted with sbatch, launched with srun, its loss
curve streamed to the terminal; halfway through, a NIC of one of its nodes goes dark (its switch port loses
carrier) and LinkPass moves the node's traffic to its other NIC: the job carries on, and the longest pause
between two of its steps is printed. Scene 2 (Fleet Lens): 3 % loss on one switch port; ``clockwork lens
suspects`` names that port within seconds, and clears it once the loss is gone. Scene 3 (TorchPass): the same
kind of job under TorchPass (``sbatch --clockwork-ft --clockwork-spares=standby``, 3 ranks and a standby node); a
node of the job crashes mid-training and the job carries on at the same step. Its final weights' hash is
printed beside the one of a fault-free run of the same training (``torchpass run --local``, started on the host
during scene 2): bit for bit the same.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from clockwork.contracts.config.core import SandboxConfig
from clockwork.contracts.errors import ClockworkError, SandboxError
from clockwork.sandbox.cluster import REPO_ROOT, Sandbox
from clockwork.sandbox.daemons import NodeDaemons

TRAIN_SCRIPT = REPO_ROOT / "examples" / "train_ddp.py"
TORCHPASS_SCRIPT = REPO_ROOT / "examples" / "train_torchpass.py"
# What scene 2 shows of the job's output: the loss lines, the failure and recovery events, the final hashes.
SCENE2_LINES = re.compile(r"^step \d+ loss|torchpass\.(member_failed|recovered)|final weights sha256|^torchpass: job")
HASH_LINE = re.compile(r"slot (\d+): final weights sha256 ([0-9a-f]{64})")
DARK_NODE, DARK_NIC = "node2", "nic0"  # scene 1: the NIC that goes dark (node2 trains in the 3-node job)
LOSSY_NODE, LOSSY_NIC, LOSS_PCT = "node3", "nic1", "3"  # scene 2


def _say(text: str = "") -> None:
    click.echo(text)


def _read_from(path: Path, pos: int) -> tuple[str, int]:
    """What a growing file holds past ``pos``, and the new position ('' while the file does not exist)."""
    if not path.exists():
        return "", pos
    with open(path) as f:
        f.seek(pos)
        return f.read(), f.tell()


class _DarkNic:
    """Scene 1's fault: a NIC of a training node goes dark mid-training; LinkPass moves its traffic.

    ``on_line`` sees every line of the job's output as it arrives; at the job's middle step it takes the NIC's
    switch port down, then watches LinkPass's failover count on that node and the time between step lines."""

    def __init__(self, box: Sandbox, daemons: NodeDaemons, at_step: int) -> None:
        self.box, self.daemons, self.at_step = box, daemons, at_step
        self.injected_at: float | None = None
        self.failovers_before = 0
        self.moved_ms: float | None = None
        self.before: list[float] = []  # step times (ms, as the job measured them) before the fault
        self.after: list[float] = []  # and from the fault on

    def on_line(self, line: str, now: float) -> None:
        match = re.match(r"step (\d+) loss \S+ \((\d+) ms\)", line)
        if match is None:
            return
        (self.before if self.injected_at is None else self.after).append(float(match.group(2)))
        if self.injected_at is None and int(match.group(1)) >= self.at_step:
            self.failovers_before = int(self.daemons.component(DARK_NODE, "linkpass").get("failovers", 0))
            self.box.fault("port", DARK_NODE, DARK_NIC, "down")
            self.injected_at = time.monotonic()
            _say(f"    >>> {DARK_NODE}'s {DARK_NIC} goes dark now (its switch port loses carrier); nobody is told")

    def poll(self) -> None:
        """While the NIC is dark: has LinkPass moved the traffic yet?"""
        if self.injected_at is None or self.moved_ms is not None:
            return
        if int(self.daemons.component(DARK_NODE, "linkpass").get("failovers", 0)) > self.failovers_before:
            self.moved_ms = 1000 * (time.monotonic() - self.injected_at)

    def report(self) -> None:
        if self.injected_at is None:
            raise ClockworkError("scene 1: the job ended before the NIC could go dark (give it more --steps)")
        deadline = time.monotonic() + 5.0  # a job that ended within a second of the fault: LinkPass may still act
        while self.moved_ms is None and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.02)
        self.box.fault("port", DARK_NODE, DARK_NIC, "up")
        if self.moved_ms is None or not self.after:
            raise ClockworkError(f"scene 1: LinkPass did not move {DARK_NODE}'s traffic off {DARK_NIC} in time")
        typical = sorted(self.before)[len(self.before) // 2] if self.before else 0.0
        _say(f"        LinkPass moved {DARK_NODE}'s traffic off {DARK_NIC} within {self.moved_ms:.0f} ms of the fault.")
        _say(
            f"        The job's slowest step from then on took {max(self.after):.0f} ms of work (a step takes "
            f"{typical:.0f} ms otherwise): the dark NIC cost it no more. {DARK_NIC} is back up now."
        )


def _follow(
    box: Sandbox, job_id: int, out: Path, timeout_s: float, watch: _DarkNic | None = None, poll_s: float = 0.3
) -> str:
    """Stream the job's output file while it runs; return the job's final state."""
    slurm = box.slurm()
    pos, deadline, state = 0, time.monotonic() + timeout_s, "PENDING"
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        state = info.state if info else "UNKNOWN"
        chunk, pos = _read_from(out, pos)
        now = time.monotonic()
        for line in chunk.splitlines():
            _say(f"    | {line}")
            if watch is not None:
                watch.on_line(line, now)
        if watch is not None:
            watch.poll()
        if info is None or info.finished:
            return state
        if info.restart_count > 0:
            slurm.cancel(job_id)
            raise SandboxError(
                f"demo job {job_id} failed to launch and Slurm requeued it; cancelled it "
                f"(see the slurmd logs in {box.paths.logs})"
            )
        time.sleep(poll_s)
    slurm.cancel(job_id)
    raise SandboxError(f"demo job {job_id} did not finish within {timeout_s:g} s (state {state}); cancelled it")


def _until(what: str, check: Any, timeout_s: float, interval_s: float = 0.25) -> float:
    """Seconds until ``check()`` holds; SandboxError naming ``what`` after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise SandboxError(f"demo: {what} did not happen within {timeout_s:g} s")
        time.sleep(interval_s)
    return time.monotonic() - start


def _lens_suspects(box: Sandbox, *, text: bool = False) -> Any:
    """``clockwork lens suspects`` as an admin runs it on the sandbox host (its JSON, or its table)."""
    env = {"CLOCKWORK_CONFIG": str(box.paths.clockwork_toml), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    argv = [sys.executable, "-m", "clockwork.cli.main", "lens", "suspects", *([] if text else ["--json"])]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30, check=True)
    return proc.stdout if text else json.loads(proc.stdout)


def _scene_lens(box: Sandbox, daemons: NodeDaemons) -> None:
    """Scene 2: Fleet Lens names a lossy switch port within seconds, and clears it when the loss is gone."""
    _say(f"\nStep 4. Fleet Lens: every daemon probes every peer on every rail. {LOSS_PCT} % loss on {LOSSY_NODE}'s")
    _say(f"        {LOSSY_NIC} switch port (clockwork sandbox fault loss {LOSSY_NODE} {LOSSY_NIC} {LOSS_PCT}):")
    _until("Fleet Lens learning every path's baseline", daemons.lens_ready, 90)
    _until("a fabric without suspects (scene 1's NIC is back)", lambda: not _lens_suspects(box), 60)
    box.fault("loss", LOSSY_NODE, LOSSY_NIC, LOSS_PCT)
    found: list[dict[str, Any]] = []

    def named() -> bool:
        found[:] = _lens_suspects(box)
        return bool(found)

    seconds = _until(f"a suspect for the loss on {LOSSY_NODE}/{LOSSY_NIC}", named, 60)
    _say(f"    $ clockwork lens suspects          # {seconds:.1f} s after the loss began")
    for line in _lens_suspects(box, text=True).rstrip().splitlines():
        _say(f"    | {line}")
    wrong = [s for s in found if s.get("nic") != f"{LOSSY_NODE}/{LOSSY_NIC}"]
    if wrong:
        raise ClockworkError(f"demo: Fleet Lens named {wrong} for a loss on {LOSSY_NODE}/{LOSSY_NIC} only")
    box.fault("loss", LOSSY_NODE, LOSSY_NIC, "0")
    cleared = _until("the suspect to clear", lambda: not _lens_suspects(box), 60)
    _say(f"        The loss is lifted; {cleared:.1f} s later `clockwork lens suspects` names nobody.")


def _start_reference(steps: int, folder: Path) -> subprocess.Popen[bytes]:
    """The fault-free run of scene 3's training, on this host (three local ranks), for its final hash."""
    cmd = [sys.executable, "-m", "torchpass", "run", "--local", "--nproc", "3", "--spares", "0"]
    cmd += ["--coordinator-file", str(folder / "coordinator"), str(TORCHPASS_SCRIPT), "--steps", str(steps)]
    with open(folder / "reference.out", "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=folder)


def _reference_hash(reference: subprocess.Popen[bytes], folder: Path) -> str:
    try:
        code = reference.wait(timeout=300)
    except subprocess.TimeoutExpired:
        reference.kill()
        raise ClockworkError(f"demo: the fault-free reference run did not finish; see {folder}") from None
    hashes = {h for _, h in HASH_LINE.findall((folder / "reference.out").read_text())}
    if code != 0 or len(hashes) != 1:
        raise ClockworkError(f"demo: the fault-free reference run failed (exit {code}); see {folder / 'reference.out'}")
    return hashes.pop()


def _scene_node_crash(box: Sandbox, steps: int, crash_at: int) -> str:
    """Scene 3: a TorchPass job loses a node mid-training and carries on at the same step; its final hash."""
    out = box.paths.root / "demo-ft-%j.out"
    cmd = f"{shlex.quote(sys.executable)} -m torchpass run {shlex.quote(str(TORCHPASS_SCRIPT))} --steps {steps}"
    options = ["-N4", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", "-J", "clockwork-demo-ft"]
    _say("\nStep 5. The same kind of job, fault tolerant: TorchPass keeps a standby node and moves a dead rank's")
    _say("        state to it from a healthy replica. Submitted with:")
    _say(f"        sbatch {' '.join(options[:4])} --wrap 'torchpass run examples/train_torchpass.py --steps {steps}'")
    export = f"--export=ALL,CLOCKWORK_CONFIG={box.paths.clockwork_toml}"  # as `eval "$(clockwork sandbox env)"`
    job_id = box.slurm().submit(cmd, [*options, export, "-o", str(out)])
    path = Path(str(out).replace("%j", str(job_id)))
    slurm, pos, crashed, victim = box.slurm(), 0, 0.0, "node3"
    hashes: set[str] = set()
    deadline = time.monotonic() + 300
    state = "PENDING"
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        state = info.state if info else "UNKNOWN"
        chunk, pos = _read_from(path, pos)
        for line in chunk.splitlines():
            hashes |= {h for _, h in HASH_LINE.findall(line)}
            if SCENE2_LINES.search(line):
                _say(f"    | {_short(line)}")
            if not crashed and (m := re.match(r"step (\d+) loss", line)) and int(m.group(1)) >= crash_at:
                box.crash_node(victim)
                crashed = time.monotonic()
                _say(f"    >>> {victim} crashes now: every process on it killed, both NICs dark (nobody is told)")
        if info is None or info.finished or (crashed and "COMPLETING" in state):
            break
        time.sleep(0.2)
    if crashed:
        box.restore_node(victim)
    while (info := slurm.job(job_id)) is not None and not info.finished and time.monotonic() < deadline:
        state = info.state
        time.sleep(0.3)
    exit_code = info.exit_code if info else "?"
    _say(f"\nStep 6. Job {job_id}: batch script exit {exit_code}; {victim} is back, empty.")
    if not crashed or not exit_code.startswith("0:") or len(hashes) != 1:
        raise ClockworkError(f"demo job {job_id} ended {state} (exit {exit_code}); see {path} and {box.paths.logs}")
    _say("        The dead node's rank was rebuilt on the standby node from a replica's state; training resumed at")
    _say("        the step it was on, and every rank ends with the same weights (the sha256 lines above).")
    return hashes.pop()


def _short(line: str) -> str:
    """An event line without the logger's prefix, for the demo's narration."""
    if "event torchpass." not in line:
        return line
    kind, _, fields = line.split("event ", 1)[1].partition(" ")
    try:
        data = json.loads(fields)
    except ValueError:
        return line
    keep = ("why", "slot", "reason", "step", "detect_ms", "total_ms", "slots")
    return f"{kind} " + ", ".join(f"{k} {data[k]}" for k in keep if k in data)


def run_demo(config: SandboxConfig, steps: int = 40, ft_steps: int = 300, keep: bool = False) -> None:
    """Run the demo on a fresh sandbox cluster built from ``config`` (4 nodes), then tear it down unless ``keep``.

    ``steps``: training steps of scene 1's job; ``ft_steps``: of the fault-tolerant job. What ``clockwork demo``
    runs (:mod:`clockwork.cli.demo_cmd`)."""
    box = Sandbox(config)
    if not TRAIN_SCRIPT.exists():
        raise SandboxError(f"{TRAIN_SCRIPT} is missing: run the demo from a checkout of the repository")
    _say("Clockwork demo: a real Slurm cluster on this machine, and a training job across it.\n")
    _say("Step 1. Build the sandbox: 4 nodes (network namespaces node1..node4), each with two NICs on two")
    _say("        rails and a stable node address; munge, slurmctld and one slurmd per node.")
    seconds = box.up(progress=lambda m: _say(f"    - {m}"))
    folder = Path(tempfile.mkdtemp(prefix="clockwork-demo-"))
    try:
        daemons = NodeDaemons(box)
        daemons.start_all()
        _say("    - clockworkd on every node: LinkPass (moves a dead NIC's traffic) and Fleet Lens (probes every path)")
        _say(f"        ready in {seconds:.1f} s.\n")
        for node in box.status()["nodes"]:
            nics = ", ".join(f"{n['nic']} {n['addr']}" for n in node["nics"])
            _say(f"    {node['name']}: node address {node['node_addr']}; {nics}; Slurm {node['slurm_state']}")
        out = box.paths.root / "demo-%j.out"
        cmd = f"srun {shlex.quote(sys.executable)} {shlex.quote(str(TRAIN_SCRIPT))} --steps {steps} --step-ms 50"
        _say("\nStep 2. Submit a data-parallel PyTorch job (gloo, one rank per node) with sbatch:")
        _say(f"        sbatch -N3 --ntasks-per-node=1 --wrap '{cmd}'")
        job_id = box.slurm().submit(cmd, ["-N3", "--ntasks-per-node=1", "-J", "clockwork-demo", "-o", str(out)])
        _say(f"        job {job_id} submitted; the ranks rendezvous on node1's node address. Output as it arrives:")
        t0 = time.monotonic()
        dark = _DarkNic(box, daemons, at_step=steps // 2)
        out_file = Path(str(out).replace("%j", str(job_id)))
        final = _follow(box, job_id, out_file, timeout_s=300, watch=dark, poll_s=0.05)
        _say(f"\nStep 3. Job {job_id} ended {final} after {time.monotonic() - t0:.1f} s.")
        if final != "COMPLETED":
            raise ClockworkError(f"demo job {job_id} ended {final}; see {box.paths.logs} and the output above")
        _say("        Every rank trained on its own node and address; the weights agree across ranks (sha256).")
        dark.report()
        reference = _start_reference(ft_steps, folder)  # runs on this host while Fleet Lens looks for the loss
        _scene_lens(box, daemons)
        faulted = _scene_node_crash(box, ft_steps, crash_at=ft_steps // 3)
        expected = _reference_hash(reference, folder)
        _say(f"        final weights sha256, node crash:  {faulted}")
        _say(f"        final weights sha256, no fault:    {expected}  (torchpass run --local, on this host)")
        if faulted != expected:
            raise ClockworkError("demo: the faulted job's weights differ from the fault-free run's")
        _say("        Bit for bit the same: the crash cost seconds, and no step was lost or done twice.")
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        if keep:
            _say(f"\nThe sandbox keeps running (state {box.paths.root}); stop it with `clockwork sandbox down`.")
        else:
            _say("\nStep 7. Tear down: stop every daemon, remove namespaces, bridges and veths.")
            box.down()
            _say("        done. Next: `clockwork sandbox up` to explore, `make test` for the test suite.")
