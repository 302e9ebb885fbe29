"""Failure domains bigger than a node (a rack, a leaf switch, a Slurm block): where they come from, and the two
decisions they change: the order of the peer-copy ring and which spares take a lost node's ranks.

Why: the ring puts shard s's copy on the next slot, and slots are numbered in hostlist order, so the next slot is
usually the next node in the same rack (or, with G ranks per node, the same node). One rack or leaf-switch loss
then takes a shard and its only copy, and a job that had every defence configured stops ("no member holds
shard"). Ordering the ring so that neighbours sit in different domains costs nothing at run time.

Where a node's domain comes from (``failure_domains``, :func:`rank_domain`, :func:`node_domains`):

* ``"auto"``: Slurm's own topology. A task's ``SLURM_TOPOLOGY_ADDR`` (``top.rack1.node3``, with
  ``SLURM_TOPOLOGY_ADDR_PATTERN`` ``switch.switch.node``), which slurmd sets for every task when the topology/tree
  or topology/block plugin is configured, names the leaf switch (or block) above the task's node; else
  ``topology.conf`` beside ``slurm.conf`` (``SLURM_CONF``, else /etc/slurm/slurm.conf), whose ``SwitchName=X
  Nodes=...`` (tree) or ``BlockName=X Nodes=...`` (block) lines list each leaf's nodes;
* a path: a site map file, one ``HOSTLIST DOMAIN`` per line (``node[01-16] rack1``; ``#`` comments);
* ``"nodes"``: every node is its own domain (the topology is ignored); ``"off"``: the ring keeps slot order and
  spares are chosen as they were before domains existed.

A node with no known domain is its own domain: a node is always a failure domain.

The ring (:func:`ring_order`, pure): slots are grouped by domain (by node when fewer than two domains are known),
the groups laid end to end, largest first, and the result dealt round-robin into as many columns as the largest
group has members, which are then read one after another. Each domain's members land in different columns, and
each column holds at most one member of a domain, so when no domain holds more than ``n / (r + 1)`` of the ``n``
slots and there are at least ``r + 1`` domains, no slot's next ``r`` ring neighbours (the holders of its
``peer_copies = r`` copies) share its domain. With no domain information at all the order is the slot order.

Spares (:func:`spares_outside`, pure): a domain that lost a node is suspect (a leaf switch, a PDU or a cooling
loop may be failing), so a replacement is taken from outside the domains of the nodes the job lost when enough
ready spares are there; otherwise from all, as before. When a whole domain is lost its own spares are gone
anyway. The ring is fixed for the job (a ring that changed with every recovery would leave stale copies behind
in host memory): a replacement in another domain may share one with its slot's ring neighbour, which the job's
``torchpass.peer_ring`` event records. This module imports no torch.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from clockwork.contracts.hostlist import expand_hostlist
from torchpass.coordinator.records import agent_of

__all__ = [
    "DomainError",
    "Place",
    "node_domains",
    "parse_site_map",
    "parse_topology_conf",
    "rank_domain",
    "ring_order",
    "ring_successors",
    "spares_outside",
    "this_node",
    "topology_addr_domain",
    "topology_conf_path",
]

AUTO, NODES, OFF = "auto", "nodes", "off"


class DomainError(ValueError):
    """A topology or site map file that cannot be read as one (the message names the file and line)."""


@dataclass(frozen=True)
class Place:
    """Where one slot runs: its node, and the failure domain above it ('' when unknown)."""

    node: str
    domain: str = ""

    def wire(self) -> str:
        """``node domain`` (node names and domain names hold no whitespace)."""
        return f"{self.node} {self.domain}".strip()

    @classmethod
    def from_wire(cls, text: str) -> Place:
        node, _, domain = text.strip().partition(" ")
        return cls(node, domain.strip())


# ----- the ring ----------------------------------------------------------------------------------------


def ring_order(places: Sequence[Place]) -> tuple[int, ...]:
    """The peer-copy ring over ``places`` (index i is slot i of a ring): a permutation of their indices in which
    ring neighbours sit in different domains wherever the domains' sizes allow (see the module docstring).

    Deterministic from ``places`` alone, so every rank computes the same ring."""
    n = len(places)
    if n == 0:
        return ()
    domains = {p.domain or p.node for p in places}
    key = [p.domain or p.node for p in places] if len(domains) >= 2 else [p.node for p in places]
    groups: dict[str, list[int]] = {}
    for index, name in enumerate(key):
        groups.setdefault(name, []).append(index)
    # Largest group first; between equals the one with the lowest slot (no name enters the order: with every slot
    # in a domain of its own the ring is the slot order, as it was before domains existed).
    ordered = sorted(groups.values(), key=lambda members: (-len(members), members[0]))
    flat = [i for members in ordered for i in sorted(members, key=lambda i: (places[i].node, i))]
    columns = len(ordered[0])
    return tuple(flat[i] for column in range(columns) for i in range(column, n, columns))


def ring_successors(order: Sequence[int], index: int, copies: int) -> list[int]:
    """The next ``copies`` entries after ``index`` in ring ``order`` (never ``index`` itself): whose memory keeps
    ``index``'s copies."""
    n = len(order)
    at = order.index(index)
    return [order[(at + i) % n] for i in range(1, min(copies, n - 1) + 1)]


# ----- spares ------------------------------------------------------------------------------------------


def spares_outside(
    spares: Sequence[str], need: int, domains: Mapping[int, str], lost_agents: Collection[int]
) -> list[str]:
    """The spares (worker ids, in ready order) a recovery choosing ``need`` of them may take: those outside the
    domains of the nodes the job lost (``lost_agents``; ``domains``: agent -> its node's domain) when there are
    ``need`` of them, else all of them."""
    suspect = {domains[agent] for agent in lost_agents if agent in domains}
    if not suspect:
        return list(spares)
    outside = [wid for wid in spares if domains.get(agent_of(wid)) not in suspect]
    return outside if len(outside) >= need else list(spares)


# ----- where domains come from -------------------------------------------------------------------------


def topology_addr_domain(addr: str, pattern: str = "") -> str:
    """The leaf switch (or block) in a task's ``SLURM_TOPOLOGY_ADDR``: the name right above the node
    (``top.rack1.node3`` -> ``rack1``); '' when it names no switch. ``pattern`` (``switch.switch.node``) says which
    component is the node, where Slurm sets it."""
    parts = [p for p in addr.strip().split(".") if p]
    kinds = [k for k in pattern.strip().split(".") if k]
    node_at = kinds.index("node") if len(kinds) == len(parts) and "node" in kinds else len(parts) - 1
    return parts[node_at - 1] if node_at >= 1 else ""


_TOPOLOGY_LINE = re.compile(r"(?i)^\s*(switchname|blockname)\s*=\s*(\S+)(.*)$")
_NODES = re.compile(r"(?i)\bnodes\s*=\s*(\S+)")


def parse_topology_conf(text: str, where: str = "topology.conf") -> dict[str, str]:
    """Node -> its leaf switch (tree: ``SwitchName=X Nodes=...``) or block (``BlockName=X Nodes=...``)."""
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0]
        match = _TOPOLOGY_LINE.match(line)
        if match is None:
            continue
        nodes = _NODES.search(match.group(3))
        if nodes is None:
            continue  # a switch over switches (SwitchName=top Switches=...): no node hangs on it
        try:
            for node in expand_hostlist(nodes.group(1)):
                out.setdefault(node, match.group(2))
        except ValueError as exc:
            raise DomainError(f"{where}:{number}: {exc}") from None
    return out


def parse_site_map(text: str, where: str = "site map") -> dict[str, str]:
    """Node -> domain from a site map: one ``HOSTLIST DOMAIN`` (or ``HOSTLIST = DOMAIN``) per line."""
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].replace("=", " ").strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise DomainError(f"{where}:{number}: expected 'HOSTLIST DOMAIN', got {raw.strip()!r}")
        try:
            for node in expand_hostlist(fields[0]):
                out[node] = fields[1]
        except ValueError as exc:
            raise DomainError(f"{where}:{number}: {exc}") from None
    return out


def topology_conf_path(environ: Mapping[str, str]) -> Path:
    """Where Slurm reads topology.conf: beside slurm.conf."""
    return Path(environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf").with_name("topology.conf")


def this_node(environ: Mapping[str, str]) -> str:
    """This process's node as Slurm names it (``SLURMD_NODENAME``, else the short host name)."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".", 1)[0]


def _read(path: Path, parse: Callable[[str, str], dict[str, str]]) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise DomainError(f"cannot read {path}: {exc.strerror}") from None
    return parse(text, str(path))


def node_domains(setting: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Node -> domain for every node a file names (``setting``: the ``failure_domains`` value). ``auto``
    without a topology.conf, ``nodes`` and ``off`` know none: each node is then its own domain."""
    env = os.environ if environ is None else environ
    if setting in (NODES, OFF):
        return {}
    if setting == AUTO:
        path = topology_conf_path(env)
        return _read(path, parse_topology_conf) if path.exists() else {}
    return _read(Path(setting).expanduser(), parse_site_map)


def rank_domain(setting: str, environ: Mapping[str, str] | None = None) -> Place:
    """Where this process runs (``setting``: the ``failure_domains`` value): its node, and the domain above it
    (from the site map; with ``auto``, from ``SLURM_TOPOLOGY_ADDR``, else topology.conf)."""
    env = os.environ if environ is None else environ
    if setting == OFF:
        return Place("")  # every slot alike: the ring keeps the slot order
    node = this_node(env)
    if setting == NODES:
        return Place(node)
    if setting == AUTO and env.get("SLURM_TOPOLOGY_ADDR"):
        domain = topology_addr_domain(env["SLURM_TOPOLOGY_ADDR"], env.get("SLURM_TOPOLOGY_ADDR_PATTERN", ""))
        if domain:
            return Place(node, domain)
    return Place(node, node_domains(setting, env).get(node, ""))
