"""The Debian packages, installed the way admins install them, and a job run through what they installed (root).

1. ``packaging/deb/build.sh`` (what ``make deb`` runs) builds clockwork-slurm and clockwork-slurm-spank, the plugin
   against the host's libslurm-dev (22.05).
2. A clean Debian 12 root (``mmdebstrap --variant=minbase``, with python3.11, libsodium23 and slurm-client: what
   the packages depend on from the distribution), built once per machine under /var/cache/clockwork/deb-check like the
   sandbox's Slurm roots, gets a fresh overlay per run, and ``dpkg -i`` installs both packages there. They
   install (their dependencies are met by the distribution's packages alone); ``clockwork --version``,
   ``clockworkd`` and the hooks run inside the root; the conffiles and the plugin are where the admin guide says.
3. The installed ``/opt/clockwork`` is bind-mounted at the same path on the host, and a sandbox points its nodes
   at it (``[sandbox] python`` = the package's interpreter, ``spank_plugin`` = the package's plugin): sbatch's
   ``--clockwork-*`` options come from the installed plugin (a bad value is refused with its message), the
   Prolog is the installed ``slurm_hooks`` and starts the installed ``clockworkd``, which registers the job, and
   the installed Epilog writes the report and the AdminComment.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from clockwork.sandbox.cluster import Sandbox
from tests.conftest import until
from tests.integration.conftest import SandboxManager, daemon_pid, slurm_env, wait_job
from tests.integration.test_hooks_daemon import admin_comment

REPO = Path(__file__).resolve().parents[2]
CACHE = Path("/var/cache/clockwork/deb-check")
ROOT = CACHE / "root"
MARKER = ROOT / ".clockwork-clean-root"
OPT = Path("/opt/clockwork")
PLUGIN = "usr/lib/x86_64-linux-gnu/slurm-wlm/clockwork.so"
#: What the packages' Depends name from the distribution (dpkg -i installs no dependency: the admin's apt does).
DEPENDS = ("python3.11", "libsodium23", "slurm-client")


def _run(argv: list[str], timeout: float = 600, **kw: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, (
        f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("deb")
    _run(["bash", str(REPO / "packaging/deb/build.sh"), str(out)], timeout=1800, cwd=REPO)
    built = sorted(out.glob("*.deb"))
    assert sorted(p.name.split("_")[0] for p in built) == ["clockwork-slurm", "clockwork-slurm-spank"], built
    return built


@pytest.fixture(scope="module")
def clean_root() -> Path:
    """Debian 12 minbase with what the packages need from the distribution; built once, never installed into."""
    wanted = ",".join(DEPENDS)
    if not MARKER.exists() or MARKER.read_text().strip() != wanted:
        CACHE.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(ROOT, ignore_errors=True)
        _run(["mmdebstrap", "--variant=minbase", f"--include={wanted}", "bookworm", str(ROOT)], 1800)
        MARKER.write_text(wanted + "\n")
    return ROOT


@pytest.fixture(scope="module")
def installed(clean_root: Path, debs: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh overlay of the clean root with both packages installed by dpkg -i; its merged folder."""
    work = tmp_path_factory.mktemp("overlay")
    upper, scratch, merged = work / "upper", work / "work", work / "merged"
    for d in (upper, scratch, merged):
        d.mkdir()
    _run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={clean_root},upperdir={upper},workdir={scratch}",
            str(merged),
        ]
    )
    try:
        for deb in debs:
            shutil.copy(deb, merged / "tmp" / deb.name)
        _run(["chroot", str(merged), "dpkg", "-i", *(f"/tmp/{deb.name}" for deb in debs)])
        yield merged
    finally:
        subprocess.run(["umount", "-l", str(merged)], check=False)


@pytest.fixture(scope="module")
def opt_from_the_package(installed: Path) -> Iterator[Path]:
    """The package's /opt/clockwork at /opt/clockwork on the host (its scripts name that path)."""
    assert not OPT.exists() or not any(OPT.iterdir()), f"{OPT} exists on this machine: the test would hide it"
    created = not OPT.exists()
    OPT.mkdir(parents=True, exist_ok=True)
    _run(["mount", "--bind", str(installed / "opt/clockwork"), str(OPT)])
    try:
        yield OPT
    finally:
        subprocess.run(["umount", "-l", str(OPT)], check=False)
        if created:
            with contextlib.suppress(OSError):
                OPT.rmdir()


def test_both_packages_install_on_a_clean_root_and_their_programs_run(installed: Path) -> None:
    status = _run(
        [
            "chroot",
            str(installed),
            "dpkg-query",
            "-W",
            "-f=${Package} ${Status}\n",
            "clockwork-slurm",
            "clockwork-slurm-spank",
        ]
    ).stdout
    assert status.splitlines() == ["clockwork-slurm install ok installed", "clockwork-slurm-spank install ok installed"]
    version = _run(["chroot", str(installed), "clockwork", "--version"]).stdout
    assert version.startswith("clockwork, version "), version
    daemon = _run(["chroot", str(installed), "/opt/clockwork/venv/bin/clockworkd", "--help"]).stdout
    assert "clockworkd" in daemon
    for path in (
        "etc/clockwork/clockwork.toml",
        "etc/slurm/plugstack.conf.d/clockwork.conf",
        PLUGIN,
        "lib/systemd/system/clockworkd.service",
        "usr/share/man/man1/clockwork.1.gz",
    ):
        assert (installed / path).is_file(), path
    conffiles = _run(["chroot", str(installed), "dpkg-query", "-W", "-f=${Conffiles}\n", "clockwork-slurm"]).stdout
    assert "/etc/clockwork/clockwork.toml" in conffiles


def test_a_job_runs_through_the_installed_plugin_hooks_and_daemon(
    installed: Path, opt_from_the_package: Path, sandbox_manager: SandboxManager
) -> None:
    python = opt_from_the_package / "venv/bin/python"
    box: Sandbox = sandbox_manager.ensure_up(
        nodes=2, accounting=True, python=str(python), spank_plugin=str(installed / PLUGIN)
    )
    env = slurm_env(box)
    refused = subprocess.run(
        ["sbatch", "--clockwork-spares=bogus", "--wrap", "true"], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0 and "clockwork" in refused.stderr and "bogus" in refused.stderr, refused.stderr
    submitted = _run(["sbatch", "--parsable", "-o", "/dev/null", "-N2", "--clockwork-ft", "--wrap", "sleep 2"], env=env)
    job_id = int(submitted.stdout.strip().split(";")[0])
    assert wait_job(box, job_id) == "COMPLETED"
    comment = admin_comment(box, job_id)
    assert comment.startswith("clockwork: 0 link failovers, 0 migrations, 0 rollbacks; report="), comment
    pid = until("node1's daemon to answer", lambda: daemon_pid(box, "node1"), 30)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert any(arg.startswith(str(opt_from_the_package).encode()) for arg in argv), argv  # the package's daemon
    assert sys.executable not in (a.decode() for a in argv)
