"""``clockwork demo``: the product on the embedded cluster, told step by step for a newcomer.

Scene 1 (today): a 3-node gloo data-parallel training job submitted with sbatch, launched with
srun, its loss curve streamed to the terminal. Later scenes (link failure, rank failure) build on it.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import click

from clockworkd.cli.context import CliContext, pass_ctx
from clockworkd.errors import ClockworkError, SandboxError
from clockworkd.sandbox.cluster import REPO_ROOT, Sandbox

TRAIN_SCRIPT = REPO_ROOT / "examples" / "train_ddp.py"


def _say(text: str = "") -> None:
    click.echo(text)


def _follow(box: Sandbox, job_id: int, out: Path, timeout_s: float) -> str:
    """Stream the job's output file while it runs; return the job's final state."""
    slurm = box.slurm()
    pos, deadline, state = 0, time.monotonic() + timeout_s, "PENDING"
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        state = info.state if info else "UNKNOWN"
        if out.exists():
            with open(out) as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
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


@click.command()
@click.option("--steps", default=40, show_default=True, help="Training steps of the demo job.")
@click.option(
    "--keep", is_flag=True, help="Leave the sandbox running afterwards (stop it with `clockwork sandbox down`)."
)
@pass_ctx
def demo(state: CliContext, steps: int, keep: bool) -> None:
    """Run the demo on a fresh 3-node sandbox cluster, then tear it down."""
    state.set("sandbox.nodes", 3)
    box = Sandbox(state.load().config.sandbox)
    if not TRAIN_SCRIPT.exists():
        raise SandboxError(f"{TRAIN_SCRIPT} is missing: run the demo from a checkout of the repository")
    _say("Clockwork demo: a real Slurm cluster on this machine, and a training job across it.\n")
    _say("Step 1. Build the sandbox: 3 nodes (network namespaces node1..node3), each with two NICs on two")
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
    finally:
        if keep:
            _say(f"\nThe sandbox keeps running (state {box.paths.root}); stop it with `clockwork sandbox down`.")
        else:
            _say("\nStep 4. Tear down: stop every daemon, remove namespaces, bridges and veths.")
            box.down()
            _say("        done. Next: `clockwork sandbox up` to explore, `make test` for the test suite.")
