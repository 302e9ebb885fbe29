"""The files a sandbox cluster runs on: slurm.conf, slurmdbd.conf, plugstack, hosts, hook wrappers.

Settings follow what was measured to work and be fast on these machines (shared/TESTBED.md): SlurmUser
root, linuxproc process tracking, no task plugin, a 5 s credential lifetime so requeued jobs start
at once, and a scheduler that looks at the queue every 2 s.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
from pathlib import Path
from typing import Any

from clockwork.sandbox import gpu_faults
from clockwork.sandbox.fabric import fabric_plan
from clockwork.sandbox.layout import CLUSTER, CONTROLLER, Layout
from clockwork.sandbox.paths import StatePaths
from linkpass.settings import LinkPassConfig

#: Fake GPUs per node, as GRES (gres.conf: one character device file each, bound to nothing): jobs may ask
#: for ``--gres=gpu:N``, their steps get CUDA_VISIBLE_DEVICES, and with accounting Slurm records them (AllocTRES
#: ``gres/gpu=N``), so what a borrowed node's holder and guest step are given can be checked; nothing binds
#: devices (TaskPlugin=task/none, no ConstrainDevices).
GPUS_PER_NODE = 2

#: Slurm script contexts and the wrapper file each slurm.conf parameter points at.
HOOKS = {
    "Prolog": "prolog",
    "Epilog": "epilog",
    "PrologSlurmctld": "prolog_slurmctld",
    "EpilogSlurmctld": "epilog_slurmctld",
    "HealthCheckProgram": "healthcheck",
}


def slurm_conf(
    paths: StatePaths,
    layout: Layout,
    accounting: bool,
    cpus_per_node: int,
    plugin_dir: Path | None = None,
    slurmctld_parameters: tuple[str, ...] = (),
    slurmd_timeout_s: int = 300,
) -> str:
    """slurm.conf (``slurmctld_parameters``: the release's own, :attr:`SlurmRelease.slurmctld_parameters`)."""
    p = paths
    lines = [
        "# Written by `clockwork sandbox up`; every path lies under the sandbox state folder.",
        f"ClusterName={CLUSTER}",
        f"SlurmctldHost={CONTROLLER}({layout.ctl_ip})",
        f"SlurmctldPort={layout.slurmctld_port}",
        f"SlurmdPort={layout.slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={p.munge_socket},cred_expire=5",
        f"StateSaveLocation={p.ctld_state}",
        f"SlurmdSpoolDir={p.root}/nodes/%n/spool",
        f"SlurmctldPidFile={p.root}/slurmctld.pid",
        f"SlurmdPidFile={p.root}/nodes/%n/slurmd.pid",
        f"SlurmctldLogFile={p.logs}/slurmctld.log",
        f"SlurmdLogFile={p.logs}/slurmd-%n.log",
        f"PlugStackConfig={p.plugstack_conf}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "JobAcctGatherType=jobacct_gather/none",
        "GresTypes=gpu",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1",
        "MessageTimeout=10",
        f"SlurmdTimeout={slurmd_timeout_s}",
        "KillWait=5",
        "MinJobAge=300",
        "MpiDefault=none",
        "PrologFlags=Alloc",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        # Run on demand by tests and admins (`sandbox exec NODE -- STATE/hooks/healthcheck`), not periodically.
        "HealthCheckInterval=0",
        *(f"{param}={p.hooks / name}" for param, name in HOOKS.items()),
    ]
    if plugin_dir is not None:
        lines.append(f"PluginDir={plugin_dir}")
    if slurmctld_parameters:
        lines.append(f"SlurmctldParameters={','.join(slurmctld_parameters)}")
    if layout.racks:
        lines.append("TopologyPlugin=topology/tree")  # topology.conf (slurm_topology) lists the racks
    if accounting:
        lines += [
            "AccountingStorageType=accounting_storage/slurmdbd",
            # The controller's mgmt address: reachable from the root namespace and from every node (the
            # Epilog records AdminComments of finished jobs through slurmdbd).
            f"AccountingStorageHost={layout.ctl_ip}",
            f"AccountingStoragePort={layout.slurmdbd_port}",
            f"AccountingStoragePass={p.munge_socket}",
            "AccountingStorageTRES=gres/gpu",  # sacct's AllocTRES shows the GPUs (slurmctld needs slurmdbd for it)
            "JobCompType=jobcomp/none",
        ]
    else:
        lines.append("AccountingStorageType=accounting_storage/none")
    for node in layout.nodes:
        lines.append(
            f"NodeName={node.name} NodeAddr={node.mgmt_ip} NodeHostname={node.name} "
            f"CPUs={cpus_per_node} RealMemory=1024 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
        )
    names = ",".join(n.name for n in layout.nodes)
    lines += [
        f"PartitionName=low Nodes={names} Default=YES PriorityTier=1 PreemptMode=REQUEUE MaxTime=INFINITE State=UP",
        f"PartitionName=high Nodes={names} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def gpu_files(paths: StatePaths, node: str) -> list[Path]:
    """The files that stand for ``node``'s GPUs in gres.conf (``File=``): Slurm counts a GPU per file."""
    return [paths.root / "nodes" / node / "dev" / f"gpu{i}" for i in range(GPUS_PER_NODE)]


def gres_conf(paths: StatePaths, layout: Layout) -> str:
    """gres.conf: :data:`GPUS_PER_NODE` GPUs on every node, each a character device file of the sandbox's
    (:func:`gpu_files`, with /dev/null's numbers: nothing is bound to them; a count alone, without ``File=``,
    makes a 22.05 slurmd report no GPU at all)."""
    lines = ["# Written by `clockwork sandbox up`: fake GPUs, counted by Slurm, bound to no device."]
    for node in layout.nodes:
        files = gpu_files(paths, node.name)
        lines.append(f"NodeName={node.name} Name=gpu File={files[0].parent}/gpu[0-{len(files) - 1}]")
    return "\n".join(lines) + "\n"


def slurmdbd_conf(paths: StatePaths, layout: Layout) -> str:
    return (
        "\n".join(
            [
                "AuthType=auth/munge",
                f"AuthInfo=socket={paths.munge_socket}",
                "DbdHost=localhost",
                "DbdAddr=127.0.0.1",
                f"DbdPort={layout.slurmdbd_port}",
                "SlurmUser=root",
                f"LogFile={paths.logs}/slurmdbd.log",
                f"PidFile={paths.root}/slurmdbd.pid",
                "StorageType=accounting_storage/mysql",
                # MariaDB's unix socket (MYSQL_UNIX_PORT in slurmdbd's environment), not TCP: the MariaDB client
                # library of Slurm 24.11's root (Debian 13) insists on TLS over TCP, which the sandbox's server lacks.
                "StorageHost=localhost",
                f"StoragePort={layout.mariadb_port}",
                "StorageUser=slurm",
                "StorageLoc=slurm_acct_db",
            ]
        )
        + "\n"
    )


def hosts(layout: Layout) -> str:
    """/etc/hosts inside every node: hostnames resolve to the stable node addresses.

    So a process's own hostname is its node address, which is what gloo, TCPStore and peers bind
    and connect to: traffic then follows the routed node address that LinkPass can move. The NIC and
    management addresses get names too (``node2-nic0``, ``node2-mgmt``): a connection's source address may be
    one of them. c10d's stores accept on dual-stack sockets and look up the peer's name as an IPv4-mapped IPv6
    address (``::ffff:198.18.0.2``), so every address has such a line too, under a name of its own
    (``node2.v4mapped``: forward lookups of ``node2`` stay IPv4). Without them c10d warns "The hostname of the
    client socket cannot be retrieved" for every connection, after a DNS lookup that goes nowhere.
    """
    named = [("127.0.0.1", "localhost"), (layout.ctl_ip, CONTROLLER)]
    named += [(n.node_addr, n.name) for n in layout.nodes]
    named += [(nic.ip, f"{n.name}-{nic.name}") for n in layout.nodes for nic in n.nics]
    named += [(n.mgmt_ip, f"{n.name}-mgmt") for n in layout.nodes]
    lines = [f"{addr}\t{name}" for addr, name in named]
    lines += [f"::ffff:{addr}\t{name}.v4mapped" for addr, name in named]
    return "\n".join(lines) + "\n"


def controller_hosts(layout: Layout) -> str:
    """/etc/hosts for slurmctld and slurmdbd: every name the sandbox uses resolves locally (to the
    management addresses the controller reaches nodes on), so no lookup ever leaves the machine."""
    lines = ["127.0.0.1\tlocalhost", f"{layout.ctl_ip}\t{CONTROLLER}"]
    lines += [f"{n.mgmt_ip}\t{n.name}" for n in layout.nodes]
    return "\n".join(lines) + "\n"


def plugstack(spank_so: Path | None) -> str:
    """Load the Clockwork SPANK plugin once it has been built (spank/clockwork.so)."""
    if spank_so is None or not spank_so.exists():
        return "# spank/clockwork.so is not built yet; nothing to load.\n"
    return f"optional {spank_so}\n"


def clockwork_toml(
    paths: StatePaths, state_dir: Path, nics: list[str], slurm_bin: Path | None = None, lens: bool = True
) -> str:
    """The configuration the hooks, the node daemons (and `clockwork` inside jobs) read on the sandbox
    (``lens``: whether the daemons run Fleet Lens, ``[sandbox] lens``).

    The nodes share one filesystem, so each node's daemon gets its own folders through ``{node}``;
    one CURVE key pair, made at ``up``, is the admin-installed key set of all daemons.
    """
    settings: dict[str, dict[str, Any]] = {
        "log": {"file": str(paths.logs / "clockwork.log")},
        "slurm": {"backend": "cli", "conf": str(paths.slurm_conf), "bin_dir": str(slurm_bin or "")},
        # Lens's verdict on a dead NIC is waited for 10 s (not 60): the health check's tests run it in a loop
        "hooks": {"spool_dir": str(paths.spool), "health_nics": ",".join(nics), "lens_verdict_wait_s": 10.0},
        "daemon": {
            "run_dir": str(paths.root / "nodes" / "{node}" / "run"),
            "state_dir": str(paths.root / "nodes" / "{node}" / "lib"),
            "curve_secret_key": str(paths.curve_keys / "daemon.key_secret"),
            "curve_public_key": str(paths.curve_keys / "daemon.key"),
        },
        "linkpass": {
            "fabric_file": str(paths.fabric_map),
            # The defaults plus a 20 ms minimum TCP retransmission timeout: a segment lost in the
            # few ms before a route moves is resent after 20 ms, not 200 ms (then 400, 800...).
            "sysctls": LinkPassConfig().sysctls + ",net.ipv4.tcp_rto_min_us=20000",
        },
        # Fleet Lens names the sandbox's real switch ports (the bridge ports in the fabric namespace).
        "lens": {"enabled": lens, "topology_file": str(paths.topology)},
        # No GPUs here: each daemon reads its node's GPU fault file (`clockwork sandbox fault gpu`).
        "health": {
            "source": "fault-file",
            "fault_file": str(gpu_faults.fault_file(paths.root / "nodes", "{node}")),
            "interval_s": 0.5,
        },
        # Borrowed spares: work in the default partition 'low' may be preempted (requeued) by a holder in
        # 'high' (PriorityTier 10 over the same nodes, PreemptType=preempt/partition_prio above). Only jobs
        # submitted with --clockwork-spares=borrow ever ask; nothing else changes.
        "borrow": {"enabled": True, "partitions": "low", "method": "partition_prio", "holder_partition": "high"},
        "sandbox": {"state_dir": str(state_dir)},
    }
    lines = ["# Written by `clockwork sandbox up`."]
    for section, values in settings.items():
        lines.append(f"[{section}]")
        # JSON string escapes are valid TOML basic-string escapes.
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def fabric_map(layout: Layout) -> str:
    """LinkPass's fabric map: every node's address and its NIC (rail) addresses (``clockwork fabric init``'s plan)."""
    return json.dumps(fabric_plan(layout).fabric, indent=2) + "\n"


def topology(layout: Layout) -> str:
    """Fleet Lens's topology: each NIC hangs on its rail's bridge, on the bridge port named after it."""
    nics = {f"{n.name}/{nic.name}": {"switch": nic.bridge, "port": nic.port} for n in layout.nodes for nic in n.nics}
    return json.dumps({"nics": nics}, indent=2) + "\n"


def slurm_topology(layout: Layout) -> str:
    """Slurm's topology.conf for ``[sandbox] racks``: a leaf switch per rack (rack0, rack1, ...), one above them."""
    lines = ["# Written by `clockwork sandbox up` from [sandbox] racks: one leaf switch per rack."]
    lines += [f"SwitchName=rack{i} Nodes={','.join(rack)}" for i, rack in enumerate(layout.racks)]
    lines.append(f"SwitchName=top Switches=rack[0-{len(layout.racks) - 1}]")
    return "\n".join(lines) + "\n"


def hook_wrapper(python: str, config: Path, context: str, pythonpath: str = "") -> str:
    """Slurm runs hooks as root with no PATH: an absolute interpreter and config are mandatory.

    Slurm gives a hook none of slurmd's environment, so the builder's ``PYTHONPATH`` (a checkout or worktree
    whose code is under test, ahead of the venv's own install) is written into the wrapper: the Prolog, the
    Epilog and the node daemons a Prolog starts then run the same code as the jobs and the tests."""
    path = f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    return (
        "#!/bin/sh\n"
        f"# Slurm {context} hook for the Clockwork sandbox.\n"
        f"{path}CLOCKWORK_CONFIG={shlex.quote(str(config))} exec {shlex.quote(python)} -m slurm_hooks {context}\n"
    )


def write_all(
    paths: StatePaths,
    layout: Layout,
    *,
    accounting: bool,
    cpus_per_node: int,
    python: str,
    spank_so: Path | None,
    plugin_dir: Path | None = None,
    slurm_bin: Path | None = None,
    pythonpath: str = "",
    slurmctld_parameters: tuple[str, ...] = (),
    lens: bool = True,
    slurmd_timeout_s: int = 300,
) -> None:
    """Write every file the sandbox's daemons read (``plugin_dir`` and ``slurm_bin``: a Slurm release from a
    root, whose plugins and client commands those are; ``pythonpath``: the hooks', see :func:`hook_wrapper`;
    ``slurmctld_parameters``: the release's, see :func:`slurm_conf`; ``lens``: see :func:`clockwork_toml`;
    ``slurmd_timeout_s``: Slurm's SlurmdTimeout)."""
    for d in paths.all_dirs():
        d.mkdir(parents=True, exist_ok=True)
    paths.slurm_conf.write_text(
        slurm_conf(paths, layout, accounting, cpus_per_node, plugin_dir, slurmctld_parameters, slurmd_timeout_s)
    )
    paths.gres_conf.write_text(gres_conf(paths, layout))
    for node in layout.nodes:
        for path in gpu_files(paths, node.name):  # character devices, as slurmd wants: /dev/null's numbers
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_char_device():
                path.unlink(missing_ok=True)
                os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    if layout.racks:
        paths.slurm_topology.write_text(slurm_topology(layout))
    else:
        paths.slurm_topology.unlink(missing_ok=True)
    paths.cgroup_conf.write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
    paths.plugstack_conf.write_text(plugstack(spank_so))
    paths.hosts.write_text(hosts(layout))
    paths.fabric_map.write_text(fabric_map(layout))
    paths.topology.write_text(topology(layout))
    paths.controller_hosts.write_text(controller_hosts(layout))
    nics = [nic.name for nic in layout.nodes[0].nics]
    paths.clockwork_toml.write_text(clockwork_toml(paths, paths.root, nics, slurm_bin, lens))
    if accounting:
        paths.slurmdbd_conf.write_text(slurmdbd_conf(paths, layout))
        os.chmod(paths.slurmdbd_conf, 0o600)  # slurmdbd refuses a readable file
    for name in HOOKS.values():
        wrapper = paths.hooks / name
        wrapper.write_text(hook_wrapper(python, paths.clockwork_toml, name, pythonpath))
        wrapper.chmod(0o755)
    for node in layout.nodes:
        (paths.node_dir(node.name) / "spool").mkdir(parents=True, exist_ok=True)
