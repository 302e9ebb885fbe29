"""The CLI backend: its JSON and text parsers on realistic Slurm output, and its command handling.

Fixtures under data/slurm/: ``*_22.05*`` follow Slurm 22.05.8 exactly (``*_controller_down.json`` were
captured from 22.05.8 clients; the others are laid out like the 22.05 openapi v0.0.38 dump code and
scontrol/sacct print code); ``*_23.11_shape.json`` follow the 23.02+ data_parser layout (lists for
states, ``{"set","number"}`` numbers) and are constructed, not captured.

Command handling is exercised through fake client executables in a temporary ``bin_dir`` (public
configuration of the backend), which log their argv and SLURM_CONF.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import pytest

from clockworkd.errors import SlurmError
from clockworkd.slurm import SlurmBackend
from clockworkd.slurm.backend import AcctRecord, JobInfo, NodeInfo, node_state
from clockworkd.slurm.cli_backend import (
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

DATA = Path(__file__).parent / "data" / "slurm"


def load_json(name: str) -> dict[str, Any]:
    doc = json.loads((DATA / name).read_text())
    assert isinstance(doc, dict)
    return doc


def fixture_text(name: str) -> str:
    return (DATA / name).read_text()


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


def test_squeue_json_22_05() -> None:
    jobs = {j.job_id: j for j in parse_squeue_json(load_json("squeue_22.05.json"))}
    assert sorted(jobs) == [4240, 4241, 4242, 4243]
    assert jobs[4242] == JobInfo(
        job_id=4242,
        name="train-ft",
        state="RUNNING",
        user="alice",
        partition="main",
        nodes=["n01", "n02", "gpu7"],
        exit_code="0:0",
        restart_count=1,
        admin_comment="",
    )
    assert not jobs[4242].finished
    # 22.05 gives the raw wait status: 256 is "exit 1", 9 is "killed by signal 9".
    assert jobs[4240].exit_code == "1:0"
    assert jobs[4240].state == "FAILED"
    assert jobs[4240].finished
    assert jobs[4240].admin_comment == "clockwork:report=/var/spool/clockwork/reports/4240.json"
    assert jobs[4241].exit_code == "0:9"
    assert jobs[4241].nodes == ["n02", "n03"]
    assert jobs[4243].state == "PENDING"
    assert jobs[4243].nodes == []
    assert jobs[4243].user == "bob"


def test_squeue_json_23_11_shape() -> None:
    jobs = {j.job_id: j for j in parse_squeue_json(load_json("squeue_23.11_shape.json"))}
    assert jobs[9001].state == "RUNNING"
    assert jobs[9001].nodes == ["n01", "n02"]
    assert jobs[9001].restart_count == 2
    assert jobs[9001].admin_comment == "clockwork:ft=aware"
    assert jobs[9001].exit_code == "0:0"
    assert jobs[9002].exit_code == "3:0"
    assert jobs[9002].finished
    # ["PENDING", "REQUEUED"]: the flag wins, as job_state_string() does in 22.05.
    assert jobs[9003].state == "REQUEUED"
    assert not jobs[9003].finished
    assert jobs[9003].nodes == []


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


def test_json_errors_of_real_22_05_controller_down_output() -> None:
    # Captured from squeue/sinfo 22.05.8 with slurmctld down: exit 0, only "errors" tells.
    squeue = json_errors(load_json("squeue_22.05_controller_down.json"))
    sinfo = json_errors(load_json("sinfo_22.05_controller_down.json"))
    assert squeue == [(-1, "Failed while looking for jobs: Unspecified error: slurm_load_jobs")]
    assert sinfo == [(-1, "Unspecified error")]
    assert json_errors(load_json("squeue_22.05.json")) == []


def test_nodes_json_22_05() -> None:
    nodes = {n.name: n for n in parse_nodes_json(load_json("sinfo_22.05.json"))}
    assert nodes["n01"] == NodeInfo("n01", ("MIXED",), "10.10.0.1", ["main"], "")
    assert nodes["n02"].state == ("IDLE", "DRAIN")
    assert nodes["n02"].has("drain")
    assert nodes["n02"].base_state == "IDLE"
    assert nodes["n02"].reason == "clockwork: NIC0 flapping"
    assert nodes["n03"].state == ("DOWN", "NOT_RESPONDING")
    assert nodes["gpu7"].state == ("ALLOCATED", "DRAIN")
    assert nodes["gpu7"].partitions == ["main", "spare"]
    assert not nodes["n01"].has("DRAIN")


def test_nodes_json_23_11_shape() -> None:
    nodes = {n.name: n for n in parse_nodes_json(load_json("scontrol_show_node_23.11_shape.json"))}
    assert nodes["n01"] == NodeInfo("n01", ("IDLE", "DRAIN"), "10.10.0.1", ["main"], "maint window")
    assert nodes["n02"].partitions == ["main", "spare"]
    assert nodes["n03"].state == ("DOWN", "NOT_RESPONDING")


def test_text_and_json_node_parsers_agree() -> None:
    # The two 22.05 fixtures describe the same four nodes; scontrol adds "[user@time]" to reasons.
    from_json = parse_nodes_json(load_json("sinfo_22.05.json"))
    from_text = parse_scontrol_nodes(fixture_text("scontrol_show_node_22.05.txt"))
    assert from_text == from_json


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


def test_scontrol_job_text_22_05() -> None:
    (job,) = parse_scontrol_jobs(fixture_text("scontrol_show_job_22.05.txt"))
    assert job == JobInfo(
        job_id=4242,
        name="train ft",
        state="RUNNING",
        user="alice",
        partition="main",
        nodes=["n01", "n02", "gpu7"],
        exit_code="0:0",
        restart_count=1,
        admin_comment="clockwork:ft=aware,report=/var/spool/clockwork/4242.json",
    )
    (pending,) = parse_scontrol_jobs(fixture_text("scontrol_show_job_22.05_pending.txt"))
    assert (pending.state, pending.nodes, pending.user, pending.admin_comment) == ("PENDING", [], "bob", "")


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


def test_sacct_parsable_22_05() -> None:
    recs = parse_sacct_parsable(fixture_text("sacct_22.05_all_steps.txt"))
    assert [r.job_id for r in recs] == ["4240", "4240.batch", "4240.extern", "4240.0", "4243"]
    assert recs[0] == AcctRecord(
        job_id="4240",
        state="FAILED",
        nodes=["n01"],
        start="2024-05-01T10:00:00",
        end="2024-05-01T10:40:00",
        exit_code="1:0",
        # AdminComment is the last column, so a "|" inside it survives.
        admin_comment="clockwork:report=/var/spool/clockwork/4240.json|x",
        restarts=None,
    )
    assert not recs[0].is_step
    assert recs[1].is_step
    assert recs[3].state == "CANCELLED"  # "CANCELLED by 1000"
    assert recs[3].nodes == ["n01", "n02"]
    assert recs[3].exit_code == "0:9"
    assert (recs[4].nodes, recs[4].start, recs[4].end) == ([], "", "")


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

    def cat(self, fixture: str) -> str:
        return f"cat {shlex.quote(str(DATA / fixture))}"

    def calls(self) -> list[str]:
        return [line.split("|", 1)[0] for line in self.log.read_text().splitlines()]

    def backend(self, timeout_s: float = 10.0) -> CliBackend:
        return CliBackend(self.conf, bin_dir=self.bin_dir, timeout_s=timeout_s)

    def add_sinfo(self, version: str = "slurm-wlm 22.05.8", json_body: str = "exit 3") -> None:
        self.add(
            "sinfo",
            f'case "$1" in\n  --version) echo "{version}" ;;\n  --json) {json_body} ;;\n'
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


def test_job_from_squeue_json(fake: FakeSlurm) -> None:
    fake.add("squeue", fake.cat("squeue_22.05.json"))
    backend = fake.backend()
    job = backend.job(4242)
    assert job is not None
    assert job.nodes == ["n01", "n02", "gpu7"]
    assert backend.job(999) is None  # 22.05 ignores --jobs with --json: the record is picked here
    assert fake.calls() == ["squeue --json --states=all --jobs=4242", "squeue --json --states=all --jobs=999"]


def test_job_json_rejected_falls_back_to_scontrol_once(fake: FakeSlurm) -> None:
    fake.add("squeue", "echo \"squeue: unrecognized option '--json'\" >&2\nexit 1")
    fake.add(
        "scontrol",
        'case "$*" in\n'
        f'  "-o show job 4242") {fake.cat("scontrol_show_job_22.05.txt")} ;;\n'
        '  "-o show job 7") echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;\n'
        "  *) exit 9 ;;\nesac",
    )
    backend = fake.backend()
    first = backend.job(4242)
    assert first is not None
    assert first.admin_comment == "clockwork:ft=aware,report=/var/spool/clockwork/4242.json"
    assert backend.job(7) is None
    assert backend.job(4242) == first
    assert fake.calls() == [
        "squeue --json --states=all --jobs=4242",
        "scontrol -o show job 4242",
        "scontrol -o show job 7",
        "scontrol -o show job 4242",
    ]


def test_job_json_errors_raise(fake: FakeSlurm) -> None:
    fake.add("squeue", fake.cat("squeue_22.05_controller_down.json"))
    with pytest.raises(SlurmError, match="Failed while looking for jobs"):
        fake.backend().job(4242)


def test_job_invalid_id_reported_in_json_errors_is_none(fake: FakeSlurm) -> None:
    doc = {"jobs": [], "errors": [{"error_number": 2017, "error": "Invalid job id specified"}]}
    fake.add("squeue", f"echo {shlex.quote(json.dumps(doc))}")
    assert fake.backend().job(5) is None


def test_nodes_22_05_use_sinfo_json(fake: FakeSlurm) -> None:
    fake.add_sinfo(json_body=fake.cat("sinfo_22.05.json"))
    nodes = fake.backend().nodes()
    assert [n.name for n in nodes] == ["n01", "n02", "n03", "gpu7"]
    assert fake.calls() == ["sinfo --version", "sinfo --json"]


def test_nodes_23_11_use_scontrol_json(fake: FakeSlurm) -> None:
    fake.add_sinfo(version="slurm 23.11.1")
    fake.add("scontrol", fake.cat("scontrol_show_node_23.11_shape.json"))
    nodes = fake.backend().nodes()
    assert nodes[0].state == ("IDLE", "DRAIN")
    assert fake.calls() == ["sinfo --version", "scontrol --json show node"]


def test_nodes_fall_back_to_text_when_json_has_no_serializer(fake: FakeSlurm) -> None:
    fake.add_sinfo(json_body='echo "sinfo: fatal: unable to load openapi plugins" >&2; exit 1')
    fake.add("scontrol", fake.cat("scontrol_show_node_22.05.txt"))
    backend = fake.backend()
    assert backend.nodes() == parse_nodes_json(load_json("sinfo_22.05.json"))
    assert backend.nodes()[1].state == ("IDLE", "DRAIN")
    assert fake.calls() == [
        "sinfo --version",
        "sinfo --json",
        "scontrol -o show node",
        "scontrol -o show node",
    ]


def test_nodes_json_errors_raise(fake: FakeSlurm) -> None:
    fake.add_sinfo(json_body=fake.cat("sinfo_22.05_controller_down.json"))
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


def test_accounting(fake: FakeSlurm) -> None:
    fake.add("sacct", fake.cat("sacct_22.05_all_steps.txt"))
    backend = fake.backend()
    recs = backend.accounting(4240, all_steps=True)
    assert recs[0].exit_code == "1:0"
    backend.accounting(4240)
    fields = "--format=JobID,State,NodeList,Start,End,ExitCode,AdminComment"
    assert fake.calls() == [
        f"sacct --jobs=4240 --noheader --parsable2 {fields}",
        f"sacct --jobs=4240 --noheader --parsable2 {fields} --allocations",
    ]


def test_admin_comment_on_live_job_goes_to_slurmctld(fake: FakeSlurm) -> None:
    fake.add("squeue", fake.cat("squeue_22.05.json"))
    fake.add("scontrol", "exit 0")
    fake.add("sacctmgr", "exit 99")
    fake.backend().set_admin_comment(4243, "clockwork:report=/var/spool/clockwork/4243.json")
    assert fake.calls()[-1] == (
        "scontrol update JobId=4243 AdminComment=clockwork:report=/var/spool/clockwork/4243.json"
    )


def test_admin_comment_on_requeued_job_also_goes_to_its_earlier_runs_record(fake: FakeSlurm) -> None:
    """Job 4242 was requeued once: slurmctld takes the comment, and so does slurmdbd's record of the earlier
    run (a failing sacctmgr, as without accounting, is logged, not raised)."""
    fake.add("squeue", fake.cat("squeue_22.05.json"))
    fake.add("scontrol", "exit 0")
    fake.add("sacctmgr", "exit 99")
    fake.backend().set_admin_comment(4242, "clockwork: preempted for job 7")
    assert [c for c in fake.calls() if not c.startswith("squeue")] == [
        "scontrol update JobId=4242 AdminComment=clockwork: preempted for job 7",
        "sacctmgr -i modify job where JobID=4242 set AdminComment=clockwork: preempted for job 7",
    ]


def test_admin_comment_on_finished_job_goes_to_slurmdbd(fake: FakeSlurm) -> None:
    fake.add("squeue", fake.cat("squeue_22.05.json"))
    fake.add("scontrol", "exit 99")
    fake.add("sacctmgr", 'echo " Modified jobs..."\necho "  4240 submitted at 2024-05-01T10:00:00"')
    backend = fake.backend()
    backend.set_admin_comment(4240, "clockwork:report=r.json")  # FAILED: in slurmctld, but finished
    backend.set_admin_comment(31337, "clockwork:report=old.json")  # purged from slurmctld
    assert [c for c in fake.calls() if not c.startswith("squeue")] == [
        "sacctmgr -i modify job where JobID=4240 set AdminComment=clockwork:report=r.json",
        "sacctmgr -i modify job where JobID=31337 set AdminComment=clockwork:report=old.json",
    ]


def test_admin_comment_for_unknown_job_fails(fake: FakeSlurm) -> None:
    fake.add("squeue", fake.cat("squeue_22.05.json"))
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
