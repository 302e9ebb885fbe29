"""The sandbox cluster as one object: bring up, inspect, enter, tear down.

``up`` builds in this order, each step waiting only as long as it must: files and munge key ->
network fabric -> munged -> (MariaDB -> slurmdbd -> cluster record) -> slurmctld -> one slurmd per
node -> every node idle. Any failure tears down what was built and re-raises, leaving the logs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from clockwork.contracts import curve_keys
from clockwork.contracts.config import load_config
from clockwork.contracts.config.core import SandboxConfig
from clockwork.contracts.errors import NeedRootError, SandboxError, SlurmError
from clockwork.contracts.slurm.cli_backend import CliBackend
from clockwork.sandbox import fabric, faults, gpu_faults, oci, processes, slurm_files
from clockwork.sandbox.fabric import baseline_routes as fabric_baseline_routes
from clockwork.sandbox.layout import CLUSTER, CONTROLLER, Layout, NodeSpec, build_layout
from clockwork.sandbox.paths import StatePaths
from clockwork.sandbox.prefixes import controller_prefix, node_prefix
from clockwork.sandbox.shell import missing_programs, run
from clockwork.sandbox.slurm_release import SlurmRelease, release
from clockwork.sandbox.state import SandboxState

log = logging.getLogger("clockwork.sandbox")

REPO_ROOT = Path(__file__).resolve().parents[2]
SPANK_SO = REPO_ROOT / "spank" / "clockwork.so"
"""The SPANK plugin built against the host's Slurm headers (``make -C spank``)."""


def spank_plugin(slurm: SlurmRelease) -> Path:
    """The SPANK plugin the sandbox loads for ``slurm``: the host build, or the release's own build
    (``spank/slurm-24.11/clockwork.so``, ``make slurm-24.11``): Slurm refuses a plugin of another series."""
    return SPANK_SO if not slurm.from_root else REPO_ROOT / "spank" / f"slurm-{slurm.version}" / "clockwork.so"


UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise NeedRootError(
            f"{what} needs root: it creates network namespaces, veths, bridges and mounts and starts "
            f"munged and the Slurm daemons (you are uid {os.geteuid()}; run it with sudo)"
        )


def _owners(namespaces: set[str]) -> list[str]:
    """The state folders whose sandboxes marked these namespaces (unmarked ones left out), sorted."""
    return sorted({owner for owner in map(fabric.owner, namespaces) if owner is not None})


class Sandbox:
    """One sandbox cluster, identified by its state folder."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.paths = StatePaths(Path(config.state_dir).resolve())
        self._progress: Callable[[str], None] = lambda msg: None

    # ----- inspection -----------------------------------------------------------------------
    def state(self) -> SandboxState | None:
        return SandboxState.load(self.paths.state_file)

    def layout(self) -> Layout:
        st = self.state()
        return build_layout(st.config if st else self.config)

    def running(self) -> bool:
        st = self.state()
        return st is not None and st.phase == "up" and any(processes.alive(p) for p in st.pids.values())

    def require_up(self) -> SandboxState:
        st = self.state()
        if st is None or st.phase != "up":
            raise SandboxError(f"no sandbox is running at {self.paths.root} (start one with `clockwork sandbox up`)")
        return st

    def slurm_release(self) -> SlurmRelease:
        """The Slurm release this sandbox runs (a running one's own, whatever the current configuration says)."""
        st = self.state()
        return release((st.config if st else self.config).slurm)

    def slurm_bin(self) -> Path | None:
        """The folder of Slurm client commands for this sandbox: the release's wrappers, or None for the host's
        own commands (found on PATH)."""
        return self.paths.slurm_bin if self.slurm_release().from_root else None

    def slurm_env(self) -> dict[str, str]:
        """Environment for Slurm client commands aimed at this sandbox (its release's commands first on PATH)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.paths.slurm_conf)
        bindir = self.slurm_bin()
        if bindir is not None:
            env["PATH"] = f"{bindir}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        return env

    def env_exports(self) -> str:
        """Shell lines that point a shell at the sandbox (for ``eval "$(clockwork sandbox env)"``)."""
        st = self.require_up()
        bindir = str(Path(st.python).parent)
        slurm_bin = self.slurm_bin()
        if slurm_bin is not None:
            bindir = f"{slurm_bin}:{bindir}"
        return (
            "\n".join(
                [
                    f"export SLURM_CONF={self.paths.slurm_conf}",
                    f"export CLOCKWORK_CONFIG={self.paths.clockwork_toml}",
                    f"export PATH={bindir}:/usr/sbin:/usr/bin:$PATH",
                ]
            )
            + "\n"
        )

    # ----- bring-up -------------------------------------------------------------------------
    def up(self, progress: Callable[[str], None] | None = None) -> float:
        """Build and start the whole cluster; returns the seconds it took."""
        self._progress = progress or (lambda msg: None)
        require_root("clockwork sandbox up")
        slurm = release(self.config.slurm)
        missing = missing_programs(self.config.accounting, host_slurm=not slurm.from_root)
        if missing:
            raise SandboxError(
                "missing system programs: " + ", ".join(missing) + " (install them with `make venv`, "
                "which runs apt-get for you)"
            )
        layout = build_layout(self.config)
        self._check_socket_paths(layout)
        slurm.ensure_root(self._progress)
        self._claim_state_dir(layout)
        t0 = time.monotonic()
        st = SandboxState(
            config=replace(self.config, state_dir=str(self.paths.root)), python=self._python(), builder=os.getpid()
        )
        st.save(self.paths.state_file)
        try:
            self._build(st, layout)
        except BaseException:
            self._progress("bring-up failed; tearing down what was built")
            self.down()
            raise
        st.phase = "up"
        st.save(self.paths.state_file)
        return time.monotonic() - t0

    def _check_socket_paths(self, layout: Layout) -> None:
        """slurmstepd's sockets (SPOOL/NODE_JOBID.STEPID) must fit a unix socket path (107 bytes)."""
        node = max((n.name for n in layout.nodes), key=len)
        longest = len(f"{self.paths.node_dir(node)}/spool/{node}_{'9' * 10}.{'9' * 10}")
        if longest > UNIX_PATH_MAX:
            raise SandboxError(
                f"state folder {self.paths.root} is {longest - UNIX_PATH_MAX} characters too long: Slurm's step "
                f"sockets under it would exceed the {UNIX_PATH_MAX}-byte unix socket limit; choose a shorter --state"
            )

    def _claim_state_dir(self, layout: Layout) -> None:
        root = self.paths.root
        if self.running():
            raise SandboxError(
                f"a sandbox is already running at {root} ({len(self.layout().nodes)} nodes); "
                "use it, or stop it first with `clockwork sandbox down`"
            )
        if processes.marked(root) or self._owned_namespaces():
            self._progress("found leftovers of an earlier sandbox at this state folder; cleaning them up")
            self.down()
        wanted = set(layout.namespaces)
        self._reclaim_abandoned(fabric.existing_namespaces() & wanted)
        clash = fabric.existing_namespaces() & wanted
        if clash:
            owners = _owners(clash)
            whose = (
                f"the sandbox at {', '.join(owners)} owns them; use it, or stop it first with "
                f"`clockwork sandbox --state {owners[0]} down`"
                if owners
                else "another tool owns them"
            )
            raise SandboxError(
                f"network namespaces {', '.join(sorted(clash))} exist but do not belong to the sandbox at "
                f"{root}; {whose}"
            )
        if root.exists() and any(root.iterdir()) and not self.paths.state_file.exists():
            raise SandboxError(f"{root} exists, is not empty and is not a sandbox state folder; choose another --state")
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True, mode=0o755)
        os.chmod(root, 0o755)

    def _reclaim_abandoned(self, clash: set[str]) -> None:
        """Tear down other state folders' sandboxes that own ``clash`` and of which nothing is alive.

        A sandbox whose processes were all killed (its shell, CI runner or machine session ended under
        it) leaves marked namespaces that nothing will ever use again; refusing to build because of them
        would only make the user hunt for a state folder that may be gone. A sandbox with any live
        process, or one whose bring-up is still running, is left alone.
        """
        for owner in [o for o in _owners(clash) if o != str(self.paths.root)]:
            other = Sandbox(replace(self.config, state_dir=owner))
            if other.alive():
                continue
            self._progress(f"the sandbox at {owner} left its namespaces behind and nothing of it runs; removing it")
            other.down()

    def alive(self) -> bool:
        """True while any process of this sandbox runs, or its bring-up does."""
        st = self.state()
        if st is not None and st.phase == "building" and processes.alive(st.builder):
            return True
        return bool(processes.marked(self.paths.root) or processes.netns_pids(self._owned_namespaces()))

    def _start(
        self,
        st: SandboxState,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        ready: Callable[[], bool] | None = None,
        timeout_s: float = 30.0,
        interval_s: float = 0.02,
    ) -> int:
        """Start daemon ``name`` (logging to log/NAME.log), record its pid, and wait for ``ready``."""
        log_file = self.paths.logs / f"{name}.log"
        pid = processes.start(argv, log_file=log_file, state_dir=self.paths.root, env=env)
        st.pids[name] = pid
        st.save(self.paths.state_file)
        if ready is not None:
            processes.wait_until(name, ready, timeout_s=timeout_s, pid=pid, log_file=log_file, interval_s=interval_s)
        return pid

    def _python(self) -> str:
        """The interpreter of the nodes' hooks (``[sandbox] python``, else this one)."""
        return self.config.python or sys.executable

    def _build(self, st: SandboxState, layout: Layout) -> None:
        p = self.paths
        accounting = self.config.accounting
        slurm = release(self.config.slurm)
        slurm_env = {"SLURM_CONF": str(p.slurm_conf)}
        slurm_files.write_all(
            p,
            layout,
            accounting=accounting,
            cpus_per_node=self.config.cpus_per_node,
            python=self._python(),
            spank_so=Path(self.config.spank_plugin) if self.config.spank_plugin else spank_plugin(slurm),
            plugin_dir=slurm.plugin_dir(),
            slurm_bin=self.slurm_bin(),
            # An installed Clockwork ([sandbox] python) runs its own code: the builder's checkout must not shadow it.
            pythonpath="" if self.config.python else os.environ.get("PYTHONPATH", ""),
            slurmctld_parameters=slurm.slurmctld_parameters,
            lens=self.config.lens,
            slurmd_timeout_s=self.config.slurmd_timeout_s,
        )
        if slurm.from_root:
            slurm.write_client_wrappers(p.slurm_bin)
            p.oci_conf.write_text(oci.oci_conf(p.root / "crun"))  # the root carries crun: srun --container works
        p.munge.chmod(0o755)
        p.munge_key.write_bytes(os.urandom(1024))
        p.munge_key.chmod(0o600)
        curve_keys.generate(p.curve_keys, "daemon")

        self._progress(f"building the fabric: {len(layout.nodes)} nodes x {layout.rails} NICs on {layout.rails} rails")
        fabric.build(layout, owner_mark=str(self.paths.root))

        self._progress("starting munged (authentication)")
        self._start(
            st,
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={p.munge_socket}",
                f"--key-file={p.munge_key}",
                f"--pid-file={p.munge / 'munged.pid'}",
                f"--seed-file={p.munge / 'seed'}",
                f"--log-file={p.logs / 'munged.log'}",
                "--num-threads=4",
            ],
            ready=p.munge_socket.exists,
        )

        if accounting:
            self._start_accounting(st, layout, slurm_env)

        self._progress(f"starting slurmctld on host '{CONTROLLER}' ({layout.ctl_ip})")
        self._start(
            st,
            "slurmctld",
            [*controller_prefix(p, slurm.overlay_command()), "slurmctld", "-D", "-c", "-f", str(p.slurm_conf)],
            env=slurm_env,
            ready=self.slurm().ping,
            interval_s=0.05,
        )
        self._check_release(slurm)

        self._progress("starting one slurmd per node")
        for node in layout.nodes:
            self._start(
                st,
                f"slurmd-{node.name}",
                [
                    *self._node_prefix(node),
                    "slurmd",
                    "-D",
                    "-N",
                    node.name,
                    "-f",
                    str(p.slurm_conf),
                ],
                env=slurm_env,
            )
        names = [n.name for n in layout.nodes]

        def all_idle() -> bool:
            dead = [name for name, pid in st.pids.items() if not processes.alive(pid)]
            if dead:
                raise SandboxError(f"{', '.join(dead)} exited during start-up (see {p.logs}/{dead[0]}.log)")
            states = self.node_states()
            return all(states.get(n, "").startswith("IDLE") for n in names)

        processes.wait_until("the sandbox nodes", all_idle, timeout_s=30, interval_s=0.1)
        self._progress("all nodes idle: the cluster is ready")

    def _start_accounting(self, st: SandboxState, layout: Layout, slurm_env: dict[str, str]) -> None:
        p = self.paths
        self._progress("starting MariaDB and slurmdbd (accounting, for sacct)")
        p.db_tmp.mkdir(parents=True, exist_ok=True)
        run(
            [
                "mariadb-install-db",
                "--no-defaults",
                f"--datadir={p.db}",
                f"--tmpdir={p.db_tmp}",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--skip-name-resolve",
            ],
            timeout=60,
        )
        init = p.etc / "mariadb-init.sql"
        init.write_text(
            "".join(
                f"CREATE USER IF NOT EXISTS 'slurm'@'{host}';\nGRANT ALL PRIVILEGES ON *.* TO 'slurm'@'{host}';\n"
                for host in ("localhost", "127.0.0.1")
            )
        )
        self._start(
            st,
            "mariadb",
            [
                "mariadbd",
                "--no-defaults",
                f"--datadir={p.db}",
                f"--tmpdir={p.db_tmp}",
                f"--socket={p.db_socket}",
                f"--port={layout.mariadb_port}",
                "--bind-address=127.0.0.1",
                "--user=root",
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=32M",
                "--innodb-log-file-size=8M",
                f"--init-file={init}",
                f"--pid-file={p.root / 'mariadb.pid'}",
                "--skip-log-bin",
            ],
            ready=processes.port_open("127.0.0.1", layout.mariadb_port),
        )
        self._start(
            st,
            "slurmdbd",
            [*controller_prefix(p, release(self.config.slurm).overlay_command()), "slurmdbd", "-D"],
            env={**slurm_env, "MYSQL_UNIX_PORT": str(p.db_socket)},
            ready=processes.port_open(layout.ctl_ip, layout.slurmdbd_port),
        )
        self.slurm().run_text(["sacctmgr", "-i", "add", "cluster", CLUSTER])

    def _check_release(self, slurm: SlurmRelease) -> None:
        """The controller must be the release asked for: every version-specific test relies on it."""
        running = self.slurm().version()
        if f"{running[0]}.{running[1]:02d}" != slurm.version:
            where = f"the root at {slurm.root}" if slurm.from_root else "the host's packages"
            raise SandboxError(
                f"[sandbox] slurm = {slurm.version!r}, but {where} run Slurm {'.'.join(map(str, running))}"
            )

    def slurm(self) -> CliBackend:
        """The Slurm CLI backend aimed at this sandbox (tests use exactly what users' tools use)."""
        return CliBackend(self.paths.slurm_conf, bin_dir=self.slurm_bin(), timeout_s=10.0)

    def node_states(self) -> dict[str, str]:
        """Slurm's state of each node (``IDLE``, ``ALLOCATED+DRAIN`` ...); empty if slurmctld is unreachable."""
        try:
            return {n.name: "+".join(n.state) for n in self.slurm().nodes()}
        except SlurmError:
            return {}

    # ----- tear-down ------------------------------------------------------------------------
    def _owned_namespaces(self) -> list[str]:
        """Sandbox namespaces that belong to this state folder.

        A namespace marked with another state folder is never ours. An unmarked one is ours only while
        our record says a bring-up was under way (it died before marking), so ``down`` never touches
        another sandbox's or another tool's namespaces.
        """
        st = self.state()
        building = st is not None and st.phase in ("building", "up")
        expected = set(build_layout(st.config).namespaces) if st else set()
        owned = []
        for ns in sorted(fabric.existing_namespaces()):
            if not fabric.is_fabric(ns) and not re.fullmatch(r"([a-z0-9]+-)?node\d+", ns):
                continue
            mark = fabric.owner(ns)
            if mark == str(self.paths.root) or (mark is None and building and ns in expected):
                owned.append(ns)
        return owned

    def down(self) -> list[str]:
        """Stop every process and remove every namespace, bridge and veth; safe on any partial state."""
        require_root("clockwork sandbox down")
        st = self.state()
        namespaces = self._owned_namespaces()
        pids = processes.marked(self.paths.root) | processes.netns_pids(namespaces)
        stopped = processes.stop(pids, grace_s=0.5)  # nothing is kept: no need to wait for a clean exit
        removed = [f"{len(stopped)} processes"] if stopped else []
        removed += fabric.teardown(namespaces, self.layout().root_dev)
        if st is not None:
            st.phase = "down"
            st.pids = {}
            st.faults = {}
            st.save(self.paths.state_file)
        return removed

    # ----- status and exec ------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        st = self.state()
        if st is None:
            return {"state_dir": str(self.paths.root), "phase": "absent", "running": False}
        layout = build_layout(st.config)
        states = self.node_states() if st.phase == "up" else {}
        nodes = []
        for node in layout.nodes:
            pid = st.pids.get(f"slurmd-{node.name}")
            nodes.append(
                {
                    "name": node.name,
                    "node_addr": node.node_addr,
                    "mgmt_addr": node.mgmt_ip,
                    "slurm_state": states.get(node.name, "unknown"),
                    "slurmd_pid": pid,
                    "slurmd_alive": bool(pid and processes.alive(pid)),
                    "nics": [
                        {
                            "nic": nic.name,
                            "device": nic.name,
                            "rail": nic.rail,
                            "addr": nic.cidr,
                            "switch": f"{layout.fabric_ns}/{nic.bridge}",
                            "switch_port": nic.port,
                        }
                        for nic in node.nics
                    ],
                }
            )
        return {
            "state_dir": str(self.paths.root),
            "phase": st.phase,
            "running": self.running(),
            "accounting": st.config.accounting,
            "slurm": st.config.slurm,
            "controller": {"host": CONTROLLER, "addr": layout.ctl_ip, "port": layout.slurmctld_port},
            "slurm_conf": str(self.paths.slurm_conf),
            "munge_socket": str(self.paths.munge_socket),
            "clockwork_config": str(self.paths.clockwork_toml),
            "logs": str(self.paths.logs),
            "services": {name: {"pid": pid, "alive": processes.alive(pid)} for name, pid in st.pids.items()},
            "faults": st.faults,
            "nodes": nodes,
        }

    def fault(self, kind: str, node: str, nic: str, value: str) -> faults.Fault:
        """Inject (or lift) one fault and record it in the sandbox state."""
        require_root("clockwork sandbox fault")
        st = self.require_up()
        fault = faults.validate(build_layout(st.config), kind, node, nic, value)
        faults.apply(build_layout(st.config), fault, st.faults)
        st.save(self.paths.state_file)
        return fault

    def gpu_fault(self, node: str, index: str, what: str, value: str | None) -> tuple[int, dict[str, Any]]:
        """Inject a GPU fault into ``node``'s GPU fault file (its daemon reads it); (index, the GPU's faults)."""
        require_root("clockwork sandbox fault gpu")
        st = self.require_up()
        build_layout(st.config).node(node)
        gpus = load_config(self.paths.clockwork_toml, env={}).config.health.emulated_gpus
        gpu, what, parsed = gpu_faults.parse(index, what, value, gpus)
        injected = gpu_faults.apply(gpu_faults.fault_file(self.paths.root / "nodes", node), gpu, what, parsed)
        key = f"gpu {node} {gpu}"
        if injected:
            st.faults[key] = gpu_faults.summary(injected)
        else:
            st.faults.pop(key, None)
        st.save(self.paths.state_file)
        return gpu, injected

    def clear_faults(self) -> None:
        require_root("clockwork sandbox fault clear")
        st = self.require_up()
        for key in [k for k in st.faults if k.startswith("gpu ")]:
            _, node, index = key.split()
            gpu_faults.apply(gpu_faults.fault_file(self.paths.root / "nodes", node), int(index), "clear", None)
            st.faults.pop(key)
        st.save(self.paths.state_file)
        for node in [key.split()[1] for key in st.faults if key.startswith("node ")]:
            self.restore_node(node)
        st = self.require_up()  # restore_node saved its own changes (slurmd's new pid)
        faults.clear(build_layout(st.config), st.faults)
        st.save(self.paths.state_file)

    def crash_node(self, node: str, *more: str) -> int:
        """A whole node dies at once (``more``: other nodes dying with it, a rack): every process in it is
        SIGKILLed and its links go dark.

        The switch ports of its NICs and its management port go down (the node's side of each cable is
        gone with it), so peers see silence, not a reset. They go down first, and every process is stopped
        before any is killed: processes die one by one, and a survivor on the node (a TorchPass agent whose rank
        just died) must not get a word out that a real crash would not let it send. Returns how many processes
        were killed.
        """
        require_root("clockwork sandbox fault node")
        st = self.require_up()
        layout = build_layout(st.config)
        specs = [layout.node(name) for name in (node, *more)]
        ports = [port for spec in specs for port in [*(nic.port for nic in spec.nics), spec.mgmt_port]]
        run(["ip", "-n", layout.fabric_ns, "-batch", "-"], input="".join(f"link set {p} down\n" for p in ports))
        pids = processes.netns_pids([spec.netns for spec in specs])
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        st.faults.update({f"node {spec.name} -": "crash" for spec in specs})
        st.save(self.paths.state_file)
        return len(pids)

    def restore_node(self, node: str) -> None:
        """The crashed node comes back empty: links up, baseline routes, a fresh slurmd (no daemons, no jobs)."""
        require_root("clockwork sandbox fault node")
        st = self.require_up()
        layout = build_layout(st.config)
        spec = layout.node(node)
        ports = [nic.port for nic in spec.nics] + [spec.mgmt_port]
        run(["ip", "-n", layout.fabric_ns, "-batch", "-"], input="".join(f"link set {p} up\n" for p in ports))
        node_cmds = [f"link set {nic.name} up" for nic in spec.nics] + fabric_baseline_routes(layout, spec)
        run(["ip", "-n", spec.netns, "-batch", "-"], input="\n".join(node_cmds) + "\n")
        st.faults.pop(f"node {node} -", None)
        st.save(self.paths.state_file)
        self._restart_slurmd(st, node)

    def _restart_slurmd(self, st: SandboxState, node: str) -> None:
        name = f"slurmd-{node}"
        if name in st.pids and processes.alive(st.pids[name]):
            return
        conf = str(self.paths.slurm_conf)
        argv = [*self._node_prefix(self.layout().node(node)), "slurmd", "-D", "-N", node, "-f", conf]
        self._start(st, name, argv, env={"SLURM_CONF": str(self.paths.slurm_conf)})

    def exec_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """The full argv that runs ``argv`` on ``node`` (namespaces as the node's slurmd sees them)."""
        self.require_up()
        return [*self._node_prefix(self.layout().node(node)), *argv]

    def _node_prefix(self, node: NodeSpec) -> list[str]:
        return node_prefix(self.paths, node, self.layout().cgroup_name, self.slurm_release().overlay_command())
