"""TorchPass in Slurm's native OCI containers (``srun --container``, crun) on the 24.11 sandbox: a node crash, bitwise.

The sandbox's oci.conf runs Debian's crun from the Slurm 24.11 root (clockwork/sandbox/oci.py). The job's bundle is
written by :func:`clockwork.sandbox.oci.write_bundle`: a read-only rootfs with a marker file, the host's /usr and
/etc, this checkout, the venv and its Python installation read-only (the "image's" TorchPass), and read-write the
job's folder and the node daemons' run folders, with Clockwork's configuration read-only. The batch script runs on
the node itself and starts ``torchpass run --container BUNDLE``: every node agent step is ``srun ... --container=
BUNDLE``, so the agents and their ranks run in the bundle.

* While the jobs run, every node agent and every rank seen is inside the container (its root shows the marker;
  the batch script's launcher, outside, does not), and the agents reached their node daemons through the mounted
  socket (the recovery is found by the daemons' node-silent verdict).
* 3 ranks and a standby node on 4 nodes (the batch host, node1, is last in agent order: the standby); slot 1's
  node crashes at a random step and point (``CW_TEST_SEED`` replays it), its rank moves to the standby node, and the
  job ends bitwise equal to the fault-free containerised run, each step committed once.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest

from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.oci import IMAGE_MARKER, Bind, python_binds, write_bundle
from tests.integration import sandbox_jobs as jobs
from tests.integration.conftest import SandboxManager
from tests.unit import test_torchpass_oracle as oracle

SLURM = "24.11"
NODES = 4  # the shape of test_slurm_2411_sandbox: one 24.11 sandbox for both modules
NPROC = 3
STEPS = 30
STEP_SLEEP_S = 0.08
JOB_TIMEOUT_S = 240
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
CRASH_PHASES = ("crashnode", "crashnode-backward", "crashnode-optimizer")
CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    sandbox = sandbox_manager.ensure_up(nodes=NODES, accounting=True, slurm=SLURM)
    sandbox.clear_faults()
    print(f"fault seed {SEED} (CW_TEST_SEED={SEED} replays the node crash)")
    return sandbox


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("oci")


@pytest.fixture(scope="module")
def bundle(box: Sandbox, base: Path) -> Path:
    binds = [
        *python_binds(CHECKOUT),
        Bind(str(base), writable=True),  # the jobs' folders: events, journals, final states, crash requests
        Bind(str(box.paths.root / "nodes"), writable=True),  # every node daemon's run folder (its control socket)
        Bind(str(box.paths.etc)),  # Clockwork's configuration (CLOCKWORK_CONFIG) and slurm.conf
    ]
    return write_bundle(base / "bundle", binds)


class Inside:
    """Which TorchPass processes on the nodes ran inside the bundle: agents (``TORCHPASS_AGENT_INDEX`` in their
    environment) and ranks (the rank script on their command line), by pid, and the launcher outside."""

    def __init__(self, script: Path) -> None:
        self.script = str(script).encode()
        self.agents: dict[int, bool] = {}
        self.ranks: dict[int, bool] = {}
        self.launchers: dict[int, bool] = {}
        self._next = 0.0

    def look(self) -> None:
        if time.monotonic() < self._next:  # a /proc walk a second is plenty (the jobs run ~10 s)
            return
        self._next = time.monotonic() + 1.0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                if b"python" not in Path(cmdline[0].decode(errors="replace")).name.encode():
                    continue  # srun, slurmstepd, crun and shells carry the same words on their command lines
                if b"torchpass" not in cmdline and self.script not in cmdline:
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
                inside = (entry / "root" / IMAGE_MARKER).exists()
            except OSError:  # ended meanwhile
                continue
            pid = int(entry.name)
            if self.script in cmdline and b"-m" not in cmdline:
                self.ranks[pid] = inside
            elif any(v.startswith(b"TORCHPASS_AGENT_INDEX=") for v in environ):
                self.agents[pid] = inside
            elif b"run" in cmdline and any(v.startswith(b"SLURM_JOB_ID=") for v in environ):
                self.launchers[pid] = inside


def _run(box: Sandbox, base: Path, bundle: Path, name: str, kill: str = "") -> tuple[oracle.Run, Inside]:
    out = base / name
    out.mkdir()
    env = jobs.job_env(box, out, kill=kill, step_sleep=STEP_SLEEP_S, CW_TEST_STEPS=str(STEPS))
    command = jobs.torchpass_command(out, oracle.SCRIPT, f"--container {bundle} --container-python {sys.executable}")
    options = [f"-N{NODES}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    job_id = jobs.submit(options, command, env)
    inside = Inside(oracle.SCRIPT)
    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, inside.look)
    run = oracle.Run(out, returncode, f"{output}\ncrashed: {crashed}", jobs.job_events(out))
    jobs.wait_gone(box, job_id)
    return run, inside


def _all_inside(run: oracle.Run, inside: Inside) -> None:
    assert len(inside.agents) >= NODES - 1 and all(inside.agents.values()), (inside.agents, run.output[-3000:])
    assert len(inside.ranks) >= NPROC and all(inside.ranks.values()), inside.ranks
    assert inside.launchers and not any(inside.launchers.values()), inside.launchers  # the batch script: outside
    assert f"--container={run.out.parent / 'bundle'}" in run.output  # the launcher said so


@pytest.fixture(scope="module")
def reference(box: Sandbox, base: Path, bundle: Path) -> oracle.Run:
    run, inside = _run(box, base, bundle, "reference")
    run.check_ok()
    _all_inside(run, inside)
    return run


def test_fault_free_job_runs_in_the_container(reference: oracle.Run) -> None:
    oracle._assert_each_step_once(reference, nproc=NPROC, steps=STEPS)
    assert not reference.of_kind("torchpass.recovered")


def test_node_crash_in_a_containerised_job_ends_bitwise_equal(
    box: Sandbox, base: Path, bundle: Path, reference: oracle.Run
) -> None:
    rng = random.Random(SEED)
    slot, step, phase = 1, rng.randint(8, 20), rng.choice(CRASH_PHASES)
    print(f"crash of slot {slot}'s node at step {step}, {phase}")
    run, inside = _run(box, base, bundle, "crash", kill=f"{slot}:{step}:{phase}")
    assert "crashed: ['node" in run.output, run.output[-3000:]
    run.check_ok()
    _all_inside(run, inside)
    oracle._assert_same_final_state(run, reference, nproc=NPROC, steps=STEPS)
    oracle._assert_each_step_once(run, nproc=NPROC, steps=STEPS)
    fields = oracle._recovered(run, slot)
    # The daemons' verdict reached the agents in the containers through the mounted control socket.
    assert "silent on every rail" in str(fields["reason"]), fields
