"""Probe, train and summary packets: a fixed 40-byte header, a payload, an 8-byte keyed BLAKE2b tag.

Header (little-endian): magic ``CWL1``, kind, flags, source node index, source NIC index,
destination NIC index, destination node index, sequence number (per directed NIC pair), the sender's
transmit time (its clock, ns), the sender's session (random per daemon start: a restarted peer's
sequence numbers start again), ``aux`` (train: index << 16 | count; summary: body length), and the
echo (probe: the newest sequence number the sender received on the reverse path, and how long it had
held it by then, ns; the receiver turns that into a round trip with its own two timestamps).

Node and NIC indices are positions in the sorted fabric map that every daemon shares, so a packet
names its path in 8 bytes. Every packet is authenticated with the key of its two nodes (pairwise, from
each node's own key pair: :mod:`clockworkd.lens.keys`; or one key every daemon shares): nobody on the
fabric can forge probes, nor a node send them as another, and make Lens blame (and LinkPass avoid, or the
health check drain) a healthy link. Train packets carry padding after the tag; only header and body are authenticated.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import msgpack
import numpy as np

from clockwork.contracts.errors import WireError

MAGIC = b"CWL1"
PROBE, TRAIN, SUMMARY = 1, 2, 3
PAIR_FIRST, PAIR_SECOND = 1, 2
TAG = 8
HEADER = struct.Struct("<4sBBHBBHIqIIII")
HEADER_BYTES = HEADER.size  # 40
NO_ECHO = 0xFFFFFFFF  # echo hold value: nothing to echo
PROBE_BYTES = HEADER_BYTES + TAG
TRAIN_PACKET = 1400
MAX_SUMMARY_BODY = 7000

#: numpy view of a header + tag, for parsing a batch of probes at once.
DTYPE = np.dtype(
    [
        ("magic", "S4"),
        ("kind", "u1"),
        ("flags", "u1"),
        ("src_node", "<u2"),
        ("src_nic", "u1"),
        ("dst_nic", "u1"),
        ("dst_node", "<u2"),
        ("seq", "<u4"),
        ("tx_ns", "<i8"),
        ("session", "<u4"),
        ("aux", "<u4"),
        ("echo_seq", "<u4"),
        ("echo_hold_ns", "<u4"),
        ("tag", "S8"),
    ]
)
assert DTYPE.itemsize == PROBE_BYTES


def tag(key: bytes, data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, key=key, digest_size=TAG).digest()


def header(
    kind: int,
    flags: int,
    src: tuple[int, int],
    dst: tuple[int, int],
    seq: int,
    tx_ns: int,
    session: int,
    aux: int = 0,
    echo_seq: int = 0,
    echo_hold_ns: int = NO_ECHO,
) -> bytes:
    return HEADER.pack(
        MAGIC,
        kind,
        flags,
        src[0],
        src[1],
        dst[1],
        dst[0],
        seq & 0xFFFFFFFF,
        tx_ns,
        session,
        aux,
        echo_seq,
        echo_hold_ns,
    )


def sign(key: bytes, head: bytes, body: bytes = b"", pad_to: int = 0) -> bytes:
    """``head + body + tag`` padded with zeros to ``pad_to`` bytes."""
    signed = head + body
    packet = signed + tag(key, signed)
    return packet + bytes(pad_to - len(packet)) if pad_to > len(packet) else packet


def verify(key: bytes, packet: memoryview, length: int) -> bool:
    """True when the header (and a summary's body) carry a valid tag."""
    if length < PROBE_BYTES or bytes(packet[:4]) != MAGIC:
        return False
    kind = packet[4]
    signed = HEADER_BYTES
    if kind == SUMMARY:
        signed += int.from_bytes(packet[28:32], "little")
        if signed + TAG > length:
            return False
    return tag(key, packet[:signed]) == bytes(packet[signed : signed + TAG])


def summary_body(doc: dict[str, Any]) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def packed_size(value: Any) -> int:
    """The bytes ``value`` takes inside a summary body (packed as :func:`summary_body` packs it)."""
    return len(msgpack.packb(value, use_bin_type=True))


def parse_summary(packet: memoryview) -> dict[str, Any]:
    """The body of a verified summary packet."""
    size = int.from_bytes(packet[28:32], "little")
    try:
        doc = msgpack.unpackb(bytes(packet[HEADER_BYTES : HEADER_BYTES + size]), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for garbage
        raise WireError(f"undecodable summary: {exc}") from None
    if not isinstance(doc, dict):
        raise WireError("summary body is not a map")
    return doc
