"""The files a sandbox runs on: slurm.conf, slurmdbd.conf, hosts, plugstack and the hook wrappers.

The wrappers are executed for real (they only need a python and a spool folder), which proves that a
hook Slurm runs as root without PATH finds its interpreter, its configuration and the hook code.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from clockwork.contracts.config import load_config
from clockwork.contracts.config.core import SandboxConfig
from clockwork.sandbox.layout import Layout, build_layout
from clockwork.sandbox.paths import StatePaths
from clockwork.sandbox.slurm_files import (
    GPUS_PER_NODE,
    HOOKS,
    gres_conf,
    hook_wrapper,
    hosts,
    plugstack,
    slurm_conf,
    slurmdbd_conf,
    write_all,
)
from clockwork.sandbox.slurm_release import RELEASES
from slurm_hooks import events


@pytest.fixture
def paths(tmp_path: Path) -> StatePaths:
    return StatePaths(tmp_path / "state")


@pytest.fixture
def layout() -> Layout:
    return build_layout(SandboxConfig(nodes=3))


def _settings(text: str) -> dict[str, str]:
    """Single-valued ``Key=Value`` lines of a Slurm config (node and partition lines excluded)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("#") or line.startswith(("NodeName=", "PartitionName=")):
            continue
        key, sep, value = line.partition("=")
        assert sep, line
        assert key not in out, f"{key} set twice"
        out[key] = value
    return out


def _records(text: str, kind: str) -> dict[str, dict[str, str]]:
    """``NodeName=...``/``PartitionName=...`` lines as name -> {key: value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith(f"{kind}="):
            fields = dict(token.split("=", 1) for token in line.split())
            out[fields[kind]] = fields
    return out


def test_slurm_conf_without_accounting(paths: StatePaths, layout: Layout) -> None:
    conf = _settings(slurm_conf(paths, layout, accounting=False, cpus_per_node=2))
    assert conf["AccountingStorageType"] == "accounting_storage/none"
    assert "AccountingStorageHost" not in conf
    assert "AccountingStoragePass" not in conf


def test_slurm_conf_with_accounting(paths: StatePaths, layout: Layout) -> None:
    conf = _settings(slurm_conf(paths, layout, accounting=True, cpus_per_node=2))
    assert conf["AccountingStorageType"] == "accounting_storage/slurmdbd"
    assert conf["AccountingStorageHost"] == "198.19.0.254"  # the controller, reachable from every node
    assert conf["AccountingStoragePort"] == str(layout.slurmdbd_port)
    assert conf["AccountingStoragePass"] == str(paths.munge_socket)


def test_slurm_conf_core_settings(paths: StatePaths, layout: Layout) -> None:
    conf = _settings(slurm_conf(paths, layout, accounting=False, cpus_per_node=2))
    assert conf["ClusterName"] == "clockwork"
    assert conf["SlurmctldHost"] == f"ctl({layout.ctl_ip})"
    assert conf["SlurmctldPort"] == str(layout.slurmctld_port)
    assert conf["SlurmdPort"] == str(layout.slurmd_port)
    assert conf["PrologFlags"] == "Alloc"
    assert conf["PreemptType"] == "preempt/partition_prio"
    assert conf["PreemptMode"] == "REQUEUE"
    assert conf["AuthInfo"] == f"socket={paths.munge_socket},cred_expire=5"
    assert conf["PlugStackConfig"] == str(paths.plugstack_conf)
    assert conf["StateSaveLocation"] == str(paths.ctld_state)


def test_every_node_declares_fake_gpus_slurm_counts(paths: StatePaths, layout: Layout) -> None:
    text = slurm_conf(paths, layout, accounting=False, cpus_per_node=2)
    conf = _settings(text)
    assert conf["GresTypes"] == "gpu" and "AccountingStorageTRES" not in conf  # slurmctld needs slurmdbd for it
    assert _settings(slurm_conf(paths, layout, accounting=True, cpus_per_node=2))["AccountingStorageTRES"] == "gres/gpu"
    nodes = _records(text, "NodeName")
    assert nodes and all(n["Gres"] == f"gpu:{GPUS_PER_NODE}" for n in nodes.values())
    gres = _records(gres_conf(paths, layout), "NodeName")
    assert set(gres) == set(nodes)
    for name, line in gres.items():
        assert line == {"NodeName": name, "Name": "gpu", "File": f"{paths.root}/nodes/{name}/dev/gpu[0-1]"}


def test_slurm_conf_hooks_are_absolute_paths_under_state_hooks(paths: StatePaths, layout: Layout) -> None:
    conf = _settings(slurm_conf(paths, layout, accounting=False, cpus_per_node=2))
    assert set(HOOKS) == {"Prolog", "Epilog", "PrologSlurmctld", "EpilogSlurmctld", "HealthCheckProgram"}
    for param, name in HOOKS.items():
        path = Path(conf[param])
        assert path.is_absolute(), param
        assert path == paths.root / "hooks" / name
    assert conf["Prolog"].endswith("/hooks/prolog")
    assert conf["EpilogSlurmctld"].endswith("/hooks/epilog_slurmctld")


def test_slurm_conf_nodes(paths: StatePaths, layout: Layout) -> None:
    nodes = _records(slurm_conf(paths, layout, accounting=False, cpus_per_node=4), "NodeName")
    assert list(nodes) == ["node1", "node2", "node3"]
    for node in layout.nodes:
        line = nodes[node.name]
        assert line["NodeAddr"] == node.mgmt_ip
        assert line["NodeHostname"] == node.name
        assert line["CPUs"] == "4"


def test_slurm_conf_partitions(paths: StatePaths, layout: Layout) -> None:
    parts = _records(slurm_conf(paths, layout, accounting=False, cpus_per_node=2), "PartitionName")
    assert set(parts) == {"low", "high"}
    low, high = parts["low"], parts["high"]
    assert low["Default"] == "YES"
    assert low["PreemptMode"] == "REQUEUE"
    assert low["PriorityTier"] == "1"
    assert high["PriorityTier"] == "10"
    assert "Default" not in high
    assert int(high["PriorityTier"]) > int(low["PriorityTier"])
    assert low["Nodes"] == high["Nodes"] == "node1,node2,node3"


def test_slurmdbd_conf(paths: StatePaths, layout: Layout) -> None:
    conf = _settings(slurmdbd_conf(paths, layout))
    assert conf["AuthInfo"] == f"socket={paths.munge_socket}"
    assert conf["DbdPort"] == str(layout.slurmdbd_port)
    assert conf["StoragePort"] == str(layout.mariadb_port)
    assert conf["StorageType"] == "accounting_storage/mysql"


def test_hosts(layout: Layout) -> None:
    entries = [line.split("\t") for line in hosts(layout).splitlines()]
    table = {name: addr for addr, name in entries}
    assert table["localhost"] == "127.0.0.1"
    assert table["ctl"] == layout.ctl_ip
    for node in layout.nodes:
        assert table[node.name] == node.node_addr
        assert table[f"{node.name}-mgmt"] == node.mgmt_ip
        for nic in node.nics:  # a connection's source address has a name too (c10d looks it up)
            assert table[f"{node.name}-{nic.name}"] == nic.ip
        assert table[f"{node.name}.v4mapped"] == f"::ffff:{node.node_addr}"  # how c10d looks its peers up
    addresses = [addr for addr, _ in entries]
    assert len(addresses) == len(set(addresses)), "one name per address"
    assert sum(1 for _, name in entries if name == "node1") == 1, "forward lookups stay IPv4"


def test_hook_wrapper() -> None:
    text = hook_wrapper("/opt/py env/bin/python3", Path("/run/cw sandbox/etc/clockwork.toml"), "prolog")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh"
    assert shlex.split(lines[-1]) == [
        "CLOCKWORK_CONFIG=/run/cw sandbox/etc/clockwork.toml",
        "exec",
        "/opt/py env/bin/python3",
        "-m",
        "slurm_hooks",
        "prolog",
    ]


def test_hook_wrapper_carries_the_builders_pythonpath() -> None:
    """Slurm gives a hook none of slurmd's environment: a worktree on the builder's PYTHONPATH reaches the hooks
    (and the daemons a Prolog starts) only through the wrapper."""
    text = hook_wrapper("/venv/bin/python", Path("/s/clockwork.toml"), "epilog", "/work/wt x:/work/wt x/daemon")
    assert shlex.split(text.splitlines()[-1])[:3] == [
        "PYTHONPATH=/work/wt x:/work/wt x/daemon",
        "CLOCKWORK_CONFIG=/s/clockwork.toml",
        "exec",
    ]


def test_plugstack(tmp_path: Path) -> None:
    so = tmp_path / "clockwork.so"
    assert plugstack(None).startswith("#")
    assert plugstack(so).startswith("#")
    so.write_bytes(b"")
    assert plugstack(so) == f"optional {so}\n"


@pytest.mark.parametrize("accounting", [False, True])
def test_write_all(paths: StatePaths, layout: Layout, accounting: bool) -> None:
    write_all(paths, layout, accounting=accounting, cpus_per_node=2, python=sys.executable, spank_so=None)
    for d in paths.all_dirs():
        assert d.is_dir(), d
    for f in (paths.slurm_conf, paths.cgroup_conf, paths.plugstack_conf, paths.hosts, paths.clockwork_toml):
        assert f.is_file(), f
    assert paths.slurm_conf.read_text() == slurm_conf(paths, layout, accounting, 2)
    assert paths.hosts.read_text() == hosts(layout)
    if accounting:
        assert stat.S_IMODE(paths.slurmdbd_conf.stat().st_mode) == 0o600
        assert paths.slurmdbd_conf.read_text() == slurmdbd_conf(paths, layout)
    else:
        assert not paths.slurmdbd_conf.exists()
    for name in HOOKS.values():
        wrapper = paths.hooks / name
        assert wrapper.read_text() == hook_wrapper(sys.executable, paths.clockwork_toml, name)
        assert os.access(wrapper, os.X_OK)
        assert stat.S_IMODE(wrapper.stat().st_mode) == 0o755
    for node in layout.nodes:
        assert (paths.node_dir(node.name) / "spool").is_dir()


def test_written_clockwork_toml_is_a_valid_configuration(paths: StatePaths, layout: Layout) -> None:
    write_all(paths, layout, accounting=False, cpus_per_node=2, python=sys.executable, spank_so=None)
    cfg = load_config(paths.clockwork_toml, env={}).config
    assert cfg.log.file == str(paths.logs / "clockwork.log")
    assert cfg.slurm.backend == "cli"
    assert cfg.slurm.conf == str(paths.slurm_conf)
    assert cfg.hooks.spool_dir == str(paths.spool)
    assert cfg.sandbox.state_dir == str(paths.root)
    # No GPUs on the sandbox: every daemon reads its own node's GPU fault file (`clockwork sandbox fault gpu`).
    assert cfg.health.source == "fault-file"
    assert cfg.health.fault_file.replace("{node}", "node2") == str(paths.root / "nodes" / "node2" / "gpu-faults.json")
    # Borrowing takes from the preemptible default partition through the high-tier one.
    assert (cfg.borrow.enabled, cfg.borrow.partitions, cfg.borrow.holder_partition) == (True, "low", "high")
    assert cfg.lens.enabled  # Fleet Lens runs in the daemons, unless [sandbox] lens turns it off:
    write_all(paths, layout, accounting=False, cpus_per_node=2, python=sys.executable, spank_so=None, lens=False)
    assert not load_config(paths.clockwork_toml, env={}).config.lens.enabled


def test_prolog_wrapper_runs_and_records_the_event(paths: StatePaths, layout: Layout, tmp_path: Path) -> None:
    write_all(paths, layout, accounting=False, cpus_per_node=2, python=sys.executable, spank_so=None)
    env = {  # what slurmd gives a Prolog: no PATH, no HOME
        "SLURM_JOB_ID": "42",
        "SLURMD_NODENAME": "node1",
        "SLURM_JOB_UID": "0",
        "SLURM_JOB_USER": "root",
        "SPANK_CLOCKWORK_FT": "off",  # no daemon work: this checks the wrapper itself
    }
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    proc = subprocess.run([str(paths.hooks / "prolog")], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    event_file = paths.spool / "jobs" / "42" / "node1.jsonl"
    assert event_file.is_file(), proc.stderr
    (event,) = events.read(paths.spool, 42)
    assert event["event"] == "job.prolog"
    assert event["job_id"] == 42
    assert event["node"] == "node1"
    assert event["uid"] == 0
    assert event["user"] == "root"
    assert event["options"] == {"ft": "off"}
    assert "exit_code" not in event
    assert "job 42: job.prolog on node1" in (paths.logs / "clockwork.log").read_text()


def test_a_release_from_a_root_gets_its_plugins_and_commands(paths: StatePaths, layout: Layout, tmp_path: Path) -> None:
    """Slurm 24.11's sandbox: slurm.conf names the root's plugin folder (no host plugin is ever found), and the
    configuration the hooks, the daemons and the tools read points them at the release's client commands."""
    plugins = tmp_path / "root" / "usr" / "lib" / "x86_64-linux-gnu" / "slurm-wlm"
    write_all(
        paths,
        layout,
        accounting=True,
        cpus_per_node=2,
        python=sys.executable,
        spank_so=None,
        plugin_dir=plugins,
        slurm_bin=paths.slurm_bin,
    )
    assert _settings(paths.slurm_conf.read_text())["PluginDir"] == str(plugins)
    assert "PluginDir" not in _settings(slurm_conf(paths, layout, accounting=True, cpus_per_node=2))
    slurm = load_config(paths.clockwork_toml, env={}).config.slurm
    assert slurm.bin_dir == str(paths.slurm_bin)
    write_all(paths, layout, accounting=True, cpus_per_node=2, python=sys.executable, spank_so=None)
    assert load_config(paths.clockwork_toml, env={}).config.slurm.bin_dir == ""  # the host's: PATH


def test_racks_make_slurms_topology_and_torchpass_reads_it(paths: StatePaths) -> None:
    """``[sandbox] racks``: a topology.conf beside slurm.conf with a leaf switch per rack, TopologyPlugin set, and the
    file read back as TorchPass reads it (the rack of each node); without racks, neither."""
    from torchpass.failure_domains import node_domains

    layout = build_layout(SandboxConfig(nodes=6, racks="node[1-2,5-6] node[3-4]"))
    assert layout.racks == (("node1", "node2", "node5", "node6"), ("node3", "node4"))
    assert _settings(slurm_conf(paths, layout, accounting=False, cpus_per_node=2))["TopologyPlugin"] == "topology/tree"
    write_all(paths, layout, accounting=False, cpus_per_node=2, python=sys.executable, spank_so=None)
    assert paths.slurm_topology.parent == paths.slurm_conf.parent
    domains = node_domains("auto", {"SLURM_CONF": str(paths.slurm_conf)})
    assert domains == {"node1": "rack0", "node2": "rack0", "node5": "rack0", "node6": "rack0"} | {
        "node3": "rack1",
        "node4": "rack1",
    }
    flat = build_layout(SandboxConfig(nodes=3))
    assert "TopologyPlugin" not in _settings(slurm_conf(paths, flat, accounting=False, cpus_per_node=2))
    write_all(paths, flat, accounting=False, cpus_per_node=2, python=sys.executable, spank_so=None)
    assert not paths.slurm_topology.exists()


@pytest.mark.parametrize(
    ("racks", "error"),
    [
        ("node[1-2] node[2-3]", "in two racks ['node2']"),
        ("node[1-2]", "in no rack ['node3']"),
        ("node[1-3] node9", "unknown ['node9']"),
        ("node[1-", "[sandbox] racks: bad hostlist"),
    ],
)
def test_bad_racks_are_refused_naming_the_nodes(racks: str, error: str) -> None:
    from clockwork.contracts.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        build_layout(SandboxConfig(nodes=3, racks=racks))
    assert error in str(info.value)


def test_expedited_requeue_is_enabled_from_slurm_25_11_only(paths: StatePaths, layout: Layout) -> None:
    """``sbatch --requeue=expedite`` needs ``SlurmctldParameters=enable_expedited_requeue`` (25.11+); older releases
    get no SlurmctldParameters line (24.11's slurmctld ignores the unknown word, but its sbatch refuses the option)."""
    assert RELEASES["26.05"].slurmctld_parameters == ("enable_expedited_requeue",)
    assert RELEASES["24.11"].slurmctld_parameters == RELEASES["22.05"].slurmctld_parameters == ()
    for version, expected in (("26.05", "enable_expedited_requeue"), ("24.11", None), ("22.05", None)):
        params = RELEASES[version].slurmctld_parameters
        conf = _settings(slurm_conf(paths, layout, False, 2, slurmctld_parameters=params))
        assert conf.get("SlurmctldParameters") == expected, version
