"""Move before it breaks: a hot GPU on the sandbox has its rank migrated live to the standby spare.

The job is the TorchPass oracle's deterministic training (as in ``test_torchpass_sandbox.py``): 4 ranks on
node1..node4 and a standby spare on node5, ``sbatch -N5 --no-kill --clockwork-ft --clockwork-spares=standby``.
The sandbox's daemons read their GPUs from fault files (``[health] source = "fault-file"`` in the sandbox's
clockwork.toml). Once training is under way, ``clockwork sandbox fault gpu node2 0 temp 95`` heats node2's gpu0
(emulated slowdown threshold 90 C): node2's daemon raises ``temperature.slowdown``, finds the rank on that GPU
(local rank 0: TorchPass's one rank per node) and asks the job's coordinator for a planned migration. Nothing
fails: the rank hands its live state to the spare at a step boundary and exits, the job continues at the next
step, and its final weights are bitwise equal to the fault-free run's. node2's daemon recorded the
``gpu.health`` and ``gpu.migration`` events naming the signal, its value and its threshold.

Needs root and Slurm (the sandbox). Not run by default: ``sudo -E env PATH=$PATH .venv/bin/python -m pytest
tests/integration/test_gpu_health_sandbox.py -v`` (``CW_TEST_SEED`` replays the fault step).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from clockwork.contracts.daemon_client import DaemonClient
from clockwork.sandbox.cluster import Sandbox
from tests.integration import sandbox_jobs as jobs
from tests.integration.conftest import CLOCKWORK, daemon_paths, slurm_env
from tests.integration.test_torchpass_sandbox import (
    JOB_TIMEOUT_S,
    NODES,
    SEED,
    STEPS,
    _check,
    _committed,
    base,
    box,
    reference,
)
from tests.unit import test_torchpass_oracle as oracle

__all__ = ["base", "box", "reference"]  # fixtures used by name below

HOT_NODE = "node2"
STEP_SLEEP_S = 0.15  # ~9 s of training: detection (2 readings at 0.5 s) and the handoff land mid-job


def _clockwork(box: Sandbox, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLOCKWORK, "sandbox", "--state", str(box.paths.root), *argv],
        env=slurm_env(box),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _node_events(box: Sandbox, node: str, job_id: int) -> list[dict[str, Any]]:
    with DaemonClient(daemon_paths(box, node), timeout_s=5) as client:
        return client.job_events(job_id)


def _run_with_hot_gpu(box: Sandbox, base: Path, name: str, fault_step: int) -> tuple[oracle.Run, int, dict[str, Any]]:
    """Submit the job, heat node2's gpu0 once slot 0 committed ``fault_step``, wait for the job's end."""
    out = base / name
    out.mkdir()
    env = dict(
        slurm_env(box),
        CW_TEST_DIR=str(out),
        CW_TEST_KILL="",
        CW_TEST_STEPS=str(STEPS),
        CW_TEST_STEP_SLEEP=str(STEP_SLEEP_S),
        OMP_NUM_THREADS="1",
        CLOCKWORK_CONFIG=str(box.paths.clockwork_toml),
    )
    command = (
        f"{sys.executable} -m torchpass run --events {out}/events-{{agent}}.jsonl --set collective_timeout_s=20 "
        f"{oracle.SCRIPT}"
    )
    options = [f"-N{NODES}", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", f"--output={out}/job.out"]
    submit = subprocess.run(
        ["sbatch", "--parsable", *options, f"--wrap={command}"], env=env, capture_output=True, text=True, check=True
    )
    job_id = int(submit.stdout.strip().split(";")[0])
    slurm = box.slurm()
    heated = ""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    info = slurm.job(job_id)
    next_query = time.monotonic()
    try:
        while time.monotonic() < deadline:
            if not heated and _committed(out, 0) >= fault_step:
                proc = _clockwork(box, "fault", "gpu", HOT_NODE, "0", "temp", "95")
                heated = f"rc {proc.returncode}: {proc.stdout}{proc.stderr}"
                assert proc.returncode == 0, heated
            if time.monotonic() >= next_query:  # a squeue round trip: twice a second (jobs.SLURM_POLL_S)
                next_query = time.monotonic() + jobs.SLURM_POLL_S
                info = slurm.job(job_id)
                if info is not None and info.finished:
                    break
            time.sleep(0.05)
    finally:
        try:  # what node2's daemon thinks of its GPU after the job, before the GPU is healed
            gpus = _gpus(box, HOT_NODE)
        except Exception as exc:
            gpus = {"error": str(exc)}
        healed = _clockwork(box, "fault", "gpu", HOT_NODE, "0", "clear")
        assert healed.returncode == 0, healed.stderr
    output = (out / "job.out").read_text() if (out / "job.out").exists() else ""
    assert info is not None and info.finished, f"job {job_id}: {info}\n{output[-6000:]}"
    returncode = int(info.exit_code.split(":")[0]) if info.exit_code else -1
    run = oracle.Run(out, returncode, f"{output}\nheated: {heated}", jobs.job_events(out))
    jobs.wait_gone(box, job_id)
    return run, job_id, gpus


def _gpus(box: Sandbox, node: str) -> dict[str, Any]:
    with DaemonClient(daemon_paths(box, node), timeout_s=5) as client:
        return client.gpus()


def test_hot_gpu_rank_moves_to_the_spare_before_anything_fails(box: Sandbox, base: Path, reference: oracle.Run) -> None:
    step = random.Random(SEED + 40).randint(8, 25)
    run, job_id, gpus_at_end = _run_with_hot_gpu(box, base, "hot-gpu", step)
    assert "heated: rc 0" in run.output, run.output[-3000:]
    journals = _check(run, reference)  # job ok, final state bitwise equal, every step committed once

    events = _node_events(box, HOT_NODE, job_id)
    joined = [e["fields"]["slot"] for e in events if e["kind"] == "torchpass.joined" and e["node"] == HOT_NODE]
    assert joined, f"no rank joined on {HOT_NODE}: {[e['kind'] for e in events]}"
    hot_slot = joined[0]
    assert len({pid for *_, pid in journals[hot_slot]}) == 2, "the slot was not taken over by the spare"

    moved = run.of_kind("torchpass.migrated")
    assert moved and moved[0]["slots"] == [hot_slot] and moved[0]["handoff_ok"], moved
    assert not run.of_kind("torchpass.member_failed"), "something failed: the move was not ahead of the fault"
    assert not run.of_kind("torchpass.recovered")

    # node2's daemon recorded why, naming the signal, its value and its threshold.
    health = [e["fields"] for e in events if e["kind"] == "gpu.health" and e["fields"]["state"] == "raised"]
    assert health and health[0]["signal"] == "temperature.slowdown", health
    assert (health[0]["gpu"], health[0]["value"], health[0]["threshold"]) == (0, 95.0, 90.0)
    migration = [e["fields"] for e in events if e["kind"] == "gpu.migration"]
    states = [m["state"] for m in migration]
    assert states[:2] == ["requested", "accepted"], migration
    assert all(m["signal"] == "temperature.slowdown" and m["slot"] == hot_slot for m in migration), migration
    requested = run.of_kind("torchpass.migration_requested")
    assert requested and "temperature.slowdown 95.0" in str(requested[0]["by"]), requested

    # Once the rank had left the GPU, the daemon would let the health check drain node2 (not done here: the
    # sandbox's next tests need node2).
    gpu0 = gpus_at_end["gpus"][0]
    assert gpu0["drain_ready"] is True and gpu0["drain_reason"].startswith("gpu0 temperature.slowdown"), gpus_at_end
