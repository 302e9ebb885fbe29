"""make_backend(): which backend a site gets, and why; plus PyslurmBackend's mapping of pyslurm objects.

pyslurm is not installed here (it needs the site's libslurm headers), so the "pyslurm present" cases
put a stand-in module into sys.modules that exposes the pyslurm 25.11 names make_backend and
PyslurmBackend use. The site's Slurm version comes from a fake ``sinfo --version`` in bin_dir.
"""

from __future__ import annotations

import importlib.machinery
import logging
import shlex
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from clockwork.contracts.errors import ConfigError, SlurmError
from clockwork.contracts.slurm import (
    CliBackend,
    JobInfo,
    NodeInfo,
    PyslurmBackend,
    SlurmBackend,
    make_backend,
)
from clockwork.contracts.slurm.pyslurm_backend import pyslurm_release


class FakeRPCError(Exception):
    def __init__(self, errno: int, msg: str) -> None:
        super().__init__(msg)
        self.errno = errno


def fake_pyslurm(version: str, jobs: dict[int, Any] | None = None, nodes: dict[str, Any] | None = None) -> Any:
    """A stand-in for the pyslurm module with the 25.11 API surface that Clockwork touches."""
    mod: Any = types.ModuleType("pyslurm")
    mod.__spec__ = importlib.machinery.ModuleSpec("pyslurm", loader=None)
    mod.version = lambda: version
    mod.RPCError = FakeRPCError
    known_jobs = jobs or {}

    def load_job(job_id: int) -> Any:
        if job_id not in known_jobs:
            raise FakeRPCError(2017, "Invalid job id specified")
        return known_jobs[job_id]

    mod.Job = SimpleNamespace(load=load_job)
    mod.Nodes = SimpleNamespace(load=lambda: dict(nodes or {}))
    return mod


@pytest.fixture
def site(tmp_path: Path) -> tuple[Path, Path]:
    """(slurm_conf, bin_dir) of a site running Slurm 22.05.8."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sinfo = bin_dir / "sinfo"
    log = shlex.quote(str(tmp_path / "sinfo.log"))
    sinfo.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\necho 'slurm-wlm 22.05.8'\n")
    sinfo.chmod(0o755)
    return tmp_path / "slurm.conf", bin_dir


@pytest.fixture
def no_pyslurm(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes find_spec() answer None and `import pyslurm` raise, even where it is installed.
    monkeypatch.setitem(sys.modules, "pyslurm", None)


def install_fake(monkeypatch: pytest.MonkeyPatch, module: Any, slurm_conf: Path) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", module)
    monkeypatch.setenv("SLURM_CONF", str(slurm_conf))


def test_cli_kind_runs_nothing(site: tuple[Path, Path], tmp_path: Path) -> None:
    conf, bin_dir = site
    backend = make_backend("cli", conf, bin_dir, 5.0)
    assert isinstance(backend, CliBackend)
    assert isinstance(backend, SlurmBackend)
    assert backend.slurm_conf == conf
    assert backend.bin_dir == bin_dir
    assert backend.timeout_s == 5.0
    assert not (tmp_path / "sinfo.log").exists()


def test_unknown_kind_is_a_config_error(site: tuple[Path, Path]) -> None:
    conf, bin_dir = site
    with pytest.raises(ConfigError, match=r"'slurmrestd'.*auto, cli, pyslurm"):
        make_backend("slurmrestd", conf, bin_dir, 5.0)


def test_auto_without_pyslurm_is_cli_and_says_why(
    site: tuple[Path, Path], no_pyslurm: None, caplog: pytest.LogCaptureFixture
) -> None:
    conf, bin_dir = site
    with caplog.at_level(logging.INFO, logger="clockwork.slurm"):
        backend = make_backend("auto", conf, bin_dir, 5.0)
    assert isinstance(backend, CliBackend)
    messages = [r.getMessage() for r in caplog.records if r.name == "clockwork.slurm"]
    assert any("CLI" in m and "pyslurm is not importable" in m for m in messages), messages


def test_explicit_pyslurm_without_pyslurm_raises(site: tuple[Path, Path], no_pyslurm: None) -> None:
    conf, bin_dir = site
    with pytest.raises(SlurmError, match=r"pyslurm.*cannot be used: pyslurm is not importable") as info:
        make_backend("pyslurm", conf, bin_dir, 5.0)
    assert info.value.exit_code == 4


def test_auto_with_mismatched_pyslurm_is_cli(
    site: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    conf, bin_dir = site
    install_fake(monkeypatch, fake_pyslurm("25.11.0"), conf)
    with caplog.at_level(logging.INFO, logger="clockwork.slurm"):
        backend = make_backend("auto", conf, bin_dir, 5.0)
    assert isinstance(backend, CliBackend)
    assert "pyslurm is built for Slurm 25.11 but the site's libslurm is 22.05.8" in caplog.text


def test_explicit_pyslurm_with_mismatched_version_raises(
    site: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    conf, bin_dir = site
    install_fake(monkeypatch, fake_pyslurm("23.11.2"), conf)
    with pytest.raises(SlurmError, match=r"built for Slurm 23\.11 but the site's libslurm is 22\.05\.8"):
        make_backend("pyslurm", conf, bin_dir, 5.0)


def test_matching_pyslurm_is_chosen(site: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    conf, bin_dir = site
    install_fake(monkeypatch, fake_pyslurm("22.5.1"), conf)
    auto = make_backend("auto", conf, bin_dir, 5.0)
    explicit = make_backend("pyslurm", conf, bin_dir, 5.0)
    assert isinstance(auto, PyslurmBackend)
    assert isinstance(explicit, PyslurmBackend)
    assert isinstance(auto, SlurmBackend)
    assert auto.version() == (22, 5, 8)


def test_pyslurm_loaded_for_another_conf_is_not_used(site: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    conf, bin_dir = site
    install_fake(monkeypatch, fake_pyslurm("22.05.0"), conf)
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/other.conf")
    with pytest.raises(SlurmError, match=r"already loaded with SLURM_CONF='/etc/slurm/other\.conf'"):
        make_backend("pyslurm", conf, bin_dir, 5.0)
    assert isinstance(make_backend("auto", conf, bin_dir, 5.0), CliBackend)


def test_site_version_unknown_means_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "slurm.conf"
    install_fake(monkeypatch, fake_pyslurm("22.05.0"), conf)
    empty_bin = tmp_path / "empty"
    empty_bin.mkdir()
    assert isinstance(make_backend("auto", conf, empty_bin, 5.0), CliBackend)
    with pytest.raises(SlurmError, match="site's Slurm version is unknown"):
        make_backend("pyslurm", conf, empty_bin, 5.0)


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({"slurm_version": lambda: "22.05.8", "version": lambda: "25.11.0"}, (22, 5)),
        ({"version": lambda: "25.11.0"}, (25, 11)),
        ({"slurm_version": lambda: (24, 11, 3)}, (24, 11)),
        ({"__version__": "23.2.2"}, (23, 2)),
    ],
)
def test_pyslurm_release(attrs: dict[str, Any], expected: tuple[int, int]) -> None:
    assert pyslurm_release(SimpleNamespace(**attrs)) == expected


def test_pyslurm_backend_maps_jobs_and_nodes(site: tuple[Path, Path]) -> None:
    conf, bin_dir = site
    job = SimpleNamespace(
        id=4242,
        name="train-ft",
        state="RUNNING",
        user_name="alice",
        partition="main",
        allocated_nodes="n[01-02],gpu7",
        exit_code=0,
        exit_code_signal=0,
        requeue_count=1,
        admin_comment=None,
    )
    node = SimpleNamespace(
        name="n02", state="IDLE+DRAIN", address="10.10.0.2", partitions=["main"], reason="NIC0 flapping"
    )
    backend = PyslurmBackend(fake_pyslurm("22.05.0", jobs={4242: job}, nodes={"n02": node}), CliBackend(conf, bin_dir))
    assert backend.job(4242) == JobInfo(
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
    assert backend.job(7) is None
    assert backend.nodes() == [NodeInfo("n02", ("IDLE", "DRAIN"), "10.10.0.2", ["main"], "NIC0 flapping")]
