"""``clockwork report JOBID`` after a real sandbox job that went through a link failover and a live migration.

A TorchPass job (3 ranks, 1 standby node) runs on the 4-node sandbox with accounting, under node daemons
with LinkPass on. While it trains, ``clockwork migrate`` moves rank 1 to the standby node, then node2's nic0
goes down (LinkPass moves its traffic to nic1, and back after the link returns). Afterwards the report,
read from the host like an admin would, joins the daemons' events with sacct: both incidents in its
timeline with their durations, and the job's accounting fields.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from clockwork.sandbox.cluster import REPO_ROOT, Sandbox
from clockwork.sandbox.daemons import NodeDaemons
from tests.conftest import until
from tests.integration.conftest import CLOCKWORK, slurm_env, wait_job

SCRIPT = REPO_ROOT / "examples" / "train_torchpass.py"


def test_report_joins_a_failover_and_a_migration_with_sacct(sandbox: Sandbox, short_tmp: Path) -> None:
    daemons = NodeDaemons(sandbox)
    daemons.start_all({"linkpass.enabled": "true"})
    env = dict(slurm_env(sandbox), CLOCKWORK_CONFIG=str(sandbox.paths.clockwork_toml))
    out = short_tmp / "job.out"
    try:
        command = f"{sys.executable} -m torchpass run {SCRIPT} --steps 1200"
        options = ["-N4", "--no-kill", "--clockwork-ft", "--clockwork-spares=standby", "-o", str(out)]
        submitted = subprocess.run(
            ["sbatch", "--parsable", *options, f"--wrap={command}"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        job_id = int(submitted.stdout.strip().split(";")[0])

        def stepped(at_least: int) -> bool:
            text = out.read_text() if out.exists() else ""
            return any(int(s) >= at_least for s in re.findall(r"^step (\d+) loss", text, re.MULTILINE))

        until("the job to train", lambda: stepped(50), 120)
        migrate = subprocess.run(
            sandbox.exec_argv("node2", [CLOCKWORK, "migrate", str(job_id), "--rank", "1"]),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        until("the migration", lambda: "event torchpass.migrated" in out.read_text(), 60)
        sandbox.fault("link", "node2", "nic0", "down")
        until("LinkPass to fail node2's nic0 over", lambda: daemons.component("node2", "linkpass").get("failovers"), 20)
        sandbox.fault("link", "node2", "nic0", "up")
        state = wait_job(sandbox, job_id, timeout_s=240)
        job_text = "\n".join(line for line in out.read_text().splitlines() if "event torchpass." in line)
        assert state == "COMPLETED", out.read_text()[-4000:]
    finally:
        sandbox.clear_faults()
        daemons.stop_all()

    report = subprocess.run(
        [CLOCKWORK, "report", str(job_id), "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr
    doc = json.loads(report.stdout)
    assert doc["accounting"]["source"] == "sacct" and doc["accounting"]["state"] == "COMPLETED", doc["accounting"]
    assert doc["accounting"]["nodes"] == ["node1", "node2", "node3", "node4"]
    assert any(s["step"].endswith(".batch") for s in doc["accounting"]["steps"]), doc["accounting"]["steps"]
    kinds = [i["what"] for i in doc["incidents"]]
    assert "link failover" in kinds and "rank migrated" in kinds, f"{kinds} from {doc['sources']}\n{job_text}"
    failovers = [i for i in doc["incidents"] if i["what"] == "link failover"]
    migrated = next(i for i in doc["incidents"] if i["what"] == "rank migrated")
    # node2's own move after the migration (its peers move their routes to it too, and LinkPass may have moved
    # routes home as the job started, from state an earlier test left)
    own = [i for i in failovers if i["node"] == "node2" and i["time"] > migrated["time"]]
    assert own and "nic0 -> nic1" in own[0]["detail"] and own[0]["duration_s"] > 0, (migrated, failovers)
    assert migrated["duration_s"] > 0 and "1" in migrated["detail"], migrated
    assert doc["saved_node_h"] > 0 and doc["faults"] >= 1
    text = subprocess.run([CLOCKWORK, "report", str(job_id)], env=env, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "link failover" in text.stdout and "rank migrated" in text.stdout, text.stdout
    assert f"Job {job_id}: COMPLETED" in text.stdout and "Saved against checkpoint-restart" in text.stdout
    fleet = subprocess.run(
        [CLOCKWORK, "report", "--since", "1h", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert fleet.returncode == 0, fleet.stderr
    summary = json.loads(fleet.stdout)
    assert summary["jobs"] >= 1 and summary["by_kind"].get("link failover", 0) >= 1, summary
    assert summary["by_kind"].get("rank migrated", 0) >= 1 and summary["faults"] >= 1, summary
    assert any(link.startswith("node2/nic0") for link, _ in summary["worst_links"]), summary
