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
* The same crash with no standby node: 3 ranks on node1-3 (partition high, ``--clockwork-spares=borrow``) while a
  preemptible job of partition low holds node4. The spare is borrowed from it: the guest step that the leading
  agent starts (from inside its container) in the holder's allocation on node4 runs the replacement rank in the
  bundle too, and the job ends bitwise equal to the fault-free containerised run.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.oci import IMAGE_MARKER, Bind, python_binds, write_bundle
from tests.conftest import until
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
        # Slurm's client as the image must carry it for TorchPass's own srun/scontrol inside (a borrowed node's
        # guest step, a requeue): the release's plugins (slurm.conf's PluginDir) and munge's socket.
        Bind(str(box.slurm_release().root)),
        Bind(str(box.paths.munge)),
    ]
    return write_bundle(base / "bundle", binds)


class Inside:
    """Which TorchPass processes of the job writing to ``out`` ran inside the bundle: agents
    (``TORCHPASS_AGENT_INDEX`` in their environment) and ranks (the rank script on their command line), by pid,
    and the launcher outside. Only this job's (``CW_TEST_DIR=out`` in their environment, the guest's too): the
    other pytest worker's sandbox jobs run TorchPass agents on this machine at the same time."""

    def __init__(self, script: Path, out: Path) -> None:
        self.script = str(script).encode()
        self.mine = f"CW_TEST_DIR={out}".encode()
        self.agents: dict[int, bool] = {}
        self.ranks: dict[int, bool] = {}
        self.rank_nodes: dict[int, str] = {}  # pid -> SLURMD_NODENAME
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
                cmdline = [arg for arg in (entry / "cmdline").read_bytes().split(b"\0") if arg]
                if not cmdline:  # a zombie
                    continue
                if len(cmdline) == 1:  # a process the zygote forked: its title, "python SCRIPT ARGS" in one string
                    cmdline = cmdline[0].split(b" ")
                if b"python" not in Path(cmdline[0].decode(errors="replace")).name.encode():
                    continue  # srun, slurmstepd, crun and shells carry the same words on their command lines
                if b"torchpass" not in cmdline and self.script not in cmdline:
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
                inside = (entry / "root" / IMAGE_MARKER).exists()
            except OSError:  # ended meanwhile
                continue
            if self.mine not in environ:
                continue  # another job's
            pid = int(entry.name)
            if self.script in cmdline and b"-m" not in cmdline:
                self.ranks[pid] = inside
                node = [v for v in environ if v.startswith(b"SLURMD_NODENAME=")]
                self.rank_nodes[pid] = node[0].split(b"=", 1)[1].decode() if node else "?"
            elif any(v.startswith(b"TORCHPASS_AGENT_INDEX=") for v in environ):
                self.agents[pid] = inside
            elif b"run" in cmdline and any(v.startswith(b"SLURM_JOB_ID=") for v in environ):
                self.launchers[pid] = inside


STANDBY = [f"-N{NODES}", "--clockwork-spares=standby"]
BORROW = [f"-N{NPROC}", "-w", "node[1-3]", "-p", "high", "--clockwork-spares=borrow"]  # node4: the low job's


def _run(
    box: Sandbox,
    base: Path,
    bundle: Path,
    name: str,
    kill: str = "",
    spares: list[str] = STANDBY,
    before_gone: Callable[[], None] = lambda: None,
) -> tuple[oracle.Run, Inside]:
    out = base / name
    out.mkdir()
    env = jobs.job_env(box, out, kill=kill, step_sleep=STEP_SLEEP_S, CW_TEST_STEPS=str(STEPS))
    command = jobs.torchpass_command(out, oracle.SCRIPT, f"--container {bundle} --container-python {sys.executable}")
    options = [*spares, "--no-kill", "--clockwork-ft", f"--output={out}/job.out"]
    job_id = jobs.submit(options, command, env)
    inside = Inside(oracle.SCRIPT, out)
    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, inside.look)
    run = oracle.Run(out, returncode, f"{output}\ncrashed: {crashed}", jobs.job_events(out))
    before_gone()  # e.g. cancel other work that holds a node
    jobs.wait_gone(box, job_id)
    return run, inside


def _all_inside(run: oracle.Run, inside: Inside, agents: int = NODES - 1) -> None:
    assert len(inside.agents) >= agents and all(inside.agents.values()), (inside.agents, run.output[-3000:])
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


def test_a_borrowed_nodes_replacement_rank_runs_in_the_container(
    box: Sandbox, base: Path, bundle: Path, reference: oracle.Run
) -> None:
    low_out = base / "low.out"
    low = jobs.submit(
        ["-p", "low", "--requeue", "-N1", "-w", "node4", "-J", "low-work", f"--output={low_out}"],
        "echo started; exec sleep 3600",
        jobs.job_env(box, base, kill="", step_sleep=0),
    )
    until(f"low job {low} to start", lambda: low_out.exists() and "started" in low_out.read_text(), 60)
    rng = random.Random(SEED + 1)
    slot, step, phase = 1, rng.randint(8, 20), rng.choice(CRASH_PHASES)
    print(f"crash of slot {slot}'s node at step {step}, {phase}; the spare is borrowed from job {low}")

    def cancel_low() -> None:  # the low job runs again on node4 once the borrowed node is given back
        box.slurm().cancel(low)

    try:
        run, inside = _run(
            box, base, bundle, "borrow-crash", kill=f"{slot}:{step}:{phase}", spares=BORROW, before_gone=cancel_low
        )
    finally:
        cancel_low()
    assert "crashed: ['node3']" in run.output, run.output[-3000:]  # slot 1's (node1, the batch host, is last)
    run.check_ok()
    (borrowed,) = run.of_kind("torchpass.borrowed")
    assert (borrowed["node"], borrowed["from_job"]) == ("node4", low), borrowed
    _all_inside(run, inside, agents=NPROC - 1)
    on_node4 = [pid for pid, node in inside.rank_nodes.items() if node == "node4"]
    assert on_node4 and all(inside.ranks[pid] for pid in on_node4), (inside.rank_nodes, inside.ranks)
    oracle._assert_same_final_state(run, reference, nproc=NPROC, steps=STEPS)
    oracle._assert_each_step_once(run, nproc=NPROC, steps=STEPS)
    oracle._recovered(run, slot)
