"""Heartbeat packets: who sends, on which rail, and which peers the sender hears on each rail.

"I hear you on rail X" is what lets a node learn that its *outbound* side of a path is broken (a
one-way blackhole keeps its own receive side healthy). Every packet carries an HMAC-SHA256 tag under
the daemons' shared key, so no one on the fabric can forge a heartbeat or a down notice and make
nodes move their traffic.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import TypeGuard

import msgpack

VERSION = 1
TAG_BYTES = 16
MAX_PACKET = 8192


class PacketError(Exception):
    """A packet that is not a valid, authentic heartbeat (it is dropped and counted)."""


@dataclass(frozen=True)
class Heartbeat:
    node: str
    rail: str
    seq: int
    heard: dict[str, list[str]] = field(default_factory=dict)  # rail -> peers heard on it recently
    down: list[str] = field(default_factory=list)  # rails the sender just lost (a down notice)


def encode(hb: Heartbeat, key: bytes) -> bytes:
    body = msgpack.packb({"v": VERSION, "n": hb.node, "r": hb.rail, "s": hb.seq, "h": hb.heard, "d": hb.down})
    return body + _tag(key, body)


def _tag(key: bytes, body: bytes) -> bytes:
    # hmac.digest: OpenSSL's one-shot HMAC, without building an hmac.HMAC object per packet (4x cheaper).
    return hmac.digest(key, body, hashlib.sha256)[:TAG_BYTES]


def _strings(value: object) -> TypeGuard[list[str]]:
    if type(value) is not list:
        return False
    for item in value:
        if type(item) is not str:
            return False
    return True


def decode(data: bytes, key: bytes) -> Heartbeat:
    if len(data) <= TAG_BYTES or len(data) > MAX_PACKET:
        raise PacketError(f"bad size {len(data)}")
    body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, body)):
        raise PacketError("bad authentication tag")
    try:
        doc = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage
        raise PacketError(f"undecodable: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise PacketError("unknown version")
    node, rail, seq, heard, down = doc.get("n"), doc.get("r"), doc.get("s"), doc.get("h"), doc.get("d")
    if not (isinstance(node, str) and isinstance(rail, str) and isinstance(seq, int)):
        raise PacketError("missing node, rail or sequence")
    # Plain loops over exact types: every daemon decodes hundreds of these a second.
    if type(heard) is not dict or not all(type(k) is str and _strings(v) for k, v in heard.items()):
        raise PacketError("malformed heard map")
    if not _strings(down):
        raise PacketError("malformed down list")
    return Heartbeat(node, rail, seq, heard, down)
