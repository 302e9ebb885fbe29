"""Which Slurm a sandbox runs (clockwork.sandbox.slurm_release): the host's packages or a release from a root.

The root of Slurm 24.11 is what ``make slurm-24.11`` builds (CI builds it before the tests); its client wrappers are
run for real where root can make mount namespaces, which shows that a command started from the host runs the root's
Slurm on the root's libraries. Missing prerequisites fail in CI and skip elsewhere.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from clockwork.contracts.errors import SandboxError
from clockwork.sandbox.cluster import SPANK_SO, spank_plugin
from clockwork.sandbox.slurm_release import CACHE_DIR, RELEASES, release
from tests.conftest import in_ci

CLIENTS = {"sbatch", "srun", "salloc", "squeue", "scontrol", "sinfo", "sacct", "sacctmgr", "scancel"}


def _require(problem: str | None) -> None:
    if problem is None:
        return
    if in_ci():
        pytest.fail(problem + " (CI must run everything)")
    pytest.skip(problem + " (skipped on a developer machine only)")


def test_the_releases_and_the_default() -> None:
    assert list(RELEASES) == ["22.05", "24.11", "26.05"]
    host = release("22.05")
    assert not host.from_root and host.ready()
    assert host.overlay_command() == "" and host.plugin_dir() is None
    assert spank_plugin(host) == SPANK_SO
    with pytest.raises(SandboxError, match=r"no sandbox Slurm release '23\.02'"):
        release("23.02")


def test_a_root_release_is_laid_over_usr_from_outside_it() -> None:
    slurm = release("24.11")
    assert slurm.from_root and slurm.suite == "trixie"
    assert slurm.root == CACHE_DIR / "slurm-24.11" / "root"
    assert not slurm.root.is_relative_to("/usr")  # overlayfs refuses a layer inside another
    assert slurm.overlay_command() == (
        f"mount -t overlay clockwork-slurm-24.11 -o ro,lowerdir={slurm.root}/usr:/usr /usr"
    )
    assert spank_plugin(slurm).parts[-2:] == ("slurm-24.11", "clockwork.so")


def test_a_missing_root_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("clockwork.sandbox.slurm_release.CACHE_DIR", tmp_path)
    slurm = release("24.11")
    assert not slurm.ready()
    with pytest.raises(SandboxError, match=r"clockwork sandbox prepare --slurm 24.11.*make slurm-24.11"):
        slurm.require()
    with pytest.raises(SandboxError, match="not built yet"):
        slurm.installed()


def test_the_built_root_and_its_wrappers(tmp_path: Path) -> None:
    slurm = release("24.11")
    _require(None if slurm.ready() else f"{slurm.root} is missing (make slurm-24.11 builds it)")
    assert slurm.installed().startswith("24.11.")
    assert slurm.ensure_root() == 0.0  # built: nothing to do
    plugins = slurm.plugin_dir()
    assert plugins is not None and (plugins / "libslurmfull.so").is_file() and plugins.is_relative_to(slurm.root)
    tools = slurm.write_client_wrappers(tmp_path)
    assert CLIENTS <= set(tools)
    assert sorted(p.name for p in tmp_path.iterdir()) == tools
    _require(None if os.geteuid() == 0 else "running the wrappers needs root (a mount namespace)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\n")  # 24.11's clients read it even for --version
    out = subprocess.run(
        [tmp_path / "sbatch", "--version"],
        env={"PATH": "/usr/bin:/bin", "SLURM_CONF": str(conf)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"slurm-wlm {slurm.installed().split('-')[0]}"
    host = subprocess.run(
        ["sbatch", "--version"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "SLURM_CONF": str(conf)}
    )
    assert host.stdout.startswith("slurm-wlm 22.05."), host  # the host's own stays as it was
