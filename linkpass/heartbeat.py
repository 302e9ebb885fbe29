"""Heartbeat packets: who sends, on which rail, and which nodes the sender hears on each rail.

"I hear you on rail X" is what lets a node learn that its *outbound* side of a path is broken (a
one-way blackhole keeps its own receive side healthy). Every packet carries a keyed BLAKE2b tag (16 bytes) under
the key of the pair (sender, receiver) (:mod:`linkpass.keyring`), so no one on the fabric can forge a
heartbeat or a down notice and make nodes move their traffic, and no node can sign one for another. The tag is
the keyed BLAKE2b of the body (version 3 tagged the body's digest, to hash a 1 KB body once for every peer; a body
now fits in one BLAKE2b block). BLAKE2b, not HMAC-SHA256 (version 2): the daemon tags and
checks heartbeats in C (:mod:`linkpass.fastpath`) with libsodium's BLAKE2b, as Fleet Lens does; this module is
the reference the C code is tested against byte for byte.

Why a fixed binary layout and no names: a packet's size must not depend on the node names or on the
fabric's size, or a cluster with long names silently loses every heartbeat (a name-based packet of a 64-node
fabric with 16-character names was over 8 KB). Nodes and rails are named by their index in the fabric map
(:class:`FabricIndex`, the same on every node that loads the same map; the map's fingerprint travels in each
packet so two daemons with different maps refuse each other's packets instead of misreading them). What the
sender hears is one entry per path peer (its node index and the mask of the rails it is heard on): only a path
peer reads it, and the sender has at most a configured bound of them (:func:`linkpass.peers.bound`, 4 by
default), so a packet is ``HEADER + 4 x entries + TAG_BYTES`` bytes, 54 by default, whatever the fabric's size
(version 3 carried a bitmap over every node per rail: 1,060 bytes at 1,024 nodes x 8 rails, all of it hashed on
receipt, for the one bit per rail the receiver reads).

Layout (network byte order): version u8, flags u8, fabric fingerprint u32, sender node index u16,
rail index u8, number of rails u8, number of nodes u16, sequence u32, down-rail mask u16, up-rail
mask u16, number of entries u16, then the entries (node index u16, rails-heard mask u16), then the tag over
everything before it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from linkpass.fabric import FabricMap

VERSION = 4  # 4: path peer entries, the tag over the body (3: bitmaps, the tag over their digest; 2: HMAC-SHA256)
TAG_BYTES = 16
#: IPoIB's datagram-mode MTU, less the IPv4 (20) and UDP (8) headers: the most one unfragmented heartbeat may carry.
MAX_PACKET = 4092 - 28
MAX_RAILS = 16  # the down and up masks are 16 bits
MAX_NODES = 65535
_HEADER = struct.Struct("!BBIHBBHIHHH")
HEADER_BYTES = _HEADER.size
_ENTRY = struct.Struct("!HH")  # node index, mask of the rails it is heard on
#: The most path peers one datagram can list.
MAX_ENTRIES = (MAX_PACKET - HEADER_BYTES - TAG_BYTES) // _ENTRY.size

#: Flag: the packet is a notice (a NIC of the sender went down or came back), sent to every node of the fabric.
FLAG_NOTICE = 1


OTHER_MAP = "sent by a daemon with another fabric map"


class PacketError(Exception):
    """A packet that is not a valid, authentic heartbeat (it is dropped and counted)."""


class NotAuthentic(PacketError):
    """The tag is not the one ``key`` makes: another key signed the packet (a forgery, or a key out of step)."""


def packet_size(entries: int) -> int:
    """The size in bytes of a heartbeat listing ``entries`` path peers."""
    return HEADER_BYTES + _ENTRY.size * entries + TAG_BYTES


@dataclass(frozen=True)
class FabricIndex:
    """Node and rail numbers every daemon derives alike from the same fabric map: sorted names, and a fingerprint."""

    nodes: tuple[str, ...]
    rails: tuple[str, ...]
    fingerprint: int

    @classmethod
    def of(cls, fabric: FabricMap) -> FabricIndex:
        nodes = tuple(sorted(fabric.nodes))
        rails = tuple(sorted({rail for node in fabric.nodes.values() for rail in node.nics}))
        canon = "\n".join(
            f"{n}={fabric.nodes[n].addr};" + ",".join(f"{r}:{ip}" for r, ip in sorted(fabric.nodes[n].nics.items()))
            for n in nodes
        )
        fingerprint = int.from_bytes(hashlib.sha256(canon.encode()).digest()[:4], "big")
        index = cls(nodes, rails, fingerprint)
        if len(rails) > MAX_RAILS:
            raise ValueError(f"the fabric map has {len(rails)} rails; heartbeats carry at most {MAX_RAILS}")
        if len(nodes) > MAX_NODES:
            raise ValueError(f"the fabric map has {len(nodes)} nodes; heartbeats number at most {MAX_NODES}")
        return index

    @cached_property
    def _numbers(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.nodes)}

    @cached_property
    def _rail_numbers(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.rails)}

    def node_number(self, name: str) -> int:
        """``name``'s index (a dict read: the send path asks per peer every interval); ValueError if none."""
        try:
            return self._numbers[name]
        except KeyError:
            raise ValueError(f"{name} is not a node of the fabric map") from None

    def rail_number(self, name: str) -> int:
        try:
            return self._rail_numbers[name]
        except KeyError:
            raise ValueError(f"{name} is not a rail of the fabric map") from None


#: What a heartbeat says its sender hears: (node index, mask of the rails it hears that node on) per path peer.
Heard = tuple[tuple[int, int], ...]


class Heartbeat(NamedTuple):
    """One heartbeat as numbers: ``heard`` is one (node index, rail mask) pair per path peer of the sender, bit r of
    the mask set when it hears that node on rail index r.

    A named tuple, not a dataclass: every daemon builds hundreds of these a second, and a tuple is built fastest.
    """

    node: int
    rail: int
    seq: int
    heard: Heard
    down: int = 0  # rail mask: rails the sender just lost (a down notice)
    up: int = 0  # rail mask: rails the sender got back (an up notice)
    flags: int = 0

    def hears(self, node: int, rail: int) -> bool:
        """Whether the sender hears node index ``node`` on rail index ``rail``."""
        return bool(self.hears_mask(node) >> rail & 1)

    def hears_mask(self, node: int) -> int:
        """The rails (bit r = rail index r) on which the sender hears node index ``node`` (what the C path gives)."""
        return next((mask for peer, mask in self.heard if peer == node), 0)


def encode_bodies(hb: Heartbeat, rails: list[int], index: FabricIndex) -> list[bytes]:
    """The packet without its tag (one body serves every peer of a rail; :func:`seal` adds the tag) on each rail
    index of ``rails``: one interval's bodies, the entries packed once."""
    if len(hb.heard) > MAX_ENTRIES:
        raise ValueError(f"a heartbeat lists at most {MAX_ENTRIES} path peers, not {len(hb.heard)}")
    entries = b"".join(_ENTRY.pack(node, mask) for node, mask in hb.heard)
    head = (VERSION, hb.flags, index.fingerprint, hb.node)
    tail = (len(index.rails), len(index.nodes), hb.seq & 0xFFFFFFFF, hb.down, hb.up, len(hb.heard))
    return [_HEADER.pack(*head, rail, *tail) + entries for rail in rails]


def encode_body(hb: Heartbeat, index: FabricIndex) -> bytes:
    """:func:`encode_bodies` of ``hb`` on its own rail."""
    return encode_bodies(hb, [hb.rail], index)[0]


def seal(body: bytes, key: bytes) -> bytes:
    """``body`` with its authentication tag under ``key``."""
    return body + _tag(key, body)


def encode(hb: Heartbeat, index: FabricIndex, key: bytes) -> bytes:
    return seal(encode_body(hb, index), key)


def _tag(key: bytes, body: bytes) -> bytes:
    # What linkpass._hbfast computes with libsodium's crypto_generichash_blake2b (keys of 1 to 64 bytes).
    return hashlib.blake2b(body, key=key, digest_size=TAG_BYTES).digest()


def sender(data: bytes) -> int:
    """The sender's node index, read before the tag is checked (to pick the key a per-peer scheme needs)."""
    if len(data) < HEADER_BYTES:
        raise PacketError(f"bad size {len(data)}")
    return int(_HEADER.unpack_from(data)[3])


def decode(data: bytes, index: FabricIndex, key: bytes) -> Heartbeat:
    """The heartbeat in ``data``: authentic, of this fabric map, well-formed; else :class:`PacketError`."""
    if len(data) < HEADER_BYTES + TAG_BYTES or len(data) != packet_size(_HEADER.unpack_from(data)[10]):
        raise PacketError(f"bad size {len(data)} (a heartbeat is {packet_size(0)} bytes + 4 per path peer listed)")
    body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, body)):
        raise NotAuthentic("bad authentication tag")
    version, flags, fingerprint, node, rail, nrails, nnodes, seq, down, up, _entries = _HEADER.unpack_from(body)
    if version != VERSION:
        raise PacketError("unknown version")
    if fingerprint != index.fingerprint or nrails != len(index.rails) or nnodes != len(index.nodes):
        raise PacketError(OTHER_MAP)
    heard = tuple(_ENTRY.iter_unpack(body[HEADER_BYTES:]))
    if node >= nnodes or rail >= nrails or (down | up) >> nrails or any(n >= nnodes or m >> nrails for n, m in heard):
        raise PacketError("node or rail out of range")
    return Heartbeat(node, rail, seq, heard, down, up, flags)
