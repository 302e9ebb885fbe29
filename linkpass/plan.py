"""The fabric LinkPass needs, planned from each node's NIC inventory: the fabric map and the per-peer routes.

LinkPass routes by a map of every node's stable address and its NICs' addresses, and fails over routes that must
exist first: one /32 per peer node address, over one rail, with ``src`` = the node's own address (which sits on
loopback, on no NIC). Writing both by hand for 1,024 nodes x 8 NICs is where set-ups go wrong, so
``clockwork fabric init`` builds them here from what each node reports (:class:`Inventory`, made by
``clockwork fabric inventory`` on the node) and checks them: the same rails everywhere, one subnet per rail, no
address twice, node addresses on no rail's subnet, and heartbeats that fit one datagram. The sandbox builds its
fabric with the same functions. Pure: no I/O.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from linkpass.fabric import FabricError, FabricMap
from linkpass.heartbeat import FabricIndex

__all__ = ["HOME_CHOICES", "FabricPlan", "Inventory", "Route", "plan"]

#: How each peer's home rail is chosen: the first rail for every peer, or spread over the rails by peer index.
HOME_CHOICES = ("first", "spread")


@dataclass(frozen=True)
class Inventory:
    """One node's addresses: its stable node address and each fabric NIC's address with its prefix length."""

    node: str
    addr: str
    nics: dict[str, str]  # NIC name (rail) -> "address/prefix"

    def to_doc(self) -> dict[str, object]:
        return {"node": self.node, "addr": self.addr, "nics": dict(sorted(self.nics.items()))}

    @classmethod
    def from_doc(cls, doc: object, origin: str = "inventory") -> Inventory:
        if not isinstance(doc, dict) or not isinstance(doc.get("node"), str) or not isinstance(doc.get("nics"), dict):
            raise FabricError(
                f'{origin}: expected {{"node": NAME, "addr": ADDRESS, "nics": {{NIC: "ADDRESS/PREFIX"}}}}'
            )
        try:
            addr = str(ipaddress.IPv4Address(doc.get("addr")))
            nics = {str(k): str(ipaddress.IPv4Interface(v)) for k, v in doc["nics"].items()}
        except (ipaddress.AddressValueError, ipaddress.NetmaskValueError, ValueError) as exc:
            raise FabricError(f"{origin}: {exc}") from None
        return cls(doc["node"], addr, nics)


@dataclass(frozen=True)
class Route:
    """One node's route to a peer's node address over one rail."""

    dst: str  # the peer's node address (a /32)
    via: str  # the peer's address on the rail
    dev: str  # this node's NIC on the rail
    src: str  # this node's own node address

    def ip_batch(self) -> str:
        """The route as one line of ``ip -batch``."""
        return f"route replace {self.dst}/32 via {self.via} dev {self.dev} src {self.src}"


@dataclass(frozen=True)
class FabricPlan:
    """The fabric map (as LinkPass's ``fabric_file`` holds it) and every node's routes."""

    fabric: dict[str, object]
    routes: dict[str, list[Route]]

    def routes_doc(self) -> dict[str, list[dict[str, str]]]:
        return {node: [r.__dict__ for r in routes] for node, routes in self.routes.items()}


def plan(nodes: Sequence[str], inventories: Mapping[str, Inventory], home: str = "first") -> FabricPlan:
    """The fabric of ``nodes`` (the Slurm node list, in its order) from their inventories; FabricError listing
    every problem found when the fabric would not work."""
    if home not in HOME_CHOICES:
        raise FabricError(f"home rail choice {home!r}: expected one of {', '.join(HOME_CHOICES)}")
    problems = _check(nodes, inventories)
    if problems:
        raise FabricError("the fabric does not check out:\n  " + "\n  ".join(problems))
    doc: dict[str, object] = {
        "nodes": {
            n: {
                "addr": inventories[n].addr,
                "nics": {nic: cidr.split("/")[0] for nic, cidr in sorted(inventories[n].nics.items())},
            }
            for n in nodes
        }
    }
    fabric = FabricMap.parse(doc)
    try:
        FabricIndex.of(fabric)
    except ValueError as exc:
        raise FabricError(f"the fabric does not check out: {exc}") from None
    rails = sorted(inventories[nodes[0]].nics)
    routes = {}
    for me in nodes:
        mine = fabric.node(me)
        out = []
        for i, peer in enumerate(nodes):
            if peer == me:
                continue
            rail = rails[0] if home == "first" else rails[i % len(rails)]
            out.append(Route(fabric.node(peer).addr, fabric.node(peer).nics[rail], rail, mine.addr))
        routes[me] = out
    return FabricPlan(doc, routes)


def _check(nodes: Sequence[str], inventories: Mapping[str, Inventory]) -> list[str]:
    problems = []
    if len(set(nodes)) != len(nodes) or not nodes:
        problems.append("the node list is empty or names a node twice")
    missing = [n for n in nodes if n not in inventories]
    if missing:
        problems.append(f"no inventory from {', '.join(missing)}")
    present = [n for n in nodes if n in inventories]
    for n in present:
        if inventories[n].node != n:
            problems.append(f"{n}'s inventory says it is {inventories[n].node!r}")
        if not inventories[n].nics:
            problems.append(f"{n} reports no fabric NIC")
    rail_sets = {n: frozenset(inventories[n].nics) for n in present}
    if len(set(rail_sets.values())) > 1:
        first = present[0]
        odd = [n for n in present if rail_sets[n] != rail_sets[first]]
        problems.append(
            f"the rails differ: {first} has {', '.join(sorted(rail_sets[first]))}, but "
            + "; ".join(f"{n} has {', '.join(sorted(rail_sets[n])) or 'none'}" for n in odd[:5])
        )
    seen: dict[str, str] = {}
    for n in present:
        for what, ip in [("node address", inventories[n].addr)] + [
            (nic, cidr.split("/")[0]) for nic, cidr in sorted(inventories[n].nics.items())
        ]:
            if ip in seen:
                problems.append(f"{ip} is {seen[ip]} and {n}'s {what}")
            seen[ip] = f"{n}'s {what}"
    subnets: dict[str, set[ipaddress.IPv4Network]] = {}
    for n in present:
        for nic, cidr in inventories[n].nics.items():
            subnets.setdefault(nic, set()).add(ipaddress.IPv4Interface(cidr).network)
    for nic, nets in sorted(subnets.items()):
        if len(nets) > 1:
            problems.append(
                f"rail {nic} spans {len(nets)} subnets ({', '.join(sorted(map(str, nets))[:4])}): "
                "a rail's NICs must reach each other on-link"
            )
    for n in present:
        addr = ipaddress.IPv4Address(inventories[n].addr)
        for nic, nets in subnets.items():
            if any(addr in net for net in nets):
                problems.append(
                    f"{n}'s node address {addr} lies on rail {nic}'s subnet: put it on loopback, off every rail"
                )
    return problems
