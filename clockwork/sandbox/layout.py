"""Names and addresses of every part of the sandbox, computed from the configuration alone.

Keeping this pure (no I/O) means the fabric builder, the Slurm config writer, the fault injector and
``status --json`` all agree on one picture of the cluster, and it can be unit-tested without root.

Topology: node ``nodeI`` is a network namespace named ``nodeI`` (``TAG-nodeI`` for a tagged sandbox) with
- ``nicR`` (R = 0..nics-1): a veth whose other end ``nI-nicR`` is a port of bridge ``railR``,
  addressed in rail R's subnet (host I); these are the "GPU fabric" NICs that LinkPass protects;
- ``mgmt0``: a veth to bridge ``mgmt`` carrying Slurm's own traffic, as a real cluster's
  management Ethernet does (so rail faults never cut the node off from slurmctld);
- its stable node address (/32 on ``lo``), which peers reach through a rail with ``src`` = node address.
All bridges live in namespace ``cw-fabric`` (the "switches"). The root namespace (slurmctld,
slurmdbd, sbatch) joins the management bridge through the veth ``cwsb0``. A tagged sandbox (``tag``) prefixes
both namespaces and names its veth ``cwsb-TAG``, so several sandboxes (one per test worker) can run side by side.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from clockwork.contracts.config.core import SandboxConfig
from clockwork.contracts.errors import ConfigError
from clockwork.contracts.hostlist import expand_hostlist

FABRIC_NS = "cw-fabric"
ROOT_DEV = "cwsb0"
ROOT_PEER = "ctl-mgmt"
MGMT_BRIDGE = "mgmt"
MGMT_DEV = "mgmt0"
CONTROLLER = "ctl"
CLUSTER = "clockwork"


@dataclass(frozen=True)
class NicSpec:
    """One fabric NIC of a node and the switch port it is cabled to."""

    name: str  # device name inside the node namespace: nic0, nic1, ...
    rail: int
    ip: str
    prefixlen: int
    port: str  # device name of the switch-side veth end, inside FABRIC_NS
    bridge: str  # the rail's bridge (switch) inside FABRIC_NS

    @property
    def cidr(self) -> str:
        return f"{self.ip}/{self.prefixlen}"


@dataclass(frozen=True)
class NodeSpec:
    """One sandbox node."""

    name: str  # hostname and Slurm NodeName
    netns: str  # network namespace: the name, or TAG-name in a tagged sandbox
    index: int
    node_addr: str  # stable /32 address that peers and TCP connections use
    mgmt_ip: str
    mgmt_prefixlen: int
    mgmt_port: str
    nics: tuple[NicSpec, ...]

    def nic(self, name: str) -> NicSpec:
        for nic in self.nics:
            if nic.name == name:
                return nic
        raise ConfigError(f"{self.name} has no NIC {name!r} (NICs: {', '.join(n.name for n in self.nics)})")


@dataclass(frozen=True)
class Layout:
    """The whole sandbox: nodes, fabric and the controller's address."""

    nodes: tuple[NodeSpec, ...]
    ctl_ip: str
    mgmt_prefixlen: int
    port_base: int
    tag: str = ""  # keeps side-by-side sandboxes apart (SandboxConfig.tag)
    racks: tuple[tuple[str, ...], ...] = ()  # the nodes of each rack (SandboxConfig.racks); () = no topology

    @property
    def fabric_ns(self) -> str:
        """The switches' namespace."""
        return _prefixed(self.tag, FABRIC_NS)

    @property
    def root_dev(self) -> str:
        """The controller's veth in the root namespace."""
        return f"cwsb-{self.tag}" if self.tag else ROOT_DEV

    @property
    def cgroup_name(self) -> str:
        """The named cgroup-v1 hierarchy the nodes' slurmds mount (one per sandbox, so theirs never meet)."""
        return f"clockwork-sandbox-{self.tag}" if self.tag else "clockwork-sandbox"

    @property
    def namespaces(self) -> list[str]:
        """Every network namespace of this sandbox: the fabric's, then the nodes' in order."""
        return [self.fabric_ns, *(n.netns for n in self.nodes)]

    @property
    def slurmctld_port(self) -> int:
        return self.port_base

    @property
    def slurmd_port(self) -> int:
        return self.port_base + 1

    @property
    def slurmdbd_port(self) -> int:
        return self.port_base + 2

    @property
    def mariadb_port(self) -> int:
        return self.port_base + 3

    @property
    def rails(self) -> int:
        return len(self.nodes[0].nics)

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ConfigError(f"no sandbox node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")


def _network(text: str, key: str) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(text, strict=True)
    except ValueError as exc:
        raise ConfigError(f"[sandbox] {key}: invalid value {text!r} ({exc})") from None


def _host(net: ipaddress.IPv4Network, index: int, key: str) -> str:
    if index >= net.num_addresses - 1:
        raise ConfigError(f"[sandbox] {key}: {net} has no room for host {index}")
    return str(net.network_address + index)


TAG = re.compile(r"[a-z0-9]{0,8}")


def _prefixed(tag: str, name: str) -> str:
    return f"{tag}-{name}" if tag else name


def build_layout(cfg: SandboxConfig) -> Layout:
    """Compute the layout for ``cfg``; raises ConfigError when the networks cannot hold it."""
    if not TAG.fullmatch(cfg.tag):
        raise ConfigError(f"[sandbox] tag: invalid value {cfg.tag!r} (expected up to 8 lowercase letters or digits)")
    node_net = _network(cfg.node_net, "node_net")
    mgmt_net = _network(cfg.mgmt_net, "mgmt_net")
    if "{rail}" not in cfg.rail_net:
        raise ConfigError(f"[sandbox] rail_net: invalid value {cfg.rail_net!r} (expected a '{{rail}}' field)")
    rail_nets = [_network(cfg.rail_net.replace("{rail}", str(r + 1)), "rail_net") for r in range(cfg.nics)]
    ctl_ip = str(mgmt_net.broadcast_address - 1)
    if cfg.nodes >= mgmt_net.num_addresses - 2:
        raise ConfigError(f"[sandbox] mgmt_net: {mgmt_net} has no room for {cfg.nodes} nodes and the controller")
    nodes = []
    for i in range(1, cfg.nodes + 1):
        nics = tuple(
            NicSpec(
                name=f"nic{r}",
                rail=r,
                ip=_host(rail_nets[r], i, "rail_net"),
                prefixlen=rail_nets[r].prefixlen,
                port=f"n{i}-nic{r}",
                bridge=f"rail{r}",
            )
            for r in range(cfg.nics)
        )
        nodes.append(
            NodeSpec(
                name=f"node{i}",
                netns=_prefixed(cfg.tag, f"node{i}"),
                index=i,
                node_addr=_host(node_net, i, "node_net"),
                mgmt_ip=_host(mgmt_net, i, "mgmt_net"),
                mgmt_prefixlen=mgmt_net.prefixlen,
                mgmt_port=f"n{i}-mgmt",
                nics=nics,
            )
        )
    return Layout(
        tuple(nodes),
        ctl_ip,
        mgmt_net.prefixlen,
        cfg.port_base,
        tag=cfg.tag,
        racks=_racks(cfg.racks, [n.name for n in nodes]),
    )


def _racks(text: str, names: list[str]) -> tuple[tuple[str, ...], ...]:
    """The racks of ``[sandbox] racks``: every node in exactly one (a node Slurm's tree does not reach could never
    share a job with the others)."""
    if not text.strip():
        return ()
    try:
        racks = tuple(tuple(expand_hostlist(item)) for item in text.split())
    except ValueError as exc:
        raise ConfigError(f"[sandbox] racks: {exc}") from None
    placed = [name for rack in racks for name in rack]
    unknown = sorted(set(placed) - set(names))
    twice = sorted({name for name in placed if placed.count(name) > 1})
    missing = [name for name in names if name not in placed]
    if unknown or twice or missing:
        what = [f"unknown {unknown}" if unknown else "", f"in two racks {twice}" if twice else ""]
        what.append(f"in no rack {missing}" if missing else "")
        raise ConfigError(f"[sandbox] racks: {text!r}: " + ", ".join(w for w in what if w))
    return racks
