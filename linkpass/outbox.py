"""What one interval's heartbeats and a notice are: which packet goes to which peer address on which rail.

Apart from the engine so the choice is a pure function of the evidence, testable (and benchmarked) without sockets:
one packet body per usable rail, sealed for each peer that gets it on that rail under that peer's send key (pairwise
keys: one tag per peer; a key shared by every peer: one tag per rail); path peers get it on every usable rail they
share with this node, the other watch peers on one such rail, the rails taking turns (``seq``); notices go to every
node of the fabric on up to ``NOTICE_RAILS`` rails each.

The daemon sends :class:`Batch` es (one body per rail and the node numbers it goes to), which
:mod:`linkpass.fastpath` tags and sends in C; :meth:`Outbox.seal` makes the same packets in Python (tests, the
reference).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from linkpass import heartbeat
from linkpass.keyring import KeyRing

__all__ = ["NOTICE_RAILS", "Batch", "Outbox", "Outgoing"]

#: Notices go out on at most this many of the rails still usable, to each node (one lost packet loses nothing).
NOTICE_RAILS = 2

Outgoing = list[tuple[str, bytes, str]]  # (rail, packet, peer address on that rail)
Batch = tuple[str, bytes, list[int]]  # (rail, packet body without its tag, node numbers of the peers it goes to)


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
        self.number = {name: index.node_number(name) for name in self.peers}
        self.seq = 0
        # ((usable rails, path peers), rail -> their node numbers): the same every interval while nothing changes
        self._path_to: tuple[tuple[list[str], frozenset[str]] | None, dict[str, list[int]]] = (None, {})

    def heard(self, fresh: Mapping[str, Iterable[str]]) -> heartbeat.Heard:
        """What a heartbeat says this node hears: per peer of ``fresh`` (peer -> the rails it was heard on recently),
        its node number and the mask of those rails."""
        rail = self.index.rail_number
        return tuple((self.number[name], sum(1 << rail(r) for r in rails)) for name, rails in sorted(fresh.items()))

    def _bodies(self, usable: list[str], heard: heartbeat.Heard, down: int, up: int, flags: int) -> dict[str, bytes]:
        self.seq += 1
        hb = heartbeat.Heartbeat(self.me, 0, self.seq, heard, down, up, flags)
        bodies = heartbeat.encode_bodies(hb, [self.index.rail_number(rail) for rail in usable], self.index)
        return dict(zip(usable, bodies, strict=True))

    def seal(self, batches: list[Batch]) -> Outgoing:
        """The packets of ``batches``, tagged in Python under each peer's send key (one tag per (rail, key))."""
        sealed: dict[tuple[str, bytes], bytes] = {}
        out: Outgoing = []
        for rail, body, numbers in batches:
            for number in numbers:
                name = self.index.nodes[number]
                key = self.keys.send_key(name)
                packet = sealed.get((rail, key))
                if packet is None:
                    packet = sealed[(rail, key)] = heartbeat.seal(body, key)
                out.append((rail, packet, self.peers[name][rail]))
        return out

    def heartbeats(
        self, usable: list[str], heard: heartbeat.Heard, path_peers: Iterable[str], watch_peers: Iterable[str]
    ) -> Outgoing:
        """:meth:`heartbeat_batches`, sealed in Python."""
        return self.seal(self.heartbeat_batches(usable, heard, path_peers, watch_peers))

    def notices(self, usable: list[str], heard: heartbeat.Heard, down: list[str], up: list[str]) -> Outgoing:
        """:meth:`notice_batches`, sealed in Python."""
        return self.seal(self.notice_batches(usable, heard, down, up))

    def heartbeat_batches(
        self, usable: list[str], heard: heartbeat.Heard, path_peers: Iterable[str], watch_peers: Iterable[str]
    ) -> list[Batch]:
        """One interval's heartbeats: every path peer on every usable rail, every other watch peer on one, in turn."""
        bodies = self._bodies(usable, heard, 0, 0, 0)
        paths = frozenset(path_peers)
        if self._path_to[0] != (usable, paths):  # the path peers' part changes only with them or a NIC's state
            self._path_to = (
                (list(usable), paths),
                {rail: [self.number[n] for n in sorted(paths) if rail in self.peers[n]] for rail in usable},
            )
        to = {rail: list(numbers) for rail, numbers in self._path_to[1].items()}
        for turn, name in enumerate(sorted(set(watch_peers) - paths)):
            nics = self.peers[name]
            shared = [r for r in usable if r in nics]
            if shared:
                to[shared[(self.seq + turn) % len(shared)]].append(self.number[name])
        return [(rail, bodies[rail], to[rail]) for rail in usable if to[rail]]

    def notice_batches(self, usable: list[str], heard: heartbeat.Heard, down: list[str], up: list[str]) -> list[Batch]:
        """A notice that ``down`` went down and ``up`` came back, to every node of the fabric."""
        bodies = self._bodies(usable, heard, self._mask(down), self._mask(up), heartbeat.FLAG_NOTICE)
        to: dict[str, list[int]] = {rail: [] for rail in usable}
        for turn, (name, nics) in enumerate(self.peers.items()):
            shared = [r for r in usable if r in nics]
            for k in range(min(NOTICE_RAILS, len(shared))):
                to[shared[(turn + k) % len(shared)]].append(self.number[name])
        return [(rail, bodies[rail], to[rail]) for rail in usable if to[rail]]

    def _mask(self, rails: list[str]) -> int:
        return sum(1 << self.index.rail_number(r) for r in rails)
