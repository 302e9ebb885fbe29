"""The Prolog/Epilog's daemon work without Slurm: a real clockworkd started, adopted, registered, reported.

Slurm itself is the integration tests' business; here the hooks run as functions against a daemon in
a temporary run folder, so the start/adopt/restart logic and require_daemon are checked on any machine.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clockwork.contracts.config import load_config
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import DaemonPaths
from slurm_hooks import events, runner

ENV = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_UID": "1001",
    "SLURM_JOB_USER": "alice",
    "SLURMD_NODENAME": "n1",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_JOB_EXIT_CODE2": "0:0",
    "SPANK_CLOCKWORK_FT": "aware",
    "SPANK_CLOCKWORK_SPARES": "none",
}


@pytest.fixture
def site() -> Iterator[dict[str, Path]]:
    """A config whose daemon lives in a short temporary folder; any daemon started is stopped after."""
    with tempfile.TemporaryDirectory(prefix="cwh-", dir="/tmp") as tmp:
        root = Path(tmp)
        config = root / "clockwork.toml"
        config.write_text(
            f'[log]\nfile = "{root / "log"}"\n[hooks]\nspool_dir = "{root / "spool"}"\n'
            f'[daemon]\nnode_name = "n1"\nrun_dir = "{root / "run"}"\nstate_dir = "{root / "lib"}"\n'
            f'curve_secret_key = "{root / "keys/daemon.key_secret"}"\ncurve_public_key = "{root / "keys/daemon.key"}"\n'
            f'[slurm]\nbackend = "cli"\nconf = "{root / "no-slurm.conf"}"\ntimeout_s = 2\n'
        )
        yield {"root": root, "config": config, "spool": root / "spool", "run": root / "run", "log": root / "log"}
        pid_file = root / "run" / "clockworkd.pid"
        if pid_file.is_file():
            stop_daemon(int(pid_file.read_text().split()[0]))


def stop_daemon(pid: int) -> None:
    """SIGKILL the daemon and wait until it is gone (reaping it: the hook started it as our child)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            if not Path(f"/proc/{pid}").exists():
                return
        time.sleep(0.02)


def paths(site: dict[str, Path]) -> DaemonPaths:
    return DaemonPaths.from_config(load_config(site["config"], env={}).config.daemon)


def daemon_actions(site: dict[str, Path]) -> list[str]:
    return [e["event"] for e in events.read(site["spool"], 77) if e["event"].startswith("daemon.")]


def test_prolog_starts_then_adopts_the_daemon_and_registers_the_job(site: dict[str, Path]) -> None:
    env = {**ENV, "CLOCKWORK_CONFIG": str(site["config"])}
    assert runner.main(["prolog"], env) == 0
    assert runner.main(["prolog"], env) == 0  # idempotent: the second run adopts the live daemon
    assert daemon_actions(site) == ["daemon.started", "daemon.adopted"]
    with DaemonClient(paths(site)) as client:
        job = {j["job_id"]: j for j in client.jobs()}[77]
    assert job["uid"] == 1001 and job["nodes"] == ["n1", "n2"] and job["options"]["ft"] == "aware"


def test_epilog_writes_the_report_and_unregisters_even_without_slurm(site: dict[str, Path]) -> None:
    env = {**ENV, "CLOCKWORK_CONFIG": str(site["config"])}
    assert runner.main(["prolog"], env) == 0
    with DaemonClient(paths(site)) as client:
        client.post_event(77, "link.failover", {"nic": "nic0"})
        client.post_event(77, "torchpass.coordinator", {"leader": "tcp://n1:21000", "key": "ab" * 32})
        client.post_event(77, "torchpass.migrated", {"slot": 1})
        for rank in (0, 1):  # a restore is reported by every rank that loads the snapshot: one rollback
            client.post_event(77, "torchpass.restored", {"step": 40, "rank": rank})
    assert runner.main(["epilog"], env) == 0  # the AdminComment fails (no Slurm here): logged, not fatal
    text = (paths(site).reports_dir / "77.json").read_text()
    report = json.loads(text)
    assert report["counts"] == {"link failovers": 1, "migrations": 1, "rollbacks": 1}
    assert [e["kind"] for e in report["events"]][:3] == ["job.registered", "link.failover", "torchpass.coordinator"]
    assert report["events"][2]["fields"] == {"leader": "tcp://n1:21000", "key": "(redacted)"}  # no job key
    assert "ab" * 32 not in text
    with DaemonClient(paths(site)) as client:
        assert {j["job_id"]: j for j in client.jobs()}[77]["state"] == "ended"
    assert "hook failed (ignored" in site["log"].read_text()


def test_hung_daemon_is_restarted(site: dict[str, Path]) -> None:
    env = {**ENV, "CLOCKWORK_CONFIG": str(site["config"])}
    assert runner.main(["prolog"], env) == 0
    pid = int((site["run"] / "clockworkd.pid").read_text().split()[0])
    os.kill(pid, signal.SIGSTOP)  # alive, holds its pid file and socket, answers nothing
    try:
        assert runner.main(["prolog"], env) == 0
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert daemon_actions(site) == ["daemon.started", "daemon.restarted"]
    with DaemonClient(paths(site)) as client:
        assert client.ping()["pid"] != pid


@pytest.mark.parametrize(("require", "code"), [(False, 0), (True, 1)])
def test_unstartable_daemon_fails_the_prolog_only_when_required(
    site: dict[str, Path], require: bool, code: int
) -> None:
    site["run"].write_text("a file where the run folder should be\n")
    env = {**ENV, "CLOCKWORK_CONFIG": str(site["config"]), "CLOCKWORK_HOOKS_REQUIRE_DAEMON": str(require).lower()}
    assert runner.main(["prolog"], env) == code
    assert daemon_actions(site) == ["daemon.failed", "daemon.unavailable"]


def _fake_slurm_clients(site: dict[str, Path], queue: dict[str, Any]) -> Path:
    """Slurm's clients as fakes (no controller runs in a unit test): sinfo says 22.05, squeue answers ``queue``,
    scancel and scontrol succeed; every call is logged to the returned file, and the site's config points at them."""
    root = site["root"]
    fake_bin = root / "bin"
    fake_bin.mkdir()
    calls = root / "calls.log"
    (root / "queue.json").write_text(json.dumps(queue))
    tools = (
        ("sinfo", 'echo "slurm 22.05.8"'),  # the backend asks the release first (which JSON layout to ask for)
        ("squeue", f"cat {root / 'queue.json'}"),
        ("scancel", "exit 0"),
        ("scontrol", "exit 0"),
    )
    for tool, body in tools:
        script = fake_bin / tool
        script.write_text(f'#!/bin/sh\nprintf "%s\\n" "{tool} $*" >> {calls}\n{body}\n')
        script.chmod(0o755)
    site["config"].write_text(site["config"].read_text().replace("[slurm]\n", f'[slurm]\nbin_dir = "{fake_bin}"\n'))
    return calls


def test_epilog_names_the_moved_slots_in_the_admin_comment(site: dict[str, Path]) -> None:
    """The AdminComment names where replaced ranks went (node/local index) and, where the layout names one, the
    part of the state each received, from the ``torchpass.placement`` event the node agent posts at the job's end;
    the report keeps them too."""
    job = {"job_id": 77, "name": "train", "job_state": "COMPLETING", "user_name": "alice", "partition": "high",
           "nodes": "n[1-2]", "admin_comment": ""}  # fmt: skip
    calls = _fake_slurm_clients(site, {"jobs": [job], "errors": []})
    env = {**ENV, "CLOCKWORK_CONFIG": str(site["config"])}
    assert runner.main(["prolog"], env) == 0
    moved = {
        "3": {"from": "n2/1", "to": "n1/1", "part": "stage 1 of the 2x2 pipeline"},
        "2": {"from": "n2/0", "to": "n1/0"},
    }
    with DaemonClient(paths(site)) as client:
        client.post_event(77, "torchpass.placement", {"slots": moved, "moved": 2, "ranks_per_node": 2})
    assert runner.main(["epilog"], env) == 0
    (comment,) = [c for c in calls.read_text().splitlines() if c.startswith("scontrol update JobId=77")]
    stage = "(stage 1 of the 2x2 pipeline)"
    assert f"rollbacks; slots moved: 2 n2/0->n1/0, 3 n2/1->n1/1 {stage}; report=" in comment, comment
    report = json.loads((paths(site).reports_dir / "77.json").read_text())
    assert report["slots_moved"] == moved and report["slots_moved_total"] == 2


def test_epilog_of_a_borrow_job_gives_its_nodes_back_and_keeps_the_note(site: dict[str, Path]) -> None:
    """A real clockworkd with borrowing on; Slurm's clients are fakes (no controller runs in a unit test)."""
    queue = {
        "jobs": [
            {"job_id": 77, "name": "train", "job_state": "COMPLETING", "user_name": "alice", "partition": "high",
             "nodes": "n[1-2]", "admin_comment": "clockwork-borrowed: node5 from job 500 (holder 900)"},
            {"job_id": 900, "name": "clockwork-hold-77", "job_state": "RUNNING", "user_name": "alice",
             "partition": "high", "nodes": "node5", "admin_comment": ""},
        ],
        "errors": [],
    }  # fmt: skip
    calls = _fake_slurm_clients(site, queue)
    text = site["config"].read_text()
    site["config"].write_text(text + '[borrow]\nenabled = true\npartitions = "low"\nholder_partition = "high"\n')
    env = {**ENV, "SPANK_CLOCKWORK_SPARES": "borrow", "CLOCKWORK_CONFIG": str(site["config"])}
    assert runner.main(["prolog"], env) == 0
    assert runner.main(["epilog"], env) == 0
    log = calls.read_text().splitlines()
    assert "scancel 900" in log
    (comment,) = [c for c in log if c.startswith("scontrol update JobId=77")]
    assert "clockwork-borrowed: node5 from job 500 (holder 900); report=" in comment
    report = json.loads((paths(site).reports_dir / "77.json").read_text())
    released = [e["fields"] for e in report["events"] if e["kind"] == "borrow.released"]
    assert released == [{"holder": 900, "node": "node5", "why": "job 77 ended", "held_s": None}]


def test_the_admin_comment_names_the_first_moved_slots_within_its_limit() -> None:
    """A job that moved hundreds of ranks: the comment lists the first slots that fit and counts the rest."""
    from slurm_hooks import report

    moved = {str(s): {"from": f"gpu-node-{s // 8:04d}/{s % 8}", "to": f"gpu-node-9{s:03d}/0"} for s in range(300)}
    counts = {"link failovers": 0, "migrations": 0, "rollbacks": 0}
    line = report.summary({"counts": counts, "slots_moved": moved, "slots_moved_total": 512}, Path("/r/77.json"))
    part = line.split("; ")[1]
    assert part.startswith("slots moved: 0 gpu-node-0000/0->gpu-node-9000/0, 1 ") and line.endswith(
        "; report=/r/77.json"
    )
    shown = part.count("->")
    assert 0 < shown < 300 and part.endswith(f", +{512 - shown} more"), part
    assert len(part) <= len("slots moved: ") + report.SLOTS_MAX_CHARS
    plain = report.summary({"counts": counts, "slots_moved": {}, "slots_moved_total": 0}, Path("/r/77.json"))
    assert plain == "clockwork: 0 link failovers, 0 migrations, 0 rollbacks; report=/r/77.json"
