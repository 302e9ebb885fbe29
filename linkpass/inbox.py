"""Whose heartbeat a packet is, and whether that peer really signed it: the receive side of the pairwise keys.

With a key per pair of nodes, the key a packet must carry depends on who sent it, and the sender a packet names
is what a forger would lie about. So the sender is taken from where the packet came from: the rail's socket and
the source address, which the fabric map gives to exactly one peer's NIC. The packet must then carry a tag under
one of the keys that peer's packets may carry now (:meth:`linkpass.keyring.KeyRing.accept_keys`: two or more
while a key changes) and name that peer and that rail. Anything else from a peer's address is *refused*: a
forgery (root on a node signing for another, or a spoofed source address) or a key out of step during a rotation;
it is counted apart from the other rejects and logged, once a minute per source address and reason, so a forger
cannot flood the log. Packets that the peer did sign but that this node cannot use (another fabric map, another
packet size or version) are rejected without being called forged, and said once per address.

Apart from the engine so that the rule is one function of (rail, source, packet), tested without sockets. The
daemon applies the same rule in C (:mod:`linkpass.fastpath`), which hands back each rejected packet's
:class:`Reject` code; :meth:`Inbox.explain` counts and logs those as :meth:`Inbox.open` does its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from enum import IntEnum

from linkpass import heartbeat
from linkpass.keyring import KeyRing

__all__ = ["Inbox", "Refused", "Reject"]

log = logging.getLogger("clockwork.linkpass")

#: A refusal of the same source address for the same reason is logged at most this often.
REFUSED_LOG_EVERY_S = 60.0


class Reject(IntEnum):
    """Why the C path (linkpass/csrc/_hbfast.c's REJ_*, in the order it checks) dropped a packet."""

    UNKNOWN = 1  # no peer has the source address on this rail
    SIZE = 2  # not the size its entry count says (truncated, oversized, not a heartbeat)
    TAG = 3  # no key the peer may use made the tag: forged, or a key out of step (refused)
    VERSION = 4  # another wire version
    MAP = 5  # another fabric map (fingerprint, node or rail count)
    RANGE = 6  # node, rail or masks out of range
    CLAIM = 7  # signed by the peer at that address but naming another node or rail (refused)


_UNUSABLE = {
    Reject.VERSION: "unknown version",
    Reject.MAP: heartbeat.OTHER_MAP,
    Reject.RANGE: "node or rail out of range",
}


class Refused(heartbeat.PacketError):
    """A packet from a peer's address that the peer did not sign for itself (forged, or a key out of step)."""


class Inbox:
    """Opens the heartbeats ``me`` receives from its peers (name -> rail -> address) under ``keys``."""

    def __init__(
        self, index: heartbeat.FabricIndex, keys: KeyRing, me: str, peers: Mapping[str, Mapping[str, str]]
    ) -> None:
        self.index = index
        self.keys = keys
        self.me = me
        # (rail, source address) -> (peer, its node number): the key a packet must carry depends on its sender
        self.sender_of = {
            (rail, ip): (name, index.node_number(name)) for name, nics in peers.items() for rail, ip in nics.items()
        }
        self.rail_number = {rail: index.rail_number(rail) for rail in index.rails}
        self.refused_logged: dict[tuple[str, str], float] = {}  # (source, why) -> when last logged
        self.unusable_logged: set[str] = set()  # addresses whose signed packets this node cannot use (said once)

    def open(self, rail: str, src: str, data: bytes, now: float) -> tuple[str, heartbeat.Heartbeat]:
        """(peer, heartbeat) of a packet that arrived on ``rail``'s socket from ``src``. Raises :class:`Refused`
        for a packet from a peer's address that the peer did not sign for itself, :class:`heartbeat.PacketError`
        for any other packet this node does not use."""
        sender = self.sender_of.get((rail, src))
        if sender is None:
            log.debug("%s: heartbeat from %s on %s dropped: no peer has that address there", self.me, src, rail)
            raise heartbeat.PacketError(f"{src} is no peer's address on {rail}")
        name, number = sender
        hb = self._authentic(rail, src, data, name, now)
        if hb.node != number or hb.rail != self.rail_number[rail]:
            why = f"signed by {name} but claims to be {self.index.nodes[hb.node]} on {self.index.rails[hb.rail]}"
            raise self._refused(rail, src, name, why, now)
        return name, hb

    def explain(self, rail: str, src: str, code: int, named_node: int, named_rail: int, now: float) -> bool:
        """Log a packet the C path rejected on ``rail`` from ``src`` (``code``: :class:`Reject`; the node and rail
        it named, -1 when not read) as :meth:`open` would; True when it was refused (forged or a key out of step)."""
        sender = self.sender_of.get((rail, src))
        if sender is None or code == Reject.UNKNOWN:
            log.debug("%s: heartbeat from %s on %s dropped: no peer has that address there", self.me, src, rail)
            return False
        name = sender[0]
        if code == Reject.TAG:
            self._refused(rail, src, name, "bad authentication tag", now)
            return True
        if code == Reject.CLAIM:
            why = f"signed by {name} but claims to be {self.index.nodes[named_node]} on {self.index.rails[named_rail]}"
            self._refused(rail, src, name, why, now)
            return True
        size = f"bad size (a heartbeat is {heartbeat.packet_size(0)} bytes + 4 per path peer)"
        why = _UNUSABLE.get(Reject(code), size)
        self._unusable(rail, src, name, why)
        return False

    def _unusable(self, rail: str, src: str, name: str, why: object) -> None:
        # Not a forgery: the peer's daemon speaks another map, release or size; said once per address.
        if src not in self.unusable_logged:
            self.unusable_logged.add(src)
            log.warning("%s: heartbeats from %s (%s's %s) dropped: %s", self.me, src, name, rail, why)
        log.debug("%s: heartbeat from %s on %s dropped: %s", self.me, src, rail, why)

    def _authentic(self, rail: str, src: str, data: bytes, name: str, now: float) -> heartbeat.Heartbeat:
        why = "no key for this peer"
        for key in self.keys.accept_keys(name):
            try:
                return heartbeat.decode(data, self.index, key)
            except heartbeat.NotAuthentic as exc:
                why = str(exc)
            except heartbeat.PacketError as exc:
                self._unusable(rail, src, name, exc)
                raise
        raise self._refused(rail, src, name, why, now)

    def _refused(self, rail: str, src: str, name: str, why: str, now: float) -> Refused:
        last = self.refused_logged.get((src, why))
        if last is None or now - last >= REFUSED_LOG_EVERY_S:
            self.refused_logged[(src, why)] = now
            log.warning("%s: heartbeat from %s (%s's %s) refused: %s", self.me, src, name, rail, why)
        return Refused(why)
