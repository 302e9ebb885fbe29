"""The emulated network: namespaces, veth NICs, rail bridges, node addresses and routes.

Commands go to iproute2 in batches (one ``ip -batch`` process per namespace), which keeps bring-up of a
few nodes well under a second.
"""

from __future__ import annotations

import json
import os
import subprocess

from clockwork.contracts.errors import SandboxError
from clockwork.sandbox.layout import FABRIC_NS, MGMT_BRIDGE, MGMT_DEV, ROOT_PEER, Layout, NodeSpec
from clockwork.sandbox.shell import in_netns, run
from linkpass.plan import FabricPlan, Inventory, plan

# Sysctls every node needs for routed, multi-rail addressing (see docs/sandbox.md):
# rp_filter 0 accepts replies that arrive on another rail than the one we sent on; arp_ignore 1 /
# arp_announce 2 stop a node answering ARP for one rail's address on another rail.
NODE_SYSCTLS = {
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
    "net.ipv4.conf.all.arp_ignore": "1",
    "net.ipv4.conf.all.arp_announce": "2",
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}
FABRIC_SYSCTLS = {
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}
# With br_netfilter loaded (container hosts load it), every frame a rail bridge forwards would also run
# the fabric namespace's IP firewall hooks, ~1 µs a packet charged to the sending node's process, which no
# switch does. Faults use nftables' bridge family, which does not need them. Per namespace since Linux 5.3.
BRIDGE_NF_SYSCTLS = {
    "net.bridge.bridge-nf-call-iptables": "0",
    "net.bridge.bridge-nf-call-ip6tables": "0",
    "net.bridge.bridge-nf-call-arptables": "0",
}


def is_fabric(ns: str) -> bool:
    """Whether ``ns`` is a sandbox's switch namespace (``cw-fabric`` or ``TAG-cw-fabric``)."""
    return ns == FABRIC_NS or ns.endswith("-" + FABRIC_NS)


def owner(ns: str) -> str | None:
    """The state folder that built namespace ``ns`` (stored as the alias of its management device).

    ``None`` when the namespace carries no mark yet (a bring-up that died early) or cannot be read.
    """
    dev = MGMT_BRIDGE if is_fabric(ns) else MGMT_DEV
    out = run(["ip", "-n", ns, "-j", "link", "show", "dev", dev], check=False).stdout
    try:
        return json.loads(out)[0].get("ifalias") or None
    except (ValueError, IndexError, AttributeError):
        return None


def existing_namespaces() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


def _batch(lines: list[str], ns: str | None = None) -> None:
    argv = ["ip", "-batch", "-"] if ns is None else ["ip", "-n", ns, "-batch", "-"]
    run(argv, input="\n".join(lines) + "\n")


def _sysctls(namespaces_and_values: list[tuple[str, dict[str, str]]]) -> None:
    """Set sysctls in several namespaces concurrently (each nsenter costs a few ms)."""
    procs = []
    for ns, values in namespaces_and_values:
        argv = [*in_netns(ns), "sysctl", "-q", "-w", *(f"{k}={v}" for k, v in values.items())]
        procs.append((argv, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    errors = []
    for argv, proc in procs:
        _, err = proc.communicate(timeout=30)
        if proc.returncode != 0:
            errors.append(f"{' '.join(argv)}: {err.strip()}")
    if errors:
        raise SandboxError("; ".join(errors))


def fabric_plan(layout: Layout) -> FabricPlan:
    """The sandbox's fabric map and routes, planned and checked as ``clockwork fabric init`` does on a cluster,
    from the inventory each node would report (its node address, its NICs' addresses)."""
    inventories = {n.name: Inventory(n.name, n.node_addr, {nic.name: nic.cidr for nic in n.nics}) for n in layout.nodes}
    return plan([n.name for n in layout.nodes], inventories)


def baseline_routes(layout: Layout, node: NodeSpec) -> list[str]:
    """The routes ``sandbox up`` gives a node: every peer's node address via rail 0, src = own address."""
    return [route.ip_batch() for route in fabric_plan(layout).routes[node.name]]


def build(layout: Layout, owner_mark: str) -> None:
    """Create the whole fabric, marking each namespace with ``owner_mark`` (see :func:`owner`).

    The caller tears it down with :func:`teardown` if this raises.
    """
    fabric_ns = layout.fabric_ns
    _batch([f"netns add {ns}" for ns in layout.namespaces])
    fabric_sysctls = FABRIC_SYSCTLS | (BRIDGE_NF_SYSCTLS if os.path.isdir("/proc/sys/net/bridge") else {})
    _sysctls([(fabric_ns, fabric_sysctls)] + [(n.netns, NODE_SYSCTLS) for n in layout.nodes])

    links = [f"link add {layout.root_dev} type veth peer name {ROOT_PEER} netns {fabric_ns}"]
    for node in layout.nodes:
        links.append(f"link add {node.mgmt_port} netns {fabric_ns} type veth peer name {MGMT_DEV} netns {node.netns}")
        for nic in node.nics:
            links.append(f"link add {nic.port} netns {fabric_ns} type veth peer name {nic.name} netns {node.netns}")
    _batch(links)

    bridges = [MGMT_BRIDGE, *(f"rail{r}" for r in range(layout.rails))]
    fabric = ["link set lo up"]
    for br in bridges:
        fabric += [f"link add {br} type bridge stp_state 0 mcast_snooping 0", f"link set {br} up"]
    fabric.append(f"link set {MGMT_BRIDGE} alias {owner_mark}")
    fabric.append(f"link set {ROOT_PEER} master {MGMT_BRIDGE} up")
    for node in layout.nodes:
        fabric.append(f"link set {node.mgmt_port} master {MGMT_BRIDGE} up")
        fabric += [f"link set {nic.port} master {nic.bridge} up" for nic in node.nics]
    _batch(fabric, fabric_ns)

    for node in layout.nodes:
        cmds = [
            "link set lo up",
            f"addr add {node.node_addr}/32 dev lo",
            f"addr add {node.mgmt_ip}/{node.mgmt_prefixlen} dev {MGMT_DEV}",
            f"link set {MGMT_DEV} alias {owner_mark}",
            f"link set {MGMT_DEV} up",
        ]
        for nic in node.nics:
            cmds += [f"addr add {nic.cidr} dev {nic.name}", f"link set {nic.name} up"]
        _batch(cmds + baseline_routes(layout, node), node.netns)

    root_dev = layout.root_dev
    run(["sysctl", "-q", "-w", f"net.ipv6.conf.{root_dev}.disable_ipv6=1"], check=False)
    _batch([f"addr add {layout.ctl_ip}/{layout.mgmt_prefixlen} dev {root_dev}", f"link set {root_dev} up"])


def teardown(namespaces: list[str], root_dev: str) -> list[str]:
    """Remove every namespace, veth and bridge the sandbox made; tolerant of a half-built fabric.

    Deleting the veths explicitly (not just the namespaces) matters: a namespace is freed
    asynchronously and a quick re-``up`` would otherwise meet its devices. Returns what was removed.
    """
    removed = []
    present = existing_namespaces()
    for ns in namespaces:
        if ns in present:
            links = run(["ip", "-n", ns, "-o", "link", "show"], check=False).stdout
            devs = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line]
            dels = [f"link del {d}" for d in devs if d != "lo"]
            if dels:
                run(["ip", "-n", ns, "-force", "-batch", "-"], input="\n".join(dels) + "\n", check=False)
            run(["ip", "netns", "del", ns], check=False)
            removed.append(f"namespace {ns}")
    # The controller's veth pairs with a port in the fabric namespace: ours exactly when that namespace is.
    if any(map(is_fabric, namespaces)) and run(["ip", "link", "show", root_dev], check=False).returncode == 0:
        run(["ip", "link", "del", root_dev], check=False)
        removed.append(f"veth {root_dev}")
    return removed
