"""Heartbeat packets: who sends, on which rail, and which nodes the sender hears on each rail.

"I hear you on rail X" is what lets a node learn that its *outbound* side of a path is broken (a
one-way blackhole keeps its own receive side healthy). Every packet carries a keyed BLAKE2b tag (16 bytes) under
the key of the pair (sender, receiver) (:mod:`linkpass.keyring`), so no one on the fabric can forge a
heartbeat or a down notice and make nodes move their traffic, and no node can sign one for another. The tag is
the keyed BLAKE2b of the body's BLAKE2b-256 digest (hash, then MAC): a rail's body is the same for every peer, so
the sender hashes it once and each peer's tag costs one BLAKE2b block, and a receiver hashes a packet once
whatever number of keys it tries while a key changes. BLAKE2b, not HMAC-SHA256 (version 2): the daemon tags and
checks heartbeats in C (:mod:`linkpass.fastpath`) with libsodium's BLAKE2b, as Fleet Lens does; this module is
the reference the C code is tested against byte for byte.

Why a fixed binary layout and no names: a packet's size must not depend on the node names or on how
many peers the sender hears, or a cluster with long names silently loses every heartbeat (a name-based
packet of a 64-node fabric with 16-character names was over 8 KB). Nodes and rails are named by their
index in the fabric map (:class:`FabricIndex`, the same on every node that loads the same map; the
map's fingerprint travels in each packet so two daemons with different maps refuse each other's
packets instead of misreading them). What the sender hears is one bitmap per rail over every node
index: ``HEADER + rails * ceil(nodes / 8) + TAG_BYTES`` bytes, 1,060 bytes at 1,024 nodes x 8 rails,
within IPoIB's 4,092-byte MTU up to about 4,000 nodes x 8 rails (:func:`packet_size` says exactly,
and :class:`FabricIndex` refuses a fabric whose packets would not fit).

Layout (network byte order): version u8, flags u8, fabric fingerprint u32, sender node index u16,
rail index u8, number of rails u8, number of nodes u16, sequence u32, down-rail mask u16, up-rail
mask u16, then the bitmaps, then the tag over everything before it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from linkpass.fabric import FabricMap

VERSION = 3  # 3: keyed BLAKE2b tags (2: HMAC-SHA256)
TAG_BYTES = 16
DIGEST_BYTES = 32  # the body's BLAKE2b digest, which the tag is the keyed BLAKE2b of
#: IPoIB's datagram-mode MTU, less the IPv4 (20) and UDP (8) headers: the most one unfragmented heartbeat may carry.
MAX_PACKET = 4092 - 28
MAX_RAILS = 16  # the down and up masks are 16 bits
MAX_NODES = 65535
_HEADER = struct.Struct("!BBIHBBHIHH")
HEADER_BYTES = _HEADER.size

#: Flag: the packet is a notice (a NIC of the sender went down or came back), sent to every node of the fabric.
FLAG_NOTICE = 1


OTHER_MAP = "sent by a daemon with another fabric map"


class PacketError(Exception):
    """A packet that is not a valid, authentic heartbeat (it is dropped and counted)."""


class NotAuthentic(PacketError):
    """The tag is not the one ``key`` makes: another key signed the packet (a forgery, or a key out of step)."""


def packet_size(nodes: int, rails: int) -> int:
    """The size in bytes of every heartbeat of a fabric of ``nodes`` nodes and ``rails`` rails."""
    return HEADER_BYTES + rails * ((nodes + 7) // 8) + TAG_BYTES


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
        if len(nodes) > MAX_NODES or index.size > MAX_PACKET:
            raise ValueError(
                f"a heartbeat of {len(nodes)} nodes x {len(rails)} rails would be {index.size} bytes, over the "
                f"{MAX_PACKET} bytes one IPoIB datagram carries"
            )
        return index

    @cached_property
    def size(self) -> int:
        return packet_size(len(self.nodes), len(self.rails))

    @cached_property
    def bitmap_bytes(self) -> int:
        return (len(self.nodes) + 7) // 8

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


class Heartbeat(NamedTuple):
    """One heartbeat as numbers: ``heard[r]`` is the bitmap (bit i = node index i) of rail index r.

    A named tuple, not a dataclass: every daemon builds hundreds of these a second, and a tuple is built fastest.
    """

    node: int
    rail: int
    seq: int
    heard: tuple[bytes, ...]
    down: int = 0  # rail mask: rails the sender just lost (a down notice)
    up: int = 0  # rail mask: rails the sender got back (an up notice)
    flags: int = 0

    def hears(self, node: int, rail: int) -> bool:
        """Whether the sender hears node index ``node`` on rail index ``rail``."""
        return bool(self.heard[rail][node >> 3] & (1 << (node & 7)))

    def hears_mask(self, node: int) -> int:
        """The rails (bit r = rail index r) on which the sender hears node index ``node`` (what the C path gives)."""
        byte, bit = node >> 3, 1 << (node & 7)
        return sum(1 << r for r, bits in enumerate(self.heard) if bits[byte] & bit)


def bitmap(index: FabricIndex, members: set[int]) -> bytes:
    """The bitmap over ``index``'s nodes with the bits of ``members`` (node indices) set."""
    out = bytearray(index.bitmap_bytes)
    for i in members:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def encode_body(hb: Heartbeat, index: FabricIndex) -> bytes:
    """The packet without its tag (one body serves every peer of a rail; :func:`seal` adds the tag)."""
    if len(hb.heard) != len(index.rails) or any(len(b) != index.bitmap_bytes for b in hb.heard):
        raise ValueError("one bitmap of the fabric's size per rail expected")
    header = _HEADER.pack(
        VERSION,
        hb.flags,
        index.fingerprint,
        hb.node,
        hb.rail,
        len(index.rails),
        len(index.nodes),
        hb.seq & 0xFFFFFFFF,
        hb.down,
        hb.up,
    )
    return header + b"".join(hb.heard)


def encode_bodies(hb: Heartbeat, rails: list[int], index: FabricIndex) -> list[bytes]:
    """:func:`encode_body` of ``hb`` on each rail index of ``rails`` (one interval's bodies: the bitmaps checked and
    joined once)."""
    if len(hb.heard) != len(index.rails) or any(len(b) != index.bitmap_bytes for b in hb.heard):
        raise ValueError("one bitmap of the fabric's size per rail expected")
    bitmaps = b"".join(hb.heard)
    head = (VERSION, hb.flags, index.fingerprint, hb.node)
    tail = (len(index.rails), len(index.nodes), hb.seq & 0xFFFFFFFF, hb.down, hb.up)
    return [_HEADER.pack(*head, rail, *tail) + bitmaps for rail in rails]


def seal(body: bytes, key: bytes) -> bytes:
    """``body`` with its authentication tag under ``key``."""
    return body + _tag(key, body)


def encode(hb: Heartbeat, index: FabricIndex, key: bytes) -> bytes:
    return seal(encode_body(hb, index), key)


def _tag(key: bytes, body: bytes) -> bytes:
    # What linkpass._hbfast computes with libsodium's crypto_generichash_blake2b (keys of 1 to 64 bytes).
    return hashlib.blake2b(
        hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest(), key=key, digest_size=TAG_BYTES
    ).digest()


def sender(data: bytes) -> int:
    """The sender's node index, read before the tag is checked (to pick the key a per-peer scheme needs)."""
    if len(data) < HEADER_BYTES:
        raise PacketError(f"bad size {len(data)}")
    return int(_HEADER.unpack_from(data)[3])


def decode(data: bytes, index: FabricIndex, key: bytes) -> Heartbeat:
    """The heartbeat in ``data``: authentic, of this fabric map, well-formed; else :class:`PacketError`."""
    if len(data) != index.size:
        raise PacketError(f"bad size {len(data)} (this fabric's heartbeats are {index.size} bytes)")
    body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, body)):
        raise NotAuthentic("bad authentication tag")
    version, flags, fingerprint, node, rail, nrails, nnodes, seq, down, up = _HEADER.unpack_from(body)
    if version != VERSION:
        raise PacketError("unknown version")
    if fingerprint != index.fingerprint or nrails != len(index.rails) or nnodes != len(index.nodes):
        raise PacketError(OTHER_MAP)
    if node >= nnodes or rail >= nrails or (down | up) >> nrails:
        raise PacketError("node or rail out of range")
    width = index.bitmap_bytes
    heard = tuple([body[o : o + width] for o in range(HEADER_BYTES, HEADER_BYTES + nrails * width, width)])
    return Heartbeat(node, rail, seq, heard, down, up, flags)
