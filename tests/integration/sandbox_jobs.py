"""TorchPass training jobs on the sandbox's Slurm: submitted, faulted on request and followed to their end.

Shared by test_torchpass_sandbox.py, test_torchpass_transparent_sandbox.py, test_borrow_sandbox.py and the sharded
layouts' tests (test_torchpass_tp_sandbox.py, test_torchpass_pp_sandbox.py), which all run a rank script of
tests/unit (the oracle's training, the unmodified DDP script) under ``torchpass run`` as a Slurm job and crash
the nodes its ranks ask for: one way to submit, fault, wait and read what the job left, so that a difference
between their results is a difference in what they test, not in how they drive the job.
test_gpu_health_sandbox.py reads its job's events and waits for the nodes the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from clockwork.sandbox.cluster import Sandbox
from tests.integration.conftest import CLOCKWORK, SandboxManager, slurm_env
from tests.unit.local_jobs import FinishedJob


def faults_box(
    manager: SandboxManager, *, nodes: int, accounting: bool, seed: int, replays: str, racks: str = ""
) -> Sandbox:
    """The sandbox in the shape a module needs (``racks``: its ``[sandbox] racks``), with no fault left over from
    an earlier test.

    It prints the seed of the module's random faults: a failure seen once can be replayed with ``CW_TEST_SEED``.
    These modules judge TorchPass, never Fleet Lens: their node daemons run without it (``[sandbox] lens``), which
    leaves its probes' CPU (about half of each daemon's; five nodes share two cores here) to the job.
    """
    sandbox = manager.ensure_up(nodes=nodes, accounting=accounting, racks=racks, lens=False)
    sandbox.clear_faults()
    print(f"fault seed {seed} (CW_TEST_SEED={seed} replays {replays})")
    return sandbox


def job_env(box: Sandbox, out: Path, *, kill: str, step_sleep: float, **extra: str) -> dict[str, str]:
    """The job's environment: the rank script's ``CW_TEST_*`` settings (``extra`` adds more) and the sandbox's
    Slurm and Clockwork configuration, as ``eval "$(clockwork sandbox env)"`` sets them for a user."""
    return dict(
        slurm_env(box),
        CW_TEST_DIR=str(out),
        CW_TEST_KILL=kill,
        CW_TEST_STEP_SLEEP=str(step_sleep),
        OMP_NUM_THREADS="1",
        CLOCKWORK_CONFIG=str(box.paths.clockwork_toml),
        **extra,
    )


def torchpass_command(out: Path, script: Path, options: str = "") -> str:
    """The batch script: ``torchpass run`` of the rank script, each node agent writing its events under ``out``
    (``events-AGENT.jsonl``); a short collective timeout so that a rank on a crashed node is given up quickly.
    ``options``: more of ``torchpass run``'s own (``--spares 2``, ``--set KEY=VALUE``)."""
    return (
        f"{sys.executable} -m torchpass run --events {out}/events-{{agent}}.jsonl --set collective_timeout_s=20 "
        f"{options + ' ' if options else ''}{script}"
    )


def submit(options: list[str], command: str, env: dict[str, str]) -> int:
    """``sbatch --parsable OPTIONS --wrap=COMMAND``; the job's id (a failed submission raises)."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", *options, f"--wrap={command}"], env=env, capture_output=True, text=True, check=True
    )
    return int(submitted.stdout.strip().split(";")[0])


SLURM_POLL_S = 0.5


def follow_job(
    box: Sandbox,
    job_id: int,
    out: Path,
    timeout_s: float,
    tick: Callable[[], None] | None = None,
    crash: Callable[[str], list[str]] = lambda node: [node],
) -> tuple[list[str], str, int]:
    """Crash every node the job's ranks ask for (``crash``: the nodes to crash at once when a rank asks for its
    node's crash, e.g. its whole rack), call ``tick`` (the test's own action mid-job) every round until the job
    ends, then bring the crashed nodes back; the crashed nodes, the job's output and its exit code.

    A rank asks by writing ``crash-request-SLOT-STEP`` (its node's name) and waits there for the crash, so the
    fault lands at the point it chose. A crashed node keeps its job COMPLETING until Slurm hears from it again:
    that counts as the end here, and the node is restored afterwards.
    """
    slurm = box.slurm()
    crashed: list[str] = []
    handled: set[str] = set()
    deadline = time.monotonic() + timeout_s
    info = slurm.job(job_id)
    next_query = time.monotonic()
    while time.monotonic() < deadline:
        for request in sorted(out.glob("crash-request-*")):
            if request.name not in handled:
                handled.add(request.name)
                nodes = [node for node in crash(request.read_text().split()[0]) if node not in crashed]
                if nodes:
                    box.crash_node(*nodes)  # what `clockwork sandbox fault node NODE crash` does (at once)
                    crashed += nodes
        if tick is not None:
            tick()
        # The crash requests are files (cheap to look for, and a rank waits on each); the job's state is a
        # squeue round trip through slurmctld (~20 ms of CPU): asked twice a second, not twenty times.
        if time.monotonic() >= next_query:
            next_query = time.monotonic() + SLURM_POLL_S
            info = slurm.job(job_id)
            if info is not None and (info.finished or (crashed and "COMPLETING" in info.state)):
                break
        time.sleep(0.05)
    for node in crashed:
        box.restore_node(node)
    output = (out / "job.out").read_text() if (out / "job.out").exists() else ""
    assert info is not None and (info.finished or "COMPLETING" in info.state), f"job {job_id}: {info}\n{output[-6000:]}"
    returncode = int(info.exit_code.split(":")[0]) if info.exit_code else -1
    return crashed, output, returncode


def run_job(
    box: Sandbox, out: Path, options: list[str], command: str, env: dict[str, str], timeout_s: float
) -> FinishedJob:
    """Submit ``command`` (``sbatch OPTIONS``, its output to ``out/job.out``), crash the nodes its ranks ask for,
    wait for its end and for its nodes to be free again: the job as an oracle test checks it (its output ends
    with ``crashed: [NODES]``, its events are every node agent's)."""
    job_id = submit([*options, f"--output={out}/job.out"], command, env)
    crashed, output, returncode = follow_job(box, job_id, out, timeout_s)
    run = FinishedJob(out, returncode, f"{output}\ncrashed: {crashed}")
    run.events = job_events(out)
    wait_gone(box, job_id)
    return run


def held_for_migration(out: Path, step: int) -> dict[str, str]:
    """The rank script's setting that holds every slot at ``step`` until :func:`clockwork_migrate` answered."""
    return {"CW_TEST_HOLD": f"{step}:{out / 'migrate-answered'}"}


def clockwork_migrate(box: Sandbox, job_id: int, rank: int, env: dict[str, str]) -> str:
    """``clockwork migrate JOBID --rank R`` on one of the job's nodes (node2), as on a real cluster; what it said
    (``rc N: ...``, for the run's output). It must succeed.

    A job run with :func:`held_for_migration`'s setting waits at that step until this has answered: a spare
    slow to start on a loaded machine must not let the job end before the move."""
    proc = subprocess.run(
        box.exec_argv("node2", [CLOCKWORK, "migrate", str(job_id), "--rank", str(rank)]),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    migrated = f"rc {proc.returncode}: {proc.stdout}{proc.stderr}"
    if "CW_TEST_HOLD" in env:
        Path(env["CW_TEST_HOLD"].partition(":")[2]).touch()
    assert proc.returncode == 0, migrated
    return migrated


def job_events(out: Path) -> list[dict[str, object]]:
    """Every node agent's events (``events-*.jsonl`` under ``out``) in one list, in time order."""
    events = []
    for path in sorted(out.glob("events-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: float(str(e.get("time", 0))))


def wait_gone(box: Sandbox, job_id: int, timeout_s: float = 60) -> None:
    """The next job needs every node: wait until this one has left them (a restored node reports in)."""
    slurm = box.slurm()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        if info is None or info.finished:
            if all("IDLE" in node.state[:1] for node in slurm.nodes()):
                return
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} still holds nodes: {slurm.job(job_id)} {slurm.nodes()}")
