"""A TorchPass job trains on after Slurm declares its crashed node down (SlurmdTimeout after the crash).

Found by the fault campaign's soak (``bench/fault_campaign.py --soak``): five minutes after a node crash that
TorchPass had repaired in 0.2 s, slurmctld declared the node down, ended the node's agent step, and that srun
exited 0; the batch launcher took the 0 for the job's verdict and cancelled every live agent 15 s later. On a
real cluster every node crash reaches that point (SlurmdTimeout is 300 s by default), so every job that outlived
a crash by five minutes was killed.

Here the sandbox's SlurmdTimeout is 12 s. The oracle's training (4 ranks on 4 nodes and a standby node, as in
test_torchpass_sandbox.py) crashes slot 1's node at a random step, then holds every slot at a later step until
Slurm has declared the node down and the launcher has said the step's end is not the job's verdict; released,
the job must end by itself with every step committed once on every slot.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from clockwork.sandbox.cluster import Sandbox
from tests.integration import sandbox_jobs as jobs
from tests.integration.conftest import SandboxManager
from tests.unit import test_torchpass_oracle as oracle

NODES = 5
NPROC = 4
STEPS = 40
HOLD_STEP = 30
SLURMD_TIMEOUT_S = 12
JOB_TIMEOUT_S = 300
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
NOT_THE_VERDICT = "lost before its step ended: not the job's verdict"


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    sandbox = sandbox_manager.ensure_up(nodes=NODES, accounting=False, lens=False, slurmd_timeout_s=SLURMD_TIMEOUT_S)
    sandbox.clear_faults()
    print(f"fault seed {SEED} (CW_TEST_SEED={SEED} replays the crash's step)")
    return sandbox


def test_a_job_trains_on_after_slurm_declares_its_crashed_node_down(box: Sandbox, tmp_path: Path) -> None:
    out = tmp_path / "node-down"
    out.mkdir()
    step = random.Random(SEED).randint(5, 20)
    release = out / "release"
    env = jobs.job_env(
        box, out, kill=f"1:{step}:crashnode", step_sleep=0.05, CW_TEST_STEPS=str(STEPS),
        CW_TEST_HOLD=f"{HOLD_STEP}:{release}",
    )  # fmt: skip
    options = [f"-N{NODES}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    job_id = jobs.submit(options, jobs.torchpass_command(out, oracle.SCRIPT), env)
    slurm = box.slurm()
    seen = {"down": False}
    next_query = 0.0

    def release_once_slurm_ended_the_lost_step() -> None:
        nonlocal next_query
        requests = sorted(out.glob("crash-request-*"))
        if release.exists() or not requests or time.monotonic() < next_query:
            return
        next_query = time.monotonic() + 0.5  # a Slurm query is a process: twice a second is plenty
        crashed = requests[0].read_text().split()[0]
        seen["down"] = seen["down"] or any(n.name == crashed and n.base_state == "DOWN" for n in slurm.nodes())
        log = (out / "job.out").read_text() if (out / "job.out").exists() else ""
        if seen["down"] and NOT_THE_VERDICT in log:
            release.touch()

    tick = release_once_slurm_ended_the_lost_step
    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, tick)
    run = oracle.Run(out, returncode, f"{output}\ncrashed: {crashed}", jobs.job_events(out))
    jobs.wait_gone(box, job_id)
    assert seen["down"], f"Slurm never declared the crashed node down:\n{output[-4000:]}"
    assert release.exists(), f"the launcher never set the lost node's step end aside:\n{output[-4000:]}"
    run.check_ok()
    assert "the job ended 15 s ago" not in output, output[-4000:]  # no live agent was cancelled
    oracle._assert_each_step_once(run, nproc=NPROC, steps=STEPS)
    oracle._recovered(run, 1)
