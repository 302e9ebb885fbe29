"""The SPANK plugin's Debian package (``make deb``, packaging/deb/build.sh with ``ONLY=spank``): what it installs,
its conffile, the Slurm series its Depends pins (Slurm loads a plugin only from its own series), and lintian.

The other package (clockwork-slurm, the venv) needs the Python registry and minutes to build: it is built by
``make deb`` and checked by hand (docs/admin-guide.md says what was run). Needs dpkg-deb, gcc, libslurm-dev and
lintian (``make venv`` installs them): missing ones fail the tests in CI and skip them elsewhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import in_ci

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "packaging" / "deb" / "build.sh"


def _require(problem: str | None) -> None:
    if problem is None:
        return
    if in_ci():
        pytest.fail(problem + " (CI must run everything)")
    pytest.skip(problem + " (skipped on a developer machine only)")


@pytest.fixture(scope="module")
def spank_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [tool for tool in ("dpkg-deb", "cc", "make") if shutil.which(tool) is None]
    _require(f"building the package needs {', '.join(missing)}" if missing else None)
    out = tmp_path_factory.mktemp("deb")
    built = subprocess.run(
        ["bash", str(BUILD), str(out)], env={"ONLY": "spank", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (deb,) = out.glob("clockwork-slurm-spank_*.deb")
    return deb


def _field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True, check=True).stdout.strip()


def test_the_plugin_package_installs_the_plugin_and_its_plugstack_snippet(spank_deb: Path, tmp_path: Path) -> None:
    subprocess.run(["dpkg-deb", "-x", str(spank_deb), str(tmp_path)], check=True)
    (plugin,) = tmp_path.glob("usr/lib/*/slurm-wlm/clockwork.so")
    snippet = tmp_path / "etc/slurm/plugstack.conf.d/clockwork.conf"
    assert snippet.read_text() == (ROOT / "etc/plugstack.conf.d/clockwork.conf").read_text()
    assert f"/{plugin.relative_to(tmp_path)} " in snippet.read_text()  # the plugstack line names where it lies
    exported = subprocess.run(["nm", "-D", "--defined-only", str(plugin)], capture_output=True, text=True, check=True)
    assert "slurm_spank_init" in exported.stdout
    control = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(spank_deb)], capture_output=True, check=True).stdout
    assert b"conffiles" in control
    info = subprocess.run(["dpkg-deb", "-I", str(spank_deb), "conffiles"], capture_output=True, text=True, check=True)
    assert info.stdout.split() == ["/etc/slurm/plugstack.conf.d/clockwork.conf"]


def test_the_plugin_package_depends_on_the_slurm_series_it_was_built_for(spank_deb: Path) -> None:
    headers = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "libslurm-dev"], capture_output=True, text=True)
    major, minor = (int(v) for v in headers.stdout.split(".")[:2])
    depends = _field(spank_deb, "Depends")
    assert f"slurm-client (>= {major}.{minor:02d}~)" in depends, depends
    assert f"slurm-client (<< {major}.{minor + 1:02d}~)" in depends, depends
    assert re.search(rf"built for Slurm {major}\.{minor:02d}", _field(spank_deb, "Description"))


def test_lintian_finds_nothing(spank_deb: Path) -> None:
    _require(None if shutil.which("lintian") else "lintian is not installed")
    result = subprocess.run(
        ["lintian", "--tag-display-limit", "0", str(spank_deb)], capture_output=True, text=True, timeout=300
    )
    tags = [line for line in (result.stdout + result.stderr).splitlines() if re.match(r"[EWIP]: ", line)]
    assert tags == [], "\n".join(tags)
