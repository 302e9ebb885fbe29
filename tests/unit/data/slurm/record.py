"""Record what the real Slurm clients print, for the CLI backend's parsing tests (tests/unit/test_slurm_cli_parsing.py).

Brings up a sandbox of the given release (3 nodes, accounting), puts it in a known state, runs every client
command the backend parses, and writes each output under ``tests/unit/data/slurm/VERSION/``, with
``manifest.json`` naming what the scenario made (job ids by role, the drained node, the comments set), so that
the tests check the parsers against facts the scenario created, not against the recordings themselves:

- job ``exits-three`` ran ``exit 3`` on node1 (FAILED 3:0), and got a finished job's AdminComment (sacctmgr);
- job ``running`` runs on node1 and node2 with a live AdminComment;
- job ``held`` was submitted held (PENDING, no nodes);
- job ``requeued`` ran on node2 and was requeued and held (``scontrol requeuehold``: restart count 1);
- job ``cancelled`` ran ``sleep`` on node1 and was cancelled while it slept (scancel: SIGTERM, exit ``0:15``);
- node3 is drained with a reason.

Then slurmctld is stopped and what the clients print without a controller is recorded too (standard output and
error, and their exit status in the manifest). Re-record (as root;
the sandbox takes the usual ``CLOCKWORK_SANDBOX_*`` settings, e.g. a test slot's)::

    flock /tmp/cw-heavy.lock .venv/bin/python tests/unit/data/slurm/record.py --slurm 22.05
    flock /tmp/cw-heavy.lock .venv/bin/python tests/unit/data/slurm/record.py --slurm 24.11
    flock /tmp/cw-heavy.lock .venv/bin/python tests/unit/data/slurm/record.py --slurm 26.05
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from clockwork.contracts.config import load_config
from clockwork.contracts.slurm.backend import JobInfo
from clockwork.contracts.slurm.cli_backend import SACCT_FIELDS
from clockwork.contracts.slurm.data_parser import json_option
from clockwork.sandbox import processes
from clockwork.sandbox.cluster import Sandbox

HERE = Path(__file__).resolve().parent
LIVE_COMMENT = "clockwork: recorded live"
FINISHED_COMMENT = "clockwork: report=/var/spool/clockwork/reports/recorded.json"
DRAIN_REASON = "clockwork: nic1 down"
CLIENT_TIMEOUT_S = 60


def wait(what: str, check: Callable[[], Any], timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


class Recorder:
    def __init__(self, box: Sandbox, out: Path) -> None:
        self.box = box
        self.out = out
        self.slurm = box.slurm()
        self.env = dict(box.slurm_env(), SLURM_TIME_FORMAT="standard")
        for key in [k for k in self.env if k.startswith(("SQUEUE_", "SINFO_", "SACCT_", "SCONTROL_"))]:
            del self.env[key]

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)

    def record(self, name: str, *argv: str) -> str:
        """Run a client command and keep its standard output as ``name`` (it must succeed)."""
        proc = self.run(*argv)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
        (self.out / name).write_text(proc.stdout)
        print(f"  {name}: {' '.join(argv)}")
        return proc.stdout

    def submit(self, *args: str) -> int:
        return self.slurm.submit(args[-1], ["-o", "/dev/null", *args[:-1]])

    def job(self, job_id: int) -> JobInfo:
        info = self.slurm.job(job_id)
        assert info is not None, job_id
        return info

    def running(self, job_id: int) -> None:
        wait(f"job {job_id} to run", lambda: self.job(job_id).state == "RUNNING")

    def finished(self, job_id: int) -> None:
        wait(f"job {job_id} to end", lambda: self.job(job_id).finished)


def scenario(rec: Recorder) -> dict[str, Any]:
    """Put the sandbox in the state the manifest describes; returns the manifest."""
    jobs = {}
    jobs["exits-three"] = rec.submit("-N1", "-w", "node1", "-J", "exits-three", "exit 3")
    rec.finished(jobs["exits-three"])
    jobs["running"] = rec.submit("-N2", "-w", "node[1-2]", "-J", "running", "sleep 600")
    rec.running(jobs["running"])
    rec.slurm.set_admin_comment(jobs["running"], LIVE_COMMENT)
    jobs["held"] = rec.submit("--hold", "-J", "held", "true")
    jobs["requeued"] = rec.submit("-N1", "-w", "node2", "--requeue", "-J", "requeued", "sleep 600")
    rec.running(jobs["requeued"])
    rec.slurm.run_text(["scontrol", "requeuehold", str(jobs["requeued"])])
    wait("the requeued job to be held", lambda: rec.job(jobs["requeued"]).restart_count == 1)
    wait("the requeued job to leave its node", lambda: not rec.job(jobs["requeued"]).nodes)
    started = rec.box.paths.root / "cancelled-started"
    jobs["cancelled"] = rec.submit("-N1", "-w", "node1", "-J", "cancelled", f"touch {started}; exec sleep 600")
    wait("the job to be cancelled to run its sleep", started.exists)  # so that SIGTERM is what ends it
    rec.slurm.cancel(jobs["cancelled"])
    rec.finished(jobs["cancelled"])
    rec.slurm.drain("node3", DRAIN_REASON)
    settled = {"exits-three": "FAILED", "running": "RUNNING", "held": "PENDING", "requeued": "PENDING"}
    settled["cancelled"] = "CANCELLED"
    for role, state in settled.items():  # slurmdbd hears of starts and ends a moment after slurmctld
        wait(
            f"slurmdbd's record of {role} to say {state}",
            lambda r=role, s=state: [a.state for a in rec.slurm.accounting(jobs[r])] == [s],
        )
    rec.slurm.set_admin_comment(jobs["exits-three"], FINISHED_COMMENT)
    wait(
        "the finished job's AdminComment in slurmdbd",
        lambda: rec.slurm.accounting(jobs["exits-three"])[0].admin_comment == FINISHED_COMMENT,
    )
    layout = rec.box.layout()
    return {
        "jobs": jobs,
        "user": "root",
        "partition": "low",
        "live_comment": LIVE_COMMENT,
        "finished_comment": FINISHED_COMMENT,
        "drained": {"node": "node3", "reason": DRAIN_REASON},
        "nodes": {n.name: n.mgmt_ip for n in layout.nodes},
        "partitions": ["low", "high"],
    }


def record(rec: Recorder, manifest: dict[str, Any], major_minor: tuple[int, int]) -> None:
    """Every JSON command with the option the backend gives this release (``--json=v0.0.42`` from 24.11)."""
    jobs = manifest["jobs"]
    as_json = json_option((*major_minor, 0))
    manifest["json_option"] = as_json
    all_ids = ",".join(str(j) for j in jobs.values())
    fields = f"--format={','.join(SACCT_FIELDS)}"
    manifest["version"] = rec.record("version.txt", "sinfo", "--version").strip()
    rec.record("squeue.json", "squeue", as_json)
    finished = f"--jobs={jobs['exits-three']}"
    rec.record("squeue_finished_job.json", "squeue", as_json, finished)
    rec.record("squeue_finished_job_all_states.json", "squeue", as_json, "--states=all", finished)
    rec.record("sinfo.json", "sinfo", as_json)
    if major_minor >= (23, 2):
        rec.record("scontrol_show_node.json", "scontrol", as_json, "show", "node")
    rec.record("scontrol_show_job.txt", "scontrol", "-o", "show", "job")
    rec.record("scontrol_show_node.txt", "scontrol", "-o", "show", "node")
    rec.record("sacct.txt", "sacct", f"--jobs={all_ids}", "--noheader", "--parsable2", fields)
    rec.record("sacct_allocations.txt", "sacct", f"--jobs={all_ids}", "--noheader", "--parsable2", fields, "-X")

    state = rec.box.state()
    assert state is not None
    pid = state.pids["slurmctld"]
    os.kill(pid, signal.SIGKILL)
    wait("slurmctld to die", lambda: not processes.alive(pid))
    print("  (slurmctld stopped)")
    down = {"squeue_controller_down.json": ["squeue", as_json], "sinfo_controller_down.json": ["sinfo", as_json]}
    if major_minor >= (23, 2):
        down["scontrol_show_node_controller_down.json"] = ["scontrol", as_json, "show", "node"]
    for name, argv in down.items():
        proc = rec.run(*argv)
        (rec.out / name).write_text(proc.stdout)
        (rec.out / name.replace(".json", ".stderr")).write_text(proc.stderr)
        manifest.setdefault("controller_down_exit", {})[name] = proc.returncode
        print(f"  {name}: {' '.join(argv)} (exit {proc.returncode})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slurm", required=True, help="release to record: 22.05, 24.11 or 26.05")
    version = parser.parse_args().slurm
    base = load_config(None).config.sandbox
    out = HERE / version
    out.mkdir(exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="cw-rec-", dir="/tmp") as tmp:
        box = Sandbox(replace(base, state_dir=f"{tmp}/state", nodes=3, accounting=True, slurm=version))
        print(f"recording Slurm {version} into {out}")
        box.up(progress=lambda msg: print(f"  - {msg}"))
        try:
            rec = Recorder(box, out)
            manifest = scenario(rec)
            record(rec, manifest, rec.slurm.version()[:2])
        finally:
            box.down()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    print(f"done: {len(list(out.iterdir()))} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
