"""What one interval's heartbeats and a notice are: which packet goes to which peer address on which rail.

Apart from the engine so the choice is a pure function of the evidence, testable (and benchmarked) without sockets:
one packet body per usable rail, sealed for each peer that gets it on that rail under that peer's send key (pairwise
keys: one tag per peer; a key shared by every peer: one tag per rail); path peers get it on every usable rail they
share with this node, the other watch peers on one such rail, the rails taking turns (``seq``); notices go to every
node of the fabric on up to ``NOTICE_RAILS`` rails each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from linkpass import heartbeat
from linkpass.keyring import KeyRing

__all__ = ["NOTICE_RAILS", "Outbox", "Outgoing"]

#: Notices go out on at most this many of the rails still usable, to each node (one lost packet loses nothing).
NOTICE_RAILS = 2

Outgoing = list[tuple[str, bytes, str]]  # (rail, packet, peer address on that rail)


class Outbox:
    """Packets of ``me`` (its node number in ``index``) to its peers (name -> rail -> address), each tagged under
    the key ``keys`` gives for its peer."""

    def __init__(
        self, index: heartbeat.FabricIndex, keys: KeyRing, me: str, peers: Mapping[str, Mapping[str, str]]
    ) -> None:
        self.index = index
        self.keys = keys
        self.me = index.node_number(me)
        self.peers = {name: dict(nics) for name, nics in sorted(peers.items())}
        self.seq = 0

    def heard(self, fresh: Mapping[str, Iterable[str]]) -> tuple[bytes, ...]:
        """One bitmap per fabric rail: the nodes heard on it recently (``fresh``: peer -> rails heard on)."""
        bits: list[set[int]] = [set() for _ in self.index.rails]
        for name, rails in fresh.items():
            number = self.index.node_number(name)
            for rail in rails:
                bits[self.index.rail_number(rail)].add(number)
        return tuple(heartbeat.bitmap(self.index, members) for members in bits)

    def _bodies(self, usable: list[str], heard: tuple[bytes, ...], down: int, up: int, flags: int) -> dict[str, bytes]:
        self.seq += 1
        return {
            rail: heartbeat.encode_body(
                heartbeat.Heartbeat(self.me, self.index.rail_number(rail), self.seq, heard, down, up, flags),
                self.index,
            )
            for rail in usable
        }

    def _sealer(self, bodies: dict[str, bytes]) -> Callable[[str, str], bytes]:
        """(rail, peer) -> the rail's packet tagged under the peer's send key; one tag per (rail, key)."""
        sealed: dict[tuple[str, bytes], bytes] = {}

        def packet(rail: str, peer: str) -> bytes:
            key = self.keys.send_key(peer)
            out = sealed.get((rail, key))
            if out is None:
                out = sealed[(rail, key)] = heartbeat.seal(bodies[rail], key)
            return out

        return packet

    def heartbeats(
        self, usable: list[str], heard: tuple[bytes, ...], path_peers: Iterable[str], watch_peers: Iterable[str]
    ) -> Outgoing:
        """One interval's heartbeats: every path peer on every usable rail, every other watch peer on one, in turn."""
        packet = self._sealer(self._bodies(usable, heard, 0, 0, 0))
        paths = sorted(set(path_peers))
        out: Outgoing = []
        for name in paths:
            nics = self.peers[name]
            out.extend((rail, packet(rail, name), nics[rail]) for rail in usable if rail in nics)
        for turn, name in enumerate(sorted(set(watch_peers) - set(paths))):
            nics = self.peers[name]
            shared = [r for r in usable if r in nics]
            if shared:
                rail = shared[(self.seq + turn) % len(shared)]
                out.append((rail, packet(rail, name), nics[rail]))
        return out

    def notices(self, usable: list[str], heard: tuple[bytes, ...], down: list[str], up: list[str]) -> Outgoing:
        """A notice that ``down`` went down and ``up`` came back, to every node of the fabric."""
        packet = self._sealer(self._bodies(usable, heard, self._mask(down), self._mask(up), heartbeat.FLAG_NOTICE))
        out: Outgoing = []
        for turn, (name, nics) in enumerate(self.peers.items()):
            shared = [r for r in usable if r in nics]
            for k in range(min(NOTICE_RAILS, len(shared))):
                rail = shared[(turn + k) % len(shared)]
                out.append((rail, packet(rail, name), nics[rail]))
        return out

    def _mask(self, rails: list[str]) -> int:
        return sum(1 << self.index.rail_number(r) for r in rails)
