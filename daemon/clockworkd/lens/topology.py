"""Which NIC hangs on which switch port, the links between switches, and the links a probe crosses.

Fleet Lens only sees end-to-end probes between NICs; to turn "these paths are bad" into "this cable
is bad" it must know which directed links each probe crossed. That is this module's one job.

The topology comes from three places, in order of trust:

- a topology file an admin ships (JSON or TOML), naming each NIC's switch and port and the links
  between switches (leaf/spine);
- inferred from the fabric map for every NIC the file does not name: a NIC name is a rail, so each
  rail gets one switch, ``rail:<nic>``, and the switch port is named after the NIC;
- synthetic fat trees (``Topology.fat_tree``) for simulations and the scale benchmark.

Routing between switches is shortest-path; where several next hops tie (ECMP), the choice is a stable
hash of the probe's (source, destination) NICs, as a switch hashes a fixed 5-tuple. ``zlib.crc32`` is
used, not ``hash()``, which Python salts per process: every node must compute the same paths.
``path()`` runs millions of times in the scale benchmark, so all names and next-hop tables are built
once and the hot path only does dictionary look-ups.
"""

from __future__ import annotations

import json
import tomllib
import zlib
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clockwork.contracts import lens_model as model
from clockwork.contracts.lens_model import LinkId, NicId
from linkpass.fabric import FabricMap

RAIL_SWITCH_PREFIX = "rail:"

# Next hops from one switch towards a destination switch: (next switch, directed link to it).
_Hops = tuple[tuple[str, LinkId], ...]


class TopologyError(Exception):
    """The topology file or description is malformed (the message names the origin and the key)."""


@dataclass(frozen=True)
class Attachment:
    """The switch port a NIC is cabled to."""

    switch: str
    port: str


@dataclass(frozen=True)
class PhysicalLink:
    """The cable behind a directed link: what an operator goes and looks at."""

    name: str  # undirected, e.g. "node3/nic1 <-> rail:nic1" or "leaf0 <-> spine1"
    switch: str  # the switch whose port is involved (the upper end for inter-switch links)
    port: str  # that switch's port name
    nic: NicId | None  # the node NIC on the link, None for inter-switch links
    direction: str  # model.UPLINK, model.DOWNLINK or model.INTER_SWITCH
    reverse: LinkId  # the same cable's other direction


def rail_switch(nic_name: str) -> str:
    """The inferred switch of a rail: all NICs of one name share it (rail-optimized fabrics)."""
    return f"{RAIL_SWITCH_PREFIX}{nic_name}"


class Topology:
    """NICs, the switch ports they are cabled to, the links between switches, and probe paths."""

    def __init__(
        self,
        attachments: Mapping[NicId, Attachment],
        switch_links: Iterable[tuple[str, str]] = (),
        ports: Mapping[tuple[str, str], str] | None = None,
        origin: str = "topology",
    ) -> None:
        """Build every look-up table once.

        ``switch_links`` are undirected pairs of switches; ``ports[(switch, other)]`` names the port of
        ``switch`` that faces ``other`` (default: the other switch's name).
        """
        self._origin = origin
        self._attach: dict[NicId, Attachment] = {nic: attachments[nic] for nic in sorted(attachments)}
        pairs = sorted({tuple(sorted(pair)) for pair in switch_links})
        self._check_names(pairs)
        self._adj = self._adjacency(pairs)
        self._switch: dict[NicId, str] = {nic: a.switch for nic, a in self._attach.items()}
        self._up: dict[NicId, LinkId] = {nic: model.link_id(nic, sw) for nic, sw in self._switch.items()}
        self._down: dict[NicId, LinkId] = {nic: model.link_id(sw, nic) for nic, sw in self._switch.items()}
        self._sw_link: dict[tuple[str, str], LinkId] = {}
        for a, b in pairs:
            self._sw_link[(a, b)] = model.link_id(a, b)
            self._sw_link[(b, a)] = model.link_id(b, a)
        self._ports = {(sw, other): (ports or {}).get((sw, other), other) for sw, other in self._sw_link}
        self._nics_on = self._group_by_switch()
        self._physical = self._physical_links(pairs)
        self._links: tuple[LinkId, ...] = tuple(self._physical)
        self._groups = self._rail_groups()
        self._next: dict[str, dict[str, _Hops]] = {}  # destination switch -> switch -> next hops
        self._interned: dict[_Hops, _Hops] = {}

    # ----- construction ---------------------------------------------------------------------------

    @classmethod
    def from_fabric(cls, fabric: FabricMap) -> Topology:
        """One switch per rail (NIC name), as the sandbox and a rail-optimized cluster are cabled."""
        return cls(_inferred(fabric), origin="fabric map")

    @classmethod
    def from_doc(cls, doc: object, fabric: FabricMap | None = None, origin: str = "topology") -> Topology:
        """Parse ``{"nics": {NIC: {"switch": S, "port": P}}, "links": [[S1, S2], ...]}``.

        A link may also be ``{"ends": [S1, S2], "ports": {S1: PORT, S2: PORT}}`` when switch port names
        are known. NICs of ``fabric`` the document does not name are inferred per rail.
        """
        if not isinstance(doc, dict):
            raise TopologyError(f'{origin}: expected {{"nics": {{...}}, "links": [...]}}, got {type(doc).__name__}')
        for key in doc:
            if key not in ("nics", "links"):
                raise TopologyError(f"{origin}: unknown key {key!r} (expected 'nics' and 'links')")
        attachments = _parse_nics(doc.get("nics", {}), fabric, origin)
        pairs, ports = _parse_links(doc.get("links", []), origin)
        if fabric is not None:
            for nic, attachment in _inferred(fabric).items():
                attachments.setdefault(nic, attachment)
        return cls(attachments, pairs, ports, origin)

    @classmethod
    def load(cls, path: Path, fabric: FabricMap | None = None) -> Topology:
        """Read a topology file: TOML when it ends in ``.toml``, JSON otherwise."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise TopologyError(f"no topology file at {path}") from None
        except OSError as exc:
            raise TopologyError(f"{path}: unreadable: {exc}") from None
        try:
            doc = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise TopologyError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {exc}") from None
        return cls.from_doc(doc, fabric, str(path))

    @classmethod
    def fat_tree(cls, nodes: int, nodes_per_leaf: int, spines: int, rails: int = 1) -> Topology:
        """A two-tier leaf/spine tree per rail, every leaf linked to every spine of its rail (simulations).

        Nodes are ``n00000``...; NIC ``nicR`` of a node sits on leaf ``rR-leaf{i}`` with ``i = node //
        nodes_per_leaf``; spines are ``rR-spine{j}``.
        """
        if nodes < 1 or nodes_per_leaf < 1 or spines < 0 or rails < 1:
            raise ValueError(f"fat_tree({nodes}, {nodes_per_leaf}, {spines}, {rails}): sizes must be positive")
        width = max(5, len(str(nodes - 1)))
        leafs = -(-nodes // nodes_per_leaf)
        attachments: dict[NicId, Attachment] = {}
        pairs: list[tuple[str, str]] = []
        for r in range(rails):
            for i in range(nodes):
                nic = model.nic_id(f"n{i:0{width}d}", f"nic{r}")
                attachments[nic] = Attachment(f"r{r}-leaf{i // nodes_per_leaf}", nic)
            pairs += [(f"r{r}-leaf{i}", f"r{r}-spine{j}") for i in range(leafs) for j in range(spines)]
        return cls(attachments, pairs, origin=f"fat_tree({nodes}, {nodes_per_leaf}, {spines}, {rails})")

    # ----- queries --------------------------------------------------------------------------------

    def nics(self) -> tuple[NicId, ...]:
        """Every NIC, sorted (so every node iterates them in the same order)."""
        return tuple(self._attach)

    def links(self) -> tuple[LinkId, ...]:
        """Every directed link: each NIC's uplink and downlink, then both directions of each switch link."""
        return self._links

    def switches(self) -> tuple[str, ...]:
        return tuple(sorted(self._adj))

    def attachment(self, nic: NicId) -> Attachment:
        return self._attach[nic]

    def switch_of(self, nic: NicId) -> str:
        return self._switch[nic]

    def uplink(self, nic: NicId) -> LinkId:
        return self._up[nic]

    def downlink(self, nic: NicId) -> LinkId:
        return self._down[nic]

    def neighbors(self, switch: str) -> tuple[str, ...]:
        """Switches directly linked to ``switch``, sorted."""
        return self._adj.get(switch, ())

    def nics_on(self, switch: str) -> tuple[NicId, ...]:
        """NICs cabled to ``switch``, sorted."""
        return self._nics_on.get(switch, ())

    def rail_group(self, nic: NicId) -> tuple[NicId, ...]:
        """The NICs ``nic`` can probe, itself included: same NIC name and a switch route between them.

        Shared by all members, so asking for every NIC of a 16k-node rail costs nothing.
        """
        return self._groups[nic]

    def rail_groups(self) -> tuple[tuple[NicId, ...], ...]:
        """Every rail group once, in NIC order."""
        seen: dict[int, tuple[NicId, ...]] = {}
        for group in self._groups.values():
            seen.setdefault(id(group), group)
        return tuple(seen.values())

    def same_rail_peers(self, nic: NicId) -> tuple[NicId, ...]:
        """The NICs ``nic`` can probe (its rail group without itself)."""
        return tuple(peer for peer in self._groups[nic] if peer != nic)

    def physical(self, link: LinkId) -> PhysicalLink:
        """The cable behind a directed link."""
        try:
            return self._physical[link]
        except KeyError:
            raise KeyError(f"{self._origin}: unknown link {link!r}") from None

    def path(self, src: NicId, dst: NicId) -> tuple[LinkId, ...] | None:
        """The directed links a probe from ``src`` to ``dst`` crosses, or None when it cannot get there."""
        s = self._switch.get(src)
        d = self._switch.get(dst)
        if s is None or d is None or src == dst:
            return None
        if s == d:
            return (self._up[src], self._down[dst])
        hops = self._route(s, d, src, dst)
        if hops is None:
            return None
        return (self._up[src], *hops, self._down[dst])

    # ----- routing --------------------------------------------------------------------------------

    def _route(self, s: str, d: str, src: NicId, dst: NicId) -> tuple[LinkId, ...] | None:
        """Switch-to-switch links from ``s`` to ``d``; ECMP ties broken by a stable hash of the NIC pair."""
        table = self._next.get(d)
        if table is None:
            table = self._build_next(d)
        if s not in table:
            return None
        hops: list[LinkId] = []
        key = b""
        cur = s
        while cur != d:
            options = table[cur]
            if len(options) == 1:
                cur, link = options[0]
            else:
                key = key or f"{src}>{dst}".encode()
                cur, link = options[zlib.crc32(key, len(hops)) % len(options)]
            hops.append(link)
        return tuple(hops)

    def _build_next(self, d: str) -> dict[str, _Hops]:
        """Shortest-path next hops of every switch towards ``d`` (BFS from ``d``), computed once per ``d``."""
        dist = {d: 0}
        queue = deque([d])
        while queue:
            cur = queue.popleft()
            for nxt in self._adj.get(cur, ()):
                if nxt not in dist:
                    dist[nxt] = dist[cur] + 1
                    queue.append(nxt)
        table: dict[str, _Hops] = {d: ()}
        for cur, hops in dist.items():
            if cur != d:
                options = tuple((n, self._sw_link[(cur, n)]) for n in self._adj[cur] if dist.get(n) == hops - 1)
                table[cur] = self._interned.setdefault(options, options)
        self._next[d] = table
        return table

    # ----- table building -------------------------------------------------------------------------

    def _check_names(self, pairs: list[tuple[str, ...]]) -> None:
        """Names must parse back out of link ids: no '>' anywhere, '/' only in NIC ids."""
        for nic, attachment in self._attach.items():
            node, name = model.split_nic(nic)
            if not node or not name or ">" in nic:
                raise TopologyError(f"{self._origin}: NIC {nic!r} must be NODE/NIC without '>'")
            _check_switch(attachment.switch, f"{self._origin}: NIC {nic!r}")
        for a, b in pairs:
            _check_switch(a, f"{self._origin}: link {a!r} - {b!r}")
            _check_switch(b, f"{self._origin}: link {a!r} - {b!r}")
            if a == b:
                raise TopologyError(f"{self._origin}: link {a!r} - {b!r} connects a switch to itself")

    def _adjacency(self, pairs: list[tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        adj: dict[str, set[str]] = {a.switch: set() for a in self._attach.values()}
        for a, b in pairs:
            adj.setdefault(a, set()).add(b)
            adj.setdefault(b, set()).add(a)
        return {sw: tuple(sorted(peers)) for sw, peers in sorted(adj.items())}

    def _group_by_switch(self) -> dict[str, tuple[NicId, ...]]:
        on: dict[str, list[NicId]] = {}
        for nic, sw in self._switch.items():
            on.setdefault(sw, []).append(nic)
        return {sw: tuple(nics) for sw, nics in on.items()}

    def _levels(self) -> dict[str, int]:
        """Tier of each switch: 0 where NICs hang, then hops away from that (spines are 1)."""
        level = {sw: 0 for sw in self._nics_on}
        queue = deque(level)
        while queue:
            cur = queue.popleft()
            for nxt in self._adj.get(cur, ()):
                if nxt not in level:
                    level[nxt] = level[cur] + 1
                    queue.append(nxt)
        return level

    def _physical_links(self, pairs: list[tuple[str, ...]]) -> dict[LinkId, PhysicalLink]:
        physical: dict[LinkId, PhysicalLink] = {}
        for nic, attachment in self._attach.items():
            up, down = self._up[nic], self._down[nic]
            name = f"{nic} <-> {attachment.switch}"
            physical[up] = PhysicalLink(name, attachment.switch, attachment.port, nic, model.UPLINK, down)
            physical[down] = PhysicalLink(name, attachment.switch, attachment.port, nic, model.DOWNLINK, up)
        level = self._levels()
        for a, b in pairs:
            lower, upper = sorted((a, b), key=lambda sw: (level.get(sw, 0), sw))
            name = f"{lower} <-> {upper}"
            port = self._ports[(upper, lower)]
            ab, ba = self._sw_link[(a, b)], self._sw_link[(b, a)]
            physical[ab] = PhysicalLink(name, upper, port, None, model.INTER_SWITCH, ba)
            physical[ba] = PhysicalLink(name, upper, port, None, model.INTER_SWITCH, ab)
        return physical

    def _rail_groups(self) -> dict[NicId, tuple[NicId, ...]]:
        """NIC -> its rail group: same NIC name and connected switches; one shared tuple per group."""
        component: dict[str, int] = {}
        for start in self._adj:
            if start in component:
                continue
            component[start] = len(component)
            queue = deque([start])
            while queue:
                for nxt in self._adj[queue.popleft()]:
                    if nxt not in component:
                        component[nxt] = component[start]
                        queue.append(nxt)
        members: dict[tuple[str, int], list[NicId]] = {}
        for nic, sw in self._switch.items():
            members.setdefault((model.split_nic(nic)[1], component[sw]), []).append(nic)
        groups = {key: tuple(nics) for key, nics in members.items()}
        return {nic: groups[(model.split_nic(nic)[1], component[sw])] for nic, sw in self._switch.items()}


def _check_switch(name: object, where: str) -> None:
    if not isinstance(name, str) or not name or ">" in name or "/" in name:
        raise TopologyError(f"{where}: switch name {name!r} must be a non-empty string without '>' or '/'")


def _inferred(fabric: FabricMap) -> dict[NicId, Attachment]:
    """Every NIC of the fabric on its rail's switch, on a port named after the NIC."""
    attachments = {}
    for node in fabric.nodes.values():
        for name in node.nics:
            nic = model.nic_id(node.name, name)
            attachments[nic] = Attachment(rail_switch(name), nic)
    return attachments


def _parse_nics(nics: object, fabric: FabricMap | None, origin: str) -> dict[NicId, Attachment]:
    if not isinstance(nics, dict):
        raise TopologyError(f"{origin}: 'nics' must be a table of NODE/NIC -> {{switch, port}}, got {nics!r}")
    known = set(_inferred(fabric)) if fabric is not None else None
    attachments = {}
    for nic, entry in nics.items():
        where = f"{origin}: nics.{nic!r}"
        node, name = model.split_nic(str(nic))
        if not node or not name or ">" in nic:
            raise TopologyError(f"{where}: a NIC is named NODE/NIC (e.g. 'node3/nic1')")
        if known is not None and nic not in known:
            raise TopologyError(f"{where}: no such NIC in the fabric map")
        if not isinstance(entry, dict):
            raise TopologyError(f'{where}: expected {{"switch": ..., "port": ...}}, got {entry!r}')
        for key in entry:
            if key not in ("switch", "port"):
                raise TopologyError(f"{where}: unknown key {key!r} (expected 'switch' and 'port')")
        switch = entry.get("switch")
        _check_switch(switch, f"{where}.switch")
        port = entry.get("port", nic)
        if not isinstance(port, str) or not port:
            raise TopologyError(f"{where}.port: expected a port name, got {port!r}")
        attachments[nic] = Attachment(str(switch), port)
    return attachments


def _parse_links(links: object, origin: str) -> tuple[list[tuple[str, str]], dict[tuple[str, str], str]]:
    if not isinstance(links, list):
        raise TopologyError(f"{origin}: 'links' must be a list of [SWITCH, SWITCH], got {links!r}")
    pairs: list[tuple[str, str]] = []
    ports: dict[tuple[str, str], str] = {}
    seen: set[frozenset[str]] = set()
    for i, entry in enumerate(links):
        where = f"{origin}: links[{i}]"
        a, b, entry_ports = _parse_link(entry, where)
        if frozenset((a, b)) in seen:
            raise TopologyError(f"{where}: link {a!r} - {b!r} is listed twice")
        seen.add(frozenset((a, b)))
        pairs.append((a, b))
        for sw, port in entry_ports.items():
            ports[(sw, b if sw == a else a)] = port
    return pairs, ports


def _parse_link(entry: Any, where: str) -> tuple[str, str, dict[str, str]]:
    """One link entry: ``[A, B]`` or ``{"ends": [A, B], "ports": {A: PORT, B: PORT}}``."""
    ports: Any = {}
    if isinstance(entry, dict):
        for key in entry:
            if key not in ("ends", "ports"):
                raise TopologyError(f"{where}: unknown key {key!r} (expected 'ends' and 'ports')")
        ends, ports = entry.get("ends"), entry.get("ports", {})
    else:
        ends = entry
    if not isinstance(ends, list) or len(ends) != 2:
        raise TopologyError(f'{where}: expected [SWITCH, SWITCH] or {{"ends": [...], "ports": {{...}}}}, got {entry!r}')
    a, b = ends
    _check_switch(a, where)
    _check_switch(b, where)
    if a == b:
        raise TopologyError(f"{where}: link {a!r} - {b!r} connects a switch to itself")
    if not isinstance(ports, dict):
        raise TopologyError(f"{where}.ports: expected {{SWITCH: PORT}}, got {ports!r}")
    for sw, port in ports.items():
        if sw not in (a, b):
            raise TopologyError(f"{where}.ports: {sw!r} is not an end of this link ({a!r}, {b!r})")
        if not isinstance(port, str) or not port:
            raise TopologyError(f"{where}.ports.{sw}: expected a port name, got {port!r}")
    return a, b, ports
