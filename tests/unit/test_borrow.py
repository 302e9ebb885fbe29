"""Borrowed spares, the daemon's side: the [borrow] policy, the candidate choice, and the acquisition.

No Slurm controller runs in a unit test, so the acquisition runs the real CLI backend against fake client
executables in a temporary ``bin_dir`` (as tests/unit/test_slurm_cli_parsing.py does): ``squeue --json`` prints
a queue file, ``sbatch`` logs its options and "starts" the holder by swapping in the queue Slurm would show
after preempting, ``scontrol``/``scancel`` log what they were asked. The daemon's request handling (ownership,
refusals, what is logged) runs through :meth:`Daemon.handle` with a real registry on disk.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shlex
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from clockwork.contracts.borrow_comments import preempted_comment
from clockwork.contracts.config import load_config
from clockwork.contracts.config.borrow import BorrowConfig
from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.daemon_wire import FORBIDDEN, encode_request
from clockwork.contracts.errors import ConfigError
from clockwork.contracts.slurm.backend import NodeInfo
from clockwork.contracts.slurm.cli_backend import CliBackend
from clockworkd.borrow.candidates import QueueJob, choose, holder_name, parse_queue_json
from clockworkd.borrow.manager import BorrowManager, BorrowRefused
from clockworkd.borrow.slurm_ops import CliBorrowSlurm
from clockworkd.daemon_auth import Caller
from clockworkd.registry import JobRecord, Registry
from clockworkd.server import Daemon

DATA = Path(__file__).parent / "data" / "slurm"
NOW = 1_800_000_000.0
TRAIN = 100  # the training job that borrows
POLICY = BorrowConfig(enabled=True, partitions="low", holder_partition="high", timeout_s=5.0)


# ----------------------------------------------------------------------- the policy in the config


def test_borrow_section_loads_from_the_file_and_is_validated(tmp_path: Path) -> None:
    path = tmp_path / "clockwork.toml"
    path.write_text('[borrow]\nenabled = true\npartitions = "low, scavenger"\nholder_partition = "high"\n')
    cfg = load_config(path, env={}).config.borrow
    assert (cfg.enabled, cfg.partitions, cfg.holder_partition, cfg.max_nodes_per_job) == (
        True,
        "low, scavenger",
        "high",
        1,
    )
    path.write_text("[borrow]\nmax_nodes = 2\n")
    with pytest.raises(ConfigError, match="unknown key 'max_nodes' in \\[borrow\\]"):
        load_config(path, env={})
    path.write_text('[borrow]\ngive_back = "never"\n')
    with pytest.raises(ConfigError, match="give_back: invalid value 'never'"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"partitions": "", "qos": ""}, "both empty"),
        ({"partitions": "low", "holder_partition": ""}, "holder_partition: invalid value ''"),
        ({"partitions": "low", "method": "qos", "holder_qos": ""}, "holder_qos: invalid value ''"),
        ({"partitions": "low,high", "holder_partition": "high"}, "also listed in 'partitions'"),
    ],
)
def test_a_policy_that_cannot_work_is_refused_naming_the_key(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BorrowConfig(enabled=True, **kwargs)


def test_a_disabled_policy_needs_nothing_else() -> None:
    assert BorrowConfig().enabled is False  # the default: nothing is ever borrowed


# ----------------------------------------------------------------------- the queue and the choice


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_the_queue_is_read_from_both_json_shapes(version: str) -> None:
    """``squeue --json`` as Slurm 22.05 and 24.11 printed it (data/slurm/VERSION, recorded with the jobs its
    manifest names): strings and plain numbers, or state lists and ``{"set", "number"}`` numbers."""
    folder = DATA / version
    manifest = json.loads((folder / "manifest.json").read_text())
    queue = {j.job_id: j for j in parse_queue_json(json.loads((folder / "squeue.json").read_text()))}
    running = queue[manifest["jobs"]["running"]]
    assert (running.state, running.user, running.account, running.partition, running.qos, running.requeue) == (
        "RUNNING",
        "root",
        "root",
        "low",
        "normal",
        True,  # JobRequeue=1, Slurm's default
    )
    assert running.nodes == ("node1", "node2") and running.start_time > 1.7e9
    assert running.admin_comment == manifest["live_comment"]
    held = queue[manifest["jobs"]["held"]]
    assert (held.state, held.nodes, held.start_time) == ("PENDING", (), 0)
    assert queue[manifest["jobs"]["requeued"]].state == "PENDING"


def _job(
    job_id: int,
    nodes: str,
    *,
    minutes: float = 30,
    partition: str = "low",
    requeue: bool = True,
    state: str = "RUNNING",
    name: str = "work",
    qos: str = "normal",
    user: str = "bob",
) -> QueueJob:
    return QueueJob(
        job_id,
        name,
        state,
        user,
        "acct",
        partition,
        qos,
        tuple(nodes.split(",")) if nodes else (),
        NOW - 60 * minutes if state == "RUNNING" else 0,
        requeue,
    )


def _choose(queue: list[QueueJob], cfg: BorrowConfig = POLICY, nodes: list[NodeInfo] | None = None) -> Any:
    me = next(j for j in queue if j.job_id == TRAIN)
    return choose(queue, cfg, borrower=me, borrower_id=TRAIN, borrower_nodes=me.nodes, nodes=nodes or [], now=NOW)


def test_the_candidate_that_loses_least_work_is_chosen() -> None:
    queue = [
        _job(TRAIN, "node1,node2", partition="gpu"),
        _job(201, "node5", minutes=50),
        _job(202, "node6,node7", minutes=30),  # 60 node-minutes: more work than 201's 50
        _job(203, "node8", minutes=40),
    ]
    choice = _choose(queue)
    assert (choice.job.job_id, choice.node, choice.work_lost_s, choice.considered) == (203, "node8", 2400.0, 3)
    by_elapsed = _choose(
        queue, BorrowConfig(enabled=True, partitions="low", holder_partition="high", choose="least_elapsed")
    )
    assert by_elapsed.job.job_id == 202  # 30 minutes is the shortest run, whatever its size


def test_exclusions_never_take_protected_or_foreign_work() -> None:
    cfg = BorrowConfig(enabled=True, partitions="low", holder_partition="high", min_age_minutes=10)
    queue = [
        _job(TRAIN, "node1,node2", partition="low"),  # the borrower itself runs in 'low'
        _job(301, "node5", requeue=False),
        _job(302, "node6", minutes=2),
        _job(303, "node7", partition="prod"),
        _job(304, "node2", minutes=20),  # shares the borrower's node only
        _job(305, "node9", name=holder_name(77)),  # another job's holder
        _job(306, "node10", minutes=20),  # its node is draining
        _job(307, "", state="PENDING"),
    ]
    draining = [NodeInfo("node10", ("ALLOCATED", "DRAIN"), "", ["low"], "bad")]
    assert _choose(queue, cfg, draining) is None
    queue.append(_job(308, "node11", minutes=500))
    choice = _choose(queue, cfg, draining)
    assert choice.job.job_id == 308
    assert set(choice.excluded) == {"301", "302", "304", "306", "307"}
    assert "not requeueable" in choice.excluded["301"] and "min_age_minutes" in choice.excluded["302"]


def test_a_qos_makes_work_borrowable_in_any_partition() -> None:
    cfg = BorrowConfig(enabled=True, qos="scavenger", method="qos", holder_qos="urgent")
    queue = [
        _job(TRAIN, "node1", partition="gpu"),
        _job(401, "node4", partition="gpu", qos="scavenger"),
        _job(402, "node3", partition="low", minutes=1),
    ]
    assert _choose(queue, cfg).job.job_id == 401


# ----------------------------------------------------------------------- acquisition against fake clients


class FakeSlurm:
    """Fake Slurm clients over a queue file; releasing the (held) holder swaps in the queue after preemption."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.log = tmp_path / "calls.log"
        self.log.touch()
        self.queue = tmp_path / "queue.json"
        self.after = tmp_path / "after.json"
        q = shlex.quote
        self.steps = tmp_path / "steps.txt"
        self.steps.write_text("900.batch\n")
        self._add("squeue", f'case "$1" in --json) cat {q(str(self.queue))} ;; *) cat {q(str(self.steps))} ;; esac')
        self._add("sbatch", "echo 900")
        swap = f"[ -f {q(str(self.after))} ] && cp {q(str(self.after))} {q(str(self.queue))}"
        self._add("scontrol", f'[ "$1" = release ] && {{ {swap}; }}\nexit 0')
        self._add("scancel", "exit 0")
        nodes = {
            "nodes": [
                {
                    "name": f"node{i}",
                    "state": "allocated",
                    "state_flags": [],
                    "address": "",
                    "partitions": ["low", "high"],
                    "reason": "",
                }
                for i in range(1, 7)
            ]
        }
        (tmp_path / "sinfo.json").write_text(json.dumps(nodes))
        self._add(
            "sinfo",
            f'case "$1" in --version) echo "slurm-wlm 22.05.8" ;; *) cat {q(str(tmp_path / "sinfo.json"))} ;; esac',
        )

    def _add(self, name: str, body: str) -> None:
        script = self.bin / name
        script.write_text(f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> {shlex.quote(str(self.log))}\n{body}\n')
        script.chmod(0o755)

    def set_queue(self, jobs: list[dict[str, Any]], after: list[dict[str, Any]] | None = None) -> None:
        self.queue.write_text(json.dumps({"jobs": jobs, "errors": []}))
        if after is not None:
            self.after.write_text(json.dumps({"jobs": after, "errors": []}))

    def calls(self, tool: str = "") -> list[str]:
        return [c for c in self.log.read_text().splitlines() if c.startswith(tool)]

    def slurm(self) -> CliBorrowSlurm:
        return CliBorrowSlurm(CliBackend(self.dir / "slurm.conf", bin_dir=self.bin, timeout_s=10.0))


def _qjob(
    job_id: int,
    nodes: str,
    *,
    partition: str = "low",
    state: str = "RUNNING",
    name: str = "work",
    user: str = "bob",
    minutes: float = 30,
    requeue: bool = True,
) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "name": name,
        "job_state": state,
        "user_name": user,
        "account": "acct",
        "partition": partition,
        "qos": "normal",
        "nodes": nodes,
        "requeue": requeue,
        "start_time": int(time.time() - 60 * minutes) if state == "RUNNING" else 0,
        "admin_comment": "",
        "exit_code": 0,
        "restart_cnt": 0,
    }


ME = pwd.getpwuid(os.getuid()).pw_name
#: The training job's owner in the daemon tests: a real passwd entry (the holder is submitted with its group),
#: not root (root is privileged and would skip the ownership check).
OWNER = next(p for p in pwd.getpwall() if p.pw_uid != 0)
OTHER_UID = OWNER.pw_uid + 1


def _training(options: dict[str, str] | None = None, uid: int | None = None) -> JobRecord:
    return JobRecord(
        TRAIN,
        os.getuid() if uid is None else uid,
        ME,
        ("node1", "node2", "node3", "node4"),
        {"ft": "aware", "spares": "borrow"} if options is None else options,
        registered_at=time.time(),
    )


@pytest.fixture
def fake(tmp_path: Path) -> FakeSlurm:
    return FakeSlurm(tmp_path)


def _manager(
    fake: FakeSlurm, cfg: BorrowConfig = POLICY
) -> tuple[BorrowManager, list[tuple[int, str, dict[str, Any]]]]:
    events: list[tuple[int, str, dict[str, Any]]] = []
    manager = BorrowManager(
        cfg, fake.slurm(), "node1", lambda j, k, f: events.append((j, k, f)), poll_s=0.05, threaded=False
    )
    return manager, events


def _one_request(
    fake: FakeSlurm, cfg: BorrowConfig = POLICY
) -> tuple[dict[str, Any], list[tuple[int, str, dict[str, Any]]]]:
    """One borrow request, run to its end: (its state as borrow_status reports it, the job's events)."""
    manager, events = _manager(fake, cfg)
    manager.request(_training(), by="uid 0 pid 1")
    manager.drain()
    (state,) = manager.requests_of(TRAIN)["requests"]
    return state, events


BEFORE = [
    _qjob(TRAIN, "node[1-2,4]", partition="high", name="train", user=ME),
    _qjob(500, "node5", minutes=20),
    _qjob(501, "node6", minutes=300),
]
AFTER = [
    _qjob(TRAIN, "node[1-2,4]", partition="high", name="train", user=ME),
    _qjob(500, "", state="PENDING"),
    _qjob(501, "node6", minutes=300),
    _qjob(900, "node5", partition="high", name=holder_name(TRAIN), user=ME, minutes=0),
]


def test_a_borrow_submits_a_pinned_holder_and_records_both_sides(fake: FakeSlurm) -> None:
    fake.set_queue(BEFORE, AFTER)
    manager, events = _manager(fake)
    reply = manager.request(_training(), by="uid 0 pid 1", lost_node="node3")
    manager.drain()
    (state,) = manager.requests_of(TRAIN)["requests"]
    assert reply["request"] == state["request"] == 1
    assert (state["state"], state["node"], state["holder"], state["preempted"]) == ("acquired", "node5", 900, 500)
    (sbatch,) = fake.calls("sbatch")
    for option in (
        f"--job-name={holder_name(TRAIN)}",
        "--hold",
        "--nodelist=node5",
        "--exclusive",
        "--no-requeue",
        "--partition=high",
        f"--uid={os.getuid()}",
        f"--gid={pwd.getpwuid(os.getuid()).pw_gid}",
    ):
        assert option in sbatch.split(), option
    calls = fake.calls("scontrol")
    comments = [c for c in calls if "AdminComment" in c]
    labelled = calls.index(f"scontrol update JobId=500 AdminComment={preempted_comment(TRAIN, 'node5', 900)}")
    assert labelled < calls.index("scontrol release 900"), calls  # its PREEMPTED record carries the comment
    assert any("JobId=900" in c and "preempted job 500" in c for c in comments), comments
    assert any(f"JobId={TRAIN}" in c and "clockwork-borrowed: node5 from job 500 (holder 900)" in c for c in comments)
    ((job_id, kind, fields),) = events
    assert (job_id, kind, fields["from_job"], fields["node"], fields["holder"]) == (
        TRAIN,
        "borrow.acquired",
        500,
        "node5",
        900,
    )
    assert fields["from_state"] == "PENDING" and fields["lost_node"] == "node3"
    assert {"query_ms", "choose_ms", "submit_ms", "preempt_ms", "total_ms"} <= set(fields)


def _gpu_training(*, limit_min: int | dict[str, Any], started_min_ago: float, **fields: Any) -> dict[str, Any]:
    """The training job with a time limit and GPUs, as ``squeue --json`` prints it (start on the test's clock)."""
    job = _qjob(TRAIN, "node[1-2,4]", partition="high", name="train", user=ME)
    job.update(
        account="ml-team",
        qos="gold",
        time_limit=limit_min,
        start_time=int(NOW - 60 * started_min_ago),
        node_count=3,
        tres_per_node="gres:gpu:8",
        tres_alloc_str="cpu=96,node=3,billing=96,gres/gpu=24",
    )
    job.update(fields)
    return job


def _gpu_request(fake: FakeSlurm, train: dict[str, Any], cfg: BorrowConfig = POLICY) -> tuple[dict[str, Any], str]:
    fake.set_queue([train, *BEFORE[1:]], [train, *AFTER[1:]])
    manager = BorrowManager(
        cfg, fake.slurm(), "node1", lambda j, k, f: None, poll_s=0.05, threaded=False, wall=lambda: NOW
    )
    manager.request(_training(), by="uid 0 pid 1")
    manager.drain()
    (state,) = manager.requests_of(TRAIN)["requests"]
    sbatch = fake.calls("sbatch")
    return state, sbatch[0] if sbatch else ""


def test_the_holder_asks_for_the_jobs_gres_account_qos_and_at_most_its_remaining_time(fake: FakeSlurm) -> None:
    """A borrowed node comes with what the job had: its GPUs per node (an exclusive holder gets the node's GRES
    only implicitly, and a step in it none), billed to its account under its QOS, ending no later than the job:
    120 min limit, started 30.5 min ago -> 89 whole minutes left."""
    state, sbatch = _gpu_request(fake, _gpu_training(limit_min=120, started_min_ago=30.5))
    assert state["state"] == "acquired" and state["gres"] == "gpu:8", state
    for option in ("--gres=gpu:8", "--account=ml-team", "--qos=gold", "--time=89", "--partition=high"):
        assert option in sbatch.split(), (option, sbatch)
    # 24.11's shapes; a --gpus=N job (per job: the allocation divided by its nodes); the policy's QOS wins
    cfg = BorrowConfig(enabled=True, partitions="low", holder_partition="high", holder_qos="borrow", timeout_s=5.0)
    train = _gpu_training(
        limit_min={"set": True, "infinite": False, "number": 600},
        started_min_ago=0,
        tres_per_node="",
        tres_per_job="gres/gpu:24",
    )
    train["node_count"] = {"set": True, "infinite": False, "number": 3}
    fake.log.write_text("")
    state, sbatch = _gpu_request(fake, train, cfg)
    assert state["gres"] == "gpu:8" and "--qos=borrow" in sbatch.split() and "--time=600" in sbatch.split(), sbatch


def test_a_job_without_gres_or_time_limit_asks_for_neither_and_the_job_qos_can_be_left_out(fake: FakeSlurm) -> None:
    train = _gpu_training(limit_min={"set": False, "infinite": True, "number": 0}, started_min_ago=5)
    train.update(tres_per_node="", tres_alloc_str="cpu=3,node=3,billing=3")
    cfg = BorrowConfig(enabled=True, partitions="low", holder_partition="high", holder_qos_from_job=False)
    state, sbatch = _gpu_request(fake, train, cfg)
    assert state["state"] == "acquired" and state["gres"] == ""
    assert not [a for a in sbatch.split() if a.startswith(("--gres", "--time", "--qos"))], sbatch
    assert "--account=ml-team" in sbatch.split()


def test_a_job_with_less_than_a_minute_left_borrows_nothing(fake: FakeSlurm) -> None:
    state, sbatch = _gpu_request(fake, _gpu_training(limit_min=60, started_min_ago=59.5))
    assert state["state"] == "failed" and "less than a minute of its time limit left" in state["reason"]
    assert sbatch == ""


def test_beyond_the_limit_is_refused_before_slurm_is_asked(fake: FakeSlurm) -> None:
    fake.set_queue(BEFORE, AFTER)
    manager, events = _manager(fake)
    manager.request(_training(), by="uid 0 pid 1")
    calls = len(fake.calls())
    with pytest.raises(BorrowRefused, match=r"already holds 1 borrowed node.*limit is 1"):
        manager.request(_training(), by="uid 0 pid 2")
    manager.drain()
    assert len(fake.calls()) == calls
    assert [k for _, k, _ in events] == ["borrow.acquired", "borrow.refused"]


def test_holders_in_slurm_count_against_the_limit(fake: FakeSlurm) -> None:
    fake.set_queue([*BEFORE, _qjob(777, "node6", partition="high", name=holder_name(TRAIN), user=ME)])
    manager, events = _manager(fake)
    manager.request(_training(), by="uid 0 pid 1")
    manager.drain()
    assert fake.calls("sbatch") == []
    ((_, kind, fields),) = events
    assert kind == "borrow.refused" and "holders 777" in fields["reason"]


def test_a_job_that_did_not_ask_for_borrow_is_refused(fake: FakeSlurm, caplog: pytest.LogCaptureFixture) -> None:
    fake.set_queue(BEFORE, AFTER)
    manager, events = _manager(fake)
    with caplog.at_level(logging.WARNING, "clockwork.daemon.borrow"):
        with pytest.raises(BorrowRefused, match=r"not submitted with --clockwork-spares=borrow.*standby"):
            manager.request(_training({"ft": "aware", "spares": "standby"}), by="uid 1000 pid 7")
    assert "borrow refused for uid 1000 pid 7" in caplog.text
    assert fake.calls() == [] and [k for _, k, _ in (manager.drain() or events)] == ["borrow.refused"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ft": "off", "spares": "borrow"}, "not submitted with --clockwork-ft"),
        ({"ft": "OFF", "spares": "borrow"}, "not submitted with --clockwork-ft"),  # off is off in any spelling
        ({"ft": "sometimes", "spares": "borrow"}, "CLOCKWORK_FT='sometimes': expected one of"),
    ],
)
def test_a_job_without_fault_tolerance_is_refused(fake: FakeSlurm, options: dict[str, str], message: str) -> None:
    fake.set_queue(BEFORE, AFTER)
    manager, _ = _manager(fake)
    with pytest.raises(BorrowRefused, match=message):
        manager.request(_training(options), by="uid 1000 pid 7")
    assert fake.calls() == []


def test_disabled_borrowing_refuses_everyone(fake: FakeSlurm) -> None:
    manager, _ = _manager(fake, BorrowConfig())
    with pytest.raises(BorrowRefused, match="disabled"):
        manager.request(_training(), by="uid 0 pid 1")


def test_no_candidate_fails_at_once_with_the_reason(fake: FakeSlurm) -> None:
    fake.set_queue([BEFORE[0], _qjob(500, "node5", requeue=False)])
    state, events = _one_request(fake)
    assert state["state"] == "failed" and "no node can be borrowed" in state["reason"]
    assert "job 500: not requeueable" in state["reason"]
    assert fake.calls("sbatch") == [] and events[0][1] == "borrow.refused"


def test_a_holder_slurm_does_not_start_in_time_is_cancelled(fake: FakeSlurm) -> None:
    pending = [*BEFORE, _qjob(900, "", partition="high", name=holder_name(TRAIN), state="PENDING", user=ME)]
    fake.set_queue(BEFORE, pending)
    state, events = _one_request(
        fake, BorrowConfig(enabled=True, partitions="low", holder_partition="high", timeout_s=1.0)
    )
    assert state["state"] == "failed" and "within 1 s" in state["reason"]
    assert fake.calls("scancel") == ["scancel 900"]
    # job 500 was labelled before the release; nothing preempted it, so the label is taken back
    assert [c for c in fake.calls("scontrol") if "JobId=500" in c][-1] == "scontrol update JobId=500 AdminComment="
    assert events[0][1] == "borrow.refused" and events[0][2]["holder"] == 900


def test_a_holder_slurm_will_not_release_is_cancelled_and_the_label_taken_back(fake: FakeSlurm) -> None:
    fake.set_queue(BEFORE, AFTER)
    fake._add("scontrol", '[ "$1" = release ] && { echo "scontrol: error: Access/permission denied" >&2; exit 1; }')
    state, events = _one_request(fake)
    assert state["state"] == "failed" and "permission denied" in state["reason"]
    assert fake.calls("scancel") == ["scancel 900"]
    labels = [c for c in fake.calls("scontrol") if "JobId=500" in c]
    assert labels == [
        f"scontrol update JobId=500 AdminComment={preempted_comment(TRAIN, 'node5', 900)}",
        "scontrol update JobId=500 AdminComment=",
    ]
    assert events[0][1] == "borrow.failed"


def test_slurm_refusing_the_holder_fails_the_request(fake: FakeSlurm) -> None:
    fake.set_queue(BEFORE)
    fake._add("sbatch", 'echo "sbatch: error: Batch job submission failed: Invalid qos specification" >&2; exit 1')
    state, events = _one_request(fake)
    assert state["state"] == "failed" and "Invalid qos specification" in state["reason"]
    assert events[0][1] == "borrow.failed"


def test_give_back_cancels_the_jobs_holders_found_in_slurm(fake: FakeSlurm) -> None:
    fake.set_queue(AFTER)
    manager, events = _manager(fake)
    assert manager.release(TRAIN, "job 100 ended") == [900]
    assert fake.calls("scancel") == ["scancel 900"]
    manager.drain()
    assert [(k, f["node"], f["why"]) for _, k, f in events] == [("borrow.released", "node5", "job 100 ended")]
    assert manager.release(555, "nothing held") == []


# ----------------------------------------------------------------------- through the daemon's request path


@pytest.fixture
def daemon(tmp_path: Path, fake: FakeSlurm) -> Daemon:
    cfg = DaemonConfig(run_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"), node_name="node1")
    d = Daemon(cfg, DaemonPaths.from_config(cfg))
    d.registry = Registry(tmp_path / "state", "node1")
    d.registry.load()
    d.registry.register(
        TRAIN, OWNER.pw_uid, OWNER.pw_name, ["node1", "node2"], {"ft": "aware", "spares": "borrow"}, by="t"
    )
    d.registry.register(101, OTHER_UID, "carol", ["node6"], {"ft": "aware", "spares": "standby"}, by="test")
    d.components["borrow"] = BorrowManager(POLICY, fake.slurm(), "node1", d.record_event, threaded=False)
    return d


def _ask(d: Daemon, uid: int, op: str, **fields: Any) -> dict[str, Any]:
    reply = msgpack.unpackb(d.handle(encode_request(op, **fields), Caller("local", uid=uid, gid=uid, pid=42)))
    return reply


def test_only_the_owner_of_a_borrow_job_may_borrow(daemon: Daemon, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "clockwork.daemon"):
        other = _ask(daemon, OTHER_UID, "borrow", job_id=TRAIN)
        not_borrow = _ask(daemon, OTHER_UID, "borrow", job_id=101)
    assert other["error"]["code"] == FORBIDDEN and f"belongs to uid {OWNER.pw_uid}" in other["error"]["message"]
    assert not_borrow["error"]["code"] == FORBIDDEN
    assert "not submitted with --clockwork-spares=borrow" in not_borrow["error"]["message"]
    assert f"denied: uid {OTHER_UID} (pid 42) may not borrow job 100" in caplog.text
    assert f"borrow refused for uid {OTHER_UID} pid 42" in caplog.text
    assert daemon.counters["denied"] == 2
    manager = daemon.components["borrow"]
    assert isinstance(manager, BorrowManager)
    manager.drain()
    events, _ = daemon.registry.events(101)
    assert [e["kind"] for e in events if e["kind"].startswith("borrow")] == ["borrow.refused"]


def test_the_owners_borrow_is_recorded_in_the_jobs_events(daemon: Daemon, fake: FakeSlurm) -> None:
    fake.set_queue(BEFORE, AFTER)
    reply = _ask(daemon, OWNER.pw_uid, "borrow", job_id=TRAIN, lost_node="node3")
    assert reply["ok"] is True and reply["request"] == 1
    status = _ask(daemon, OWNER.pw_uid, "borrow_status", job_id=TRAIN)
    assert status["requests"][0]["state"] == "acquired"
    manager = daemon.components["borrow"]
    assert isinstance(manager, BorrowManager)
    manager.drain()
    events, _ = daemon.registry.events(TRAIN)
    acquired = [e for e in events if e["kind"] == "borrow.acquired"]
    assert acquired and acquired[0]["fields"]["from_job"] == 500
    assert f"--uid={OWNER.pw_uid}" in fake.calls("sbatch")[0].split()


def test_the_training_jobs_comment_keeps_its_borrows_through_the_epilog() -> None:
    from clockwork.contracts.borrow_comments import add_borrowed, borrowed_part, with_borrowed

    once = add_borrowed("", "node5", 500, 900)
    twice = add_borrowed(once, "node6", 501, 901)
    assert twice == "clockwork-borrowed: node5 from job 500 (holder 900), node6 from job 501 (holder 901)"
    assert borrowed_part(f"other note; {twice}") == twice
    summary = "clockwork: 0 link failovers, 0 migrations, 0 rollbacks; report=/r/100.json"
    assert with_borrowed(summary, f"x; {once}") == (
        f"clockwork: 0 link failovers, 0 migrations, 0 rollbacks; {once}; report=/r/100.json"
    )
    assert with_borrowed(summary, "") == summary


def test_node_status_shows_counts_only(fake: FakeSlurm) -> None:
    from clockwork.cli.node_cmd import _borrow_line

    fake.set_queue(BEFORE, AFTER)
    manager, _ = _manager(fake)
    manager.request(_training(), by="uid 0 pid 1")
    status = manager.status()
    assert status == {"enabled": True, "give_back": "job_end", "held": 1, "requests": 1, "failed": 0}
    assert _borrow_line(status) == "on; 1 node(s) held now, 1 request(s) (0 failed); give back at job_end"
    assert _borrow_line({"enabled": False, "state": "disabled ([borrow] enabled = false)"}).startswith("off (disabled")


def test_node_return_gives_back_once_the_home_node_is_back_and_the_guest_left(fake: FakeSlurm) -> None:
    fake.set_queue(BEFORE, AFTER)
    cfg = BorrowConfig(enabled=True, partitions="low", holder_partition="high", give_back="node_return")
    manager, events = _manager(fake, cfg)
    manager.request(_training(), by="uid 0 pid 1", lost_node="node3")
    nodes = json.loads((fake.dir / "sinfo.json").read_text())

    def node3(state: str, flags: list[str]) -> None:
        for n in nodes["nodes"]:
            if n["name"] == "node3":
                n["state"], n["state_flags"] = state, flags
        (fake.dir / "sinfo.json").write_text(json.dumps(nodes))

    node3("down", ["NOT_RESPONDING"])
    manager._watch()
    assert fake.calls("scancel") == []  # the home node is still down
    node3("idle", [])
    fake.steps.write_text("900.batch\n900.0\n")
    manager._watch()
    assert fake.calls("scancel") == []  # back, but the replacement rank still runs in the holder
    fake.steps.write_text("900.batch\n")
    manager._watch()
    assert fake.calls("scancel") == ["scancel 900"]
    manager.drain()
    assert events[-1][1] == "borrow.released" and "node3 is back" in events[-1][2]["why"]


def test_a_failed_borrow_is_not_retried_at_once(fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch) -> None:
    from clockworkd.borrow import manager as manager_module

    fake.set_queue([BEFORE[0]])  # nothing to borrow
    manager, _ = _manager(fake)
    manager.request(_training(), by="uid 0 pid 1")
    calls = len(fake.calls())
    with pytest.raises(BorrowRefused, match="last borrow failed moments ago"):
        manager.request(_training(), by="uid 0 pid 1")
    assert len(fake.calls()) == calls  # the controller was not asked again
    monkeypatch.setattr(manager_module, "RETRY_AFTER_S", 0.0)
    manager.request(_training(), by="uid 0 pid 1")
    assert len(fake.calls()) > calls


class FakeClocks:
    """A manager's time, moved only by its own sleeps and by the test: no real second passes for a timeout."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.wall0 = time.time()  # the fake queue's start times are real epoch seconds
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.wall0 + (self.t - 1000.0)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def _clocked_manager(
    fake: FakeSlurm, clocks: FakeClocks, cfg: BorrowConfig = POLICY
) -> tuple[BorrowManager, list[tuple[int, str, dict[str, Any]]]]:
    events: list[tuple[int, str, dict[str, Any]]] = []
    manager = BorrowManager(
        cfg,
        fake.slurm(),
        "node1",
        lambda j, k, f: events.append((j, k, f)),
        monotonic=clocks.monotonic,
        wall=clocks.wall,
        sleep=clocks.sleep,
        poll_s=30.0,
        threaded=False,
    )
    return manager, events


def test_the_managers_timeouts_run_on_its_injected_clock_only(fake: FakeSlurm) -> None:
    """A ten-minute holder timeout and the retry delay pass on the injected clock in well under ten minutes."""
    from clockworkd.borrow.manager import RETRY_AFTER_S

    pending = [*BEFORE, _qjob(900, "", partition="high", name=holder_name(TRAIN), state="PENDING", user=ME)]
    fake.set_queue(BEFORE, pending)
    clocks = FakeClocks()
    cfg = BorrowConfig(enabled=True, partitions="low", holder_partition="high", timeout_s=600.0)
    manager, events = _clocked_manager(fake, clocks, cfg)
    assert manager.next_deadline() == clocks.t + 3600.0  # give_back = job_end: nothing to watch
    started = time.monotonic()
    manager.request(_training(), by="uid 0 pid 1")
    assert time.monotonic() - started < 300  # the real clock: subprocesses only, never 600 s
    manager.drain()
    (state,) = manager.requests_of(TRAIN)["requests"]
    assert state["state"] == "failed" and "within 600 s" in state["reason"]
    assert clocks.slept == [30.0] * 20  # looked at the holder every poll_s of fake time until the deadline
    assert state["requested_at"] == clocks.wall0
    assert events[0][2]["total_ms"] >= 600_000  # timings are measured on the injected clock too
    assert fake.calls("scancel") == ["scancel 900"]

    fake.set_queue([BEFORE[0]])  # nothing to borrow any more: a retry fails at once
    clocks.t += RETRY_AFTER_S - 1.0
    with pytest.raises(BorrowRefused, match=r"ask again in 1\.0 s"):
        manager.request(_training(), by="uid 0 pid 1")
    clocks.t += 1.0
    manager.request(_training(), by="uid 0 pid 1")  # the delay is over on the injected clock
    assert len(manager.requests_of(TRAIN)["requests"]) == 2


def test_held_time_is_measured_on_the_monotonic_clock_not_the_wall(fake: FakeSlurm) -> None:
    fake.set_queue(BEFORE, AFTER)
    clocks = FakeClocks()
    manager, events = _clocked_manager(fake, clocks)
    manager.request(_training(), by="uid 0 pid 1", lost_node="node3")
    clocks.t += 42.0
    clocks.wall0 -= 3600.0  # the wall clock is set back an hour: a duration must not notice
    assert manager.release(TRAIN, "job 100 ended") == [900]
    manager.drain()
    assert events[-1][1] == "borrow.released" and events[-1][2]["held_s"] == 42.0
