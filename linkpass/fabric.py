"""The fabric map: every node's stable address and its NICs (one per rail), read from a JSON file.

A NIC name is a rail: ``nic0`` of one node talks to ``nic0`` of the others over the same switch. The
map is the topology LinkPass routes by; the sandbox writes one, an admin ships one for a cluster.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path


class FabricError(Exception):
    """The fabric file is missing or malformed (the message names the file and the problem)."""


@dataclass(frozen=True)
class FabricNode:
    name: str
    addr: str
    nics: dict[str, str]  # NIC (rail) name -> IPv4 address


@dataclass(frozen=True)
class FabricMap:
    nodes: dict[str, FabricNode]

    @classmethod
    def load(cls, path: Path) -> FabricMap:
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise FabricError(f"no fabric file at {path}") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise FabricError(f"{path}: unreadable: {exc}") from None
        return cls.parse(doc, str(path))

    @classmethod
    def parse(cls, doc: object, origin: str = "fabric") -> FabricMap:
        if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), dict) or not doc["nodes"]:
            raise FabricError(f'{origin}: expected {{"nodes": {{NAME: {{"addr": ..., "nics": {{...}}}}}}}}')
        nodes = {}
        for name, entry in doc["nodes"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("nics"), dict) or not entry["nics"]:
                raise FabricError(f"{origin}: node {name!r} needs 'addr' and a non-empty 'nics' map")
            try:
                addr = str(ipaddress.IPv4Address(entry.get("addr")))
                nics = {str(nic): str(ipaddress.IPv4Address(ip)) for nic, ip in entry["nics"].items()}
            except (ipaddress.AddressValueError, ValueError) as exc:
                raise FabricError(f"{origin}: node {name!r}: {exc}") from None
            nodes[str(name)] = FabricNode(str(name), addr, nics)
        return cls(nodes)

    def node(self, name: str) -> FabricNode:
        if name not in self.nodes:
            raise FabricError(f"node {name!r} is not in the fabric map (nodes: {', '.join(sorted(self.nodes))})")
        return self.nodes[name]

    def peers(self, name: str) -> list[FabricNode]:
        return [n for n in self.nodes.values() if n.name != name]

    def by_address(self, addr: str) -> FabricNode | None:
        for node in self.nodes.values():
            if addr == node.addr or addr in node.nics.values():
                return node
        return None
