"""``clockwork demo``: the product on the embedded cluster, told step by step for a newcomer.

Scene 1: a 3-node gloo data-parallel training job submitted with sbatch, launched with srun, its loss curve
streamed to the terminal. Scene 2: the same kind of job under TorchPass (``sbatch --clockwork-ft
--clockwork-spares=standby``, 3 ranks and a standby node); a node of the job crashes mid-training and the job
carries on at the same step, its weights the same on every rank.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path

import click

from clockworkd.cli.context import CliContext, pass_ctx
from clockworkd.errors import ClockworkError, SandboxError
from clockworkd.sandbox.cluster import REPO_ROOT, Sandbox

TRAIN_SCRIPT = REPO_ROOT / "examples" / "train_ddp.py"
TORCHPASS_SCRIPT = REPO_ROOT / "examples" / "train_torchpass.py"
# What scene 2 shows of the job's output: the loss lines, the failure and recovery events, the final hashes.
SCENE2_LINES = re.compile(r"^step \d+ loss|torchpass\.(member_failed|recovered)|final weights sha256|^torchpass: job")


def _say(text: str = "") -> None:
    click.echo(text)


def _read_from(path: Path, pos: int) -> tuple[str, int]:
    """What a growing file holds past ``pos``, and the new position ('' while the file does not exist)."""
    if not path.exists():
        return "", pos
    with open(path) as f:
        f.seek(pos)
        return f.read(), f.tell()


def _follow(box: Sandbox, job_id: int, out: Path, timeout_s: float) -> str:
    """Stream the job's output file while it runs; return the job's final state."""
    slurm = box.slurm()
    pos, deadline, state = 0, time.monotonic() + timeout_s, "PENDING"
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        state = info.state if info else "UNKNOWN"
        chunk, pos = _read_from(out, pos)
        for line in chunk.splitlines():
            _say(f"    | {line}")
        if info is None or info.finished:
            return state
        if info.restart_count > 0:
            slurm.cancel(job_id)
            raise SandboxError(
                f"demo job {job_id} failed to launch and Slurm requeued it; cancelled it "
                f"(see the slurmd logs in {box.paths.logs})"
            )
        time.sleep(0.3)
    slurm.cancel(job_id)
    raise SandboxError(f"demo job {job_id} did not finish within {timeout_s:g} s (state {state}); cancelled it")


def _scene_node_crash(box: Sandbox, steps: int, crash_at: int) -> None:
    """Scene 2: a TorchPass job loses a node mid-training and carries on at the same step."""
    out = box.paths.root / "demo-ft-%j.out"
    cmd = f"{shlex.quote(sys.executable)} -m torchpass run {shlex.quote(str(TORCHPASS_SCRIPT))} --steps {steps}"
    options = ["-N4", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", "-J", "clockwork-demo-ft"]
    _say("\nStep 4. The same kind of job, fault tolerant: TorchPass keeps a standby node and moves a dead rank's")
    _say("        state to it from a healthy replica. Submitted with:")
    _say(f"        sbatch {' '.join(options[:4])} --wrap 'torchpass run examples/train_torchpass.py --steps {steps}'")
    export = f"--export=ALL,CLOCKWORK_CONFIG={box.paths.clockwork_toml}"  # as `eval "$(clockwork sandbox env)"`
    job_id = box.slurm().submit(cmd, [*options, export, "-o", str(out)])
    path = Path(str(out).replace("%j", str(job_id)))
    slurm, pos, crashed, victim = box.slurm(), 0, 0.0, "node3"
    deadline = time.monotonic() + 300
    state = "PENDING"
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        state = info.state if info else "UNKNOWN"
        chunk, pos = _read_from(path, pos)
        for line in chunk.splitlines():
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
    _say(f"\nStep 5. Job {job_id}: batch script exit {exit_code}; {victim} is back, empty.")
    if not crashed or not exit_code.startswith("0:"):
        raise ClockworkError(f"demo job {job_id} ended {state} (exit {exit_code}); see {path} and {box.paths.logs}")
    _say("        The dead node's rank was rebuilt on the standby node from a replica's state; training resumed at")
    _say("        the step it was on, and every rank ends with the same weights (the sha256 lines above).")


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


@click.command()
@click.option("--steps", default=40, show_default=True, help="Training steps of the demo job.")
@click.option("--ft-steps", default=300, show_default=True, help="Training steps of the fault-tolerant job.")
@click.option(
    "--keep", is_flag=True, help="Leave the sandbox running afterwards (stop it with `clockwork sandbox down`)."
)
@pass_ctx
def demo(state: CliContext, steps: int, ft_steps: int, keep: bool) -> None:
    """Run the demo on a fresh 4-node sandbox cluster, then tear it down."""
    state.set("sandbox.nodes", 4)
    box = Sandbox(state.load().config.sandbox)
    if not TRAIN_SCRIPT.exists():
        raise SandboxError(f"{TRAIN_SCRIPT} is missing: run the demo from a checkout of the repository")
    _say("Clockwork demo: a real Slurm cluster on this machine, and a training job across it.\n")
    _say("Step 1. Build the sandbox: 4 nodes (network namespaces node1..node4), each with two NICs on two")
    _say("        rails and a stable node address; munge, slurmctld and one slurmd per node.")
    seconds = box.up(progress=lambda m: _say(f"    - {m}"))
    try:
        _say(f"        ready in {seconds:.1f} s.\n")
        for node in box.status()["nodes"]:
            nics = ", ".join(f"{n['nic']} {n['addr']}" for n in node["nics"])
            _say(f"    {node['name']}: node address {node['node_addr']}; {nics}; Slurm {node['slurm_state']}")
        out = box.paths.root / "demo-%j.out"
        cmd = f"srun {shlex.quote(sys.executable)} {shlex.quote(str(TRAIN_SCRIPT))} --steps {steps}"
        _say("\nStep 2. Submit a data-parallel PyTorch job (gloo, one rank per node) with sbatch:")
        _say(f"        sbatch -N3 --ntasks-per-node=1 --wrap '{cmd}'")
        job_id = box.slurm().submit(cmd, ["-N3", "--ntasks-per-node=1", "-J", "clockwork-demo", "-o", str(out)])
        _say(f"        job {job_id} submitted; the ranks rendezvous on node1's node address. Output as it arrives:")
        t0 = time.monotonic()
        final = _follow(box, job_id, Path(str(out).replace("%j", str(job_id))), timeout_s=300)
        _say(f"\nStep 3. Job {job_id} ended {final} after {time.monotonic() - t0:.1f} s.")
        if final != "COMPLETED":
            raise ClockworkError(f"demo job {job_id} ended {final}; see {box.paths.logs} and the output above")
        _say("        Every rank trained on its own node and address; the weights agree across ranks (sha256).")
        _scene_node_crash(box, ft_steps, crash_at=ft_steps // 3)
    finally:
        if keep:
            _say(f"\nThe sandbox keeps running (state {box.paths.root}); stop it with `clockwork sandbox down`.")
        else:
            _say("\nStep 6. Tear down: stop every daemon, remove namespaces, bridges and veths.")
            box.down()
            _say("        done. Next: `clockwork sandbox up` to explore, `make test` for the test suite.")
