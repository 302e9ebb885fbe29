"""Borrowed spares on the sandbox's real Slurm (5 nodes, accounting): a failing job takes a node from low work.

* A preemptible job (``-p low --requeue --open-mode=append``) holds node5. A 4-node ``sbatch --clockwork-ft
  --clockwork-spares=borrow --no-kill -p high`` training job runs the oracle's deterministic training on
  node1-4 (every node trains: borrow mode keeps no standby). node3 crashes mid-step (its rank asks for the
  crash at a random step and point, as in test_torchpass_sandbox.py; ``CW_TEST_SEED`` replays it): the leading
  agent borrows through its node daemon, the daemon's holder allocation (``clockwork-hold-JOBID``, partition
  high, pinned to node5) makes slurmctld requeue the low job, the replacement rank starts on node5 as a step of
  the holder and the job resumes at the same step. Its final state is bitwise equal to a fault-free run's. The job
  asks for one of the sandbox's fake GPUs per node (gres.conf) and a 30-minute limit: ``sacct`` shows the holder
  with the node's GPUs (``--exclusive``: both), the job's account and at most 30 minutes, and the guest's step
  with ``gres/gpu=1``, the job's GPU per node.
* The low job was requeued (restart count 1) and runs again on node5 after the training job ended (its
  Epilog gave the node back); ``sacct`` shows both jobs with the AdminComments that link them.
* With 2 ranks per node (``--ntasks-per-node=2``: 8 ranks on node1-4), node3's crash loses two ranks at once;
  the borrowed node5's guest offers 2 spare slots, and both ranks are rebuilt there in one recovery, in local
  order, bitwise equal to the fault-free job of 2 ranks per node; its AdminComment names both slots' moves.
* Refusals, logged by the daemon: a borrow for a job submitted with ``--clockwork-spares=standby``, a borrow
  by another user for someone else's job, and a second borrow beyond ``max_nodes_per_job`` (1).

Needs root and Slurm (``apt-get install slurm-wlm slurmd slurmctld munge mariadb-server slurmdbd``); run with
``sudo env CI=true PYTHONPATH=$PWD/daemon:$PWD .venv/bin/python -m pytest tests/integration/test_borrow_sandbox.py
-v -s`` (the sandbox is built by the session fixture; nothing else may use it meanwhile).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.errors import DaemonError
from clockwork.sandbox.cluster import Sandbox
from tests.conftest import until
from tests.integration import sandbox_jobs as jobs
from tests.integration.conftest import SandboxManager, daemon_paths, slurm_env, wait_job
from tests.unit import test_torchpass_oracle as oracle

NODES = 5
TRAIN_NODES = "node[1-4]"
NPROC = 4
STEPS = 60
STEP_SLEEP_S = 0.08
JOB_TIMEOUT_S = 300
SEED = int(os.environ.get("CW_TEST_SEED", str(int(time.time()))))
CRASH_PHASES = ("crashnode", "crashnode-backward", "crashnode-optimizer")
#: Agent order puts the batch host (node1, the allocation's first node) last: node2, node3, node4, node1, so
#: agent/slot 1 runs on node3, the node the issue crashes.
CRASHED_SLOT, CRASHED_NODE = 1, "node3"


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Sandbox:
    return jobs.faults_box(sandbox_manager, nodes=NODES, accounting=True, seed=SEED, replays="it")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("borrow-sandbox")


#: The crash test's job asks for one of each node's fake GPUs (one rank per node: TorchPass runs a rank per GPU
#: of the step) and this time limit: the borrowed node must come with both.
JOB_GPUS, TIME_LIMIT_MIN = 1, 30

#: How long a job takes to start on the sandbox, at most (only a broken run waits that long).
WAIT_S = 60.0


def _sbatch(box: Sandbox, *args: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run(
        ["sbatch", "--parsable", *args], env=env or slurm_env(box), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().split(";")[0])


def _low_job(box: Sandbox, out: Path) -> int:
    """The preemptible work on node5: prints one line per start (a requeue starts it again)."""
    job_id = _sbatch(
        box,
        "-p",
        "low",
        "--requeue",
        "--open-mode=append",
        "-N1",
        "-w",
        "node5",
        "-J",
        "low-work",
        f"--output={out}",
        "--wrap",
        'echo "start restart=${SLURM_RESTART_COUNT:-0}"; exec sleep 3600',
    )
    until(f"low job {job_id} to start", lambda: out.exists() and "start restart=0" in out.read_text(), WAIT_S, 0.2)
    return job_id


def _train(
    box: Sandbox,
    base: Path,
    name: str,
    *,
    kill: str = "",
    during: object = None,
    per_node: int = 1,
    options: tuple[str, ...] = (),
) -> tuple[int, oracle.Run]:
    """Run the 4-node borrow training job (``per_node`` ranks per node, more sbatch ``options``); crash the node
    its rank asks for; ``during(job_id)`` once a node was borrowed."""
    out = base / name
    out.mkdir()
    env = jobs.job_env(box, out, kill=kill, step_sleep=STEP_SLEEP_S, CW_TEST_STEPS=str(STEPS))
    command = jobs.torchpass_command(out, oracle.SCRIPT)
    job_id = _sbatch(
        box,
        f"-N{NPROC}",
        "-w",
        TRAIN_NODES,
        "-p",
        "high",
        "--no-kill",
        "--clockwork-ft",
        "--clockwork-spares=borrow",
        f"--ntasks-per-node={per_node}",
        *options,
        f"--output={out}/job.out",
        f"--wrap={command}",
        env=env,
    )
    slurm = box.slurm()
    called = during is None

    def once_borrowed() -> None:
        nonlocal called
        if not called and any(e["kind"] == "torchpass.borrowed" for e in jobs.job_events(out)):
            called = True
            during(job_id)  # type: ignore[operator]

    crashed, output, returncode = jobs.follow_job(box, job_id, out, JOB_TIMEOUT_S, once_borrowed)
    run = oracle.Run(out, returncode, f"{output}\ncrashed: {crashed}", jobs.job_events(out))
    until(f"job {job_id} to end", lambda: (lambda i: i is None or i.finished)(slurm.job(job_id)), 90, 0.2)
    return job_id, run


def _daemon_events(box: Sandbox, job_id: int) -> list[dict[str, object]]:
    """The job's events on every training node's daemon (each agent posts to its own node's)."""
    events: list[dict[str, object]] = []
    for node in ("node1", "node2", "node3", "node4"):
        try:
            with DaemonClient(daemon_paths(box, node), timeout_s=5) as client:
                events += client.job_events(job_id)
        except DaemonError:
            continue  # node3 crashed: its daemon may be gone
    return events


def _comment(box: Sandbox, job_id: int, needle: str) -> str:
    deadline = time.monotonic() + 30
    comment = ""
    while time.monotonic() < deadline and needle not in comment:
        rows = [r for r in box.slurm().accounting(job_id) if not r.is_step]
        comment = rows[-1].admin_comment if rows else ""
        time.sleep(0.5)
    return comment


def _runs(box: Sandbox, job_id: int) -> list[tuple[str, str]]:
    """(state, AdminComment) of every run of a job, requeued ones included (``sacct --duplicates``)."""
    out = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", f"--jobs={job_id}", "--format=State,AdminComment"],
        env=slurm_env(box),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [tuple(line.split("|", 1)) for line in out.splitlines() if line]  # type: ignore[misc]


def _acct(box: Sandbox, job_id: int) -> dict[str, dict[str, str]]:
    """``sacct`` rows of a job and its steps: JobID -> {AllocTRES, Account, TimelimitRaw}."""
    out = subprocess.run(
        ["sacct", "-n", "-P", f"--jobs={job_id}", "--format=JobID,AllocTRES,Account,TimelimitRaw"],
        env=slurm_env(box),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split("|") for line in out.splitlines() if line]
    return {r[0]: {"AllocTRES": r[1], "Account": r[2], "TimelimitRaw": r[3]} for r in rows}


def _assert_the_node_came_with_what_the_job_had(
    box: Sandbox, job_id: int, holder: int, borrowed: dict[str, object]
) -> None:
    """The job asked for a GPU per node and a time limit: the holder was given the GPU, the job's account and
    no more than its remaining time, and the guest's step in it holds the GPUs too (Slurm gives a step of an
    --exclusive allocation no GRES it did not ask for)."""
    assert borrowed["gres"] == f"gpu:{JOB_GPUS}", borrowed

    def recorded() -> bool:
        rows = _acct(box, holder)
        return str(holder) in rows and any(k.startswith(f"{holder}.") and k[-1].isdigit() for k in rows)

    until(f"sacct to record holder {holder} and its guest step", recorded, 30, 0.5)
    job, held = _acct(box, job_id)[str(job_id)], _acct(box, holder)
    print(f"sacct: job {job}; holder {held}")
    assert _gpus(job) == NPROC * JOB_GPUS, job  # the job's own: one per node
    # --exclusive gives the holder the whole node, its every GPU (the sandbox's 2) included; it asked for the
    # job's one, so a site where an exclusive job's steps get only what the job asked for still sees it
    assert _gpus(held[str(holder)]) >= JOB_GPUS, held
    assert held[str(holder)]["Account"] == job["Account"] != "", (held, job)
    assert 0 < int(held[str(holder)]["TimelimitRaw"]) <= TIME_LIMIT_MIN, held
    (guest,) = [row for key, row in held.items() if key.startswith(f"{holder}.") and key.split(".")[1].isdigit()]
    assert _gpus(guest) == JOB_GPUS, held  # the guest's step holds the job's GPU per node


def _gpus(row: dict[str, str]) -> int:
    """``gres/gpu=N`` of an AllocTRES (0 when absent)."""
    found = [int(t.split("=", 1)[1]) for t in row["AllocTRES"].split(",") if t.startswith("gres/gpu=")]
    return found[0] if found else 0


def _log(box: Sandbox) -> str:
    path = box.paths.logs / "clockwork.log"
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def reference(box: Sandbox, base: Path) -> oracle.Run:
    _, run = _train(box, base, "reference")
    run.check_ok()
    assert not run.of_kind("torchpass.borrowed")  # nothing failed, nothing borrowed
    return run


def test_a_borrow_without_a_borrow_job_is_refused_and_logged(box: Sandbox, base: Path) -> None:
    marker = base / "standby-started"
    job_id = _sbatch(
        box,
        "-N1",
        "-w",
        "node1",
        "--clockwork-ft",
        "--clockwork-spares=standby",
        "-o",
        "/dev/null",
        "--wrap",
        f"touch {marker}; sleep 60",
    )
    try:
        until(f"job {job_id} to start", marker.exists, WAIT_S, 0.2)
        with DaemonClient(daemon_paths(box, "node1"), timeout_s=5) as client, pytest.raises(DaemonError) as err:
            client.borrow(job_id, lost_node="node1")
        assert err.value.code == "forbidden"
        assert "not submitted with --clockwork-spares=borrow" in str(err.value)
        assert "borrow refused for uid 0" in _log(box)
        intruder = _as_nobody(box, job_id, "node1")
        assert intruder.stdout.strip() == "forbidden", intruder.stdout + intruder.stderr
        assert f"may not borrow job {job_id}: it belongs to uid 0" in _log(box)
    finally:
        box.slurm().cancel(job_id)
        wait_job(box, job_id)


def _as_nobody(box: Sandbox, job_id: int, node: str) -> subprocess.CompletedProcess[str]:
    """Ask ``node``'s daemon for a borrow as uid 65534, who owns no job (the kernel tells the daemon who asks)."""
    control = daemon_paths(box, node).control_socket
    script = box.paths.root / "borrow-intruder.py"
    script.write_text(
        "import sys\nfrom pathlib import Path\nfrom clockwork.contracts.daemon_client import DaemonClient\n"
        "from clockwork.contracts.errors import DaemonError\n"
        "try:\n    DaemonClient(Path(sys.argv[1]), timeout_s=5).borrow(int(sys.argv[2]))\n    print('ALLOWED')\n"
        "except DaemonError as exc:\n    print(exc.code)\n"
    )
    script.chmod(0o755)
    for parent in [*control.parents, *script.parents]:  # any local user reaches the control socket
        if parent == Path("/"):
            break
        parent.chmod(parent.stat().st_mode | 0o005)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            str(script),
            str(control),
            str(job_id),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_node_crash_borrows_node5_from_the_low_job_and_gives_it_back(
    box: Sandbox, base: Path, reference: oracle.Run
) -> None:
    low_out = base / "low.out"
    low = _low_job(box, low_out)
    step, phase = random.Random(SEED).randint(8, 40), random.Random(SEED + 1).choice(CRASH_PHASES)
    refusals: list[str] = []

    def beyond_the_limit(job_id: int) -> None:
        """A second borrow while node5 is held: every daemon refuses it (max_nodes_per_job = 1)."""
        for node in ("node1", "node2", "node4"):
            with DaemonClient(daemon_paths(box, node), timeout_s=10) as client:
                try:
                    reply = client.borrow(job_id)
                except DaemonError as exc:  # the daemon that holds the borrow knows at once
                    refusals.append(f"{node}: {exc.code}: {exc}")
                    continue
                deadline = time.monotonic() + 30
                state = reply
                while state.get("state") == "pending" and time.monotonic() < deadline:
                    time.sleep(0.2)
                    state = client.borrow_status(job_id, int(reply["request"]))[0]
                refusals.append(f"{node}: {state.get('state')}: {state.get('reason')}")

    job_id, run = _train(
        box,
        base,
        "crash-node3",
        kill=f"{CRASHED_SLOT}:{step}:{phase}",
        during=beyond_the_limit,
        options=(f"--gres=gpu:{JOB_GPUS}", f"--time={TIME_LIMIT_MIN}"),
    )
    assert f"crashed: ['{CRASHED_NODE}']" in run.output, run.output[-3000:]

    # The training: same step, same result as the fault-free run, the slot now on node5.
    run.check_ok()
    oracle._assert_same_final_state(run, reference, nproc=NPROC, steps=STEPS)
    oracle._assert_each_step_once(run, nproc=NPROC, steps=STEPS)
    fields = oracle._recovered(run, CRASHED_SLOT)
    (borrowed,) = run.of_kind("torchpass.borrowed")
    assert (borrowed["node"], borrowed["from_job"], borrowed["lost_node"]) == ("node5", low, CRASHED_NODE)
    holder = int(str(borrowed["holder"]))
    print(f"borrowed: {json.dumps(borrowed, sort_keys=True)}; recovered: {json.dumps(fields, sort_keys=True)}")
    _assert_the_node_came_with_what_the_job_had(box, job_id, holder, borrowed)

    # The daemon's record: which node, from which job, how long each part took; and its give-back.
    daemon_events = _daemon_events(box, job_id)
    acquired = [e["fields"] for e in daemon_events if e["kind"] == "borrow.acquired"]
    assert len(acquired) == 1, daemon_events
    a = acquired[0]
    assert isinstance(a, dict) and (a["node"], a["from_job"], a["holder"]) == ("node5", low, holder)
    assert a["from_state"] != "RUNNING", a  # preempted: requeued (restart count checked below)
    for key in ("query_ms", "choose_ms", "submit_ms", "preempt_ms", "total_ms"):
        assert isinstance(a[key], float), (key, a)
    released = [e["fields"] for e in daemon_events if e["kind"] == "borrow.released"]
    assert released and released[0]["holder"] == holder, daemon_events  # type: ignore[index]

    # Beyond the limit: refused everywhere, with the reason, and logged.
    assert len(refusals) == 3 and all("limit is 1" in r for r in refusals), refusals
    assert "limit is 1" in _log(box)

    # The low job: requeued once, running again on node5 now that the holder is gone.
    slurm = box.slurm()
    until(
        f"low job {low} to run again",
        lambda: (lambda i: i is not None and i.state == "RUNNING" and i.nodes == ["node5"])(slurm.job(low)),
        90,
        0.2,
    )
    info = slurm.job(low)
    assert info is not None and info.restart_count >= 1, info
    until("the requeued low job's second start", lambda: "start restart=1" in low_out.read_text(), 30, 0.2)
    assert low_out.read_text().count("start restart=") == 2  # --open-mode=append kept the first run's line
    holder_info = slurm.job(holder)
    assert holder_info is None or holder_info.finished, holder_info

    # sacct tells both sides of the story: the low job's preempted run (its PREEMPTED record) says for whom.
    expected = f"clockwork: preempted for job {job_id} (node node5 held by job {holder})"
    runs = _runs(box, low)
    assert [state for state, _ in runs] == ["PREEMPTED", "RUNNING"], runs
    assert runs[0][1] == expected, runs
    train_comment = _comment(box, job_id, "clockwork-borrowed:")
    assert f"clockwork-borrowed: node5 from job {low} (holder {holder})" in train_comment, train_comment
    assert train_comment.startswith("clockwork: ") and "; report=" in train_comment, train_comment
    slurm.cancel(low)
    wait_job(box, low)
    # the live job kept the comment too; slurmdbd gets it with the run's end
    assert _comment(box, low, "preempted for job") == expected


def test_with_two_ranks_per_node_the_borrowed_node_takes_both_ranks_of_a_crashed_node(box: Sandbox, base: Path) -> None:
    """node3 (agent 1: slots 2 and 3 of 8) crashes at a random step and point; the borrowed node5 offers two spare
    slots, and both ranks are rebuilt there in one recovery, local index J on slot 2+J, bitwise equal to the
    fault-free job with 2 ranks per node."""
    per_node, nproc = 2, 2 * NPROC
    _, reference = _train(box, base, "two-per-node-reference", per_node=per_node)
    reference.check_ok()
    low = _low_job(box, base / "low-two-per-node.out")
    rng = random.Random(SEED + 2)
    step, phase = rng.randint(8, 40), rng.choice(CRASH_PHASES)
    slot = CRASHED_SLOT * per_node  # agent 1's local index 0; its node runs slot 3 too
    job_id, run = _train(box, base, "two-per-node-crash-node3", kill=f"{slot}:{step}:{phase}", per_node=per_node)
    try:
        assert f"crashed: ['{CRASHED_NODE}']" in run.output, run.output[-3000:]
        run.check_ok()
        oracle._assert_same_final_state(run, reference, nproc=nproc, steps=STEPS)
        oracle._assert_each_step_once(run, nproc=nproc, steps=STEPS)
        (borrowed,) = run.of_kind("torchpass.borrowed")
        assert (borrowed["node"], borrowed["from_job"], borrowed["lost_node"]) == ("node5", low, CRASHED_NODE)
        holder = int(str(borrowed["holder"]))
        (replaced,) = [g for g in run.of_kind("torchpass.generation") if g["replaced"]]
        assert replaced["replaced"] == {"2": f"g{holder}.0.0", "3": f"g{holder}.1.1"}, replaced
        assert [(p["local"], p["holder"]) for p in replaced["placed"].values()] == [(0, holder), (1, holder)]
        fields = oracle._recovered(run, slot)
        assert fields["slots"] == [2, 3], fields  # one recovery, both ranks, at the same step
        # The AdminComment the batch host's Epilog wrote names both slots, from node3 to the borrowed node.
        comment = _comment(box, job_id, "slots moved:")
        assert f"slots moved: 2 node3/0->holder{holder}/0, 3 node3/1->holder{holder}/1; " in comment, comment
        assert f"clockwork-borrowed: node5 from job {low} (holder {holder})" in comment, comment
    finally:
        box.slurm().cancel(low)
        wait_job(box, low)
