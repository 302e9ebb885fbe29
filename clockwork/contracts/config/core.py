"""The sections of Clockwork's own programs: ``[log]``, ``[slurm]``, ``[hooks]``, ``[daemon]`` and ``[sandbox]``.

Apart from :mod:`clockwork.contracts.config.schema` (the whole file, every component's section) so that a client
of the node daemon (a training rank's event sink, the hooks) can take ``DaemonConfig`` without loading every
component's section.
"""

from __future__ import annotations

from dataclasses import dataclass

from clockwork.contracts.config.fields import setting

__all__ = ["DaemonConfig", "HooksConfig", "LogConfig", "SandboxConfig", "SlurmConfig"]


@dataclass(frozen=True)
class LogConfig:
    """How Clockwork's own programs log (the CLI, the node daemon, the Slurm hooks)."""

    level: str = setting("info", "Lowest level written to the log.", choices=("debug", "info", "warning", "error"))
    file: str = setting("", "Log file for the daemon and the hooks; empty = standard error.")


@dataclass(frozen=True)
class SlurmConfig:
    """How Clockwork reaches Slurm."""

    backend: str = setting(
        "auto",
        "Slurm access backend: 'cli' runs the Slurm commands (any Slurm >= 22.05); 'pyslurm' uses pyslurm, "
        "which must match the site's libslurm; 'auto' takes pyslurm when it matches, the CLI otherwise.",
        choices=("auto", "cli", "pyslurm"),
    )
    conf: str = setting(
        "/etc/slurm/slurm.conf",
        "slurm.conf given to every Slurm command as SLURM_CONF (without it clients try a DNS SRV lookup).",
    )
    bin_dir: str = setting("", "Folder holding sbatch, scontrol, ...; empty = search PATH.")
    timeout_s: float = setting(
        30.0,
        "Seconds a Slurm command may take before it counts as failed (clients hang when slurmctld is down).",
        min=1.0,
    )


@dataclass(frozen=True)
class HooksConfig:
    """The Prolog/Epilog programs Slurm runs (root, no PATH)."""

    spool_dir: str = setting(
        "/var/spool/clockwork",
        "Where the hooks record each job's events (jobs/JOBID/NODE.jsonl) and failure reports.",
    )
    report_dir: str = setting(
        "",
        "Where the Epilog writes each job's report (JOBID.json); empty = the daemon's state_dir/reports. "
        "'{node}' is replaced by the node name.",
    )
    require_daemon: bool = setting(
        False,
        "Fail the Prolog of a clockwork job (Slurm then drains the node and requeues the job) when the node "
        "daemon cannot be started. Off: the job runs without fault tolerance and the failure is recorded.",
    )
    health_nics: str = setting(
        "",
        "Comma-separated fabric NICs the health check requires up with carrier (e.g. 'ib0,ib1'); empty = "
        "no NIC check. A failing NIC drains the node with a 'clockwork:' reason, unless Fleet Lens shows it "
        "as one switch's fault (switch_fault_nodes).",
    )
    switch_fault_nodes: int = setting(
        2,
        "When Fleet Lens suspects the links of this many nodes or more on one switch at once, the health check "
        "judges it one switch (leaf or rail) fault and drains none of them for it (a node it drained for that "
        "link is resumed); a NIC down that Lens watches but has not judged yet waits for the next check. "
        "0 = judge each node alone (a NIC down drains at once).",
        min=0,
    )
    lens_verdict_wait_s: float = setting(
        60.0,
        "How long a NIC that Fleet Lens watches may stay down without a Lens verdict (switch fault or the "
        "node's own) before the health check drains the node anyway (Lens's probes of it lost, its daemon "
        "stalled). Counted from the first health check that saw it down, so a "
        "HealthCheckInterval longer than this drains on the second check. 0 = never wait for Lens.",
        min=0.0,
    )
    gpu_job_map_dir: str = setting(
        "",
        "dcgm-exporter's --hpc-job-mapping-dir: the Prolog adds every job's ID to one file per GPU index the "
        "job holds (named by the index, job IDs one per line) and the Epilog takes it out, so DCGM metrics "
        "carry the job. Empty = off.",
    )


@dataclass(frozen=True)
class DaemonConfig:
    """The node daemon clockworkd (one per node, root): its sockets, its state and who may talk to it."""

    run_dir: str = setting(
        "/run/clockwork",
        "Runtime folder: control socket control.sock (any local user may connect; every request is "
        "authorised by the caller's kernel credentials), event socket events.sock (root and slurm_user "
        "only) and the pid file clockworkd.pid. '{node}' is replaced by the node name (in every path of "
        "this section), which gives each node of a shared filesystem its own folders.",
    )
    state_dir: str = setting(
        "/var/lib/clockwork",
        "Persistent folder: the job registry (jobs/), the per-job event logs (events/) and the Epilog's "
        "reports (reports/); survives a daemon restart. '{node}' is replaced by the node name.",
    )
    node_name: str = setting("", "This node's name as Slurm knows it; empty = the short hostname.")
    slurm_user: str = setting(
        "root",
        "Slurm's SlurmUser: like root, it may register jobs and act on every job through the control socket.",
    )
    listen_port: int = setting(
        16900,
        "TCP port of the daemon-to-daemon socket (ZeroMQ CURVE), bound on bind_addr; 0 = any free port "
        "(tests only: peers cannot find it).",
        min=0,
    )
    bind_addr: str = setting(
        "", "Address the daemon-to-daemon socket binds to; empty = the address node_name resolves to."
    )
    curve_secret_key: str = setting(
        "/etc/clockwork/curve/daemon.key_secret",
        "This daemon's ZeroMQ CURVE secret key file (made by `clockwork keys generate`; root only, mode "
        "0600). Missing or readable by others: the daemon runs without its TCP socket and says why in "
        "`clockwork node status`.",
    )
    curve_public_key: str = setting(
        "/etc/clockwork/curve/daemon.key",
        "This daemon's CURVE public key file. Every public key (*.key) in the same folder is a key that "
        "peers may present: the admin-installed set of daemon keys.",
    )
    max_message_bytes: int = setting(
        65536,
        "Largest request the daemon accepts; a larger one is answered with error 'too_large' (and a "
        "peer sending one over 4 times this, at least 1 MiB, is disconnected unread).",
        min=1024,
    )
    request_timeout_s: float = setting(
        5.0, "Seconds a client (CLI, hooks, TorchPass) waits for the daemon's answer before giving up.", min=0.1
    )


@dataclass(frozen=True)
class SandboxConfig:
    """The embedded sandbox cluster: a real Slurm on network namespaces, for demos and tests only."""

    state_dir: str = setting(
        "/run/clockwork-sandbox",
        "Folder holding everything the sandbox makes: configs, sockets, logs, databases, spool.",
    )
    tag: str = setting(
        "",
        "Up to 8 lowercase letters or digits that prefix this sandbox's network namespaces and its root namespace "
        "veth, so another sandbox can run beside it (give that one its own mgmt_net and port_base too); empty "
        "means the plain names. Host names and Slurm node names stay node1..nodeN.",
    )
    nodes: int = setting(3, "Number of nodes (node1..nodeN), each a network + UTS namespace.", min=1)
    nics: int = setting(2, "NICs per node, one per rail (nic0 on rail 0, nic1 on rail 1, ...).", min=1)
    cpus_per_node: int = setting(2, "CPUs each sandbox node offers to Slurm.", min=1)
    racks: str = setting(
        "",
        "Failure domains: space-separated hostlists, one per rack (e.g. 'node[1-2,5-6] node[3-4]'), written to "
        "Slurm's topology.conf as leaf switches rack0, rack1, ... under one top switch (TopologyPlugin=topology/tree), "
        "so that jobs see SLURM_TOPOLOGY_ADDR; every node must be in exactly one rack. Empty: no topology.",
    )
    accounting: bool = setting(False, "Start MariaDB + slurmdbd so that sacct works.")
    slurmd_timeout_s: int = setting(
        300,
        "Slurm's SlurmdTimeout: how long a silent node stays up before slurmctld declares it down and ends its "
        "job steps (Slurm's default; tests of what happens then use less).",
        min=5,
    )
    slurm: str = setting(
        "22.05",
        "Slurm release the sandbox runs: '22.05' is the host's own packages (Debian 12); '24.11' (Debian 13) and "
        "'26.05' (Debian sid) come from a root built once under /var/cache/clockwork and laid over /usr in the "
        "sandbox's mount namespaces (its daemons, hooks, jobs and client commands; see docs/sandbox.md).",
        choices=("22.05", "24.11", "26.05"),
    )
    node_net: str = setting(
        "198.18.0.0/24", "Stable node addresses (/32 each; node i gets host i). RFC 2544 test range."
    )
    rail_net: str = setting(
        "198.18.{rail}.0/24",
        "Per-rail subnets; '{rail}' is replaced by rail number + 1 (rail 0 -> 198.18.1.0/24).",
    )
    mgmt_net: str = setting(
        "198.19.0.0/24",
        "Management network that carries Slurm's own traffic; the controller (root namespace) gets "
        "the last host address, node i gets host i.",
    )
    port_base: int = setting(
        16817,
        "First of four private TCP ports: slurmctld, slurmd, slurmdbd, MariaDB (base .. base+3).",
        min=1024,
    )
    python: str = setting(
        "",
        "The Python whose Clockwork the nodes' hooks run, and with them the node daemons they start: empty is the "
        "interpreter running `clockwork sandbox up` (with its PYTHONPATH); a path tests an installed Clockwork, "
        "e.g. the clockwork-slurm package's /opt/clockwork/venv/bin/python (its own code alone: no PYTHONPATH).",
    )
    spank_plugin: str = setting(
        "",
        "The SPANK plugin the sandbox's Slurm loads: empty is this checkout's build for the release "
        "(spank/clockwork.so, spank/slurm-VERSION/clockwork.so); a path tests another, e.g. the one the Debian "
        "package installs.",
    )
    lens: bool = setting(
        True,
        "Run Fleet Lens in the nodes' daemons ([lens] enabled in the clockwork.toml it writes). Its probes of every "
        "path cost each daemon about 0.06 of a core here; the test suite's TorchPass job modules, which never read "
        "Lens, turn it off so that five nodes on two cores leave that CPU to the job.",
    )
