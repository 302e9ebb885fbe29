"""The CLI backend: its JSON and text parsers on what real Slurm clients printed, and its command handling.

The parsers read recordings of Slurm 22.05.8 (the host's), 24.11.5 (the sandbox's Debian 13 root) and 26.05.5
(the sandbox's Debian sid root) under
data/slurm/VERSION/, made by data/slurm/record.py from a sandbox it put into a known state; that state is in each
folder's manifest.json (job ids by role, the drained node and its reason, the comments set, each node's address).
Every parser test runs on every release and checks the parsed records against the manifest: what the scenario
made, not what the recording says.

Command handling is exercised through fake client executables in a temporary ``bin_dir`` (public
configuration of the backend) that print those recordings and log their argv and SLURM_CONF.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clockwork.contracts.errors import SlurmError
from clockwork.contracts.slurm import SlurmBackend
from clockwork.contracts.slurm.backend import JobInfo, NodeInfo, node_state
from clockwork.contracts.slurm.cli_backend import (
    CliBackend,
    SlurmTimeoutError,
    format_wait_status,
    json_errors,
    parse_nodes_json,
    parse_sacct_parsable,
    parse_scontrol_jobs,
    parse_scontrol_nodes,
    parse_scontrol_record,
    parse_squeue_json,
    parse_version,
)
from clockwork.contracts.slurm.data_parser import DATA_PARSERS, data_parser, json_option

DATA = Path(__file__).parent / "data" / "slurm"
RELEASES = ("22.05", "24.11", "26.05")


@dataclass(frozen=True)
class Recording:
    """One release's recorded client output and the manifest of the state it was recorded in."""

    version: str
    folder: Path

    @property
    def manifest(self) -> dict[str, Any]:
        data = json.loads((self.folder / "manifest.json").read_text())
        assert isinstance(data, dict)
        return data

    def json(self, name: str) -> dict[str, Any]:
        doc = json.loads((self.folder / name).read_text())
        assert isinstance(doc, dict)
        return doc

    def text(self, name: str) -> str:
        return (self.folder / name).read_text()

    def path(self, name: str) -> Path:
        return self.folder / name

    def job(self, role: str) -> int:
        return int(self.manifest["jobs"][role])

    @property
    def json_option(self) -> str:
        """What the backend asks this release's clients for: ``--json=v0.0.42`` from 24.11, plain before."""
        return json_option(parse_version(self.text("version.txt")))

    @property
    def nodes_json(self) -> str:
        """The node listing the backend reads for this release (sinfo before 23.02, scontrol from it)."""
        return "sinfo.json" if self.version == "22.05" else "scontrol_show_node.json"

    @property
    def lists_ended_jobs(self) -> bool:
        """22.05's ``squeue --json`` ignores every filter and lists ended jobs too; 24.11 applies the default
        state filter (and ``--jobs``)."""
        return self.version == "22.05"


R2205 = Recording("22.05", DATA / "22.05")
R2411 = Recording("24.11", DATA / "24.11")
R2605 = Recording("26.05", DATA / "26.05")


@pytest.fixture(params=[R2205, R2411, R2605], ids=RELEASES)
def rec(request: pytest.FixtureRequest) -> Recording:
    recording = request.param
    assert isinstance(recording, Recording)
    return recording


# ---------------------------------------------------------------------------------------- parsers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("slurm-wlm 22.05.8\n", (22, 5, 8)),
        ("slurm 23.11.1\n", (23, 11, 1)),
        ("slurm 24.05.0-0rc1\n", (24, 5, 0)),
        ("slurm 20.11\n", (20, 11, 0)),
    ],
)
def test_parse_version(text: str, expected: tuple[int, int, int]) -> None:
    assert parse_version(text) == expected


def test_parse_version_rejects_garbage() -> None:
    with pytest.raises(SlurmError, match="version"):
        parse_version("sinfo: fatal: Could not establish a configuration source")


def test_recorded_version(rec: Recording) -> None:
    major, minor, _ = parse_version(rec.text("version.txt"))
    assert f"{major}.{minor:02d}" == rec.version


def _expected_live_jobs(rec: Recording) -> dict[int, JobInfo]:
    """The jobs the scenario left queued or running, as the manifest says they are."""
    m = rec.manifest
    common = {"user": m["user"], "partition": m["partition"], "exit_code": "0:0"}
    return {
        rec.job("running"): JobInfo(
            rec.job("running"),
            "running",
            "RUNNING",
            nodes=["node1", "node2"],
            restart_count=0,
            admin_comment=m["live_comment"],
            **common,
        ),
        rec.job("held"): JobInfo(
            rec.job("held"), "held", "PENDING", nodes=[], restart_count=0, admin_comment="", **common
        ),
        rec.job("requeued"): JobInfo(
            rec.job("requeued"), "requeued", "PENDING", nodes=[], restart_count=1, admin_comment="", **common
        ),
    }


def _expected_ended_jobs(rec: Recording) -> dict[int, tuple[str, str, list[str]]]:
    """(state, exit code, nodes) of the jobs that ended: ``exit 3``, and a ``sleep`` ended by scancel's SIGTERM."""
    return {
        rec.job("exits-three"): ("FAILED", "3:0", ["node1"]),
        rec.job("cancelled"): ("CANCELLED", "0:15", ["node1"]),
    }


def test_squeue_json(rec: Recording) -> None:
    jobs = {j.job_id: j for j in parse_squeue_json(rec.json("squeue.json"))}
    live = _expected_live_jobs(rec)
    for job_id, expected in live.items():
        assert jobs[job_id] == expected
        assert not jobs[job_id].finished
    ended = _expected_ended_jobs(rec)
    if rec.lists_ended_jobs:
        assert sorted(jobs) == sorted([*live, *ended])
        for job_id, (state, exit_code, nodes) in ended.items():
            assert (jobs[job_id].state, jobs[job_id].exit_code, jobs[job_id].nodes) == (state, exit_code, nodes)
            assert jobs[job_id].finished
    else:
        assert sorted(jobs) == sorted(live)


def test_squeue_json_of_one_ended_job(rec: Recording) -> None:
    """What CliBackend.job() runs (``--states=all --jobs=N``) finds a job that ended; without --states=all 24.11
    finds nothing, and 22.05 dumps every job whatever the filters."""
    failed = rec.job("exits-three")
    plain = [j.job_id for j in parse_squeue_json(rec.json("squeue_finished_job.json"))]
    every = {j.job_id: j for j in parse_squeue_json(rec.json("squeue_finished_job_all_states.json"))}
    if rec.lists_ended_jobs:
        assert sorted(plain) == sorted(every) == sorted(rec.manifest["jobs"].values())
    else:
        assert plain == []
        assert list(every) == [failed]
    job = every[failed]
    assert (job.name, job.state, job.exit_code, job.nodes, job.finished) == (
        "exits-three",
        "FAILED",
        "3:0",
        ["node1"],
        True,
    )


def test_a_flag_state_wins_over_the_base_state(rec: Recording) -> None:
    """A requeued job that is pending again reads REQUEUED, as scontrol prints it: 22.05 gives that one string,
    24.11 a list (base state first, then flags). The recorded running job, its state set as each release
    writes a requeued one."""
    doc = rec.json("squeue.json")
    (job,) = [j for j in doc["jobs"] if j["job_id"] == rec.job("running")]
    job["job_state"] = "REQUEUED" if rec.version == "22.05" else ["PENDING", "REQUEUED"]
    (parsed,) = [j for j in parse_squeue_json({"jobs": [job]})]
    assert parsed.state == "REQUEUED" and not parsed.finished


def test_squeue_json_without_jobs_list_is_an_error() -> None:
    with pytest.raises(SlurmError, match="jobs"):
        parse_squeue_json({"meta": {}, "errors": []})


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (0, "0:0"),
        (256, "1:0"),
        (3 << 8, "3:0"),
        (137 << 8, "137:0"),
        (9, "0:9"),
        (15, "0:15"),
        (0xFFFFFFFE, "0:0"),
        (0x7F, "0:0"),
    ],
)
def test_format_wait_status(status: int, expected: str) -> None:
    assert format_wait_status(status) == expected


def test_json_errors_with_the_controller_down(rec: Recording) -> None:
    """22.05 exits 0 and tells only in "errors"; 24.11 exits 1 and prints no JSON, only its error."""
    exits = rec.manifest["controller_down_exit"]
    if rec.version == "22.05":
        assert exits == {"squeue_controller_down.json": 0, "sinfo_controller_down.json": 0}
        squeue = json_errors(rec.json("squeue_controller_down.json"))
        assert squeue == [(-1, "Failed while looking for jobs: Unspecified error: slurm_load_jobs")]
        assert json_errors(rec.json("sinfo_controller_down.json")) == [(-1, "Unspecified error")]
    else:
        assert set(exits.values()) == {1}
        for name in exits:
            assert rec.text(name) == ""
            assert "Unable to contact slurm controller" in rec.text(name.replace(".json", ".stderr"))
    assert json_errors(rec.json("squeue.json")) == []


def _expected_nodes(rec: Recording) -> list[NodeInfo]:
    m = rec.manifest
    drained = m["drained"]["node"]
    return [
        NodeInfo(
            name,
            ("IDLE", "DRAIN") if name == drained else ("MIXED",),  # node1 and node2 each run a 1-CPU job of 2
            addr,
            m["partitions"],
            m["drained"]["reason"] if name == drained else "",
        )
        for name, addr in m["nodes"].items()
    ]


def test_nodes_json(rec: Recording) -> None:
    nodes = parse_nodes_json(rec.json(rec.nodes_json))
    assert nodes == _expected_nodes(rec)
    drained = next(n for n in nodes if n.name == rec.manifest["drained"]["node"])
    assert drained.has("drain") and drained.base_state == "IDLE"


def test_text_and_json_node_parsers_agree(rec: Recording) -> None:
    """``scontrol -o show node`` says the same (its reasons' ``[user@time]`` stamp dropped)."""
    assert parse_scontrol_nodes(rec.text("scontrol_show_node.txt")) == parse_nodes_json(rec.json(rec.nodes_json))


def test_scontrol_record_parsing() -> None:
    fields = parse_scontrol_record(
        "JobId=7 JobName=my job UserId=bob(1001) Dependency=(null) AllocNode:Sid=head:12 "
        "CPUs/Task=1 TRES=cpu=2,mem=2M,node=1 Power= Reason=link flap [root@2024-01-01T00:00:00]"
    )
    assert fields["JobId"] == "7"
    assert fields["JobName"] == "my job"
    assert fields["Dependency"] == ""
    assert fields["AllocNode:Sid"] == "head:12"
    assert fields["CPUs/Task"] == "1"
    assert fields["TRES"] == "cpu=2,mem=2M,node=1"
    assert fields["Power"] == ""
    assert fields["Reason"] == "link flap [root@2024-01-01T00:00:00]"
    assert "cpu" not in fields


def test_admin_comment_with_or_without_25_11s_trailing_space() -> None:
    """25.11's ``scontrol show job`` no longer prints a space after AdminComment; both read the same."""
    before = parse_scontrol_record("JobId=7 AdminComment=clockwork: recorded live  JobName=x")
    at_end = parse_scontrol_record("JobId=7 AdminComment=clockwork: recorded live ")
    after = parse_scontrol_record("JobId=7 AdminComment=clockwork: recorded live")
    assert before["AdminComment"] == at_end["AdminComment"] == after["AdminComment"] == "clockwork: recorded live"


def test_scontrol_job_text(rec: Recording) -> None:
    jobs = {j.job_id: j for j in parse_scontrol_jobs(rec.text("scontrol_show_job.txt"))}
    assert sorted(jobs) == sorted(rec.manifest["jobs"].values())
    for job_id, expected in _expected_live_jobs(rec).items():
        assert jobs[job_id] == expected
    for job_id, (state, exit_code, nodes) in _expected_ended_jobs(rec).items():
        assert (jobs[job_id].state, jobs[job_id].exit_code, jobs[job_id].nodes) == (state, exit_code, nodes)


def test_text_and_json_job_parsers_agree(rec: Recording) -> None:
    from_text = {j.job_id: j for j in parse_scontrol_jobs(rec.text("scontrol_show_job.txt"))}
    for job in parse_squeue_json(rec.json("squeue.json")):
        assert from_text[job.job_id] == job


@pytest.mark.parametrize(
    ("raw", "flags", "expected"),
    [
        ("IDLE+DRAIN", (), ("IDLE", "DRAIN")),
        ("idle", ("DRAIN",), ("IDLE", "DRAIN")),
        (["IDLE", "DRAIN"], (), ("IDLE", "DRAIN")),
        ("DOWN*", (), ("DOWN", "NOT_RESPONDING")),
        ("IDLE~", (), ("IDLE", "POWERED_DOWN")),
        ("DOWN+NOT_RESPONDING", ("NOT_RESPONDING",), ("DOWN", "NOT_RESPONDING")),
        ("mixed", (), ("MIXED",)),
        (None, (), ()),
        ("", (), ()),
    ],
)
def test_node_state_normalization(raw: Any, flags: tuple[str, ...], expected: tuple[str, ...]) -> None:
    assert node_state(raw, flags) == expected


def test_sacct_parsable(rec: Recording) -> None:
    rows = {r.job_id: r for r in parse_sacct_parsable(rec.text("sacct.txt"))}
    failed, cancelled, running = rec.job("exits-three"), rec.job("cancelled"), rec.job("running")
    job = rows[str(failed)]
    assert (job.state, job.exit_code, job.nodes) == ("FAILED", "3:0", ["node1"])
    assert job.admin_comment == rec.manifest["finished_comment"]  # set through slurmdbd after the end
    assert job.start and job.end and not job.is_step
    assert rows[f"{failed}.batch"].is_step and rows[f"{failed}.batch"].exit_code == "3:0"
    assert rows[str(cancelled)].state == "CANCELLED"  # "CANCELLED by 0"
    assert rows[f"{cancelled}.batch"].exit_code == "0:15"
    assert (rows[str(running)].state, rows[str(running)].end, rows[str(running)].nodes) == (
        "RUNNING",
        "",
        ["node1", "node2"],
    )
    for role in ("held", "requeued"):
        pending = rows[str(rec.job(role))]
        assert (pending.state, pending.nodes, pending.start, pending.end) == ("PENDING", [], "", "")
    allocations = parse_sacct_parsable(rec.text("sacct_allocations.txt"))
    assert [r.job_id for r in allocations] == [j for j in rows if "." not in j]
    assert all(r == rows[r.job_id] for r in allocations)


def test_sacct_unexpected_line_is_an_error() -> None:
    with pytest.raises(SlurmError, match="sacct"):
        parse_sacct_parsable("4240|COMPLETED|n01\n")


# ------------------------------------------------------------------------ commands (fake binaries)


class FakeSlurm:
    """A temporary bin_dir of /bin/sh scripts standing in for Slurm's clients."""

    def __init__(self, tmp_path: Path) -> None:
        self.bin_dir = tmp_path / "bin"
        self.bin_dir.mkdir()
        self.log = tmp_path / "calls.log"
        self.log.touch()
        self.conf = tmp_path / "etc" / "slurm.conf"

    def add(self, name: str, body: str) -> None:
        script = self.bin_dir / name
        script.write_text(
            f'#!/bin/sh\nprintf "%s|%s\\n" "{name} $*" "$SLURM_CONF" >> {shlex.quote(str(self.log))}\n{body}\n'
        )
        script.chmod(0o755)

    def cat(self, recording: Path) -> str:
        return f"cat {shlex.quote(str(recording))}"

    def calls(self) -> list[str]:
        return [line.split("|", 1)[0] for line in self.log.read_text().splitlines()]

    def backend(self, timeout_s: float = 10.0) -> CliBackend:
        return CliBackend(self.conf, bin_dir=self.bin_dir, timeout_s=timeout_s)

    def add_sinfo(self, version: str = "slurm-wlm 22.05.8", json_body: str = "exit 3") -> None:
        self.add(
            "sinfo",
            f'case "$1" in\n  --version) echo "{version}" ;;\n  --json*) {json_body} ;;\n'
            '  *) echo "unexpected sinfo $*" >&2; exit 9 ;;\nesac',
        )


@pytest.fixture
def fake(tmp_path: Path) -> FakeSlurm:
    return FakeSlurm(tmp_path)


def test_cli_backend_satisfies_protocol(fake: FakeSlurm) -> None:
    assert isinstance(fake.backend(), SlurmBackend)


def test_every_command_gets_our_slurm_conf_and_a_clean_env(
    fake: FakeSlurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env_dump = tmp_path / "env.txt"
    fake.add("sinfo", f"env > {shlex.quote(str(env_dump))}\necho 'slurm-wlm 22.05.8'")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/wrong.conf")
    monkeypatch.setenv("SQUEUE_FORMAT", "%i")
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")
    backend = fake.backend()
    assert backend.version() == (22, 5, 8)
    assert backend.version() == (22, 5, 8)  # cached: sinfo ran once
    env = dict(line.split("=", 1) for line in env_dump.read_text().splitlines() if "=" in line)
    assert env["SLURM_CONF"] == str(fake.conf)
    assert env["SLURM_TIME_FORMAT"] == "standard"
    assert "SQUEUE_FORMAT" not in env
    assert fake.log.read_text().splitlines() == [f"sinfo --version|{fake.conf}"]


def test_job_from_squeue_json(fake: FakeSlurm, rec: Recording) -> None:
    """job() of a job that ended: the recorded answer to the very command it runs (22.05 dumps every job, so the
    record is picked here; 24.11 lists that one job)."""
    fake.add_sinfo(version=rec.text("version.txt").strip())
    fake.add("squeue", fake.cat(rec.path("squeue_finished_job_all_states.json")))
    backend = fake.backend()
    failed = rec.job("exits-three")
    job = backend.job(failed)
    assert job is not None and (job.state, job.exit_code, job.nodes) == ("FAILED", "3:0", ["node1"])
    assert backend.job(999999) is None
    assert fake.calls() == [
        "sinfo --version",
        f"squeue {rec.json_option} --states=all --jobs={failed}",
        f"squeue {rec.json_option} --states=all --jobs=999999",
    ]


def test_job_json_rejected_falls_back_to_scontrol_once(fake: FakeSlurm, rec: Recording) -> None:
    running = rec.job("running")
    fake.add_sinfo(version=rec.text("version.txt").strip())
    fake.add("squeue", "echo \"squeue: unrecognized option '--json'\" >&2\nexit 1")
    fake.add(
        "scontrol",
        'case "$*" in\n'
        f'  "-o show job {running}") {fake.cat(rec.path("scontrol_show_job.txt"))} ;;\n'
        '  "-o show job 999999") echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;\n'
        "  *) exit 9 ;;\nesac",
    )
    backend = fake.backend()
    first = backend.job(running)
    assert first == _expected_live_jobs(rec)[running]
    assert backend.job(999999) is None
    assert backend.job(running) == first
    assert fake.calls() == [
        "sinfo --version",
        f"squeue {rec.json_option} --states=all --jobs={running}",
        f"scontrol -o show job {running}",
        "scontrol -o show job 999999",
        f"scontrol -o show job {running}",
    ]


def test_job_json_errors_raise(fake: FakeSlurm) -> None:
    fake.add_sinfo()
    fake.add("squeue", fake.cat(R2205.path("squeue_controller_down.json")))  # 22.05: exit 0, only "errors" tells
    with pytest.raises(SlurmError, match="Failed while looking for jobs"):
        fake.backend().job(R2205.job("running"))


def test_an_unreachable_controller_is_an_error_not_a_reason_to_give_up_json(fake: FakeSlurm) -> None:
    """24.11 exits 1 with only its error when slurmctld is down: the backend says so, and asks in JSON again
    next time (only a client that cannot print JSON switches the backend to text)."""
    stderr = R2411.path("squeue_controller_down.stderr")
    fake.add_sinfo(version=R2411.text("version.txt").strip())
    fake.add("squeue", f"cat {shlex.quote(str(stderr))} >&2\nexit 1")
    backend = fake.backend()
    for _ in range(2):
        with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
            backend.job(5)
    assert fake.calls() == ["sinfo --version"] + ["squeue --json=v0.0.42 --states=all --jobs=5"] * 2


def test_job_invalid_id_reported_in_json_errors_is_none(fake: FakeSlurm) -> None:
    doc = {"jobs": [], "errors": [{"error_number": 2017, "error": "Invalid job id specified"}]}
    fake.add_sinfo()
    fake.add("squeue", f"echo {shlex.quote(json.dumps(doc))}")
    assert fake.backend().job(5) is None


def test_nodes_come_from_the_releases_json(fake: FakeSlurm, rec: Recording) -> None:
    """sinfo --json before 23.02; from 23.02 scontrol --json show node (24.11's sinfo groups nodes by state)."""
    fake.add_sinfo(version=rec.text("version.txt").strip(), json_body=fake.cat(rec.path("sinfo.json")))
    if rec.version != "22.05":
        fake.add("scontrol", fake.cat(rec.path("scontrol_show_node.json")))
    assert fake.backend().nodes() == _expected_nodes(rec)
    asked = "sinfo --json" if rec.version == "22.05" else f"scontrol {rec.json_option} show node"
    assert fake.calls() == ["sinfo --version", asked]


def test_nodes_fall_back_to_text_when_json_has_no_serializer(fake: FakeSlurm) -> None:
    fake.add_sinfo(json_body='echo "sinfo: fatal: unable to load openapi plugins" >&2; exit 1')
    fake.add("scontrol", fake.cat(R2205.path("scontrol_show_node.txt")))
    backend = fake.backend()
    assert backend.nodes() == _expected_nodes(R2205)
    assert backend.nodes()[2].state == ("IDLE", "DRAIN")
    assert fake.calls() == [
        "sinfo --version",
        "sinfo --json",
        "scontrol -o show node",
        "scontrol -o show node",
    ]


def test_nodes_json_errors_raise(fake: FakeSlurm) -> None:
    fake.add_sinfo(json_body=fake.cat(R2205.path("sinfo_controller_down.json")))
    with pytest.raises(SlurmError, match="Unspecified error"):
        fake.backend().nodes()


def test_failing_command_raises_with_command_and_stderr(fake: FakeSlurm) -> None:
    fake.add("scontrol", 'echo "slurm_update error: Invalid node name specified" >&2\nexit 1')
    with pytest.raises(SlurmError) as info:
        fake.backend().drain("n9", "link flap")
    message = str(info.value)
    assert "scontrol update NodeName=n9 State=DRAIN 'Reason=link flap'" in message
    assert "exit 1" in message
    assert "Invalid node name specified" in message
    assert info.value.exit_code == 4


def test_drain_and_resume_arguments(fake: FakeSlurm) -> None:
    fake.add("scontrol", "exit 0")
    backend = fake.backend()
    backend.drain("n2", "clockwork: NIC0 flapping")
    backend.resume("n2")
    assert fake.calls() == [
        "scontrol update NodeName=n2 State=DRAIN Reason=clockwork: NIC0 flapping",
        "scontrol update NodeName=n2 State=RESUME",
    ]
    with pytest.raises(ValueError, match="reason"):
        backend.drain("n2", " ")


def test_hung_command_times_out_and_is_killed(fake: FakeSlurm, tmp_path: Path) -> None:
    pid_file = tmp_path / "sinfo.pid"
    fake.add("sinfo", f"echo $$ > {shlex.quote(str(pid_file))}\nexec sleep 30")
    backend = fake.backend(timeout_s=0.5)
    with pytest.raises(SlurmTimeoutError, match=r"sinfo --version.*0\.5 s") as info:  # not the 30 s sleep
        backend.version()
    assert isinstance(info.value, SlurmError)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_missing_binary_is_a_slurm_error(fake: FakeSlurm) -> None:
    with pytest.raises(SlurmError, match="cannot run `sinfo`"):
        fake.backend().version()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('echo "Slurmctld(primary) at head is UP"', True),
        ('echo "Slurmctld(primary) at head is DOWN"\nexit 1', False),
        ('echo "Slurmctld(primary) at a is DOWN"\necho "Slurmctld(backup) at b is UP"\nexit 1', True),
        ("exec sleep 30", False),
    ],
)
def test_ping(fake: FakeSlurm, body: str, expected: bool) -> None:
    fake.add("scontrol", body)
    assert fake.backend(timeout_s=0.5).ping() is expected


def test_ping_with_broken_config_raises(fake: FakeSlurm) -> None:
    fake.add("scontrol", 'echo "scontrol: fatal: Unable to process configuration file" >&2\nexit 1')
    with pytest.raises(SlurmError, match="configuration file"):
        fake.backend().ping()


def test_submit(fake: FakeSlurm, tmp_path: Path) -> None:
    fake.add("sbatch", 'echo "4242;sandbox"')
    backend = fake.backend()
    assert backend.submit("python train.py", ["--partition=main", "--clockwork-ft=aware"]) == 4242
    script = tmp_path / "job.sh"
    assert backend.submit(script, ["-N2"]) == 4242
    assert fake.calls() == [
        "sbatch --parsable --partition=main --clockwork-ft=aware --wrap=python train.py",
        f"sbatch --parsable -N2 {script}",
    ]
    with pytest.raises(TypeError):
        backend.submit(script, "-N2")  # type: ignore[arg-type]


def test_submit_without_job_id_is_an_error(fake: FakeSlurm) -> None:
    fake.add("sbatch", 'echo "sbatch: something odd"')
    with pytest.raises(SlurmError, match="no job id"):
        fake.backend().submit("true")


def test_cancel_is_idempotent(fake: FakeSlurm) -> None:
    fake.add(
        "scancel",
        'case "$1" in\n'
        '  5) echo "scancel: error: Kill job error on job id 5: '
        'Job/step already completing or completed" >&2; exit 1 ;;\n'
        '  6) echo "scancel: error: Kill job error on job id 6: Invalid job id specified" >&2; exit 1 ;;\n'
        '  7) echo "scancel: error: Access/permission denied" >&2; exit 1 ;;\n'
        "esac",
    )
    backend = fake.backend()
    backend.cancel(5)
    backend.cancel(6)
    with pytest.raises(SlurmError, match="permission denied"):
        backend.cancel(7)


def test_accounting(fake: FakeSlurm, rec: Recording) -> None:
    failed = rec.job("exits-three")
    fake.add("sacct", fake.cat(rec.path("sacct.txt")))
    backend = fake.backend()
    rows = {r.job_id: r for r in backend.accounting(failed, all_steps=True)}
    assert rows[str(failed)].exit_code == "3:0" and rows[f"{failed}.batch"].is_step
    backend.accounting(failed)
    fields = "--format=JobID,State,NodeList,Start,End,ExitCode,AdminComment"
    assert fake.calls() == [
        f"sacct --jobs={failed} --noheader --parsable2 {fields}",
        f"sacct --jobs={failed} --noheader --parsable2 {fields} --allocations",
    ]


def _squeue_dump(fake: FakeSlurm) -> None:
    """squeue answering every question with 22.05's dump of every job (as 22.05 does with --json)."""
    fake.add_sinfo()
    fake.add("squeue", fake.cat(R2205.path("squeue.json")))


def test_admin_comment_on_live_job_goes_to_slurmctld(fake: FakeSlurm) -> None:
    held = R2205.job("held")  # pending, never requeued
    _squeue_dump(fake)
    fake.add("scontrol", "exit 0")
    fake.add("sacctmgr", "exit 99")
    fake.backend().set_admin_comment(held, "clockwork:report=/var/spool/clockwork/3.json")
    assert [c for c in fake.calls() if not c.startswith(("squeue", "sinfo"))] == [
        f"scontrol update JobId={held} AdminComment=clockwork:report=/var/spool/clockwork/3.json"
    ]


def test_admin_comment_on_requeued_job_also_goes_to_its_earlier_runs_record(fake: FakeSlurm) -> None:
    """The requeued job (restart count 1): slurmctld takes the comment, and so does slurmdbd's record of the
    earlier run (a failing sacctmgr, as without accounting, is logged, not raised)."""
    requeued = R2205.job("requeued")
    _squeue_dump(fake)
    fake.add("scontrol", "exit 0")
    fake.add("sacctmgr", "exit 99")
    fake.backend().set_admin_comment(requeued, "clockwork: preempted for job 7")
    assert [c for c in fake.calls() if not c.startswith(("squeue", "sinfo"))] == [
        f"scontrol update JobId={requeued} AdminComment=clockwork: preempted for job 7",
        f"sacctmgr -i modify job where JobID={requeued} set AdminComment=clockwork: preempted for job 7",
    ]


def test_admin_comment_on_finished_job_goes_to_slurmdbd(fake: FakeSlurm) -> None:
    failed = R2205.job("exits-three")
    _squeue_dump(fake)
    fake.add("scontrol", "exit 99")
    fake.add("sacctmgr", f'echo " Modified jobs..."\necho "  {failed} submitted at 2026-12-02T20:57:58"')
    backend = fake.backend()
    backend.set_admin_comment(failed, "clockwork:report=r.json")  # FAILED: in slurmctld, but finished
    backend.set_admin_comment(31337, "clockwork:report=old.json")  # purged from slurmctld
    assert [c for c in fake.calls() if not c.startswith(("squeue", "sinfo"))] == [
        f"sacctmgr -i modify job where JobID={failed} set AdminComment=clockwork:report=r.json",
        "sacctmgr -i modify job where JobID=31337 set AdminComment=clockwork:report=old.json",
    ]


def test_admin_comment_for_unknown_job_fails(fake: FakeSlurm) -> None:
    _squeue_dump(fake)
    fake.add("sacctmgr", 'echo " Nothing modified"')
    with pytest.raises(SlurmError, match="no record of job 555"):
        fake.backend().set_admin_comment(555, "x")


def test_admin_comment_rejects_quotes_before_running_anything(fake: FakeSlurm) -> None:
    with pytest.raises(ValueError, match="quotes"):
        fake.backend().set_admin_comment(4242, '{"report": "x"}')
    assert fake.calls() == []


def test_expand_hostlist_is_local_and_falls_back_to_scontrol(fake: FakeSlurm) -> None:
    fake.add("scontrol", 'echo "Invalid hostlist: $3"')
    backend = fake.backend()
    assert backend.expand_hostlist("n[01-02]") == ["n01", "n02"]
    assert fake.calls() == []
    with pytest.raises(SlurmError, match="invalid hostlist"):
        backend.expand_hostlist("n[1-10:2]")
    assert fake.calls() == ["scontrol show hostnames n[1-10:2]"]


def test_timeout_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="timeout"):
        CliBackend(tmp_path / "slurm.conf", timeout_s=0)


# ------------------------------------------------------------------------ the data_parser version asked for

#: The data_parser versions each release serves (Slurm's src/plugins/data_parser/ at each release's tag).
SERVED = {
    (24, 11): ("v0.0.40", "v0.0.41", "v0.0.42"),
    (25, 5): ("v0.0.40", "v0.0.41", "v0.0.42", "v0.0.43"),
    (25, 11): ("v0.0.41", "v0.0.42", "v0.0.43", "v0.0.44"),
    (26, 5): ("v0.0.42", "v0.0.43", "v0.0.44", "v0.0.45"),
}


@pytest.mark.parametrize(
    ("version", "option"),
    [
        ((22, 5, 8), "--json"),  # no data_parser versions
        ((23, 2, 7), "--json"),
        ((24, 5, 8), "--json"),
        ((24, 11, 5), "--json=v0.0.42"),
        ((25, 5, 0), "--json=v0.0.42"),
        ((25, 11, 2), "--json=v0.0.42"),
        ((26, 5, 5), "--json=v0.0.42"),
        ((26, 11, 0), "--json=v0.0.43"),  # 26.11 drops v0.0.42
    ],
)
def test_the_json_option_by_release(version: tuple[int, int, int], option: str) -> None:
    assert json_option(version) == option


def test_one_data_parser_version_for_every_release_from_24_11_to_26_05() -> None:
    asked = {data_parser((*release, 0)) for release in SERVED}
    assert len(asked) == 1, asked
    for release, served in SERVED.items():
        assert data_parser((*release, 0)) in served, release
    assert [first for first, _ in DATA_PARSERS] == sorted(first for first, _ in DATA_PARSERS)


def test_a_release_without_the_version_asked_for_falls_back_to_text(fake: FakeSlurm) -> None:
    """A release that no longer serves the version (26.11 and v0.0.42, had the table not moved on) answers
    "unable to find plugin"; the backend reads the text output from then on."""
    running = R2411.job("running")
    fake.add_sinfo(version="slurm 24.11.5")
    fake.add(
        "squeue",
        'echo "squeue: error: data_parser_g_new: unable to find plugin v0.0.42" >&2\n'
        'echo "squeue: error: application/json output not supported by v0.0.42" >&2\nexit 1',
    )
    fake.add("scontrol", fake.cat(R2411.path("scontrol_show_job.txt")))
    backend = fake.backend()
    assert backend.job(running) == _expected_live_jobs(R2411)[running]
    assert backend.job(running) == _expected_live_jobs(R2411)[running]
    assert fake.calls() == [
        "sinfo --version",
        f"squeue --json=v0.0.42 --states=all --jobs={running}",
        f"scontrol -o show job {running}",
        f"scontrol -o show job {running}",
    ]
