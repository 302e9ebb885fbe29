"""The sandbox's OCI containers (clockwork.sandbox.oci) and the root that carries crun (slurm_release).

What Slurm and crun make of these files is tested for real on the 24.11 sandbox
(tests/integration/test_oci_container_sandbox.py); here: what is written, and that a root built before crun joined
its packages is built again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clockwork.sandbox.oci import IMAGE_MARKER, Bind, oci_conf, write_bundle
from clockwork.sandbox.slurm_release import MARKER, PACKAGES, ROOT_PACKAGES, release


def test_oci_conf_runs_crun_with_a_state_folder_per_node_and_no_cgroups() -> None:
    conf = oci_conf(Path("/s/crun")).splitlines()
    assert 'RunTimeRun="crun --cgroup-manager=disabled --root=/s/crun/%n run --bundle %b %n.%u.%j.%s.%t"' in conf
    assert {line.split("=", 1)[0] for line in conf if line and not line.startswith("#")} == {
        "RunTimeQuery",
        "RunTimeKill",
        "RunTimeDelete",
        "RunTimeRun",
    }


def test_the_bundle_shares_the_nodes_network_and_mounts_what_it_is_given(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "b", [Bind("/opt/py"), Bind("/data/job", writable=True)], {"A": "1"})
    config = json.loads((bundle / "config.json").read_text())
    assert config["linux"]["namespaces"] == [{"type": "mount"}]  # no network, no pid namespace of its own
    assert config["root"] == {"path": "rootfs", "readonly": True}
    mounts = {m["destination"]: m for m in config["mounts"]}
    assert mounts["/opt/py"]["options"] == ["rbind", "ro"] and mounts["/data/job"]["options"] == ["rbind", "rw"]
    assert mounts["/usr"]["source"] == "/usr" and mounts["/tmp"]["type"] == "tmpfs"
    assert "A=1" in config["process"]["env"]
    rootfs = bundle / "rootfs"
    assert (rootfs / IMAGE_MARKER).is_file() and (rootfs / "bin").readlink() == Path("usr/bin")
    assert all((rootfs / d.lstrip("/")).is_dir() for d in mounts)  # mount points exist in the read-only rootfs


def test_a_root_without_crun_is_not_ready(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("clockwork.sandbox.slurm_release.CACHE_DIR", tmp_path)
    slurm = release("24.11")
    (slurm.root / MARKER).parent.mkdir(parents=True)
    (slurm.root / MARKER).write_text("24.11.5-4+deb13u1\n")
    assert "crun" in ROOT_PACKAGES
    assert not slurm.ready()  # built before the packages were listed: built again
    (slurm.root / PACKAGES).write_text("\n".join(p for p in ROOT_PACKAGES if p != "crun") + "\n")
    assert not slurm.ready()
    (slurm.root / PACKAGES).write_text("\n".join(ROOT_PACKAGES) + "\n")
    assert slurm.ready()
