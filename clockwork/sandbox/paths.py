"""Where each file of a sandbox lives under its state folder (one place, so nothing hard-codes paths)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StatePaths:
    """Every path under one sandbox state folder."""

    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "sandbox.json"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def slurm_topology(self) -> Path:
        """Slurm's topology.conf, beside slurm.conf (where slurmctld, slurmd and TorchPass look for it)."""
        return self.etc / "topology.conf"

    @property
    def gres_conf(self) -> Path:
        """Slurm's gres.conf, beside slurm.conf: every node's fake GPUs (counts, no device files)."""
        return self.etc / "gres.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        return self.etc / "slurmdbd.conf"

    @property
    def cgroup_conf(self) -> Path:
        return self.etc / "cgroup.conf"

    @property
    def oci_conf(self) -> Path:
        """Slurm's oci.conf, beside slurm.conf (where slurmd looks for it): a 24.11 sandbox only."""
        return self.etc / "oci.conf"

    @property
    def plugstack_conf(self) -> Path:
        return self.etc / "plugstack.conf"

    @property
    def hosts(self) -> Path:
        return self.etc / "hosts"

    @property
    def controller_hosts(self) -> Path:
        return self.etc / "hosts.controller"

    @property
    def clockwork_toml(self) -> Path:
        return self.etc / "clockwork.toml"

    @property
    def fabric_map(self) -> Path:
        """LinkPass's map of the fabric (node and NIC addresses)."""
        return self.etc / "fabric.json"

    @property
    def topology(self) -> Path:
        return self.etc / "topology.json"

    @property
    def curve_keys(self) -> Path:
        """The node daemons' CURVE key pair (one for the whole sandbox)."""
        return self.etc / "curve"

    @property
    def slurm_bin(self) -> Path:
        """Wrappers of the Slurm release's client commands (a release from a root only)."""
        return self.root / "bin"

    @property
    def hooks(self) -> Path:
        return self.root / "hooks"

    @property
    def munge(self) -> Path:
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge / "munge.socket"

    @property
    def munge_key(self) -> Path:
        return self.munge / "munge.key"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    @property
    def ctld_state(self) -> Path:
        return self.root / "slurmctld"

    @property
    def db(self) -> Path:
        return self.root / "mariadb"

    @property
    def db_tmp(self) -> Path:
        """MariaDB's temporary tables: a directory of this sandbox's, never the shared /tmp (two sandboxes
        installing at once have removed each other's there)."""
        return self.root / "mariadb-tmp"

    @property
    def db_socket(self) -> Path:
        return self.root / "mariadb.sock"

    @property
    def spool(self) -> Path:
        """Clockwork's own spool (what the hooks write)."""
        return self.root / "spool"

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def all_dirs(self) -> list[Path]:
        return [self.etc, self.hooks, self.munge, self.logs, self.ctld_state, self.spool, self.root / "nodes"]
