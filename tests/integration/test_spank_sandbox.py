"""`sbatch --clockwork-*` on the real sandbox Slurm: the plugin validates, and the job and hooks see the options."""

from __future__ import annotations

import subprocess
from pathlib import Path

from clockwork.sandbox.cluster import Sandbox, spank_plugin
from slurm_hooks import events
from tests.integration.conftest import slurm_env, wait_job


def sbatch(box: Sandbox, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**slurm_env(box), **(env_extra or {})}
    return subprocess.run(["sbatch", *args], capture_output=True, text=True, env=env, timeout=60)


def queued(box: Sandbox) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=slurm_env(box))
    return out.stdout.split()


def test_plugin_is_loaded_by_the_sandbox(sandbox: Sandbox) -> None:
    plugin = spank_plugin(sandbox.slurm_release())  # the build for this Slurm's headers
    assert plugin.exists(), "make venv builds spank/clockwork.so, make slurm-24.11 spank/slurm-24.11/clockwork.so"
    assert sandbox.paths.plugstack_conf.read_text() == f"optional {plugin}\n"
    help_text = sbatch(sandbox, "--help").stdout
    for option in ("--clockwork-ft", "--clockwork-spares", "--clockwork-snapshot", "--clockwork-linkpass"):
        assert option in help_text
    assert help_text.count("[clockwork]") == 4


def test_job_and_hooks_see_the_options(sandbox: Sandbox, tmp_path: Path) -> None:
    out = tmp_path / "env-%j.out"
    sub = sbatch(
        sandbox,
        "--parsable",
        "-N2",
        "--clockwork-ft",
        "--clockwork-spares=borrow",
        "-o",
        str(out),
        "--wrap",
        "srun -N1 -n1 env",
    )
    assert sub.returncode == 0, sub.stderr
    job_id = int(sub.stdout)
    assert wait_job(sandbox, job_id) == "COMPLETED"
    env_lines = set(Path(str(out).replace("%j", str(job_id))).read_text().splitlines())
    assert {
        "CLOCKWORK_FT=aware",
        "CLOCKWORK_SPARES=borrow",
        "CLOCKWORK_SNAPSHOT=off",
        "CLOCKWORK_LINKPASS=on",
    } <= env_lines
    prologs = [e for e in events.read(sandbox.paths.spool, job_id) if e["event"] in ("job.prolog", "job.start")]
    assert len(prologs) == 3  # two node Prologs and the PrologSlurmctld
    for event in prologs:
        assert event["options"] == {"ft": "aware", "spares": "borrow", "snapshot": "off", "linkpass": "on"}


def test_export_none_still_gives_the_job_its_options(sandbox: Sandbox, tmp_path: Path) -> None:
    out = tmp_path / "none-%j.out"
    sub = sbatch(
        sandbox,
        "--parsable",
        "--export=NONE",
        "--clockwork-ft=transparent",
        "--clockwork-snapshot=20m",
        "-o",
        str(out),
        "--wrap",
        "/usr/bin/env",
    )
    assert sub.returncode == 0, sub.stderr
    job_id = int(sub.stdout)
    assert wait_job(sandbox, job_id) == "COMPLETED"
    env_lines = set(Path(str(out).replace("%j", str(job_id))).read_text().splitlines())
    assert {"CLOCKWORK_FT=transparent", "CLOCKWORK_SNAPSHOT=20m", "CLOCKWORK_SPARES=none"} <= env_lines


def test_bad_value_stops_sbatch_and_queues_nothing(sandbox: Sandbox) -> None:
    before = queued(sandbox)
    sub = sbatch(sandbox, "--clockwork-spares=maybe", "--wrap", "true")
    assert sub.returncode != 0
    assert "clockwork: --clockwork-spares: invalid value 'maybe' (expected none, standby, borrow)" in sub.stderr
    bad_env = sbatch(sandbox, "--wrap", "true", env_extra={"CLOCKWORK_FT": "sometimes"})
    assert bad_env.returncode != 0 and "CLOCKWORK_FT" in bad_env.stderr
    assert queued(sandbox) == before


def test_job_without_clockwork_options_is_untouched(sandbox: Sandbox, tmp_path: Path) -> None:
    out = tmp_path / "plain-%j.out"
    sub = sbatch(sandbox, "--parsable", "-o", str(out), "--wrap", "env")
    job_id = int(sub.stdout)
    assert wait_job(sandbox, job_id) == "COMPLETED"
    text = Path(str(out).replace("%j", str(job_id))).read_text()
    assert "CLOCKWORK_FT=" not in text and "SPANK_CLOCKWORK" not in text
